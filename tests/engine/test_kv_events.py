"""The engine's KV events on real ZMQ: vLLM's wire format, engine-side names, token ids that
re-hash to the blocks the engine caches, the tenant salt where vLLM puts it, evictions, and a
snapshot that equals the cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsched.core.hashing import BlockHasher
from services.common.kv_events import BlockRemoved, BlockStored, EventBatch
from services.messenger.kv_subscriber import KvEventSubscriber
from tests.engine.conftest import RunningEngine


async def _subscribe(eng: RunningEngine) -> KvEventSubscriber:
    info = await eng.get_json("/kvsched/info")
    sub = KvEventSubscriber(info["kv_events"]["endpoint"], info["kv_events"]["replay_endpoint"])
    await asyncio.sleep(0.2)  # ZMQ's slow joiner: a SUB misses what is sent before it joins
    return sub


async def _events(sub: KvEventSubscriber, want: int) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(5.0):
        async for batch in sub.batches():
            assert isinstance(batch, EventBatch)
            out.extend(batch.events)
            if len(out) >= want:
                return out
    return out


def _chain(events: list[Any], hasher: BlockHasher, salt: bytes = b"") -> list[int]:
    """Our hashes of the stored chain, rebuilt from the events' token ids alone."""
    ours: dict[object, int] = {}
    out = []
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        h = ours[e.parent_block_hash] if e.parent_block_hash is not None else hasher.root(salt)
        for i, name in enumerate(e.block_hashes):
            h = hasher.extend(h, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            ours[name] = h
            out.append(h)
    return out


@pytest.mark.parametrize("shape", ["map", "array"])
async def test_stored_blocks_rehash_to_the_engines_cache_keys(
    start_engine: Any, shape: str
) -> None:
    eng: RunningEngine = await start_engine(event_shape=shape)
    sub = await _subscribe(eng)
    try:
        async with await eng.post("/v1/completions", {"prompt": "cache me " * 30, "max_tokens": 2}):
            pass
        events = await _events(sub, 1)
    finally:
        sub.close()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].parent_block_hash is None and stored[0].medium == "GPU"
    assert _chain(events, BlockHasher(16)) == list(eng.live.engine.cache.nodes)
    # vLLM's names, not ours: a relay cannot take them for our hashes
    assert not set(stored[0].block_hashes) & set(eng.live.engine.cache.nodes)


async def test_cache_salt_is_in_the_first_blocks_extra_keys(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    sub = await _subscribe(eng)
    body = {"prompt": "tenant data " * 30, "max_tokens": 2, "cache_salt": "tenant-a"}
    try:
        async with await eng.post("/v1/completions", body):
            pass
        events = await _events(sub, 1)
    finally:
        sub.close()
    first = events[0]
    assert isinstance(first, BlockStored)
    assert first.extra_keys[0] == ["tenant-a"] and all(k is None for k in first.extra_keys[1:])
    salted = _chain(events, BlockHasher(16), b"tenant-a")
    assert salted == list(eng.live.engine.cache.nodes)
    assert salted != _chain(events, BlockHasher(16))


async def test_eviction_is_announced_and_the_snapshot_equals_the_cache(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(capacity_blocks=8)
    sub = await _subscribe(eng)
    try:
        for i in range(3):  # 3 prompts of 4 blocks into 8 pages: the first must go
            body = {"prompt": [100 + i] * 64 + [7], "max_tokens": 1}
            async with await eng.post("/v1/completions", body) as resp:
                assert resp.status == 200
        events = await _events(sub, 4)
    finally:
        sub.close()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    assert removed and set(removed) <= stored
    snap = await eng.get_json("/kvsched/kv/snapshot")
    assert snap["next_seq"] == eng.live.publisher.next_seq
    names = [b["block_hash"] for b in snap["blocks"]]
    assert len(names) == len(eng.live.engine.cache.nodes) and not set(names) & set(removed)
    seen: set[int] = set()
    for block in snap["blocks"]:  # parents come first
        assert block["parent_block_hash"] is None or block["parent_block_hash"] in seen
        seen.add(block["block_hash"])
