"""The union of routed prompt paths: sizes follow shared prefixes, removal and LRU trimming
give back exactly the blocks no other path holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsched.core.routed_paths import RoutedPaths, common_prefix
from tests.conftest import chain


def test_common_prefix_of_chained_paths() -> None:
    a = chain(1, 10)
    assert common_prefix(a, a[:6]) == 6
    assert common_prefix(a, a[:4] + chain(2, 3)) == 4
    assert common_prefix(a, chain(3, 5)) == 0
    assert common_prefix((), a) == 0


def test_adding_counts_only_new_blocks_and_removing_only_unshared_ones() -> None:
    paths = RoutedPaths(2)
    a = chain(1, 10)
    assert paths.add(0, "a", a, 0.0, subsume=False) == 10
    assert paths.add(0, "b", a[:4] + chain(2, 3), 1.0, subsume=False) == 3
    assert paths.shared(0, a[:8]) == 8 and paths.shared(1, a) == 0
    assert paths.size(0) == 13
    assert paths.remove(0, "a", a[0]) == 6  # the 4 shared blocks stay with "b"
    assert paths.size(0) == 7 and paths.shared(0, a) == 4
    assert paths.remove(0, "missing", a[0]) == 0


def test_subsuming_drops_a_covered_path_and_trim_evicts_the_oldest_leaves_first() -> None:
    paths = RoutedPaths(1)
    turn1, old = chain(1, 20), chain(2, 10)
    paths.add(0, 1, old, 0.0, subsume=True)
    paths.add(0, 2, turn1[:12], 1.0, subsume=True)
    paths.add(0, 3, turn1, 2.0, subsume=True)  # the session's next turn covers its last
    assert paths.size(0) == 30
    assert paths.trim(0, 25) == 5  # the oldest path loses its tail first
    assert paths.shared(0, old) == 5 and paths.shared(0, turn1) == 20
    assert paths.trim(0, 12) == 13
    assert paths.shared(0, old) == 0 and paths.shared(0, turn1) == 12 and paths.size(0) == 12


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(1, 12)),
        min_size=1,
        max_size=25,
    ),
    st.integers(0, 40),
)
def test_sizes_match_the_set_of_blocks(ops: list[tuple[int, int, int]], budget: int) -> None:
    """Against a plain set of blocks: paths branch off three roots at random depths."""
    paths = RoutedPaths(1)
    for key, (root, cut, extra) in enumerate(ops):
        path = chain(root, 12)[:cut] + chain(100 + key, extra)
        paths.add(0, key, path, float(key), subsume=key % 2 == 0)
    held = {h for group in paths._paths[0].values() for p in group for h in p.hashes}
    assert paths.size(0) == len(held)
    paths.trim(0, budget)
    held = {h for group in paths._paths[0].values() for p in group for h in p.hashes}
    assert paths.size(0) == len(held) <= budget
