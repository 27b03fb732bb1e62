/**
 * The client without a live Conductor: uint64 hashes, errors and their trailers, backoff, and
 * leader following against fake Conductors (test/fake.ts) on loopback.
 */

import { strict as assert } from "node:assert";
import { after, describe, test } from "node:test";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Code, ConnectError } from "@connectrpc/connect";

import {
  Backoff,
  blockHash,
  ConductorClient,
  ConductorError,
  conductor,
  duration,
  errorFor,
  fromCallError,
  InvalidRequest,
  milliseconds,
  normalizeAddress,
  packHashes,
  Rejected,
  U64_MAX,
  Unavailable,
  unpackHashes,
} from "../src/index.js";
import { FakeConductor } from "./fake.js";

const HIGH = [(1n << 64n) - 5n, (1n << 63n) + 1n];

describe("uint64 block hashes", () => {
  test("take the whole unsigned range and nothing outside it", () => {
    assert.equal(blockHash(U64_MAX), U64_MAX);
    assert.equal(blockHash("18446744073709551611"), HIGH[0]);
    assert.equal(blockHash("0x8000000000000001"), HIGH[1]);
    assert.equal(blockHash(42), 42n);
    for (const bad of [-1n, U64_MAX + 1n, "nope", 2 ** 60, 1.5]) {
      assert.throws(() => blockHash(bad), RangeError, String(bad));
    }
  });

  test("encode as the Python client does and decode to the same values", () => {
    const request = create(conductor.ScheduleRequestSchema, {
      requestId: "r",
      promptTokens: 33,
      blockHashes: HIGH,
    });
    const bytes = toBinary(conductor.ScheduleRequestSchema, request);
    // ScheduleRequest(request_id="r", prompt_tokens=33, block_hashes=HIGH).SerializeToString()
    assert.equal(
      Buffer.from(bytes).toString("hex"),
      "0a017210212210fbffffffffffffff0100000000000080",
    );
    assert.deepEqual(fromBinary(conductor.ScheduleRequestSchema, bytes).blockHashes, HIGH);
  });

  test("pack little-endian as the Python client does, and read back", () => {
    const packed = packHashes(HIGH);
    // clients.python.pack_hashes(HIGH).hex()
    assert.equal(Buffer.from(packed).toString("hex"), "fbffffffffffffff0100000000000080");
    assert.deepEqual(unpackHashes(packed), HIGH);
    assert.deepEqual(unpackHashes(packed.subarray(8)), [HIGH[1]]);
    assert.equal(packHashes([]).length, 0);
    assert.throws(() => packHashes([U64_MAX + 1n]), RangeError);
    assert.throws(() => unpackHashes(new Uint8Array(9)), RangeError);
  });
});

describe("errors", () => {
  test("a refusal carries its retry delay from the trailer", () => {
    const err = errorFor(Code.ResourceExhausted, "no instance meets the SLO", {
      "retry-after-ms": "8500",
    });
    assert.ok(err instanceof Rejected);
    assert.equal(err.retryAfterMs, 8500);
    assert.equal(err.codeName, "RESOURCE_EXHAUSTED");
    assert.equal(err.message, "RESOURCE_EXHAUSTED: no instance meets the SLO");
    assert.equal(
      errorFor(Code.ResourceExhausted, "x", { "retry-after-ms": "soon" }).retryAfterMs,
      undefined,
    );
    assert.equal(errorFor(Code.ResourceExhausted, "x", {}, 10).retryAfterMs, 10);
    assert.ok(errorFor(Code.DeadlineExceeded, "x") instanceof Unavailable);
    assert.ok(errorFor(Code.PermissionDenied, "x").constructor === ConductorError);
  });

  test("an answer keeps its status and trailers; a lost connection is UNAVAILABLE", () => {
    const answered = new ConnectError("aborted", Code.Aborted, {
      "grpc-status": "10",
      "kvsched-leader": "h:1",
    });
    const err = fromCallError(answered);
    assert.equal(err.code, Code.Aborted);
    assert.equal(err.trailers["kvsched-leader"], "h:1");
    const reset = new ConnectError(
      "read ECONNRESET",
      Code.Aborted,
      undefined,
      undefined,
      Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET" }),
    );
    assert.ok(fromCallError(reset) instanceof Unavailable);
    assert.ok(
      fromCallError(new ConnectError("stream closed", Code.Canceled)) instanceof Unavailable,
    );
  });
});

