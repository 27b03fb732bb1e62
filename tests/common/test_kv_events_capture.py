"""KV events captured from a real vLLM 0.32 server (tests/data/vllm/cpu-0.32-capture): every
message decodes to what the server did (u64 block names, chains, 32-token blocks, the cache
salt, the session, evictions), and our encoder gives back its bytes exactly."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgpack
import pytest

from services.kv_events.vllm_wire import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_frames,
    encode_frames,
)

CAPTURE = Path(__file__).resolve().parents[1] / "data/vllm/cpu-0.32-capture"
KINDS = ("frames", "frames_salt", "frames_evict")
TOPIC = b"kv-events"
BLOCK_SIZE = 32
SALT = "0b806e8a15a62774aa4ea80d43cfb17f"  # the salted session's cache salt, as vLLM sent it
# vLLM 0.32's BlockStored declares 14 fields and its tag (0.33 added one).
STORED_FIELDS_0_32 = 15


def captured(kind: str) -> list[list[bytes]]:
    """The messages of one capture, in order, as the frames [topic, seq, payload]."""
    return [msgpack.unpackb(p.read_bytes()) for p in sorted((CAPTURE / kind).glob("*.bin"))]


def batches(kind: str) -> list[EventBatch]:
    return [decode_frames(frames) for frames in captured(kind)]


def stored(batch: EventBatch) -> list[BlockStored]:
    return [e for e in batch.events if isinstance(e, BlockStored)]


ALL = [(kind, i, frames) for kind in KINDS for i, frames in enumerate(captured(kind))]
IDS = [f"{kind}-{i:03d}" for kind, i, _ in ALL]


def test_the_capture_is_all_there() -> None:
    assert [len(captured(kind)) for kind in KINDS] == [2, 7, 6]


@pytest.mark.parametrize(("kind", "index", "frames"), ALL, ids=IDS)
def test_every_captured_message_decodes_whole(kind: str, index: int, frames: Any) -> None:
    batch = decode_frames(frames)
    assert batch.skipped == 0 and batch.events
    assert batch.topic == TOPIC and batch.dp_rank == 0
    assert batch.seq == int.from_bytes(frames[1], "big")
    for event in batch.events:
        assert isinstance(event, BlockStored | BlockRemoved)
        assert all(type(h) is int and 0 <= h < 1 << 64 for h in event.block_hashes)
        assert event.medium == "GPU" and event.group_idx == 0
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK_SIZE
            assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
            assert len(event.extra_keys) == len(event.block_hashes)
            assert event.kv_cache_spec_kind == "full_attention"


def test_block_names_above_the_signed_range_stay_unsigned() -> None:
    names = [
        h
        for _, _, frames in ALL
        for e in decode_frames(frames).events
        if isinstance(e, BlockStored | BlockRemoved)
        for h in e.block_hashes
    ]
    u64 = [h for h in names if isinstance(h, int) and h >= 0]
    assert u64 == names
    assert any(h >= 1 << 63 for h in u64)


def test_the_salted_session_is_one_chain_rooted_on_its_salt() -> None:
    got = batches("frames_salt")
    assert [b.seq for b in got] == list(range(10, 17))
    chain = [stored(b) for b in got[:6]]
    assert all(len(events) == 1 for events in chain)
    root = chain[0][0]
    assert root.parent_block_hash is None
    assert root.extra_keys == [[SALT]]  # the first block's extra keys: (cache_salt,)
    for before, after in itertools.pairwise(chain):
        assert after[0].parent_block_hash == before[0].block_hashes[-1]
        assert all(k is None for k in after[0].extra_keys)  # only the root carries the salt
    assert {e.session_id for events in chain for e in events} == {"acme/probe-s2"}
    # Then another session, unsalted, from the root again.
    other = stored(got[6])[0]
    assert other.parent_block_hash is None and other.extra_keys == [None]
    assert other.session_id == "anonymous/s10"


def test_unsalted_requests_are_roots_without_a_session() -> None:
    for kind in ("frames", "frames_evict"):
        for batch in batches(kind):
            for event in stored(batch):
                assert event.parent_block_hash is None and event.session_id is None
                assert all(k is None for k in event.extra_keys)


def test_evictions_remove_blocks_stored_before() -> None:
    got = batches("frames_evict")
    seen: set[int] = set()
    removed: list[int] = []
    for batch in got:
        for event in batch.events:
            if isinstance(event, BlockRemoved):
                assert len(event.block_hashes) == 1
                assert event.block_hashes[0] in seen
                removed.append(event.block_hashes[0])
            else:
                assert isinstance(event, BlockStored)
                seen.update(h for h in event.block_hashes if isinstance(h, int))
    evicting = [any(isinstance(e, BlockRemoved) for e in b.events) for b in got]
    assert evicting == [False, False, False, True, True, True]
    assert len(removed) == len(set(removed)) == 34


@pytest.mark.parametrize(("kind", "index", "frames"), ALL, ids=IDS)
def test_encoding_gives_back_vllms_bytes(kind: str, index: int, frames: Any) -> None:
    batch = decode_frames(frames)
    ours = encode_frames(
        batch.topic,
        batch.seq,
        batch.ts,
        batch.events,
        batch.dp_rank,
        stored_fields=STORED_FIELDS_0_32,
    )
    assert ours == frames
    # As vLLM ≥ 0.33 would send them: each BlockStored map's header grows to a map16.
    newer = encode_frames(batch.topic, batch.seq, batch.ts, batch.events, batch.dp_rank)
    assert len(newer[2]) == len(frames[2]) + 2 * len(stored(batch))
