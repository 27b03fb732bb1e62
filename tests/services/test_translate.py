"""Engine events to Conductor events: our chained hashes from the token ids, parents and
removals mapped through the engine's own hashes, what cannot be placed counted."""

from __future__ import annotations

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.core.hashing import BlockHasher
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from services.messenger.translate import EventTranslator

HASHER = BlockHasher(16)
TOKENS = list(range(1000, 1048))  # three blocks


def test_stored_chains_get_our_hashes_and_continue_across_events() -> None:
    t = EventTranslator(HASHER)
    first = t.translate([BlockStored((2**64 - 5, 7), None, tuple(TOKENS[:32]), 16, "GPU")])
    second = t.translate([BlockStored((b"\x01" * 32,), 7, tuple(TOKENS[32:]), 16, "CPU")])
    ours = HASHER.hash_tokens(TOKENS)
    assert list(first[0].blocks_stored.block_hashes) == ours[:2]
    assert not first[0].blocks_stored.HasField("parent_block_hash")
    assert list(second[0].blocks_stored.block_hashes) == ours[2:]
    assert second[0].blocks_stored.parent_block_hash == ours[1]
    assert second[0].blocks_stored.tier == common.TIER_CPU


def test_tenant_salt_starts_a_different_chain() -> None:
    salted = EventTranslator(HASHER, salt_of=lambda e: b"tenant-a")
    plain = EventTranslator(HASHER)
    event = BlockStored((1,), None, tuple(TOKENS[:16]), 16, "GPU")
    a = salted.translate([event])[0].blocks_stored.block_hashes[0]
    b = plain.translate([event])[0].blocks_stored.block_hashes[0]
    assert a != b and a == HASHER.hash_tokens(TOKENS[:16], b"tenant-a")[0]


def test_removals_map_back_and_unknowns_are_counted() -> None:
    t = EventTranslator(HASHER)
    t.translate([BlockStored((1, 2), None, tuple(TOKENS[:32]), 16, "GPU")])
    out = t.translate([BlockRemoved((2, 99), "GPU")])
    assert list(out[0].blocks_removed.block_hashes) == HASHER.hash_tokens(TOKENS)[1:2]
    assert t.counters.unknown_removals == 1
    assert t.translate([BlockRemoved((99,), "GPU")]) == []


def test_what_cannot_be_placed_is_skipped_and_counted() -> None:
    t = EventTranslator(HASHER)
    orphan = BlockStored((5,), 12345, tuple(TOKENS[:16]), 16, "GPU")  # parent never seen
    short = BlockStored((6,), None, tuple(TOKENS[:10]), 16, "GPU")  # too few tokens
    other_size = BlockStored((7,), None, tuple(TOKENS[:32]), 32, "GPU")
    assert t.translate([orphan, short, other_size]) == []
    assert (t.counters.unknown_parents, t.counters.short_tokens) == (1, 2)


def test_clearing_forgets_the_map() -> None:
    t = EventTranslator(HASHER)
    t.translate([BlockStored((1,), None, tuple(TOKENS[:16]), 16, "GPU")])
    out = t.translate([AllBlocksCleared()])
    assert out[0].HasField("all_blocks_cleared") and not t.ours
