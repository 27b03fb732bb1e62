"""The replay's event loop and its load-balance meter, against straightforward references."""

from __future__ import annotations

import math
import random

import pytest

from kvsched.sim.clock import EventQueue
from kvsched.sim.meters import HotspotMeter


def test_run_handles_events_in_time_order_those_pushed_meanwhile_included() -> None:
    clock = EventQueue()
    seen: list[tuple[float, int, str]] = []

    def first(payload: str) -> None:
        seen.append((clock.now, 0, payload))
        if payload == "a":  # pushed while handling: after the events already due at 2.0
            clock.push(2.0, 1, "c")

    def second(payload: str) -> None:
        seen.append((clock.now, 1, payload))

    clock.push(2.0, 1, "b")
    clock.push(1.0, 0, "a")
    clock.push(3.0, 0, "d")
    clock.run((first, second))
    assert seen == [(1.0, 0, "a"), (2.0, 1, "b"), (2.0, 1, "c"), (3.0, 0, "d")]
    assert not clock and clock.now == 3.0 and clock.handled == 4


def test_a_handler_that_raises_ends_the_run_and_its_event_counts() -> None:
    clock = EventQueue()
    for t in (1.0, 2.0, 3.0):
        clock.push(t, 0, t)

    def stop_at_two(payload: float) -> None:
        if payload == 2.0:
            raise LookupError

    with pytest.raises(LookupError):
        clock.run((stop_at_two,))
    assert clock.handled == 2 and clock.now == 2.0 and clock  # the event at 3.0 is left


def _reference(n: int, chunk: int, changes: list[tuple[float, int, float]]) -> dict[str, float]:
    """The meter's integrals worked out interval by interval from the loads at hand."""
    loads = [0.0] * n
    busy = ratio = cv = hot = 0.0
    last = changes[0][0]
    for now, slot, value in changes:
        dt = now - last
        total = sum(loads)
        if now > last and total > 0:
            mean = total / n
            busy += dt
            ratio += dt * max(loads) / mean
            var = max(sum([x * x for x in loads]) / n - mean * mean, 0.0)
            cv += dt * math.sqrt(var) / mean
            ordered = sorted(loads)
            median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
            if ordered[-1] > 1.5 * median and ordered[-1] > chunk:
                hot += dt
        last = max(last, now)
        loads[slot] = value
    return {"busy": busy, "ratio": ratio, "cv": cv, "hot": hot}


def test_the_hotspot_integrals_are_those_of_the_loads_to_the_bit() -> None:
    rng = random.Random(7)
    for n in (1, 2, 5, 8):
        t = 0.0
        changes: list[tuple[float, int, float]] = []
        for _ in range(400):
            t += rng.choice((0.0, rng.random()))  # some changes share an instant
            changes.append((t, rng.randrange(n), float(rng.choice((0, rng.randrange(1, 5000))))))
        meter = HotspotMeter(n, chunk_tokens=512)
        for now, slot, value in changes:
            meter.set(now, slot, value)
        want = _reference(n, 512, changes)
        got = {"busy": meter.busy_s, "ratio": meter.ratio_area, "cv": meter.cv_area}
        got["hot"] = meter.hot_s
        assert got == want, n  # exact: the report's numbers must not move by a bit
