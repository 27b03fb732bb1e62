"""Paths and statistics shared by the benchmarks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process (all its threads) has used so far, from
    /proc/<pid>/stat (utime and stime, fields 14 and 15, in clock ticks)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median wall time of `repeats` calls of `run`, after one to warm up."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
