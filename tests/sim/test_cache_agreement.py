"""The compiled prefix cache (`kvsched.cache._cache`) against the reference
(`kvsched.cache.prefix_cache.PrefixCache`): the same operations, as an engine and a KV copy
make them, must give the same results, the same events (evictions in the same order), the
same sizes and the same cached blocks with the same parents, children, locks and last
accesses."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.cache.prefix_cache import EngineCache, PrefixCache, make_cache
from kvsched.core.events import BlocksRemoved, BlocksStored

U64 = (1 << 64) - 1


def chain(path: tuple[int, ...]) -> list[int]:
    """Chained u64 hashes of a path in a small trie (shared prefixes share blocks)."""
    return [(hash(path[: i + 1]) * 0x9E3779B97F4A7C15) & U64 for i in range(len(path))]


def sizes(cache: EngineCache) -> tuple[int, ...]:
    return (
        cache.total,
        cache.free,
        cache.private,
        cache.locked_nodes,
        cache.evictable,
        cache.locked,
        cache.available,
        cache.evicted_total,
        len(cache),
    )


class Pair:
    """Both caches; every call goes to both and must answer the same."""

    def __init__(self, pages: int) -> None:
        self.ref = PrefixCache(pages)
        self.fast = make_cache(pages, pure=False)
        assert type(self.fast) is not PrefixCache

    def __call__(self, method: str, *args: Any, **kwargs: Any) -> Any:
        want = getattr(self.ref, method)(*args, **kwargs)
        got = getattr(self.fast, method)(*args, **kwargs)
        assert got == want, (method, args)
        return want

    def check(self) -> None:
        self("drain_events")
        assert self.ref.drain_events() == self.fast.drain_events() == []
        assert sizes(self.fast) == sizes(self.ref)
        assert self.fast.snapshot() == self.ref.snapshot()
        self.ref.check_integrity()
        self.fast.check_integrity()


paths = st.lists(st.integers(0, 2), min_size=1, max_size=7).map(tuple)
ops = st.lists(st.tuples(paths, st.integers(0, 3), st.booleans(), st.integers(0, 3)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 30), ops)
def test_the_compiled_cache_agrees_with_the_reference(
    pages: int, steps: list[tuple[tuple[int, ...], int, bool, int]]
) -> None:
    both = Pair(pages)
    live: list[tuple[list[int], int, int]] = []  # requests: hashes, blocks held, extra pages
    copies: list[tuple[list[int], int]] = []  # reads of a copy to another instance
    now = 0.0
    for path, extra, finish_one, kind in steps:
        now += float(extra % 2)  # some steps share a time: the LRU's ties go by sequence
        hashes = chain(path)
        hit = both("match", hashes, len(hashes) - 1 if kind else len(hashes))
        both("chain_match", hashes, len(hashes))
        if kind == 2 and hit:  # a copy's read: not a use
            both("lock_prefix", hashes, hit, now, touch=False)
            copies.append((hashes, hit))
        elif kind == 3:  # a tier's write-back of what it has: the leaf, then its ancestors
            for n in range(hit, 0, -1):
                both("touch_prefix", hashes, n, now)
        else:
            both("lock_prefix", hashes, hit, now)
            if both("reserve", len(hashes) - hit + extra):
                both("commit", hashes, hit, len(hashes), hit, now)
                live.append((hashes, len(hashes), extra))
            else:
                both("unlock_prefix", hashes, hit, now)
        if finish_one and live:
            done, held, spare = live.pop(0)
            both("unlock_prefix", done, held, now)
            both("release", spare)
        if finish_one and copies:
            read, n = copies.pop()
            both("unlock_prefix", read, n, now, touch=False)
        both.check()
    while live:  # everything finishes: the whole cache becomes evictable, then evicted
        done, held, spare = live.pop()
        both("unlock_prefix", done, held, now)
        both("release", spare)
    while copies:
        read, n = copies.pop()
        both("unlock_prefix", read, n, now, touch=False)
    both("reserve", pages)
    both.check()
    assert both.fast.free == 0 and len(both.fast) == 0


def test_events_name_each_run_of_new_blocks_with_its_parent() -> None:
    both = Pair(10)
    assert both("reserve", 1)
    both("commit", [5], 0, 1, 0, 1.0)
    both("unlock_prefix", [5], 1, 1.0)
    assert both("reserve", 2)
    assert both("commit", [7, 5, 8, 9], 0, 2, 0, 2.0) == 1  # 7 new, 5 already cached
    assert both("reserve", 2)
    assert both("commit", [7, 5, 8, 9], 2, 4, 2, 3.0) == 2
    assert both("drain_events") == [
        BlocksStored((5,), None),
        BlocksStored((7,), None),
        BlocksStored((8, 9), 5),
    ]
    both.check()


def test_evictions_come_out_oldest_leaf_first() -> None:
    both = Pair(4)
    for t, hashes in enumerate(([1, 2], [3, 4])):
        assert both("reserve", 2)
        both("commit", hashes, 0, 2, 0, float(t))
        both("unlock_prefix", hashes, 2, float(t))
    both("drain_events")
    assert both("reserve", 3)
    assert both("drain_events") == [BlocksRemoved((2, 1, 4))]
    both.check()


def test_a_touch_after_an_older_use_between_touches_sets_the_whole_path_again() -> None:
    """The compiled touch skips the ancestors its run of touches at one time already set; a
    use in between, even at another time, ends the run."""
    both = Pair(8)
    hashes = [1, 2, 3, 4]
    assert both("reserve", 4)
    both("commit", hashes, 0, 4, 0, 1.0)
    both("unlock_prefix", hashes, 4, 1.0)
    both("touch_prefix", hashes, 4, 5.0)
    both("lock_prefix", hashes, 2, 3.0)  # a late-stamped use sets the first two back to 3
    both("unlock_prefix", hashes, 2, 3.0)
    both("touch_prefix", hashes, 3, 5.0)
    assert both.fast.snapshot()[1][3] == 5.0
    both.check()
    assert both("reserve", 8)
    assert both("drain_events") == [BlocksRemoved((4, 3, 2, 1))]


def test_bad_calls_are_refused_alike() -> None:
    cache = make_cache(4, pure=False)
    with pytest.raises(KeyError):
        cache.lock_prefix([9], 1, 0.0)
    with pytest.raises(AssertionError):
        cache.release(1)
    with pytest.raises(AssertionError):
        cache.commit([1], 0, 1, 0, 0.0)  # no page reserved for it
    with pytest.raises(OverflowError):
        cache.match([-1], 1)
    with pytest.raises(ValueError, match="at least one page"):
        make_cache(0, pure=False)
    cache.check_integrity()
    assert sizes(cache) == (4, 4, 0, 0, 0, 0, 4, 0, 0)
