"""What a router believes each instance holds from its own routing alone: the union of
prompt paths (chained block hashes) it sent there, per instance slot.

Two peers' scorers keep such a picture instead of reading the engines' KV events: SGLang's
cache-aware router (an approximate radix tree of the requests it routed, trimmed by LRU to a
size budget) and Dynamo's KV router (the blocks of the requests it has in flight on each
worker). Our hashes are chained (a block's hash covers every block before it), so two paths
share exactly their longest common prefix, and the union of a slot's paths is a tree whose size
follows from those prefixes: adding a path adds its length less its longest prefix shared with
any path already there. Paths are grouped by their first block (only paths with the same first
block share anything), so a lookup compares a prompt with the few paths of its own
conversation, by binary search, not block by block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks two chained-hash paths share (equal hashes at i mean equal prefixes)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # invariant: a[:lo] == b[:lo]; the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class Path:
    """One routed prompt's blocks and when it was last routed (a path's nodes all carry the
    time of the latest path through them, as the radix tree's do)."""

    key: Hashable
    hashes: Sequence[int]
    stamp: float


class RoutedPaths:
    """Per slot, the union of the paths added there. `add` and `remove` change it; the
    queries read it."""

    def __init__(self, n_slots: int) -> None:
        # slot -> first block -> paths beginning with it
        self._paths: list[dict[int, list[Path]]] = [{} for _ in range(n_slots)]
        self._sizes = [0] * n_slots

    def size(self, slot: int) -> int:
        """Distinct blocks of the union on `slot`."""
        return self._sizes[slot]

    def sizes(self) -> npt.NDArray[np.float64]:
        """Every slot's union size."""
        return np.array(self._sizes, dtype=float)

    def shared(self, slot: int, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` the union on `slot` holds."""
        if not hashes:
            return 0
        group = self._paths[slot].get(hashes[0], ())
        return max((common_prefix(hashes, path.hashes) for path in group), default=0)

    def shared_by_slot(self, hashes: Sequence[int]) -> npt.NDArray[np.float64]:
        """`shared` on every slot (only the slots holding a path of the same first block are
        compared)."""
        out = np.zeros(len(self._paths))
        if hashes:
            for slot, groups in enumerate(self._paths):
                if hashes[0] in groups:
                    out[slot] = self.shared(slot, hashes)
        return out

    def add(
        self, slot: int, key: Hashable, hashes: Sequence[int], stamp: float, *, subsume: bool
    ) -> int:
        """Add path `hashes` under `key` on `slot`; returns the blocks it added to the union.
        With `subsume`, paths it wholly covers are dropped (their nodes now carry its newer
        stamp: the radix tree refreshes every node a routed request passes)."""
        if not hashes:
            return 0
        group = self._paths[slot].setdefault(hashes[0], [])
        covered = 0
        kept: list[Path] = []
        for path in group:
            prefix = common_prefix(hashes, path.hashes)
            covered = max(covered, prefix)
            if not (subsume and prefix == len(path.hashes)):
                kept.append(path)
        kept.append(Path(key, hashes, stamp))
        group[:] = kept
        added = len(hashes) - covered
        self._sizes[slot] += added
        return added

    def remove(self, slot: int, key: Hashable, first: int) -> int:
        """Drop the path added under `key` (whose first block is `first`); returns the blocks
        that left the union (those no other path shares)."""
        group = self._paths[slot].get(first)
        if not group:
            return 0
        for i, path in enumerate(group):
            if path.key == key:
                del group[i]
                break
        else:
            return 0
        removed = len(path.hashes) - max(
            (common_prefix(path.hashes, other.hashes) for other in group), default=0
        )
        if not group:
            del self._paths[slot][first]
        self._sizes[slot] -= removed
        return removed

    def trim(self, slot: int, budget: int) -> int:
        """Evict least recently routed blocks, leaves first, until the union on `slot` holds
        at most `budget` blocks; returns how many left. A path loses its tail down to what a
        newer path shares; the oldest path goes first."""
        if self._sizes[slot] <= budget:
            return 0
        evicted = 0
        paths = [path for group in self._paths[slot].values() for path in group]
        paths.sort(key=lambda path: path.stamp)
        for path in paths:
            if self._sizes[slot] <= budget:
                break
            first = path.hashes[0]
            group = self._paths[slot][first]
            others = [other for other in group if other is not path]
            floor = max((common_prefix(path.hashes, o.hashes) for o in others), default=0)
            cut = min(len(path.hashes) - floor, self._sizes[slot] - budget)
            path.hashes = path.hashes[: len(path.hashes) - cut]
            self._sizes[slot] -= cut
            evicted += cut
            if len(path.hashes) <= floor:  # nothing of its own left
                if others:
                    group[:] = others
                else:
                    del self._paths[slot][first]
        return evicted
