"""The engine's KV events on real ZMQ: vLLM's wire format, blocks named by vLLM's own hashes
of the token ids they carry, the tenant salt where vLLM puts it, the session id, evictions,
and a snapshot that equals the cache."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher, event_hash
from services.dataplane.block_hashes import BlockHashes
from services.kv_events.vllm_wire import BlockRemoved, BlockStored, Event
from tests.engine.conftest import RunningEngine

HASHER = VllmBlockHasher(16)


def rehash(events: list[Event]) -> list[int]:
    """Every cached block's name, checked against vLLM's hash of the tokens the events
    carry (a chain's salt in its first block's extra keys); removed blocks are dropped, so
    this is what the engine caches."""
    digests: dict[object, bytes] = {}
    for e in events:
        if isinstance(e, BlockRemoved):
            for name in e.block_hashes:
                del digests[name]
            continue
        assert isinstance(e, BlockStored)
        parent = e.parent_block_hash
        digest = None if parent is None else digests[parent]
        salt = e.extra_keys[0][0] if parent is None and e.extra_keys else None
        for i, name in enumerate(e.block_hashes):
            tokens = e.token_ids[i * e.block_size : (i + 1) * e.block_size]
            digest = HASHER.next_digest(digest, tokens, salt if i == 0 else None)
            assert event_hash(digest) == name
            digests[name] = digest
    return [event_hash(d) for d in digests.values()]


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
    assert sorted(rehash(got)) == sorted(eng.live.cache.nodes)


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
    assert sorted(rehash(got)) == sorted(eng.live.cache.nodes)
    # The same prompt unsalted is another chain.
    await eng.complete({**body, "cache_salt": None})
    got = await events.upto(eng.live.publisher.next_seq)
    assert sorted(rehash(got)) == sorted(eng.live.cache.nodes)
    assert len(eng.live.cache.nodes) == 1 + 2 * (len(new[0].token_ids) // 16)


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
    assert sorted(rehash(got)) == sorted(eng.live.cache.nodes)
    snap = await eng.get_json("/kvsched/kv/snapshot")
    assert snap["next_seq"] == eng.live.publisher.next_seq and snap["block_size"] == 16
    cache = eng.live.cache.nodes
    assert list(cache) == [b["block_hash"] for b in snap["blocks"]]
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


@pytest.mark.parametrize("hashes", [BlockHashes(), BlockHashes("xxhash_cbor", "42")])
async def test_blocks_are_named_as_a_router_hashes_the_prompt(
    start_engine: Any, hashes: BlockHashes
) -> None:
    eng: RunningEngine = await start_engine(block_hashes=hashes)
    body = {"prompt": "same words " * 20, "max_tokens": 1, "cache_salt": "t-9"}
    await eng.complete(body)
    async with await eng.post("/tokenize", {"prompt": body["prompt"]}) as resp:
        ids = (await resp.json())["tokens"]
    expected = hashes.hasher(16).hash_prompt(ids, "t-9")
    assert expected and list(eng.live.cache.nodes) == expected
    snap = await eng.get_json("/kvsched/kv/snapshot")
    assert [b["block_hash"] for b in snap["blocks"]] == expected
