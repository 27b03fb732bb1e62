"""The compiled block holdings against the pure-Python reference: the same random operations
(lost, duplicated and reordered events, stray parents and cycles included), identical results."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core._holdings import Holdings
from kvsched.core.holdings import BlockHoldings, PyHoldings, make_holdings
from kvsched.core.index import PrefixIndex
from kvsched.core.packed import pack

# A few hashes spread over the whole u64 range (the compiled table mixes them) and small ones.
HASHES = [1, 2, 3, 4, 5, 6, 7, 8, 2**63, 2**64 - 1, 0x9E3779B97F4A7C15, 0]
hashes = st.sampled_from(HASHES)
chains = st.lists(hashes, min_size=0, max_size=6)
tiers = st.integers(0, 2)


def edge_slots(n_slots: int) -> list[int]:
    """Slots at the ends of the bitsets' words."""
    return sorted({0, 1, 2, 63, 64, 65, n_slots - 2, n_slots - 1} & set(range(n_slots)))


def ops(n_slots: int) -> st.SearchStrategy[list[tuple[object, ...]]]:
    # Word edges and few distinct slots, so blocks often have four holders or more (above 64
    # slots the compiled store lists three holders inline, then moves them to a bitset).
    slots = st.integers(0, n_slots - 1) | st.sampled_from(edge_slots(n_slots))
    op = st.one_of(
        st.tuples(st.just("store"), slots, chains, st.none() | hashes, tiers),
        st.tuples(st.just("remove"), slots, chains, tiers),
        st.tuples(st.just("clear"), slots),
    )
    return st.lists(op, max_size=50)


def observe(h: BlockHoldings, n_slots: int) -> tuple[object, ...]:
    """Everything a caller can read, with unordered lists sorted."""
    masks, parents, children, counts = h.snapshot()
    some = edge_slots(n_slots)  # per-slot scans: the word edges (every slot is in `masks`)
    probes = [HASHES, HASHES[::-1], HASHES[:4], [HASHES[8], HASHES[9]], []]
    return (
        len(h),
        h.counters(),
        [[h.holders(x, t) for x in HASHES] for t in range(3)],
        [[h.count(s, t) for s in range(n_slots)] for t in range(3)],
        [h.counts(t) for t in range(3)],
        [h.match(p, t) for p in probes for t in range(3)],
        [list(h.match(p, 0).items()) for p in probes],  # the same order too
        [h.match(HASHES, t, limit) for t in range(3) for limit in (None, 0, 1, 3, 7, 99, -1)],
        [h.parent_of(x) for x in HASHES],
        [sorted(h.blocks_of(s, t)) for s in some for t in range(3)],
        [sorted(h.subtree_of(s, [x], t)) for s in some for x in HASHES for t in range(3)],
        masks,
        parents,
        {k: sorted(v) for k, v in children.items()},
        counts,
    )


def drive(n_slots: int, script: list[tuple[object, ...]], *, packed: bool = False) -> None:
    """Apply `script` to the reference (hashes as ints) and the compiled store (as ints, or
    with `packed` as the wire's bytes through `store_packed` / `remove_packed`)."""
    ref, fast = PyHoldings(n_slots), Holdings(n_slots)
    for op in script:
        for h in (ref, fast):
            by_bytes = packed and h is fast
            if op[0] == "store":
                _, slot, chain, parent, tier = op
                if by_bytes:
                    h.store_packed(slot, pack(chain), parent, tier)  # type: ignore[arg-type]
                else:
                    h.store(slot, chain, parent, tier)  # type: ignore[arg-type]
            elif op[0] == "remove":
                _, slot, chain, tier = op
                if by_bytes:
                    h.remove_packed(slot, pack(chain), tier)  # type: ignore[arg-type]
                else:
                    h.remove(slot, chain, tier)  # type: ignore[arg-type]
            else:
                h.clear_slot(op[1])  # type: ignore[arg-type]
        assert observe(fast, n_slots) == observe(ref, n_slots), op
        # The compiled table keeps exactly the held blocks and the parents with children.
        _, parents, children, _ = ref.snapshot()
        assert fast.entries() == len(set(parents) | set(children)), op


@settings(max_examples=400, deadline=None)
@given(ops(3))
def test_compiled_holdings_agree_with_the_reference(script: list[tuple[object, ...]]) -> None:
    drive(3, script)


@settings(max_examples=200, deadline=None)
@given(ops(130))
def test_compiled_holdings_agree_beyond_64_slots(script: list[tuple[object, ...]]) -> None:
    drive(130, script)  # holders inline, or three-word bitsets in the overflow pool


@settings(max_examples=300, deadline=None)
@given(ops(3))
def test_packed_bytes_into_the_compiled_store_agree_with_the_reference(
    script: list[tuple[object, ...]],
) -> None:
    drive(3, script, packed=True)


@settings(max_examples=100, deadline=None)
@given(ops(130))
def test_packed_bytes_agree_beyond_64_slots(script: list[tuple[object, ...]]) -> None:
    drive(130, script, packed=True)


