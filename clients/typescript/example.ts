/**
 * The TypeScript client against a running cluster: who leads, the policy, the instances, and
 * how a prompt whose block hashes lie above 2^63 would be placed (Explain); with --place, also
 * register an instance, place a request on it and deregister it.
 *
 *   node dist/example.js --endpoints endpoints.json   # a `kvsched up --endpoints-file` cluster:
 *                                                     # its Conductors, as the operator (mTLS)
 *   node dist/example.js 127.0.0.1:50051[,host:port] [--ca ca.pem --cert me.pem --key me.key]
 *   node dist/example.js 127.0.0.1:50051 --place      # a cluster started with --insecure (or
 *                                                     # certificates that may register/schedule)
 */

import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

import {
  common,
  ConductorClient,
  ConductorError,
  milliseconds,
  packHashes,
  Rejected,
  type TlsOptions,
} from "./src/index.js";

/** Block hashes of a made-up 3-block prompt: two of them above 2^63. */
const HASHES = [0x1234n, (1n << 64n) - 59n, (1n << 63n) + 17n];

interface Endpoints {
  conductors: { url: string }[];
  admin?: { ca: string; cert: string; key: string } | null;
}

function target(): { addresses: string[]; tls: TlsOptions | undefined; place: boolean } {
  const { values, positionals } = parseArgs({
    allowPositionals: true,
    options: {
      endpoints: { type: "string" },
      ca: { type: "string" },
      cert: { type: "string" },
      key: { type: "string" },
      place: { type: "boolean", default: false },
    },
  });
  const place = values.place ?? false;
  if (values.endpoints !== undefined) {
    const file = JSON.parse(readFileSync(values.endpoints, "utf8")) as Endpoints;
    const admin = file.admin ?? undefined;
    return { addresses: file.conductors.map((c) => c.url), tls: admin, place };
  }
  const addresses = (positionals[0] ?? process.env["KVSCHED_CONDUCTOR"] ?? "127.0.0.1:50051").split(
    ",",
  );
  const tls =
    values.ca === undefined ? undefined : { ca: values.ca, cert: values.cert, key: values.key };
  return { addresses, tls, place };
}

async function main(): Promise<void> {
  const { addresses, tls, place } = target();
  const client = new ConductorClient(addresses, { tls, deadlineMs: 2000 });
  try {
    const leader = await client.leader();
    const policy = await client.getPolicy();
    console.log(`leader ${leader}; policy ${policy.spec} (of ${policy.available.join(", ")})`);
    for (const inst of await client.listInstances()) {
      const load = inst.load;
      console.log(
        `instance ${inst.spec?.instanceId} slot ${inst.slot} node ${inst.spec?.node}`,
        `in flight ${inst.inFlight}, pending prefill ${milliseconds(load?.pendingPrefill).toFixed(0)} ms`,
      );
    }
    const explained = await client.explain({
      blockHashes: HASHES,
      promptTokens: 50,
      outputTokens: 16,
    });
    const d = explained.decision;
    console.log(
      explained.rejected
        ? "a prompt now would be refused"
        : `a prompt now would go to ${d?.instanceId}`,
      `(rule "${d?.rule}", ${d?.cachedTokens ?? 0} cached tokens)`,
    );
    if (place) await registerAndPlace(client);
  } finally {
    client.close();
  }
}

/** Register an instance, place a request on it (or print the refusal's delay), deregister it. */
async function registerAndPlace(client: ConductorClient): Promise<void> {
  const instanceId = `example/ts-${process.pid}`;
  await client.registerInstance(
    { instanceId, url: "http://127.0.0.1:8000", node: "example", role: common.Role.BOTH },
    10_000,
  );
  try {
    const decision = await client.schedule({
      promptTokens: 50,
      outputTokens: 16,
      packedBlockHashes: packHashes(HASHES), // 8 bytes each: the Conductor reads them fastest
    });
    console.log(`placed ${decision.requestId} on ${decision.instanceId} by "${decision.rule}"`);
  } catch (err) {
    if (!(err instanceof Rejected)) throw err;
    console.log(`refused (${err.detail}); retry after ${err.retryAfterMs} ms`);
  } finally {
    await client.deregister(instanceId);
  }
}

main().catch((err: unknown) => {
  console.error(`example failed: ${err instanceof ConductorError ? err.message : String(err)}`);
  process.exit(1);
});
