"""vLLM KV events: decoding the real frames of vLLM 0.11 (arrays) and 0.33 (maps) and damaged
input (counted and skipped, never a crash); encoding that reproduces vLLM's bytes."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.kv_events.vllm_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    Limits,
    MalformedFrames,
    Shape,
    decode_frames,
    encode_frames,
)

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "data/vllm/kv_event_vectors.json").read_text()
)


def frames_of(vector: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(f) for f in vector["frames_b64"]]


def normal(h: EngineHash | None) -> str | None:
    if h is None:
        return None
    return f"hex:{h.hex()}" if isinstance(h, bytes) else str(h)


def as_expected(event: Event) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [normal(h) for h in event.block_hashes],
            "parent_block_hash": normal(event.parent_block_hash),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "medium": event.medium,
            "lora_name": event.lora_name,
            "group_idx": event.group_idx,
            "session_id": event.session_id,
        }
    elif isinstance(event, BlockRemoved):
        out = {
            "type": "BlockRemoved",
            "block_hashes": [normal(h) for h in event.block_hashes],
            "medium": event.medium,
        }
    else:
        out = {"type": "AllBlocksCleared"}
    return out


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{v['vllm_version']}-{v['name']}")
def test_real_vllm_frames_decode_as_expected(vector: dict[str, Any]) -> None:
    batch = decode_frames(frames_of(vector))
    expected = vector["expected"]
    assert batch.skipped == 0
    assert batch.dp_rank == expected["dp_rank"]
    assert batch.topic == base64.b64decode(vector["frames_b64"][0])
    assert batch.seq == int.from_bytes(base64.b64decode(vector["frames_b64"][1]), "big")
    assert len(batch.events) == len(expected["events"])
    for got, want in zip(batch.events, expected["events"], strict=True):
        mine = as_expected(got)
        assert {k: mine.get(k) for k in want} == want  # only the fields the vector names


def test_hashes_above_the_signed_range_and_digests_survive() -> None:
    by_name = {(v["vllm_version"], v["name"]): v for v in VECTORS}
    big = decode_frames(frames_of(by_name[("0.33.0", "stored_root_u64")])).events[0]
    assert isinstance(big, BlockStored) and big.block_hashes[0] == 2**64 - 5
    digest = decode_frames(frames_of(by_name[("0.11.0", "stored_bytes_hashes_dp1")])).events[0]
    assert isinstance(digest, BlockStored)
    assert digest.block_hashes[0] == bytes(range(32)) and digest.medium == "CPU"


def message(events: list[Any], batch: Any = None, seq: int = 7) -> list[bytes]:
    payload = msgpack.packb(batch if batch is not None else [1.5, events, 0])
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


STORED = ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"]


def test_older_and_map_batches_decode() -> None:
    two = decode_frames(message([], batch=[1.5, [STORED]]))
    assert two.dp_rank is None and len(two.events) == 1
    mapped = decode_frames(
        message([], batch={"ts": 2.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3})
    )
    assert mapped.dp_rank == 3 and mapped.events == (AllBlocksCleared(),)


def test_unknown_event_types_and_fields_are_skipped_or_ignored() -> None:
    events = [
        ["SomethingNew", 1, 2],
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "brand_new": {"x": 1}},
        [*STORED, "lora", None, 0, "future-field", 42],
    ]
    batch = decode_frames(message(events))
    assert batch.skipped == 1
    assert batch.events[0] == BlockRemoved((5,), "GPU")
    assert isinstance(batch.events[1], BlockStored) and batch.events[1].lora_name == "lora"


@pytest.mark.parametrize(
    "bad",
    [
        ["BlockStored", [1], None, [1, 2], 0, None, "GPU"],  # zero block size
        ["BlockStored", [], None, [], 16],  # no hashes
        ["BlockStored", [1], None, [-1], 16],  # not a u32 token
        ["BlockStored", ["x"], None, [], 16],  # a hash that is neither int nor bytes
        ["BlockStored", [1 << 70], None, [], 16],  # too large (msgpack refuses to pack it)
        {"type": "BlockRemoved", "block_hashes": "nope"},
        {"type": 7},
        "just a string",
        ["BlockStored", [1], None, [1], True],  # a bool is not a block size
    ],
)
def test_malformed_events_are_counted_and_skipped(bad: Any) -> None:
    try:
        frames = message([bad, ["AllBlocksCleared"]])
    except OverflowError:
        return  # not representable on the wire at all
    batch = decode_frames(frames)
    assert batch.skipped == 1
    assert batch.events == (AllBlocksCleared(),)


def test_oversize_lists_are_refused() -> None:
    limits = Limits(max_events=4, max_hashes=3, max_tokens=8)
    too_many_hashes = ["BlockStored", [1, 2, 3, 4], None, [], 16]
    batch = decode_frames(message([too_many_hashes, ["AllBlocksCleared"]]), limits)
    assert batch.skipped == 1 and len(batch.events) == 1
    too_many_tokens = ["BlockStored", [1], None, list(range(9)), 16]
    assert decode_frames(message([too_many_tokens]), limits).skipped == 1
    with pytest.raises(MalformedFrames, match="events in one batch"):
        decode_frames(message([["AllBlocksCleared"]] * 5), limits)
    with pytest.raises(MalformedFrames, match="payload of"):
        decode_frames(message([STORED]), Limits(max_payload_bytes=10))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"kv-events", (1).to_bytes(8, "big")], "expected 3 frames"),
        ([b"t", b"\x00" * 8, b"x", b"y"], "expected 3 frames"),
        ([b"t", b"\x01", msgpack.packb([1.0, [], 0])], "sequence frame"),
        ([b"t", b"\x00" * 8, msgpack.packb([1.0, [STORED], 0])[:-5]], "not msgpack"),
        ([b"t", b"\x00" * 8, msgpack.packb({"no": "batch"})], "timestamp"),
        ([b"t", b"\x00" * 8, msgpack.packb(42)], "not a batch"),
        ([b"t", b"\x00" * 8, msgpack.packb([1.0, [], "rank"])], "rank"),
    ],
)
def test_damaged_messages_raise_a_clear_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(MalformedFrames, match=reason):
        decode_frames(frames)


@given(st.binary(max_size=256))
def test_arbitrary_bytes_never_crash_the_decoder(payload: bytes) -> None:
    """Any payload is a batch or a `MalformedFrames`, never another exception."""
    try:
        batch = decode_frames([b"t", b"\x00" * 8, payload])
    except MalformedFrames:
        return
    assert batch.seq == 0 and len(batch.events) + batch.skipped >= 0


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)


@given(st.lists(_VALUES, max_size=6))
def test_arbitrary_events_are_decoded_or_skipped(events: list[Any]) -> None:
    batch = decode_frames(message(events))
    assert len(batch.events) + batch.skipped == len(events)


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: f"{v['vllm_version']}-{v['name']}")
def test_encoding_reproduces_vllms_bytes(vector: dict[str, Any]) -> None:
    frames = frames_of(vector)
    batch = decode_frames(frames)
    shape: Shape = "map" if vector["event_shape"] == "map" else "array"
    events, rank = batch.events, batch.dp_rank
    assert encode_frames(batch.topic, batch.seq, batch.ts, events, rank, shape=shape) == frames


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=8))
def test_encoded_events_decode_to_themselves(hashes: list[int]) -> None:
    events: list[Event] = [
        BlockStored(tuple(hashes), hashes[0], tuple(range(16 * len(hashes))), 16, "GPU"),
        BlockRemoved(tuple(hashes[:1]), "GPU", group_idx=2),
        AllBlocksCleared(),
    ]
    for shape in ("map", "array"):
        batch = decode_frames(encode_frames(b"kv", 9, 3.25, events, 1, shape=shape))
        assert batch.seq == 9 and batch.dp_rank == 1 and batch.skipped == 0
        if shape == "map":
            assert batch.events == tuple(events)
        else:  # vLLM 0.11's arrays had no group index
            assert batch.events == (events[0], BlockRemoved(tuple(hashes[:1]), "GPU"), events[2])


def test_a_map_keyed_by_a_list_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedFrames, match="not msgpack"):
        decode_frames([b"t", b"\x00" * 8, b"\x81\x90\x00"])  # {[]: 0}