@pytest.mark.parametrize("pure", [True, False])
def test_packed_bytes_of_a_bad_length_are_refused_and_change_nothing(pure: bool) -> None:
    h = make_holdings(4, pure=pure)
    h.store_packed(0, pack([1, 2, 3]), None)
    before = h.snapshot(), h.counters()
    for bad in (bytes(7), pack([4, 5]) + b"\x01"):
        with pytest.raises(ValueError, match="not a whole number of 8-byte"):
            h.store_packed(0, bad, 3)
        with pytest.raises(ValueError, match="not a whole number of 8-byte"):
            h.remove_packed(0, bad)
    assert (h.snapshot(), h.counters()) == before
    h.store_packed(0, b"", 3)  # nothing to store: only the parent is checked (it is held)
    h.remove_packed(1, pack([2]))  # not held by slot 1: counted, nothing changes
    assert h.snapshot() == before[0]
    assert h.counters() == (0, 0, 1, 0)
    h.remove_packed(0, pack([2]))  # its descendant 3 leaves with it
    assert h.match([1, 2, 3]) == {0: 1}


def test_long_chains_grow_the_table_and_shrink_back() -> None:
    ref, fast = PyHoldings(2), make_holdings(2, pure=False)
    chain = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, 200_001)]
    for h in (ref, fast):
        h.store(0, chain, None)
        h.store(1, chain[:1000], None)
        h.remove(0, chain[150_000:])
    assert len(fast) == len(ref) == 150_000
    assert fast.match(chain) == ref.match(chain) == {0: 150_000, 1: 1000}
    for h in (ref, fast):
        h.remove(0, chain[:1])  # the root: everything slot 0 holds goes
    assert fast.counters() == ref.counters()
    assert fast.match(chain) == ref.match(chain) == {1: 1000}
    assert len(fast) == len(ref) == 1000
    for h in (ref, fast):
        h.clear_slot(1)
    assert len(fast) == 0
    assert fast.snapshot() == ref.snapshot()


def test_bad_input_is_refused_before_anything_changes() -> None:
    fast = make_holdings(4, pure=False)
    fast.store(0, [1, 2], None)
    before = fast.snapshot()
    with pytest.raises(OverflowError):
        fast.store(0, [3, 2**64], 2)
    with pytest.raises(OverflowError):
        fast.store(0, [3, -1], 2)
    with pytest.raises(TypeError):
        fast.store(0, [3, "4"], 2)  # type: ignore[list-item]
    with pytest.raises(IndexError):
        fast.store(4, [3], None)
    with pytest.raises(ValueError, match="tier"):
        fast.store(0, [3], None, 3)
    with pytest.raises(TypeError):
        fast.match(5)  # type: ignore[arg-type]
    assert fast.snapshot() == before
    with pytest.raises(ValueError, match="slot"):
        make_holdings(0, pure=False)


def test_an_index_is_compiled_unless_asked_for_the_reference() -> None:
    assert PrefixIndex(2).compiled and not PrefixIndex(2, pure=True).compiled


def test_many_holders_beyond_64_slots() -> None:
    n = 1024  # 16 words a bitset: blocks list three holders inline, then overflow
    ref, fast = PyHoldings(n), Holdings(n)
    chain = [11, 12, 13, 14]
    for slot in range(0, n, 7):
        for h in (ref, fast):
            h.store(slot, chain[: 1 + slot % 4], None)
    assert fast.snapshot() == ref.snapshot()
    assert fast.match(chain) == ref.match(chain)
    assert fast.holders(11) == ref.holders(11) == sum(1 << s for s in range(0, n, 7))
    for slot in range(0, n, 14):
        for h in (ref, fast):
            h.remove(slot, chain[:1])
    assert fast.snapshot() == ref.snapshot()
    assert fast.match(chain, 0) == ref.match(chain, 0)
    for slot in range(n):
        for h in (ref, fast):
            h.clear_slot(slot)
    assert len(fast) == fast.entries() == 0


def test_children_leave_a_parent_with_many_in_any_order() -> None:
    # Every conversation continues the shared system prompt: its last block has thousands of
    # children, and each leaves that list (head, middle or tail) without walking it.
    ref, fast = PyHoldings(4), Holdings(4)
    system = [2**64 - 1, 2**63]
    bodies = [[1000 + 3 * k, 1001 + 3 * k] for k in range(300)]
    for k, body in enumerate(bodies):
        for h in (ref, fast):
            h.store(k % 4, system + body, None)
    order = [*range(0, 300, 7), 299, 0, *range(150, 100, -1)]  # middle, tail, head
    for k in dict.fromkeys(order):
        for h in (ref, fast):
            h.remove(k % 4, bodies[k][::-1])  # leaves first, as engines evict
        assert same_links(fast, ref)
    for k in (0, 299, 120):  # stored again after leaving
        for h in (ref, fast):
            h.store(k % 4, system + bodies[k], None)
    assert same_links(fast, ref)
    for slot in range(4):
        for h in (ref, fast):
            h.clear_slot(slot)
    assert len(fast) == fast.entries() == 0


def same_links(a: BlockHoldings, b: BlockHoldings) -> bool:
    """Whether two stores hold the same, their children lists taken as sets (their order is
    unspecified)."""
    (am, ap, ac, an), (bm, bp, bc, bn) = a.snapshot(), b.snapshot()
    a_children = {k: sorted(v) for k, v in ac.items()}
    b_children = {k: sorted(v) for k, v in bc.items()}
    return (am, ap, an, a_children) == (bm, bp, bn, b_children)
