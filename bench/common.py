"""Paths and statistics shared by the benchmarks."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]
