"""Closed-loop transforms: gap caps, held-out group selection, repetition."""

from __future__ import annotations

from kvsched.sim.traces import transform
from kvsched.sim.traces.model import Trace
from tests.conftest import SLICES


def weka() -> Trace:
    return transform.load(SLICES / "weka_cc_agentic_sample.jsonl.xz", max_sessions=4)


def test_cap_gaps_only_shortens() -> None:
    trace = weka()
    capped = transform.cap_gaps(trace, 5.0)
    assert all(b.gap_s == min(a.gap_s, 5.0) for a, b in zip(trace.calls, capped.calls, strict=True))
    assert capped.notes["gaps_capped"] == sum(c.gap_s > 5.0 for c in trace.calls) > 0


def test_select_groups_keeps_dependencies_inside_the_selection() -> None:
    trace = weka()
    groups = list(dict.fromkeys(c.group for c in trace.calls))
    tail = transform.select_groups(trace, 2, 4)
    assert [c.group for c in tail.calls] == [c.group for c in trace.calls if c.group in groups[2:4]]
    for i, call in enumerate(tail.calls):
        assert call.index == i
        if call.after >= 0:
            dep = tail.calls[call.after]
            assert dep.group == call.group and dep.index < i


def test_repeated_groups_share_nothing() -> None:
    trace = weka()
    twice = transform.repeat_groups(trace, 2)
    n = len(trace.calls)
    assert len(twice.calls) == 2 * n
    first = {b for c in twice.calls[:n] for b in c.block_ids}
    second = {b for c in twice.calls[n:] for b in c.block_ids}
    assert not first & second
    assert all(c.after == -1 or c.after >= n for c in twice.calls[n:])
    assert twice.calls[n].session.endswith("#1")
