"""Engine events to Conductor events: every block keeps the name vLLM gave it (as 64 bits),
with nothing remembered between events, so what a Router hashes is what the index holds."""

from __future__ import annotations

from pathlib import Path

import msgpack

from clients.python import unpack_hashes
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.kv_events.vllm_wire import AllBlocksCleared, BlockRemoved, BlockStored, decode_frames
from services.messenger.translate import EventTranslator

CAPTURE = Path(__file__).resolve().parent.parent / "data" / "vllm" / "cpu-0.32-capture"
TOKENS = tuple(range(1000, 1048))  # three blocks of 16


def test_stored_blocks_keep_their_names_as_64_bits_and_their_parent() -> None:
    t = EventTranslator(16)
    digest = bytes(range(32))
    out = t.translate([BlockStored((2**64 - 5, digest), 1 << 70 | 9, TOKENS[:32], 16, "CPU")])
    stored = out[0].blocks_stored
    want = [2**64 - 5, int.from_bytes(digest[-8:], "big")]
    assert unpack_hashes(stored.packed_block_hashes) == want and not stored.block_hashes
    assert stored.parent_block_hash == 9 and stored.tier == common.TIER_CPU


def test_a_child_whose_parent_was_never_seen_is_still_indexed() -> None:
    out = EventTranslator(16).translate([BlockStored((5,), 12345, TOKENS[:16], 16, "GPU")])
    assert unpack_hashes(out[0].blocks_stored.packed_block_hashes) == [5]
    assert out[0].blocks_stored.parent_block_hash == 12345


def test_removals_and_clears_pass_through() -> None:
    t = EventTranslator(16)
    out = t.translate([BlockRemoved((2, 99), "GPU"), AllBlocksCleared()])
    assert unpack_hashes(out[0].blocks_removed.packed_block_hashes) == [2, 99]
    assert out[1].HasField("all_blocks_cleared")


def test_another_block_size_is_skipped_and_counted() -> None:
    t = EventTranslator(16)
    assert t.translate([BlockStored((7,), None, TOKENS[:32], 32, "GPU")]) == []
    assert t.counters.wrong_block_size == 1


def test_long_events_are_cut_into_continuing_pieces() -> None:
    out = EventTranslator(16, max_blocks=2).translate(
        [BlockStored((1, 2, 3, 4, 5), None, tuple(range(80)), 16, "GPU")]
    )
    parts = [unpack_hashes(e.blocks_stored.packed_block_hashes) for e in out]
    assert parts == [[1, 2], [3, 4], [5]]
    assert [e.blocks_stored.parent_block_hash for e in out[1:]] == [2, 4]
    assert not out[0].blocks_stored.HasField("parent_block_hash")


def test_a_real_vllms_salted_chain_is_indexed_under_the_routers_hashes() -> None:
    """Frames a real vLLM published for one salted prompt, chunk by chunk: the translated
    hashes are exactly what a Router computes for that prompt and salt."""
    events: list[BlockStored] = []
    for path in sorted((CAPTURE / "frames_salt").glob("*.bin")):
        frames = msgpack.unpackb(path.read_bytes())
        events.extend(e for e in decode_frames(frames).events if isinstance(e, BlockStored))
    first = events[0]
    assert first.parent_block_hash is None
    salt = first.extra_keys[0][0]
    chain = [first]
    for event in events[1:]:
        if event.parent_block_hash is None:
            break  # the next prompt
        chain.append(event)
    t = EventTranslator(32)
    indexed = [
        h
        for e in chain
        for h in unpack_hashes(t.translate([e])[0].blocks_stored.packed_block_hashes)
    ]
    prompt = [token for e in chain for token in e.token_ids]
    assert salt and len(indexed) >= 3
    assert indexed == VllmBlockHasher(32).hash_prompt(prompt, salt)


def test_a_chain_hashed_otherwise_than_the_cluster_does_is_counted_and_still_relayed() -> None:
    hasher = VllmBlockHasher(16)
    ours = hasher.hash_prompt(TOKENS[:32], "t")
    t = EventTranslator(16, hasher)
    good = BlockStored(tuple(ours), None, TOKENS[:32], 16, "GPU", extra_keys=[["t"], None])
    seeded = VllmBlockHasher(16, seed="1").hash_prompt(TOKENS[:32], "t")
    other = BlockStored(tuple(seeded), None, TOKENS[:32], 16, "GPU", extra_keys=[["t"], None])
    unsalted = BlockStored(tuple(ours), None, TOKENS[:32], 16, "GPU")
    child = BlockStored((99,), ours[1], TOKENS[32:48], 16, "GPU")  # not checked: no prefix
    out = t.translate([good, child, other, unsalted])
    assert t.counters.foreign_hashes == 2 and len(out) == 4
