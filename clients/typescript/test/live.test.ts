/**
 * The client against live Conductors (tests/conductor/test_typescript_client.py starts them):
 * register, schedule onto blocks whose hashes lie above 2^63, follow a leader change, read a
 * rejection's retry delay. Skipped unless KVSCHED_CONDUCTORS is set.
 *
 * Environment:
 *   KVSCHED_CONDUCTORS            host:port[,host:port] of the Conductors (policy `elastic`,
 *                                 no other instances: the last step overloads every instance)
 *   KVSCHED_CONDUCTOR_PIDS        host:port=pid,... : the leader-change step kills the leader
 *                                 (SIGKILL); skipped without it
 *   KVSCHED_TLS_CA                CA file (mutual TLS; absent: plaintext), with
 *   KVSCHED_ROUTER_CERT, _KEY     a router identity's certificate and key (schedules), and
 *   KVSCHED_MESSENGER_CERT, _KEY  a messenger identity's (registers, publishes KV events) ...
 *   KVSCHED_MESSENGER_NODE        ... whose node it names (default node-0)
 *   KVSCHED_TEST_RUN              names the instances `<node>/ts-<run>-<i>` (default: random)
 *   KVSCHED_BLOCK_TOKENS          the Conductors' block size (default 16)
 *   KVSCHED_KEEP_INSTANCES=1      leave the instances registered (their 30 s leases lapse)
 */

import { strict as assert } from "node:assert";
import { randomBytes } from "node:crypto";
import { test } from "node:test";

import {
  common,
  ConductorClient,
  duration,
  milliseconds,
  packHashes,
  Rejected,
  type TlsOptions,
} from "../src/index.js";

/** The block hashes the test publishes and schedules: both above 2^63. */
export const HIGH_HASHES: readonly bigint[] = [(1n << 64n) - 5n, (1n << 63n) + 1n];

const env = process.env;
const addresses = env["KVSCHED_CONDUCTORS"] ?? "";
const node = env["KVSCHED_MESSENGER_NODE"] ?? "node-0";
const run = env["KVSCHED_TEST_RUN"] ?? randomBytes(4).toString("hex");
const blockTokens = Number(env["KVSCHED_BLOCK_TOKENS"] ?? "16");
const ids = [0, 1].map((i) => `${node}/ts-${run}-${i}`);

/** The TLS material of one identity from the environment (undefined: plaintext). */
function tlsOf(role: "ROUTER" | "MESSENGER"): TlsOptions | undefined {
  const ca = env["KVSCHED_TLS_CA"];
  if (!ca) return undefined;
  const cert = env[`KVSCHED_${role}_CERT`];
  const key = env[`KVSCHED_${role}_KEY`];
  return cert && key ? { ca, cert, key } : { ca };
}

/** Conductor pids by address, from KVSCHED_CONDUCTOR_PIDS. */
function pids(): Map<string, number> {
  const out = new Map<string, number>();
  for (const pair of (env["KVSCHED_CONDUCTOR_PIDS"] ?? "").split(",")) {
    const at = pair.lastIndexOf("=");
    if (at > 0) out.set(pair.slice(0, at).trim(), Number(pair.slice(at + 1)));
  }
  return out;
}

