"""The capacity knee by bisection: per policy and seed, the highest load that keeps SLO
attainment at 90% or more, located to within a tolerance (`kvsched knee`).

Closed loop, each load L replays `repeat × L / base_load` copies of every session, fractions
included (a seeded sample of the last copy's sessions: `transform.repeat_groups_fraction`),
so the sessions' start window keeps its length and the sessions in flight reach a steady state
at every load, as the grid sweep's `--sweep-scale-repeat` does with whole copies. Starting
from a bracket [lo, hi] (widened by factors of 1.5 when lo misses or hi meets the target), the
search halves it until hi − lo ≤ tolerance × lo: `goodput_load` is then the last load met,
`knee_load` the first missed. A policy's attainment is not strictly monotone in load (a seed's
start times shift with it), so the search finds a knee, the first crossing it brackets.

Afterwards every policy is replayed once more at the reference load, the highest goodput of
the reference policies (the best baseline) on that seed, for TTFT, APC and the hotspot index
there. The searches are independent: `jobs` processes share them out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from kvsched.sim.compare import Comparison, replay_config
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import summarize
from kvsched.sim.sweep import GOODPUT_ATTAINMENT
from kvsched.sim.traces import transform
from kvsched.sim.traces.model import Trace

WIDEN = 1.5
MAX_WIDEN = 6  # bracket steps before giving up (a policy that never or always meets it)
ROW_KEYS = (
    "slo_attainment",
    "ttft_mean",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "apc",
    "hotspot_index",
    "steady_inflight_sessions",
    "migrations",
    "rejected",
)


@dataclass(frozen=True)
class KneeSearch:
    """Where to look and how finely."""

    lo: float
    hi: float
    tolerance: float = 0.02  # stop when hi - lo <= tolerance * lo
    target: float = GOODPUT_ATTAINMENT

    def __post_init__(self) -> None:
        if not 0 < self.lo < self.hi:
            raise ValueError(f"the bracket needs 0 < lo < hi, got {self.lo:g}:{self.hi:g}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"the tolerance must lie in (0, 1), got {self.tolerance:g}")


def find_knee(attainment_at: Callable[[float], float], search: KneeSearch) -> dict[str, Any]:
    """Bisect `attainment_at` (a replay per call) for the knee. Returns the probes in the
    order run, `goodput_load` (0 when even the widened bracket's bottom misses) and
    `knee_load` (None when even its top meets the target)."""
    probes: list[tuple[float, float]] = []

    def meets(load: float) -> bool:
        value = attainment_at(load)
        probes.append((load, value))
        return value >= search.target  # NaN (nothing offered) counts as a miss

    lo, hi = search.lo, search.hi
    if not meets(lo):  # widen downwards: the old bottom is the new top
        for _ in range(MAX_WIDEN):
            lo, hi = _round(lo / WIDEN), lo
            if meets(lo):
                break
        else:
            return _result(probes, 0.0, lo)
    elif meets(hi):  # widen upwards
        for _ in range(MAX_WIDEN):
            lo, hi = hi, _round(hi * WIDEN)
            if not meets(hi):
                break
        else:
            return _result(probes, hi, None)
    while hi - lo > search.tolerance * lo:
        mid = _round((lo + hi) / 2)
        if mid in (lo, hi):
            break
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return _result(probes, lo, hi)


def _round(load: float) -> float:
    return float(f"{load:.4g}")


def _result(
    probes: list[tuple[float, float]], goodput: float, knee: float | None
) -> dict[str, Any]:
    return {"probes": [list(p) for p in probes], "goodput_load": goodput, "knee_load": knee}


@dataclass(frozen=True)
class KneeRun:
    """One comparison's setup (its trace is the base, one copy per `repeat`), searched."""

    base: Comparison
    base_trace: Trace  # selected and gap-capped, before copies and token scaling
    scale_tokens: float
    search: KneeSearch
    seeds: tuple[int, ...]
    reference: tuple[str, ...]  # the baselines whose best goodput load is the reference

    def copies_at(self, load: float) -> float:
        return self.base.repeat * load / self.base.load

    def trace_at(self, load: float, seed: int) -> Trace:
        trace = transform.repeat_groups_fraction(self.base_trace, self.copies_at(load), seed)
        if self.scale_tokens != 1.0:
            trace = transform.scale_tokens(trace, self.scale_tokens)
        return trace

    def comparison_at(self, load: float, seed: int) -> Comparison:
        return replace(self.base, trace=self.trace_at(load, seed), load=load, seed=seed)


def replay_row(run: KneeRun, spec: str, load: float, seed: int) -> dict[str, Any]:
    """One replay of `spec` at `load`, summarised (the row's keys in ROW_KEYS)."""
    cmp, prepared = _prepared(run, load, seed)
    config = replay_config(cmp)
    row = summarize(run_replay(prepared, spec, config), cmp.trace, config)
    out = {key: row.get(key) for key in ROW_KEYS}
    inflight = out["steady_inflight_sessions"]
    out["sessions_per_instance"] = (
        inflight / cmp.instances if inflight is not None and math.isfinite(inflight) else None
    )
    return out


def _prepared(run: KneeRun, load: float, seed: int) -> tuple[Comparison, PreparedTrace]:
    """The trace at `load` for `seed`, prepared afresh: a replay's own memory then bounds a
    process's (a prepared WEKA trace at the knee's copies takes gigabytes; keeping several
    for the probes they share would not fit two jobs in a small machine)."""
    cmp = run.comparison_at(load, seed)
    return cmp, prepare(cmp.trace, seed=seed)


def search_one(run: KneeRun, spec: str, seed: int) -> dict[str, Any]:
    """The knee of `spec` on `seed`, with the rows of every probe."""
    rows: dict[float, dict[str, Any]] = {}

    def attainment(load: float) -> float:
        rows[load] = replay_row(run, spec, load, seed)
        value = rows[load]["slo_attainment"]
        return float("nan") if value is None else float(value)

    result = find_knee(attainment, run.search)
    goodput = result["goodput_load"]
    result["sessions_per_instance"] = rows[goodput]["sessions_per_instance"] if goodput else 0.0
    result["rows"] = {f"{load:g}": row for load, row in rows.items()}
    return result


def _search_task(args: tuple[KneeRun, str, int]) -> dict[str, Any]:
    return search_one(*args)


def _row_task(args: tuple[KneeRun, str, float, int]) -> dict[str, Any]:
    return replay_row(*args)


def run_knees(
    run: KneeRun,
    policies: Sequence[str],
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every policy's knee on every seed, then every policy at each seed's reference load.
    Returns the `knee` report: per seed and policy the search and the reference row."""
    tasks = [(run, spec, seed) for seed in run.seeds for spec in policies]
    searches = _map(_search_task, tasks, jobs, progress, lambda t: f"{t[1]} seed {t[2]}")
    found = {(t[2], t[1]): s for t, s in zip(tasks, searches, strict=True)}
    seeds: dict[str, Any] = {}
    reference_loads: dict[int, float] = {}
    for seed in run.seeds:
        peers = [found[(seed, spec)]["goodput_load"] for spec in run.reference if spec in policies]
        reference_loads[seed] = max(peers, default=0.0)
    row_tasks = []
    for seed in run.seeds:
        load = reference_loads[seed]
        for spec in policies:
            if load > 0 and f"{load:g}" not in found[(seed, spec)]["rows"]:
                row_tasks.append((run, spec, load, seed))
    extra = _map(_row_task, row_tasks, jobs, progress, lambda t: f"{t[1]} seed {t[3]} @ {t[2]:g}")
    for (_, spec, load, seed), row in zip(row_tasks, extra, strict=True):
        found[(seed, spec)]["rows"][f"{load:g}"] = row
    for seed in run.seeds:
        load = reference_loads[seed]
        seeds[str(seed)] = {
            "reference_load": load,
            "policies": {
                spec: {
                    **found[(seed, spec)],
                    "at_reference": found[(seed, spec)]["rows"].get(f"{load:g}"),
                }
                for spec in policies
            },
        }
    return {
        "search": {
            "lo": run.search.lo,
            "hi": run.search.hi,
            "tolerance": run.search.tolerance,
            "target": run.search.target,
            "base_load": run.base.load,
            "base_repeat": run.base.repeat,
        },
        "reference_policies": list(run.reference),
        "policies": list(policies),
        "seeds": seeds,
    }


def _map(
    fn: Callable[[Any], Any],
    tasks: list[Any],
    jobs: int,
    progress: Callable[[str], None] | None,
    label: Callable[[Any], str],
) -> list[Any]:
    if jobs <= 1 or len(tasks) <= 1:
        out = []
        for task in tasks:
            out.append(fn(task))
            if progress is not None:
                progress(label(task))
        return out
    # A fresh process per task: nothing a replay allocated outlives it.
    with ProcessPoolExecutor(max_workers=jobs, max_tasks_per_child=1) as pool:
        futures = [pool.submit(fn, task) for task in tasks]
        results = []
        for task, future in zip(tasks, futures, strict=True):
            results.append(future.result())
            if progress is not None:
                progress(label(task))
        return results