test("addresses lose their scheme and trailing slash", () => {
  assert.equal(normalizeAddress(" grpc://127.0.0.1:50051/ "), "127.0.0.1:50051");
  assert.equal(normalizeAddress("https://conductor:443"), "conductor:443");
  assert.equal(normalizeAddress("host:1"), "host:1");
});

test("backoff doubles up to its cap, with the same jitter for the same seed", () => {
  const a = new Backoff(50, 400, 7);
  const b = new Backoff(50, 400, 7);
  const delays = [0, 1, 2, 3, 4].map((n) => a.delayMs(n));
  assert.deepEqual(
    delays,
    [0, 1, 2, 3, 4].map((n) => b.delayMs(n)),
  );
  for (const [n, delay] of delays.entries()) {
    const cap = Math.min(400, 50 * 2 ** n);
    assert.ok(delay >= cap / 2 && delay <= cap, `attempt ${n}: ${delay}`);
  }
  assert.throws(() => new Backoff(100, 50), RangeError);
});

test("durations convert both ways", () => {
  const d = duration(1500.25);
  assert.equal(d.seconds, 1n);
  assert.equal(d.nanos, 500_250_000);
  assert.equal(milliseconds(d), 1500.25);
  assert.throws(() => duration(-1), RangeError);
});

describe("leader following (fake Conductors)", () => {
  const fakes: FakeConductor[] = [];
  const clients: ConductorClient[] = [];
  after(async () => {
    for (const c of clients) c.close();
    for (const f of fakes) await f.stop();
  });

  async function cluster(n: number): Promise<FakeConductor[]> {
    const made = Array.from(
      { length: n },
      (_, i) => new FakeConductor(`c${i}`, { kind: "leader" }),
    );
    for (const f of made) await f.start();
    fakes.push(...made);
    return made;
  }

  function client(addresses: string[]): ConductorClient {
    const c = new ConductorClient(addresses, {
      deadlineMs: 1000,
      retries: 4,
      backoffMs: 5,
      maxBackoffMs: 20,
      seed: 1,
    });
    clients.push(c);
    return c;
  }

  test("a standby's refusal sends the write to the leader it names, with the same key", async () => {
    const [standby, leader] = (await cluster(2)) as [FakeConductor, FakeConductor];
    standby.behaviour = { kind: "standby", leader: `grpc://${leader.address}` };
    const c = client([standby.address]); // only the standby is configured
    // The client asks the standby who leads first (the leader confirms), then schedules.
    const decision = await c.schedule({ promptTokens: 33, blockHashes: HIGH });
    assert.equal(decision.instanceId, "c1/engine-0");
    assert.equal(c.currentLeader, leader.address);
    assert.deepEqual(
      leader.scheduled.map((r) => r.blockHashes),
      [HIGH],
    );
    assert.match(leader.scheduled[0]!.requestId, /^[0-9a-f]{32}$/);
    // Then the leader steps down naming the other: the next write is refused, then followed.
    leader.behaviour = { kind: "standby", leader: standby.address };
    standby.behaviour = { kind: "leader" };
    const again = await c.schedule({ requestId: "r2", promptTokens: 33 });
    assert.equal(again.instanceId, "c0/engine-0");
    assert.equal(c.currentLeader, standby.address);
    assert.deepEqual(leader.calls.slice(-1), ["Schedule"], "refused once at the old leader");
    assert.deepEqual(
      standby.scheduled.map((r) => r.requestId),
      ["r2"],
    );
  });

  test("a leader that dies is replaced by the one the others name", async () => {
    const [first, second] = (await cluster(2)) as [FakeConductor, FakeConductor];
    second.behaviour = { kind: "standby", leader: first.address };
    const c = client([first.address, second.address]);
    assert.equal((await c.schedule({ promptTokens: 33 })).instanceId, "c0/engine-0");
    await first.stop();
    second.behaviour = { kind: "leader" };
    assert.equal((await c.schedule({ promptTokens: 33 })).instanceId, "c1/engine-0");
    assert.equal(c.currentLeader, second.address);
  });

  test("a Conductor that comes back on its address is reached again", async () => {
    const [only] = (await cluster(1)) as [FakeConductor];
    const c = client([only.address]);
    assert.equal((await c.schedule({ promptTokens: 33 })).instanceId, "c0/engine-0");
    const port = Number(only.address.split(":")[1]);
    await only.stop();
    await assert.rejects(c.listInstances(), Unavailable);
    await only.start(port);
    assert.equal((await c.schedule({ promptTokens: 33 })).instanceId, "c0/engine-0");
    assert.equal(only.scheduled.length, 2);
  });

  test("many calls at once share the client without warnings", async () => {
    const [only] = (await cluster(1)) as [FakeConductor];
    const c = client([only.address]);
    const warnings: string[] = [];
    const onWarning = (w: Error): void => void warnings.push(`${w.name}: ${w.message}`);
    process.on("warning", onWarning);
    try {
      const decisions = await Promise.all(
        Array.from({ length: 64 }, (_, i) => c.schedule({ requestId: `r${i}`, promptTokens: 33 })),
      );
      assert.deepEqual(
        decisions.map((d) => d.requestId),
        Array.from({ length: 64 }, (_, i) => `r${i}`),
      );
      await new Promise((resolve) => setImmediate(resolve)); // warnings are emitted on a tick
    } finally {
      process.off("warning", onWarning);
    }
    assert.deepEqual(warnings, []);
  });

  test("a refusal is not retried and says when to come back", async () => {
    const [only] = (await cluster(1)) as [FakeConductor];
    only.behaviour = { kind: "overloaded", retryAfterMs: "7250" };
    const c = client([only.address]);
    const err = await c.schedule({ promptTokens: 33 }).catch((e: unknown) => e);
    assert.ok(err instanceof Rejected, String(err));
    assert.equal(err.retryAfterMs, 7250);
    assert.equal(only.scheduled.length, 1);
  });

  test("bad requests fail without retries, hashes out of range before anything is sent", async () => {
    const [only] = (await cluster(1)) as [FakeConductor];
    const c = client([only.address]);
    await assert.rejects(c.schedule({ promptTokens: 0 }), InvalidRequest);
    assert.equal(only.scheduled.length, 1);
    await assert.rejects(
      c.schedule({ promptTokens: 33, blockHashes: [U64_MAX + 1n] }),
      /not an unsigned 64-bit/,
    );
    await assert.rejects(c.schedule({ promptTokens: 33, blockHashes: [-1n] }), InvalidRequest);
    assert.equal(only.scheduled.length, 1, "nothing more was sent");
  });

  test("no Conductor at all: Unavailable after the retry budget; closed: CANCELLED", async () => {
    const [gone] = (await cluster(1)) as [FakeConductor];
    await gone.stop();
    const c = client([gone.address]);
    const err = await c.schedule({ promptTokens: 33 }).catch((e: unknown) => e);
    assert.ok(err instanceof Unavailable, String(err));
    c.close();
    const closed = await c.listInstances().catch((e: unknown) => e);
    assert.ok(closed instanceof ConductorError && closed.code === Code.Canceled, String(closed));
  });
});
