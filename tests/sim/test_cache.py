"""The engine's paged prefix cache: page accounting, LRU leaf eviction, sharing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.events import BlocksRemoved, BlocksStored


def filled(pages: int, chain: list[int], now: float = 0.0) -> PrefixCache:
    """A cache holding `chain` as evictable blocks, computed by one finished request."""
    cache = PrefixCache(pages)
    assert cache.reserve(len(chain))
    cache.commit(chain, 0, len(chain), 0, now)
    cache.unlock_prefix(chain, len(chain), now)
    return cache


def test_pages_add_up_through_a_request_lifecycle() -> None:
    cache = PrefixCache(10)
    assert cache.reserve(6)  # 4 prompt blocks + 2 output pages
    assert (cache.free, cache.evictable, cache.locked) == (4, 0, 6)
    cache.commit([1, 2, 3, 4], 0, 4, 0, now=1.0)
    assert (cache.free, cache.evictable, cache.locked) == (4, 0, 6)
    cache.unlock_prefix([1, 2, 3, 4], 4, now=2.0)
    cache.release(2)
    assert (cache.free, cache.evictable, cache.locked) == (6, 4, 0)
    cache.check_integrity()
    assert cache.drain_events() == [BlocksStored((1, 2, 3, 4), None)]


def test_eviction_takes_least_recent_leaves_first() -> None:
    cache = filled(6, [1, 2, 3], now=1.0)
    # A second chain, used later, branching off block 1.
    cache.lock_prefix([1], 1, now=5.0)
    assert cache.reserve(2)
    cache.commit([1, 5, 6], 1, 3, 1, now=5.0)
    cache.unlock_prefix([1, 5, 6], 3, now=6.0)
    cache.drain_events()
    # Need 3 pages with 1 free: evict leaves, oldest first: 3 then 2 (chain 1-2-3 is older).
    assert cache.free == 1
    assert cache.reserve(3)
    assert cache.drain_events() == [BlocksRemoved((3, 2))]
    assert cache.match([1, 5, 6], 3) == 3
    assert cache.match([1, 2, 3], 3) == 1
    cache.check_integrity()


def test_locked_prefix_is_never_evicted_and_failed_reserve_changes_nothing() -> None:
    cache = filled(4, [1, 2, 3])
    cache.lock_prefix([1, 2, 3], 2, now=1.0)  # blocks 1 and 2 in use
    before = (cache.free, cache.evictable, cache.locked, dict(cache.nodes))
    assert not cache.reserve(3)  # 1 free + 1 evictable (block 3) < 3
    assert (cache.free, cache.evictable, cache.locked, dict(cache.nodes)) == before
    assert cache.drain_events() == [BlocksStored((1, 2, 3))]  # filling it; nothing evicted
    assert cache.reserve(2)
    assert cache.drain_events() == [BlocksRemoved((3,))]
    cache.check_integrity()


def test_a_block_someone_else_cached_is_shared_and_the_page_freed() -> None:
    cache = filled(8, [1, 2])
    cache.drain_events()
    assert cache.reserve(3)
    used = cache.commit([1, 2, 3], 0, 3, 0, now=1.0)
    assert used == 1  # only block 3 is new
    # 8 pages − 2 cached − 3 reserved + 2 duplicate pages returned; the chain 1-2-3 is held.
    assert (cache.free, cache.locked) == (5, 3)
    assert cache.drain_events() == [BlocksStored((3,), 2)]
    cache.check_integrity()


def test_match_is_prefix_only() -> None:
    cache = filled(8, [1, 2, 3])
    assert cache.match([1, 2, 3, 4], 4) == 3
    assert cache.match([1, 2, 3, 4], 2) == 2  # limited (a prompt always recomputes a token)
    assert cache.match([9, 2, 3], 3) == 0
    assert cache.match([], 0) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), max_size=40))
def test_random_requests_keep_the_page_invariant(reqs: list[tuple[int, int, bool]]) -> None:
    cache = PrefixCache(24)
    live: list[tuple[list[int], int, int]] = []
    now = 0.0
    for root, length, finish_one in reqs:
        now += 1.0
        chain = [root * 100 + i for i in range(length)]
        hit = cache.match(chain, length - 1)
        cache.lock_prefix(chain, hit, now)
        private = length - hit + 1
        if cache.reserve(private):
            cache.commit(chain, hit, length, hit, now)
            live.append((chain, length, private - (length - hit)))
        else:
            cache.unlock_prefix(chain, hit, now)
        if finish_one and live:
            done, held, extra = live.pop(0)
            cache.unlock_prefix(done, held, now)
            cache.release(extra)
        cache.check_integrity()
        assert cache.free + cache.evictable + cache.locked == cache.total
    with pytest.raises(AssertionError):
        cache.release(cache.private + 1)


def test_a_copy_reading_blocks_does_not_refresh_them() -> None:
    cache = filled(4, [1, 2], now=1.0)
    assert cache.reserve(1)
    cache.commit([7], 0, 1, 0, now=5.0)  # a younger block elsewhere
    cache.unlock_prefix([7], 1, now=5.0)
    cache.lock_prefix([1, 2], 2, now=9.0, touch=False)  # copied to another instance
    cache.unlock_prefix([1, 2], 2, now=9.5, touch=False)
    cache.drain_events()
    assert cache.reserve(2)  # 1 free + evict one: the old chain's leaf goes, not block 7
    assert cache.drain_events() == [BlocksRemoved((2,))]
    cache.check_integrity()


def test_drop_removes_a_block_and_everything_below_it_unless_it_is_locked() -> None:
    cache = filled(8, [1, 2, 3, 4], now=1.0)
    cache.lock_prefix([1, 2], 2, now=2.0)
    assert cache.reserve(2)
    cache.commit([1, 2, 5, 6], 2, 4, 2, now=2.0)  # a branch below block 2
    cache.unlock_prefix([1, 2, 5, 6], 4, now=2.0)
    cache.drain_events()
    cache.lock_prefix([1, 2, 3], 3, now=3.0)
    assert cache.drop(2) == () and len(cache) == 6  # held: nothing changes
    cache.unlock_prefix([1, 2, 3], 3, now=3.0)

    removed = cache.drop(2)
    assert removed[0] == 2 and sorted(removed) == [2, 3, 4, 5, 6]
    assert cache.drain_events() == [BlocksRemoved(removed)]
    assert set(cache.nodes) == {1} and cache.free == 7
    cache.check_integrity()
    assert cache.drop(2) == ()
    # The stale LRU entries of the dropped blocks are skipped: block 1, a leaf now, goes.
    assert cache.reserve(8)
    assert cache.drain_events() == [BlocksRemoved((1,))]
    cache.check_integrity()
