"""The goodput sweep: every policy replayed at rising loads until its SLO attainment falls
below 90% (its knee).

Loads run in ascending order, all policies at one load before the next; a policy that has
fallen below the target is not replayed at the loads above its knee (recorded as `null`).
Goodput is the last load before the knee, and in closed loop also the sessions it keeps in
flight there, per instance (time-averaged from the warm-up cut to the last session's start,
while sessions keep starting: `summary.steady_inflight`).

Closed loop with a fixed set of sessions, a higher load only starts them in a shorter burst,
and the makespan ends in the tail of the longest sessions ("sessions run out"): attainment then
measures a burst, not a steady state. With `repeat_trace` given, load L replays
`repeat × L / base_load` copies of each session (rounded half up, at least one), so the
sessions' start window keeps the length it has at the base load and the sessions in flight
reach a steady state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import summarize
from kvsched.sim.traces.model import Trace

GOODPUT_ATTAINMENT = 0.9

# What each swept point keeps of the policy's row at that load.
POINT_KEYS = (
    "slo_attainment",
    "steady_inflight_sessions",
    "mean_inflight_sessions",
    "ttft_mean",
    "ttft_p90",
    "apc",
    "offered",
)


@dataclass(frozen=True)
class SweepPlan:
    """Which loads a sweep runs, and how many copies of each session it replays at each."""

    loads: tuple[float, ...]  # ascending; includes the base load
    base_load: float
    base_repeat: int = 1
    scale_repeat: bool = False  # closed loop: copies grow with the load (module docstring)

    @classmethod
    def of(
        cls, sweep_loads: Sequence[float], base_load: float, base_repeat: int, scale_repeat: bool
    ) -> SweepPlan:
        return cls(tuple(sorted({*sweep_loads, base_load})), base_load, base_repeat, scale_repeat)

    def repeat_at(self, load: float) -> int:
        """Copies of each session replayed at `load` (the base repeat unless scaled)."""
        if not self.scale_repeat:
            return self.base_repeat
        return max(1, math.floor(self.base_repeat * load / self.base_load + 0.5))  # half up


def goodput_of(
    loads: Sequence[float], attainment: Sequence[float | None], target: float = GOODPUT_ATTAINMENT
) -> tuple[float, float | None]:
    """(goodput load, knee load): the knee is the first load below `target` (None when every
    load meets it); goodput is the last load before the knee (0 when the first load misses)."""
    goodput = 0.0
    for load, value in zip(loads, attainment, strict=True):
        if value is None or not value >= target:  # NaN (nothing offered) counts as a miss
            return goodput, load
        goodput = load
    return goodput, None


def sweep_goodput(
    plan: SweepPlan,
    policies: Sequence[str],
    config: ReplayConfig,
    base: tuple[Trace, PreparedTrace],
    rows: dict[str, dict[str, Any]],
    *,
    repeat_trace: Callable[[int], Trace] | None = None,
    progress: Callable[[str, float], None] | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Replay the policies over `plan`'s loads (the base load's `rows` are reused, not
    replayed). Adds `goodput_load`, `knee_load` and (closed loop) `goodput_sessions_per_instance`
    to each policy's row; calls `checkpoint` with the sweep so far after each load. Returns the
    report's `goodput` section."""
    n = config.cluster.n_instances
    closed = config.closed_loop
    repeats = [plan.repeat_at(load) if repeat_trace else plan.base_repeat for load in plan.loads]
    points: dict[str, list[dict[str, Any] | None]] = {spec: [] for spec in policies}
    for load, k in zip(plan.loads, repeats, strict=True):
        runs = [spec for spec in policies if load == plan.base_load or not _past_knee(points[spec])]
        current = base
        if repeat_trace is not None and k != plan.base_repeat and runs != []:
            trace = repeat_trace(k)
            current = (trace, prepare(trace, seed=config.seed))
        for spec in policies:
            if spec not in runs:
                points[spec].append(None)
                continue
            if load == plan.base_load:
                row = rows[spec]
            else:
                label = f"{spec} @ load {load:g}"
                tick = (lambda frac, s=label: progress(s, frac)) if progress else None
                swept = replace(config, load=load)
                result = run_replay(current[1], spec, swept, tick)
                row = summarize(result, current[0], swept)
                if progress is not None:
                    progress(label, 1.0)
            points[spec].append({key: row.get(key) for key in POINT_KEYS})
        if checkpoint is not None:
            checkpoint(_section(plan, repeats, points, n_instances=n, closed_loop=closed))
    return _section(plan, repeats, points, n_instances=n, closed_loop=closed, rows=rows)


def _past_knee(points: list[dict[str, Any] | None]) -> bool:
    attainment = [p["slo_attainment"] if p else None for p in points]
    return any(a is None or not a >= GOODPUT_ATTAINMENT for a in attainment)


def _section(
    plan: SweepPlan,
    repeats: Sequence[int],
    points: dict[str, list[dict[str, Any] | None]],
    *,
    n_instances: int,
    closed_loop: bool,
    rows: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The report's `goodput` section over the loads run so far; fills `rows` when given."""
    loads = list(plan.loads[: len(next(iter(points.values()), []))])
    out: dict[str, Any] = {
        "loads": list(loads),
        "repeats": list(repeats[: len(loads)]),  # copies of each session replayed
        "base_load": plan.base_load,
        "scale_repeat": plan.scale_repeat,
        "attainment_target": GOODPUT_ATTAINMENT,
        "stop_at_knee": True,
        "complete": len(loads) == len(plan.loads),
        "policies": {},
    }
    for spec, curve in points.items():
        attainment = [p["slo_attainment"] if p else None for p in curve]
        goodput, knee = goodput_of(loads, attainment)
        inflight = [p["steady_inflight_sessions"] if p else None for p in curve]
        per_instance: float | None = None  # open loop has no sessions in flight
        if closed_loop and goodput == 0.0:
            per_instance = 0.0
        elif closed_loop:
            at = inflight[loads.index(goodput)]
            if at is not None and math.isfinite(at):
                per_instance = at / n_instances
        entry: dict[str, Any] = {key: [p[key] if p else None for p in curve] for key in POINT_KEYS}
        entry.update(
            goodput_load=goodput,
            knee_load=knee,
            goodput_sessions_per_instance=per_instance,
        )
        out["policies"][spec] = entry
        if rows is not None:
            rows[spec]["goodput_load"] = goodput
            rows[spec]["knee_load"] = knee
            rows[spec]["goodput_sessions_per_instance"] = per_instance
    return out
