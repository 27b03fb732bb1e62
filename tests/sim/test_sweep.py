"""The goodput sweep: copies of each session grow with the load, a policy stops at its knee,
goodput in sessions per instance."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kvsched.core.cluster import ClusterConfig
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import steady_inflight, summarize
from kvsched.sim.sweep import SweepPlan, goodput_of, sweep_goodput
from kvsched.sim.traces import transform
from kvsched.sim.traces.model import Trace, TraceCall

BLOCK = 16


def agentic(groups: int = 8, turns: int = 4, blocks: int = 240) -> Trace:
    """Closed-loop sessions: each turn's prompt extends the last one's, 1 s tool gaps."""
    calls: list[TraceCall] = []
    for g in range(groups):
        ids = tuple(range(g * 10_000, g * 10_000 + blocks))
        for k in range(turns):
            n = (k + 1) * blocks // turns
            i = len(calls)
            calls.append(
                TraceCall(
                    i, f"s{g}", f"g{g}", 10.0 * k, n * BLOCK, 64, ids[:n], turn=k + 1,
                    after=i - 1 if k else -1, gap_s=1.0 if k else 0.0, recorded_service_s=5.0,
                )
            )  # fmt: skip
    return Trace("agentic", "weka", BLOCK, tuple(calls), closed_loop=True)


def test_copies_grow_with_the_load_so_the_start_window_keeps_its_length() -> None:
    plan = SweepPlan.of((128.0, 48.0, 64.0), base_load=32.0, base_repeat=2, scale_repeat=True)
    assert plan.loads == (32.0, 48.0, 64.0, 128.0)
    assert [plan.repeat_at(load) for load in plan.loads] == [2, 3, 4, 8]
    assert SweepPlan.of((8,), 32, 1, scale_repeat=True).repeat_at(8) == 1  # never below one
    halves = SweepPlan.of((72.0, 88.0), base_load=64.0, base_repeat=4, scale_repeat=True)
    assert [halves.repeat_at(load) for load in halves.loads] == [4, 5, 6]  # 4.5 and 5.5 round up
    fixed = SweepPlan.of((64,), 32, 3, scale_repeat=False)
    assert [fixed.repeat_at(load) for load in fixed.loads] == [3, 3]


@pytest.mark.parametrize(
    ("attainment", "expected"),
    [
        (
            [0.95, 0.92, 0.85, 0.95],
            (2.0, 4.0),
        ),  # the first miss is the knee, later passes do not count
        ([0.95, 0.92, 0.91, 0.90], (8.0, None)),  # never below: goodput is a lower bound
        ([0.89, None, None, 0.95], (0.0, 1.0)),  # misses at the lowest load
        ([0.95, float("nan"), None, None], (1.0, 2.0)),  # nothing offered counts as a miss
    ],
)
def test_goodput_is_the_last_load_before_the_knee(
    attainment: list[float | None], expected: tuple[float, float | None]
) -> None:
    assert goodput_of([1.0, 2.0, 4.0, 8.0], attainment) == expected


def test_sweep_stops_each_policy_at_its_knee(monkeypatch: pytest.MonkeyPatch) -> None:
    base = agentic()
    config = ReplayConfig(ClusterConfig(n_instances=2, block_size=BLOCK), closed_loop=True)
    prepared = prepare(base)
    policies = ["round_robin", "least_loaded"]
    rows = {p: summarize(run_replay(prepared, p, config), base, config) for p in policies}
    replayed: list[tuple[str, float, int]] = []  # (policy, load, sessions)
    real = run_replay

    def spy(prep: Any, spec: str, cfg: ReplayConfig, tick: Any = None) -> Any:
        replayed.append((spec, cfg.load, len({c.group for c in prep.trace.calls})))
        return real(prep, spec, cfg, tick)

    monkeypatch.setattr("kvsched.sim.sweep.run_replay", spy)
    copies: list[int] = []

    def repeat_trace(k: int) -> Trace:
        copies.append(k)
        return transform.repeat_groups(base, k)

    partial: list[dict[str, Any]] = []
    plan = SweepPlan.of((4, 16, 64, 256, 1024), base_load=1, base_repeat=1, scale_repeat=True)
    out = sweep_goodput(
        plan, policies, config, (base, prepared), rows, repeat_trace=repeat_trace,
        checkpoint=partial.append,
    )  # fmt: skip

    for spec in policies:
        curve = out["policies"][spec]
        knee = curve["knee_load"]
        assert knee is not None and knee < 1024  # the synthetic sessions overload two instances
        i = plan.loads.index(knee)
        assert curve["slo_attainment"][i] < 0.9
        assert all(a >= 0.9 for a in curve["slo_attainment"][:i])
        assert curve["slo_attainment"][i + 1 :] == [None] * (len(plan.loads) - i - 1)
        # Replayed at every load up to its knee, never above it (the base load is reused).
        assert [load for s, load, _ in replayed if s == spec] == list(plan.loads[1 : i + 1])
        goodput = curve["goodput_load"]
        assert goodput == plan.loads[i - 1] == rows[spec]["goodput_load"]
        inflight = curve["steady_inflight_sessions"][i - 1]
        assert curve["goodput_sessions_per_instance"] == pytest.approx(inflight / 2)
        assert rows[spec]["goodput_sessions_per_instance"] == curve["goodput_sessions_per_instance"]
    # Each load replays base_repeat x load / base_load copies of the 8 sessions.
    assert all(sessions == 8 * load for _, load, sessions in replayed)
    assert copies == sorted(set(copies)) and copies[0] == 4  # one trace per load, built once
    assert out["repeats"] == [1, 4, 16, 64, 256, 1024]
    offered = out["policies"]["least_loaded"]["offered"]
    ran = [o for o in offered if o is not None]
    assert ran == sorted(ran) and ran[-1] > 4 * ran[0]
    # The sweep so far is handed out after every load; the last one is complete.
    assert [len(p["loads"]) for p in partial] == list(range(1, len(plan.loads) + 1))
    assert not partial[0]["complete"] and partial[-1]["complete"]


def test_open_loop_sweep_has_no_sessions_per_instance() -> None:
    base = agentic(groups=4)
    open_trace = Trace(base.name, "mooncake", BLOCK, base.calls, closed_loop=False)
    config = ReplayConfig(ClusterConfig(n_instances=2, block_size=BLOCK))
    prepared = prepare(open_trace)
    rows = {
        "round_robin": summarize(run_replay(prepared, "round_robin", config), open_trace, config)
    }
    plan = SweepPlan.of((2,), base_load=1, base_repeat=1, scale_repeat=False)
    out = sweep_goodput(plan, ["round_robin"], config, (open_trace, prepared), rows)
    assert out["policies"]["round_robin"]["goodput_sessions_per_instance"] is None
    assert out["policies"]["round_robin"]["goodput_load"] in (0.0, 1, 2)


def test_steady_inflight_is_the_time_average_while_sessions_keep_starting() -> None:
    trace = transform.repeat_groups(agentic(), 4)
    config = ReplayConfig(
        ClusterConfig(n_instances=2, block_size=BLOCK), load=8.0, closed_loop=True
    )
    result = run_replay(prepare(trace), "least_loaded", config)
    starts = result.group_start
    cut = sorted(starts.values())[3]
    finish = dict(starts)
    for call in trace.calls:
        finish[call.group] = max(finish[call.group], result.reqs[call.index].finished_at)
    last = max(starts.values())
    grid = np.linspace(cut, last, 20_001)
    sampled = np.mean([sum(starts[g] <= t < finish[g] for g in starts) for t in grid])
    assert steady_inflight(result, trace, cut) == pytest.approx(sampled, rel=0.01)
    assert math.isnan(steady_inflight(result, trace, last))  # no span to average over
