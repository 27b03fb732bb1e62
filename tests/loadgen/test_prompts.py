"""Trace block ids as in-vocabulary token blocks: equal ids equal, different ids different."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsched.core.hashing import BlockHasher
from kvsched.sim.traces.model import TraceCall
from services.loadgen.prompts import RESERVED, block_tokens, call_prompt

VOCAB = 4096
IDS = st.integers(min_value=0, max_value=(1 << 64) - 1)


@given(IDS, IDS)
def test_blocks_are_injective_and_in_vocabulary(a: int, b: int) -> None:
    ta, tb = block_tokens(a, 16, VOCAB), block_tokens(b, 16, VOCAB)
    assert len(ta) == 16 and all(RESERVED <= t < VOCAB for t in ta)
    assert (ta == tb) == (a == b)


def _call(index: int, ids: tuple[int, ...], tokens: int) -> TraceCall:
    return TraceCall(index, "s", "g", 0.0, tokens, 1, ids)


def test_shared_block_prefixes_give_shared_hash_prefixes() -> None:
    hasher = BlockHasher(16)
    one = call_prompt(_call(0, (7, 8, 9), 50), 16, VOCAB)
    two = call_prompt(_call(1, (7, 8, 10), 60), 16, VOCAB)
    assert (len(one), len(two)) == (50, 60)
    h1, h2 = hasher.hash_tokens(one), hasher.hash_tokens(two)
    assert h1[:2] == h2[:2] and h1[2] != h2[2]
    # the partial tails differ per call, so they never pose as shared blocks
    assert one[48:] != two[48:50]
