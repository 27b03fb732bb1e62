from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsched.core.hashing import BlockHasher, pseudo_tokens
from kvsched.sim.prepare import prepare
from tests.conftest import tiny_trace

tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@given(tokens, tokens)
def test_equal_hash_at_i_iff_equal_prefix_up_to_block_i(a: list[int], b: list[int]) -> None:
    h = BlockHasher(8, seed=3)
    ha, hb = h.hash_tokens(a), h.hash_tokens(b)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == (a[: 8 * (i + 1)] == b[: 8 * (i + 1)])


def test_only_full_blocks_are_hashed() -> None:
    h = BlockHasher(4)
    assert len(h.hash_tokens(list(range(11)))) == 2
    assert h.hash_tokens(list(range(8))) == h.hash_tokens(list(range(11)))


def test_tenant_salt_and_seed_separate_hash_spaces() -> None:
    toks = list(range(32))
    plain = BlockHasher(8).hash_tokens(toks)
    assert BlockHasher(8).hash_tokens(toks, b"tenant-a") != plain
    assert BlockHasher(8).hash_tokens(toks, b"tenant-a") != BlockHasher(8).hash_tokens(
        toks, b"tenant-b"
    )
    assert BlockHasher(8, seed=1).hash_tokens(toks) != plain
    assert BlockHasher(8).hash_tokens(toks) == plain  # and it is deterministic


def test_rolling_form_matches_definition() -> None:
    h = BlockHasher(2, seed=9)
    toks = [1, 2, 3, 4]
    root = h.root()
    first = h.chain(root, h.local([1, 2]))
    assert h.hash_tokens(toks) == [first, h.chain(first, h.local([3, 4]))]


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_must_be_u32(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="32-bit"):
        BlockHasher(1).hash_tokens(bad)


def test_block_size_and_seed_are_checked() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(4, seed=-1)


def test_pseudo_tokens_keep_ids_apart() -> None:
    assert pseudo_tokens(5, 4) == pseudo_tokens(5, 4)
    assert pseudo_tokens(5, 4) != pseudo_tokens(6, 4)
    assert pseudo_tokens(1, 4) != pseudo_tokens(1 << 32, 4)
    with pytest.raises(ValueError):
        pseudo_tokens(1 << 64, 4)


@given(st.lists(st.lists(st.integers(0, 40), max_size=6), min_size=1, max_size=6))
def test_prepared_trace_hashes_equal_hashing_the_expanded_tokens(prompts: list[list[int]]) -> None:
    calls = [("", float(i), 8 * len(ids) + 3, 4, tuple(ids)) for i, ids in enumerate(prompts)]
    trace = tiny_trace(calls, block_tokens=8)
    prepared = prepare(trace, seed=11)
    hasher = BlockHasher(8, seed=11)
    for call, hashes in zip(trace.calls, prepared.hashes, strict=True):
        expanded = [t for b in call.block_ids for t in pseudo_tokens(b, 8)]
        assert list(hashes) == hasher.hash_tokens(expanded)
