"""A progress bar for long replays: one line per task, its share done and the time left.

On a terminal the line is redrawn in place, at most ten times a second. Anywhere else (a log
file, CI, a pipe) only each task's end is written, one plain line: a line redrawn with
carriage returns reads as one endless line there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 30  # the bar's characters
REDRAW_S = 0.1


class ProgressBar:
    """Told `(task, share done)` as work goes on (the replays' `progress`); writes to
    `stream`."""

    def __init__(
        self, stream: TextIO = sys.stderr, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stream = stream
        self.clock = clock
        self.live = stream.isatty()
        self._started: dict[str, float] = {}
        self._drawn = -REDRAW_S

    def __call__(self, task: str, share: float) -> None:
        now = self.clock()
        started = self._started.setdefault(task, now)
        if share >= 1.0:
            self._started.pop(task)
            line = f"{task[:28]:<28} done in {duration(now - started)}\n"
            self.stream.write(f"\r{line}" if self.live else line)
            self.stream.flush()
            return
        if not self.live or now - self._drawn < REDRAW_S:
            return
        self._drawn = now
        filled = int(share * WIDTH)
        left = (now - started) * (1.0 - share) / share if share > 0 else None
        eta = "ETA " + (duration(left) if left is not None else "?")
        bar = "#" * filled + "." * (WIDTH - filled)
        self.stream.write(f"\r{task[:28]:<28} [{bar}] {share:6.1%} {eta:<12}")
        self.stream.flush()


def duration(seconds: float) -> str:
    """`seconds` as 42s, 3m07s or 2h05m."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