test(
  "ConductorClient against live Conductors",
  { skip: addresses === "" && "set KVSCHED_CONDUCTORS" },
  async (t) => {
    // A generous retry budget: a takeover after a SIGKILL waits out the leader's lease.
    const options = { deadlineMs: 2000, retries: 20, backoffMs: 50, maxBackoffMs: 500 };
    const messenger = new ConductorClient(addresses, {
      ...options,
      tls: tlsOf("MESSENGER"),
      seed: 1,
    });
    const router = new ConductorClient(addresses, { ...options, tls: tlsOf("ROUTER"), seed: 2 });
    const sequences = new Map<string, bigint>(); // next KV event batch per instance
    const prompt = {
      promptTokens: HIGH_HASHES.length * blockTokens + 1,
      outputTokens: 16,
      blockHashes: [...HIGH_HASHES],
    };
    try {
      await t.test("registers instances", async () => {
        const slots = new Set<number>();
        for (const [i, instanceId] of ids.entries()) {
          const answer = await messenger.registerInstance(
            { instanceId, url: `http://127.0.0.1:${9100 + i}`, node, role: common.Role.BOTH },
            30_000,
          );
          const instance = answer.instance;
          assert.ok(instance !== undefined);
          assert.equal(instance.spec?.instanceId, instanceId);
          assert.equal(milliseconds(answer.leaseTtl), 30_000);
          slots.add(instance.slot);
          sequences.set(instanceId, instance.nextEventSequence);
        }
        assert.equal(slots.size, 2, "each instance has a slot of its own");
        const listed = (await router.listInstances()).map((s) => s.spec?.instanceId);
        assert.deepEqual(listed.filter((id) => id !== undefined && ids.includes(id)).sort(), ids);
        assert.ok(messenger.currentLeader !== undefined, "the write found the leader");
      });

      await t.test("schedules onto blocks whose hashes lie above 2^63", async () => {
        const [holder] = ids as [string];
        const published = await messenger.publishEvents({
          instanceId: holder,
          sequence: sequences.get(holder)!,
          events: [
            {
              event: {
                case: "blocksStored",
                value: { blockHashes: [...HIGH_HASHES], tier: common.Tier.GPU },
              },
            },
          ],
        });
        assert.equal(published.nextSequence, sequences.get(holder)! + 1n);
        sequences.set(holder, published.nextSequence);
        // The hashes packed (later placements send the repeated field): every block a hit
        // only if they arrived intact.
        const decision = await router.schedule({
          promptTokens: prompt.promptTokens,
          outputTokens: prompt.outputTokens,
          packedBlockHashes: packHashes(HIGH_HASHES),
          sessionId: `ts-${run}`,
        });
        assert.equal(decision.instanceId, holder, "placed where the blocks are");
        assert.equal(decision.cachedTokens, HIGH_HASHES.length * blockTokens, "every block hit");
        assert.match(decision.requestId, /^[0-9a-f]{32}$/, "a fresh idempotency key");
        await router.finish({
          requestId: decision.requestId,
          sessionId: `ts-${run}`,
          instanceId: holder,
          promptTokens: prompt.promptTokens,
          outputTokens: 16,
          cachedTokens: decision.cachedTokens,
          blockHashes: [...HIGH_HASHES],
          ok: true,
        });
      });

      const killable = pids();
      await t.test(
        "follows a leader change",
        { skip: killable.size === 0 && "no KVSCHED_CONDUCTOR_PIDS" },
        async () => {
          const old = await router.leader();
          assert.equal(await messenger.leader(), old);
          const pid = killable.get(old);
          assert.ok(pid !== undefined, `no pid for the leader ${old}`);
          process.kill(pid, "SIGKILL");
          // The messenger's next write (a lease renewal at the leader) reaches the new leader...
          const kept = await messenger.keepAlive(ids[0]!);
          assert.equal(
            kept.nextEventSequence,
            sequences.get(ids[0]!),
            "events resume where they were",
          );
          assert.notEqual(messenger.currentLeader, old);
          // ... and so does the router's next placement, warm-started with the blocks.
          const decision = await router.schedule({ ...prompt });
          assert.notEqual(router.currentLeader, old);
          assert.equal(router.currentLeader, messenger.currentLeader);
          assert.equal(decision.instanceId, ids[0]);
          assert.equal(decision.cachedTokens, HIGH_HASHES.length * blockTokens);
          const leader = await router.getLeader();
          assert.ok(leader.isLeader, "the believed leader says it leads");
        },
      );

      await t.test("reads a rejection's retry delay", async () => {
        // Every instance 10 s behind on prefill: no placement meets the 2 s objective.
        const busy = {
          pendingPrefillTokens: 200_000n,
          pendingPrefill: duration(10_000),
          waiting: 40,
        };
        for (const instanceId of ids) {
          const sequence = (await messenger.keepAlive(instanceId)).nextEventSequence;
          await messenger.publishEvents({
            instanceId,
            sequence,
            events: [{ event: { case: "load", value: busy } }],
          });
        }
        const before = await router.listInstances();
        const refusal = await router.schedule({ ...prompt }).then(
          () => assert.fail("an overloaded cluster placed the request"),
          (err: unknown) => err,
        );
        assert.ok(refusal instanceof Rejected, `Rejected, not ${String(refusal)}`);
        assert.equal(refusal.codeName, "RESOURCE_EXHAUSTED");
        assert.ok(refusal.retryAfterMs !== undefined, "the refusal says when to come back");
        assert.ok(
          refusal.retryAfterMs >= 7_000 && refusal.retryAfterMs <= 10_000,
          `retry after ${refusal.retryAfterMs} ms`,
        );
        assert.match(refusal.message, /SLO/);
        const after = await router.listInstances();
        assert.deepEqual(
          after.map((s) => [s.spec?.instanceId, s.inFlight]),
          before.map((s) => [s.spec?.instanceId, s.inFlight]),
          "a refusal charges nothing",
        );
      });
    } finally {
      if (env["KVSCHED_KEEP_INSTANCES"] !== "1") {
        for (const instanceId of ids) await messenger.deregister(instanceId).catch(() => undefined);
      }
      messenger.close();
      router.close();
    }
  },
);
