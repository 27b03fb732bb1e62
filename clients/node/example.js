'use strict';
// Registers an instance, places one request on it, lists the instances.
//   node example.js [host:port[,host:port...]]     (default: $KVSCHED_CONDUCTOR or 127.0.0.1:50051)
const { ConductorClient } = require('./index.js');

async function main() {
  const address = process.argv[2] || process.env.KVSCHED_CONDUCTOR || '127.0.0.1:50051';
  const client = new ConductorClient(address, { deadlineMs: 2000 });
  try {
    const instanceId = `example/engine-${process.pid}`;
    const registered = await client.registerInstance({
      instanceId, url: 'http://127.0.0.1:8000', node: 'example', role: 'ROLE_BOTH', model: 'example-model',
    });
    console.log('registered:', JSON.stringify(registered.instance.spec), 'slot', registered.instance.slot);

    const decision = await client.schedule({
      requestId: `example-${Date.now()}`,
      promptTokens: 40,
      outputTokens: 16,
      blockHashes: [0x1234n, 18446744073709551557n], // fixed64: BigInt or decimal strings
    });
    console.log(`decision: ${decision.instanceId} (${decision.instanceUrl}) by rule "${decision.rule}"`,
      `policy "${decision.policy}", ${decision.cachedTokens} cached tokens`);

    for (const inst of await client.listInstances()) {
      console.log(`instance ${inst.spec.instanceId} slot=${inst.slot} role=${inst.spec.role} in_flight=${inst.inFlight}`);
    }
    console.log('leader:', JSON.stringify(await client.getLeader()), 'via', client.address);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  console.error(`example failed: ${err.message}`);
  process.exit(1);
});
