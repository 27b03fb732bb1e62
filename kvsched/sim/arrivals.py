"""When each trace call arrives.

Open loop: at the trace's timestamps, scaled by the load. Closed loop: each group (a whole
agentic trace) starts at a seeded Poisson time, and turn k of a session arrives its recorded
gap after turn k−1 finished; a rejected turn comes back after the retry delay it was given.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvsched.sim.clock import ARRIVE, EventQueue
from kvsched.sim.traces.model import TraceCall


class Arrivals:
    """Schedules the calls' arrivals on the clock, each turn after the one it follows."""

    def __init__(self, calls: Sequence[TraceCall], clock: EventQueue) -> None:
        self._calls = calls
        self._clock = clock
        self._next_turns: dict[int, list[int]] = {}  # call -> the calls waiting for it
        self.group_start: dict[str, float] = {}  # closed loop: when each group started

    def schedule(self, load: float, closed_loop: bool, n_instances: int, seed: int) -> None:
        """Push the arrivals known up front: every call in open loop; in closed loop each
        group's first calls, the others waiting for the call they follow (`finished`)."""
        if load <= 0:
            raise ValueError("load must be positive")
        calls = self._calls
        if not closed_loop:
            t0 = calls[0].timestamp_s if calls else 0.0
            for call in calls:
                self._clock.push((call.timestamp_s - t0) / load, ARRIVE, call.index)
            return
        starts = draw_group_starts(calls, n_instances, load, seed)
        self.group_start = starts
        for call in calls:
            if call.after < 0:
                self._clock.push(starts[call.group] + call.start_offset_s, ARRIVE, call.index)
            else:
                self._next_turns.setdefault(call.after, []).append(call.index)

    def retry(self, call: int, retry_after_s: float) -> None:
        """A rejected call comes back after `retry_after_s` (at least a millisecond)."""
        self._clock.push(self._clock.now + max(retry_after_s, 0.001), ARRIVE, call)

    def finished(self, call: int) -> None:
        """`call` is done (served or rejected): the calls that follow it arrive after their
        recorded gaps."""
        now = self._clock.now
        for turn in self._next_turns.pop(call, ()):
            self._clock.push(now + self._calls[turn].gap_s, ARRIVE, turn)


def draw_group_starts(
    calls: Sequence[TraceCall], n_instances: int, load: float, seed: int
) -> dict[str, float]:
    """Closed loop: Poisson start times of the groups (whole agentic traces), in first-call
    order; load 1.0 keeps on average one group per instance active when groups run at their
    recorded speed. The live load generator draws the same starts."""
    spans: dict[str, float] = {}
    order: list[str] = []
    for call in calls:
        end = call.timestamp_s + call.recorded_service_s
        if call.group not in spans:
            order.append(call.group)
            spans[call.group] = 0.0
        spans[call.group] = max(spans[call.group], end)
    mean_span = max(sum(spans.values()) / max(len(spans), 1), 1.0)
    rate = load * n_instances / mean_span
    arrivals = random.Random(f"group-starts:{seed}")
    starts: dict[str, float] = {}
    t = 0.0
    for group in order:
        starts[group] = t
        t += arrivals.expovariate(rate)
    return starts
