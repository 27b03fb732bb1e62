"""`PackedHashes`: the wire's packed u64 bytes as a sequence of ints, equal to the ints it
packs, sliced without unpacking, split like a tuple, into the index as bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsched.core.events import BlocksRemoved, BlocksStored, split
from kvsched.core.index import PrefixIndex, Tier
from kvsched.core.packed import PackedHashes, pack

CPU = Tier.CPU
U64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(st.lists(U64, max_size=40), st.integers(-45, 45), st.integers(-45, 45))
def test_it_reads_as_the_tuple_it_packs(hashes: list[int], a: int, b: int) -> None:
    packed = PackedHashes(pack(hashes))
    assert len(packed) == len(hashes)
    assert packed == tuple(hashes) and tuple(hashes) == packed and packed == hashes
    assert list(packed) == hashes and hash(packed) == hash(tuple(hashes))
    assert packed[a:b] == hashes[a:b] and packed[a:b:2] == hashes[a:b:2]
    assert isinstance(packed[a:b], PackedHashes)
    if hashes:
        assert packed[a % len(hashes)] == hashes[a % len(hashes)] and packed[-1] == hashes[-1]
    assert packed != (*hashes, 1)
    assert packed != "x"


def test_a_length_not_a_multiple_of_8_is_refused() -> None:
    with pytest.raises(ValueError, match="13 bytes are not a whole number"):
        PackedHashes(bytes(13))


@given(st.lists(U64, min_size=1, max_size=30, unique=True), st.integers(1, 7))
def test_split_cuts_packed_events_as_it_cuts_tuples(hashes: list[int], most: int) -> None:
    for tuple_event, packed_event in (
        (BlocksStored(tuple(hashes), 5, CPU), BlocksStored(PackedHashes(pack(hashes)), 5, CPU)),
        (BlocksRemoved(tuple(hashes)), BlocksRemoved(PackedHashes(pack(hashes)))),
    ):
        pieces = list(split([packed_event], most))
        assert pieces == list(split([tuple_event], most))
        assert all(type(p.hashes) is PackedHashes for p in pieces)  # type: ignore[union-attr]


@pytest.mark.parametrize("pure", [True, False])
def test_the_index_takes_them_as_it_takes_ints(pure: bool) -> None:
    ints, packed = PrefixIndex(3, pure=pure), PrefixIndex(3, pure=pure)
    for index, form in ((ints, tuple), (packed, lambda h: PackedHashes(pack(h)))):
        index.store(1, form([10, 11, 12]), None)
        index.store(2, form([10, 11]), None, CPU)
        index.store(1, form([13]), 12)
        index.remove(1, form([11]))
        index.remove(2, form([99]), CPU)
    assert packed.match([10, 11, 12, 13]) == ints.match([10, 11, 12, 13]) == {1: 1}
    assert packed.match([10, 11], CPU) == {2: 2}
    assert packed.counters == ints.counters
    packed.check_integrity()
