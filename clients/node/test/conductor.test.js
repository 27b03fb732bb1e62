'use strict';
// Runs against a live Conductor:  KVSCHED_CONDUCTOR=127.0.0.1:50051 npm test
// Other instances may be registered on it; every id used here is unique to this run.
const { test, after } = require('node:test');
const assert = require('node:assert/strict');
const { ConductorClient, grpcStatus } = require('../index.js');

const ADDRESS = process.env.KVSCHED_CONDUCTOR;
if (!ADDRESS) {
  throw new Error('KVSCHED_CONDUCTOR is not set: give the Conductor address, e.g. KVSCHED_CONDUCTOR=127.0.0.1:50051 npm test');
}
const BLOCK_TOKENS = Number(process.env.KVSCHED_BLOCK_TOKENS || 16); // the Conductor's block size
const RUN = `nodetest-${process.pid}-${Date.now().toString(36)}`;
const BIG_HASH = 18446744073709551557n; // above 2^63: must survive as an unsigned 64-bit value

const client = new ConductorClient(ADDRESS, { deadlineMs: 5000 });
const registered = [];

after(async () => {
  for (const id of registered) await client.deregisterInstance(id).catch(() => {});
  client.close();
});

/** Registers two ROLE_BOTH instances unique to this run and test; returns their ids. */
async function registerTwo(tag) {
  const ids = [`${RUN}/${tag}-a`, `${RUN}/${tag}-b`];
  for (const [i, instanceId] of ids.entries()) {
    const { instance } = await client.registerInstance({
      instanceId, url: `http://127.0.0.1:${18000 + i}`, node: `${RUN}-node`, role: 'ROLE_BOTH', model: 'test-model',
    });
    registered.push(instanceId);
    assert.equal(instance.spec.instanceId, instanceId);
  }
  return ids;
}

test('registered instances are listed with role ROLE_BOTH', async () => {
  const ids = await registerTwo('list');
  const listed = new Map((await client.listInstances()).map((inst) => [inst.spec.instanceId, inst]));
  for (const id of ids) {
    assert.ok(listed.has(id), `${id} missing from ListInstances`);
    assert.equal(listed.get(id).spec.role, 'ROLE_BOTH');
  }
});

test('schedule places a request with a hash above 2^63 on a registered instance', async () => {
  await registerTwo('schedule');
  const blockHashes = [BIG_HASH, 0x0123456789abcdefn, `${(1n << 63n) + 7n}`];
  const decision = await client.schedule({
    requestId: `${RUN}-req`,
    promptTokens: blockHashes.length * BLOCK_TOKENS + 5,
    outputTokens: 8,
    blockHashes,
  });
  const live = new Set((await client.listInstances()).map((inst) => inst.spec.instanceId));
  assert.ok(live.has(decision.instanceId), `decision names ${JSON.stringify(decision.instanceId)}, not a registered instance`);
  assert.equal(typeof decision.rule, 'string');
  assert.ok(decision.rule.length > 0, 'decision.rule is empty');
  // Any transfer the placement needs carries hashes of this prompt, exactly as sent.
  const sent = new Set(blockHashes.map(String));
  for (const plan of decision.transfers) {
    for (const hash of plan.blockHashes) assert.ok(sent.has(hash), `transfer names hash ${hash}, not one sent`);
  }
});

test('an empty schedule request is rejected with INVALID_ARGUMENT', async () => {
  await assert.rejects(client.schedule({ requestId: '', promptTokens: 0, blockHashes: [] }), (err) => {
    assert.equal(err.code, grpcStatus.INVALID_ARGUMENT, `expected INVALID_ARGUMENT (3), got ${err.code}: ${err.details}`);
    return true;
  });
});

test('the Conductor the client talks to is the leader', async () => {
  await registerTwo('leader'); // a write: follows a standby's redirect to the leader, if any
  const info = await client.getLeader();
  assert.equal(info.isLeader, true, `${client.address} answered is_leader=false (leader ${info.leaderUrl})`);
  assert.ok(info.selfId, 'self_id is empty');
  assert.equal(info.leaderId, info.selfId);
});
