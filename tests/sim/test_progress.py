"""The progress bar: redrawn with the time left on a terminal, one line a task elsewhere."""

from __future__ import annotations

import io

from kvsched.sim.progress import ProgressBar, duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_the_line_is_redrawn_with_the_time_left() -> None:
    out, clock = Terminal(), Clock()
    bar = ProgressBar(out, clock)
    bar("elastic", 0.0)
    clock.now += 30.0
    bar("elastic", 0.25)  # 30 s for a quarter: 90 s left
    bar("elastic", 0.3)  # too soon to redraw
    clock.now += 90.0
    bar("elastic", 1.0)
    text = out.getvalue()
    assert text.count("\r") == 3 and "ETA 1m30s" in text and "30.0%" not in text
    assert text.endswith("\relastic                      done in 2m00s\n")


def test_elsewhere_only_each_tasks_end_is_written_without_carriage_returns() -> None:
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(out, clock)
    for share in (0.0, 0.5, 1.0):
        bar("round_robin", share)
        clock.now += 5.0
    assert out.getvalue() == "round_robin                  done in 10s\n"


def test_durations_read_at_a_glance() -> None:
    assert [duration(s) for s in (4.4, 187.0, 7500.0)] == ["4s", "3m07s", "2h05m"]
