"""Paged prefix cache of one engine's KV (Mini-SGLang's radix cache, one page a block): the
simulator's engines and node tiers, the simulated engine service and the Messengers' node KV
pools all keep their blocks in it.

Every page is in exactly one state:

    free       not allocated
    evictable  holds a cached block no request needs (may be evicted, LRU, leaves first)
    locked     holds a cached block some request needs, or is private to a request
               (reserved for its uncomputed prompt tail and its output)

so `free + evictable + locked == total` always (`check_integrity`). A block's node counts the
requests whose held prefix passes through it (`lock`); a node is evictable when that count is 0
and no cached child hangs below it, which keeps the cache prefix-closed.

`PrefixCache` below is the reference: plain Python, easy to read, the oracle of the agreement
tests, and the one the live engine uses (it reads `nodes`). `kvsched.cache._cache.Cache` is the
same bookkeeping compiled from C (`_cache.c`, built by pip): the simulator's replays commit and
evict a block per page of every prompt, which in Python was the largest piece of a replay's
own time. `make_cache` picks one: the compiled one unless asked for the reference
(`pure=True`). The two agree on every result, event and eviction order
(tests/sim/test_cache_agreement.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsched.core.events import BlocksRemoved, BlocksStored


@dataclass(slots=True, eq=False)
class Node:
    """One cached block."""

    hash: int
    parent: Node | None
    children: int = 0
    lock: int = 0
    last_access: float = 0.0


CacheEvent = BlocksStored | BlocksRemoved
# {hash: (parent hash or None, cached children, lock count, last access)}
CacheSnapshot = dict[int, tuple[int | None, int, int, float]]


class EngineCache(Protocol):
    """What a simulated engine needs of its prefix cache (`PrefixCache` documents each)."""

    @property
    def total(self) -> int: ...
    @property
    def free(self) -> int: ...
    @property
    def private(self) -> int: ...
    @property
    def locked_nodes(self) -> int: ...
    @property
    def evictable(self) -> int: ...
    @property
    def locked(self) -> int: ...
    @property
    def available(self) -> int: ...
    @property
    def evicted_total(self) -> int: ...
    def __len__(self) -> int: ...
    def match(self, hashes: Sequence[int], limit: int, /) -> int: ...
    def chain_match(self, hashes: Sequence[int], limit: int, /) -> int: ...
    def lock_prefix(
        self, hashes: Sequence[int], n: int, now: float, *, touch: bool = True
    ) -> None: ...
    def unlock_prefix(
        self, hashes: Sequence[int], n: int, now: float, *, touch: bool = True
    ) -> None: ...
    def touch_prefix(self, hashes: Sequence[int], n: int, now: float, /) -> None: ...
    def reserve(self, pages: int, /) -> bool: ...
    def release(self, pages: int, /) -> None: ...
    def commit(
        self, hashes: Sequence[int], start: int, end: int, held: int, now: float, /
    ) -> int: ...
    def drain_events(self) -> list[CacheEvent]: ...
    def snapshot(self) -> CacheSnapshot: ...
    def check_integrity(self) -> None: ...


def make_cache(total_pages: int, pure: bool = False) -> EngineCache:
    """A prefix cache of `total_pages` pages: the compiled one, or the reference when `pure`."""
    if pure:
        return PrefixCache(total_pages)
    try:
        from kvsched.cache._cache import Cache  # noqa: PLC0415  (built by pip)
    except ImportError as exc:
        raise ImportError(
            "kvsched's compiled prefix cache (kvsched.cache._cache) is not built: reinstall "
            "kvsched with pip (scripts/setup, or pip install -e .), which compiles it with the "
            "machine's C compiler, or run the pure-Python reference (a replay's pure=True)"
        ) from exc
    return Cache(total_pages, BlocksStored, BlocksRemoved)


class PrefixCache:
    """Pages, cached blocks and locks of one engine. Pure bookkeeping, no clock of its own."""

    def __init__(self, total_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError("a cache needs at least one page")
        self.total = total_pages
        self.free = total_pages
        self.private = 0  # pages reserved by requests, not (yet) holding a cached block
        self.locked_nodes = 0  # cached blocks with lock > 0
        self.nodes: dict[int, Node] = {}
        self._lru: list[tuple[float, int, Node]] = []
        self._seq = 0
        self.events: list[CacheEvent] = []  # since the last drain, in order
        self.evicted_total = 0

    # ---- sizes -------------------------------------------------------------------------

    @property
    def evictable(self) -> int:
        return len(self.nodes) - self.locked_nodes

    @property
    def locked(self) -> int:
        return self.locked_nodes + self.private

    @property
    def available(self) -> int:
        """Pages a reservation could get: free now or after evicting."""
        return self.free + self.evictable

    def __len__(self) -> int:
        """Cached blocks."""
        return len(self.nodes)

    # ---- lookups -----------------------------------------------------------------------

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of `hashes[:limit]` that are cached (the cache is prefix-closed, so a
        binary search suffices). Changes nothing."""
        nodes = self.nodes
        lo, hi = 0, min(limit, len(hashes))
        if hi == 0 or hashes[0] not in nodes:
            return 0
        if hashes[hi - 1] in nodes:
            return hi
        lo = 1  # hashes[lo-1] cached, hashes[hi-1] not
        while lo < hi - 1:
            mid = (lo + hi) >> 1
            if hashes[mid - 1] in nodes:
                lo = mid
            else:
                hi = mid
        return lo

    def chain_match(self, hashes: Sequence[int], limit: int) -> int:
        """`match` for hashes from outside, which need not be a chain: the leading blocks of
        `hashes[:limit]` cached as one chain from the root (each the child of the one
        before). Linear in the blocks matched. Changes nothing."""
        nodes, parent = self.nodes, None
        for i, h in enumerate(hashes[:limit]):
            node = nodes.get(h)
            if node is None or node.parent is not parent:
                return i
            parent = node
        return min(limit, len(hashes))

    # ---- locks -------------------------------------------------------------------------

    def lock_prefix(self, hashes: Sequence[int], n: int, now: float, *, touch: bool = True) -> None:
        """A request (or a copy to another instance) starts holding the first `n` cached blocks
        of `hashes`. `touch=False` for a copy's read: it is not a use, so the blocks keep their
        place in the LRU order."""
        if n <= 0:
            return
        node: Node | None = self.nodes[hashes[n - 1]]
        while node is not None:
            if node.lock == 0:
                self.locked_nodes += 1
            node.lock += 1
            if touch:
                node.last_access = now
            node = node.parent

    def unlock_prefix(
        self, hashes: Sequence[int], n: int, now: float, *, touch: bool = True
    ) -> None:
        """A request stops holding the first `n` blocks of `hashes` (all cached); see
        `lock_prefix` for `touch`."""
        if n <= 0:
            return
        node: Node | None = self.nodes[hashes[n - 1]]
        while node is not None:
            node.lock -= 1
            if touch:
                node.last_access = now
            if node.lock == 0:
                self.locked_nodes -= 1
                if node.children == 0:
                    self._push_lru(node)
            node = node.parent

    def touch_prefix(self, hashes: Sequence[int], n: int, now: float) -> None:
        """A use of the first `n` cached blocks of `hashes` that nobody goes on holding (a node
        tier's write-back of blocks it has): `lock_prefix` then `unlock_prefix`. The compiled
        cache does it in one walk that skips what the same `now`'s touches already set."""
        self.lock_prefix(hashes, n, now)
        self.unlock_prefix(hashes, n, now)

    # ---- pages -------------------------------------------------------------------------

    def reserve(self, pages: int) -> bool:
        """Take `pages` private pages, evicting LRU blocks if needed. False (and no change at
        all) when even eviction cannot make room."""
        if pages > self.free + self.evictable:
            return False
        if pages > self.free:
            self._evict(pages - self.free)
        self.free -= pages
        self.private += pages
        return True

    def release(self, pages: int) -> None:
        """Return `pages` private pages to the free pool."""
        assert 0 <= pages <= self.private, "releasing pages that were never reserved"
        self.private -= pages
        self.free += pages

    def commit(self, hashes: Sequence[int], start: int, end: int, held: int, now: float) -> int:
        """A request has computed blocks `hashes[start:end]` into its private pages.

        The request already holds the first `held` (== start) blocks. Each new block becomes a
        cached node it holds; a block someone else cached meanwhile is shared instead and the
        duplicate page goes back to the free pool. Returns how many private pages were used."""
        assert held == start, "blocks must be committed in order"
        nodes = self.nodes
        parent = nodes[hashes[start - 1]] if start > 0 else None
        new: list[int] = []
        relocked = 0  # cached blocks nobody held until now
        for h in hashes[start:end]:
            node = nodes.get(h)
            if node is None:
                nodes[h] = node = Node(h, parent, 0, 1, now)
                if parent is not None:
                    parent.children += 1
                new.append(h)
            else:
                if node.lock == 0:
                    relocked += 1
                node.lock += 1
                node.last_access = now
            parent = node
        # Counters once per commit rather than once per block: every block used a private
        # page; a new one keeps it, a shared one gives it back.
        used = len(new)
        self.private -= end - start
        self.free += end - start - used
        self.locked_nodes += used + relocked
        if new:
            self._record_stored(hashes, start, end, new)
        return used

    def drop(self, block_hash: int) -> tuple[int, ...]:
        """Remove the cached block `block_hash` and every block below it (its bytes are
        known to be wrong, so nothing built on them may be served), unless it is locked:
        then nothing changes (its holder ends, and a later check finds it again). Their
        pages are free; one `BlocksRemoved` names them, parents first. Not an eviction.
        Returns the removed hashes. Linear in the cached blocks: for the rare bad block,
        not a hot path (the node's KV pool's, not the simulator's)."""
        node = self.nodes.get(block_hash)
        if node is None or node.lock:
            return ()
        below: dict[int, list[Node]] = {}
        for other in self.nodes.values():
            if other.parent is not None:
                below.setdefault(other.parent.hash, []).append(other)
        removed: list[int] = []
        stack = [node]
        while stack:  # a lock is held along the whole path, so none below is locked either
            top = stack.pop()
            removed.append(top.hash)
            stack.extend(below.get(top.hash, ()))
        for h in removed:
            del self.nodes[h]  # their LRU entries go stale (`_evict` skips them)
        parent = node.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.lock == 0:
                self._push_lru(parent)
        self.free += len(removed)
        self.events.append(BlocksRemoved(tuple(removed)))
        return tuple(removed)

    # ---- internals ---------------------------------------------------------------------

    def _record_stored(
        self,
        hashes: Sequence[int],
        start: int,
        end: int,
        new: list[int],
    ) -> None:
        stored = self.events.append
        if len(new) == end - start:
            stored(BlocksStored(tuple(new), hashes[start - 1] if start > 0 else None))
            return
        # Some blocks already existed: emit each run of new blocks with its own parent.
        new_set = set(new)
        run: list[int] = []
        run_parent: int | None = None
        for i in range(start, end):
            h = hashes[i]
            if h in new_set:
                if not run:
                    run_parent = hashes[i - 1] if i > 0 else None
                run.append(h)
            elif run:
                stored(BlocksStored(tuple(run), run_parent))
                run = []
        if run:
            stored(BlocksStored(tuple(run), run_parent))

    def _push_lru(self, node: Node) -> None:
        self._seq += 1
        heapq.heappush(self._lru, (node.last_access, self._seq, node))

    def _evict(self, pages: int) -> None:
        nodes, lru = self.nodes, self._lru
        removed: list[int] = []
        pop, pushpop = heapq.heappop, heapq.heappushpop
        # A parent left childless by an eviction is usually the next to go: its entry goes
        # through one push-and-pop of the heap instead of a push and then a pop (the same
        # order: pops follow the entries' unique keys, whatever the heap's layout).
        entry: tuple[float, int, Node] | None = None
        while pages > 0:
            stamp, _, node = pop(lru) if entry is None else pushpop(lru, entry)
            entry = None
            if (
                node.lock
                or node.children
                or node.last_access != stamp
                or nodes.get(node.hash) is not node
            ):
                continue  # stale entry: the node was touched, locked or already evicted
            del nodes[node.hash]
            removed.append(node.hash)
            pages -= 1
            parent = node.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.lock == 0:
                    self._seq += 1  # as `_push_lru` would
                    entry = (parent.last_access, self._seq, parent)
        if entry is not None:
            heapq.heappush(lru, entry)
        self.free += len(removed)
        self.evicted_total += len(removed)
        if removed:
            self.events.append(BlocksRemoved(tuple(removed)))

    def drain_events(self) -> list[CacheEvent]:
        """The blocks stored and removed since the last drain, in the order it happened."""
        events, self.events = self.events, []
        return events

    def snapshot(self) -> CacheSnapshot:
        """Every cached block with its parent, children, lock and last access (for tests)."""
        return {
            h: (None if n.parent is None else n.parent.hash, n.children, n.lock, n.last_access)
            for h, n in self.nodes.items()
        }

    def check_integrity(self) -> None:
        """Assert the page states add up and the cache is prefix-closed."""
        assert self.free >= 0 and self.private >= 0
        assert self.free + self.evictable + self.locked == self.total, (
            f"free {self.free} + evictable {self.evictable} + locked {self.locked} "
            f"!= total {self.total}"
        )
        children: dict[int, int] = {}
        locked = 0
        for h, node in self.nodes.items():
            assert node.hash == h
            if node.parent is not None:
                assert self.nodes.get(node.parent.hash) is node.parent, "orphan block"
                children[node.parent.hash] = children.get(node.parent.hash, 0) + 1
            assert node.lock >= 0
            locked += node.lock > 0
        for h, node in self.nodes.items():
            assert node.children == children.get(h, 0), "child count out of step"
            if node.lock:
                assert node.parent is None or node.parent.lock >= node.lock, "lock not on path"
        assert locked == self.locked_nodes
