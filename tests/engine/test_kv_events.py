"""The engine's KV events on real ZMQ: vLLM's wire format, engine-side names, token ids that
re-hash to the blocks the engine caches, the tenant salt where vLLM puts it, the session id,
evictions, and a snapshot that equals the cache."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core.hashing import BlockHasher
from services.common.kv_events import BlockRemoved, BlockStored, Event
from services.messenger.translate import cache_salt
from tests.engine.conftest import RunningEngine

HASHER = BlockHasher(16)


def rehash(events: list[Event]) -> list[int]:
    """Our hashes of every stored block, rebuilt from the events alone (as the Messenger
    does: token ids, parents, and the salt from the first block's extra keys); removed
    blocks are dropped, so this is what the engine caches."""
    ours: dict[object, int] = {}
    for e in events:
        if isinstance(e, BlockRemoved):
            for name in e.block_hashes:
                del ours[name]
            continue
        assert isinstance(e, BlockStored)
        parent = e.parent_block_hash
        h = HASHER.root(cache_salt(e)) if parent is None else ours[parent]
        for i, name in enumerate(e.block_hashes):
            h = HASHER.extend(h, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            ours[name] = h
    return list(ours.values())


@pytest.mark.parametrize("shape", ["map", "array"])
async def test_stored_blocks_rehash_to_the_engines_cache_keys(
    start_engine: Any, events_of: Any, shape: str
) -> None:
    eng: RunningEngine = await start_engine(event_shape=shape)
    events = await events_of(eng)
    await eng.complete({"prompt": "cache me " * 30, "max_tokens": 2})
    got = await events.upto(eng.live.publisher.next_seq)
    stored = [e for e in got if isinstance(e, BlockStored)]
    assert stored[-1].medium == "GPU" and stored[-1].block_size == 16
    assert sorted(rehash(got)) == sorted(eng.live.engine.cache.nodes)
    # vLLM's names, not ours: a relay cannot take them for our hashes
    assert not {h for e in stored for h in e.block_hashes} & set(eng.live.engine.cache.nodes)


async def test_cache_salt_and_session_ride_on_the_chain(start_engine: Any, events_of: Any) -> None:
    eng: RunningEngine = await start_engine()
    events = await events_of(eng)
    before = eng.live.publisher.next_seq
    body = {"prompt": "tenant data " * 30, "max_tokens": 2, "cache_salt": "tenant-a"}
    await eng.complete(body, headers={"x-session-id": "s-42"})
    got = await events.upto(eng.live.publisher.next_seq)
    new = [e for b in events.batches if b.seq >= before for e in b.events]
    first = new[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.extra_keys[0] == ["tenant-a"] and all(k is None for k in first.extra_keys[1:])
    assert first.session_id == "s-42"
    assert sorted(rehash(got)) == sorted(eng.live.engine.cache.nodes)
    # The same prompt unsalted is another chain.
    await eng.complete({**body, "cache_salt": None})
    got = await events.upto(eng.live.publisher.next_seq)
    assert sorted(rehash(got)) == sorted(eng.live.engine.cache.nodes)
    assert len(eng.live.engine.cache.nodes) == 1 + 2 * (len(new[0].token_ids) // 16)


async def test_eviction_is_announced_and_the_snapshot_equals_the_cache(
    start_engine: Any, events_of: Any
) -> None:
    eng: RunningEngine = await start_engine(capacity_blocks=12)
    events = await events_of(eng)
    for i in range(4):  # 4 prompts of 4 blocks into 12 pages: the oldest must go
        await eng.complete({"prompt": [100 + i] * 64 + [7], "max_tokens": 1})
    got = await events.upto(eng.live.publisher.next_seq)
    removed = [h for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = {h for e in got if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed and set(removed) <= stored
    assert sorted(rehash(got)) == sorted(eng.live.engine.cache.nodes)
    snap = await eng.get_json("/kvsched/kv/snapshot")
    assert snap["next_seq"] == eng.live.publisher.next_seq and snap["block_size"] == 16
    cache = eng.live.engine.cache.nodes
    assert [eng.live.names.name(h) for h in cache] == [b["block_hash"] for b in snap["blocks"]]
    seen: set[int] = set()
    for block in snap["blocks"]:  # parents come first
        assert block["parent_block_hash"] is None or block["parent_block_hash"] in seen
        assert len(block["token_ids"]) == 16 and block["medium"] == "GPU"
        seen.add(block["block_hash"])
    # The snapshot names blocks exactly as the events did.
    live_names = {h for e in got if isinstance(e, BlockStored) for h in e.block_hashes}
    assert seen == live_names - set(removed)


async def test_the_snapshot_carries_the_salt_of_a_chains_first_block(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    await eng.complete({"prompt": "salted " * 40, "max_tokens": 1, "cache_salt": "t-1"})
    blocks = (await eng.get_json("/kvsched/kv/snapshot"))["blocks"]
    assert blocks[0]["extra_keys"] == ["t-1"] and blocks[0]["parent_block_hash"] is None
    assert all(b["extra_keys"] is None for b in blocks[1:])


async def test_engine_names_depend_on_the_engine_seed(start_engine: Any) -> None:
    names, keys = [], []
    for seed in (1, 2):
        eng: RunningEngine = await start_engine(engine_hash_seed=seed)
        await eng.complete({"prompt": "same words " * 20, "max_tokens": 1})
        snap = await eng.get_json("/kvsched/kv/snapshot")
        names.append({b["block_hash"] for b in snap["blocks"]})
        keys.append(set(eng.live.engine.cache.nodes))
    assert names[0] and not names[0] & names[1]  # vLLM's hashes are seeded per process
    assert keys[0] == keys[1]  # ours are not
