"""How often a prefix is reused: seed 000's frequency score, hits / sqrt(age)."""

from __future__ import annotations

import math


class PrefixHeat:
    """Hit counts per prefix (keyed by the hash of its last block) since it was first seen."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}

    def hit(self, key: int, now: float) -> tuple[int, float]:
        """Count one reuse of prefix `key` at `now`; returns (hits, score). Ages below a second
        count as one, so a burst does not score infinitely."""
        hits, first = self._seen.get(key, (0, now))
        hits += 1
        self._seen[key] = (hits, first)
        return hits, hits / math.sqrt(max(now - first, 1.0))

    def reset(self, key: int, now: float) -> None:
        """Start counting `key` afresh (it was just replicated)."""
        self._seen[key] = (0, now)
