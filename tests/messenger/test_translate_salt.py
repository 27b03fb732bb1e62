"""A tenant's cache salt, as vLLM carries it, roots our chain where the Router roots the
tenant's prompts; long chains are cut into events the Conductor accepts."""

from __future__ import annotations

from typing import Any

import pytest

from kvsched.core.hashing import BlockHasher
from services.common.kv_events import BlockRemoved, BlockStored
from services.messenger.translate import EventTranslator, cache_salt

HASHER = BlockHasher(16)
TOKENS = tuple(range(7, 7 + 48))


def stored(extra_keys: Any, lora_name: str | None = None) -> BlockStored:
    return BlockStored((1, 2, 3), None, TOKENS, 16, "GPU", lora_name, extra_keys)


@pytest.mark.parametrize(
    ("extra_keys", "lora", "salt"),
    [
        ([["tenant-a"], None, None], None, b"tenant-a"),
        ([["mm-hash", "tenant-a"], None, None], None, b"tenant-a"),
        ([("my-lora", "tenant-a"), None, None], "my-lora", b"tenant-a"),
        ([["my-lora"], None, None], "my-lora", b""),  # a LoRA name is not a salt
        ([["ünï"], None], None, "ünï".encode()),
        (None, None, b""),
        ([], None, b""),
        ([None, ["late"]], None, b""),  # only the first block's keys carry the salt
        ({"salt": "x"}, None, b""),
        ([[1, 2.5]], None, b""),
        ([["\ud800"]], None, b"\xed\xa0\x80"),  # a lone surrogate (from JSON) does not crash
    ],
)
def test_salt_is_the_last_string_of_the_first_blocks_keys(
    extra_keys: Any, lora: str | None, salt: bytes
) -> None:
    assert cache_salt(stored(extra_keys, lora)) == salt


def test_salted_chain_equals_the_routers_hashes() -> None:
    t = EventTranslator(HASHER, cache_salt)
    out = t.translate([stored([["tenant-a"], None, None])])
    assert list(out[0].blocks_stored.block_hashes) == HASHER.hash_tokens(TOKENS, b"tenant-a")
    # A child continues the salted chain without carrying the salt itself.
    child = BlockStored((4,), 3, tuple(range(100, 116)), 16, "GPU")
    more = t.translate([child])
    expected = HASHER.hash_tokens((*TOKENS, *range(100, 116)), b"tenant-a")
    assert list(more[0].blocks_stored.block_hashes) == expected[3:]


def test_long_events_are_cut_into_continuing_pieces() -> None:
    t = EventTranslator(HASHER, max_blocks=2)
    tokens = tuple(range(16 * 5))
    out = t.translate([BlockStored((1, 2, 3, 4, 5), None, tokens, 16, "GPU")])
    ours = HASHER.hash_tokens(tokens)
    parts = [list(e.blocks_stored.block_hashes) for e in out]
    assert parts == [ours[0:2], ours[2:4], ours[4:5]]
    assert not out[0].blocks_stored.HasField("parent_block_hash")
    assert [e.blocks_stored.parent_block_hash for e in out[1:]] == [ours[1], ours[3]]
    removed = t.translate([BlockRemoved((1, 2, 3), "GPU")])
    assert [list(e.blocks_removed.block_hashes) for e in removed] == [ours[0:2], ours[2:3]]
