"""The capacity knee by bisection: per policy and seed, the highest load that keeps SLO
attainment at 90% or more, located to within a tolerance (`kvsched knee`).

Closed loop, each load L replays `repeat × L / base_load` copies of every session, fractions
included (a seeded sample of the last copy's sessions: `transform.repeat_groups_fraction`),
so the sessions' start window keeps its length and the sessions in flight reach a steady state
at every load, as the grid sweep's `--sweep-scale-repeat` does with whole copies. Starting
from a bracket [lo, hi] (widened by factors of 1.5 when lo misses or hi meets the target), the
search halves it until hi − lo ≤ tolerance × lo: `goodput_load` is then the last load met,
`knee_load` the first missed; a probe's replay stops as soon as its miss is certain. A
policy's attainment is not strictly monotone in load (a seed's start times shift with it),
so the search finds a knee, the first crossing it brackets.

Afterwards every policy is replayed once more at the reference load, the highest goodput of
the reference policies (the best baseline) on that seed, for TTFT, APC and the hotspot index
there; a policy left out of the searches (`searched`) is only replayed there. One seed's
searches run side by side, sharing each prepared trace among the searches that probe its
load; `jobs` processes share the seeds, and a seed's part of the report, once done, can be
kept (`on_seed`) so a stopped run goes on from the seeds it finished (`finished`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, cast

from kvsched.sim.arrivals import draw_group_starts
from kvsched.sim.compare import Comparison, replay_config
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import measured_calls, summarize
from kvsched.sim.sweep import GOODPUT_ATTAINMENT
from kvsched.sim.traces import ceiling, transform
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
_STOPPED = {"stopped_early": True}  # what a load not replayed counts as: no full row there


@dataclass(frozen=True)
class KneeSearch:
    """Where to look and how finely."""

    lo: float
    hi: float
    tolerance: float = 0.02  # stop when hi - lo <= tolerance * lo
    target: float = GOODPUT_ATTAINMENT
    # A probe's replay stops once it cannot reach the target (`SloVerdict`): the verdict is
    # the same, and a probe far past the knee costs a fraction of its full replay. Its row
    # then holds only the attainment it could still have reached, marked `stopped_early`.
    stop_early: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.lo < self.hi:
            raise ValueError(f"the bracket needs 0 < lo < hi, got {self.lo:g}:{self.hi:g}")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"the tolerance must lie in (0, 1), got {self.tolerance:g}")


KneeSteps = Generator[float, float, dict[str, Any]]


def knee_steps(search: KneeSearch) -> KneeSteps:
    """The bisection as a generator: it yields each load to probe and is sent the attainment
    there (a replay's; NaN, nothing offered, counts as a miss). It returns the probes in the
    order run, `goodput_load` (0 when even the widened bracket's bottom misses) and
    `knee_load` (None when even its top meets the target)."""
    probes: list[tuple[float, float]] = []
    lo, hi = search.lo, search.hi
    value = yield lo
    probes.append((lo, value))
    if not value >= search.target:  # widen downwards: the old bottom is the new top
        for _ in range(MAX_WIDEN):
            lo, hi = _round(lo / WIDEN), lo
            value = yield lo
            probes.append((lo, value))
            if value >= search.target:
                break
        else:
            return _result(probes, 0.0, lo)
    else:
        value = yield hi
        probes.append((hi, value))
        if value >= search.target:  # widen upwards
            for _ in range(MAX_WIDEN):
                lo, hi = hi, _round(hi * WIDEN)
                value = yield hi
                probes.append((hi, value))
                if not value >= search.target:
                    break
            else:
                return _result(probes, hi, None)
    while hi - lo > search.tolerance * lo:
        mid = _round((lo + hi) / 2)
        if mid in (lo, hi):
            break
        value = yield mid
        probes.append((mid, value))
        if value >= search.target:
            lo = mid
        else:
            hi = mid
    return _result(probes, lo, hi)


def find_knee(attainment_at: Callable[[float], float], search: KneeSearch) -> dict[str, Any]:
    """`knee_steps` driven by `attainment_at` (a replay per call)."""
    steps = knee_steps(search)
    load = next(steps)
    while True:
        try:
            load = steps.send(attainment_at(load))
        except StopIteration as done:
            return cast(dict[str, Any], done.value)


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


def replay_rows(
    run: KneeRun, specs: Sequence[str], load: float, seed: int, *, probe: bool = False
) -> list[dict[str, Any]]:
    """Each of `specs` replayed at `load` on one trace prepared once, summarised: the row's
    keys in ROW_KEYS and the sessions in flight per instance. A `probe` of a search that
    stops early ends a replay once it misses the target: its row is then `stopped_early`,
    with the attainment bound its only figure."""
    cmp, prepared = _prepared(run, load, seed)
    config = replay_config(cmp)
    stop_below = run.search.target if probe and run.search.stop_early else None
    rows = []
    for spec in specs:
        result = run_replay(prepared, spec, config, stop_below=stop_below)
        if result.attainment_bound is not None:
            bound = {"slo_attainment": result.attainment_bound, "stopped_early": True}
            rows.append({**dict.fromkeys(ROW_KEYS), "sessions_per_instance": None, **bound})
            continue
        row = summarize(result, cmp.trace, config)
        out = {key: row.get(key) for key in ROW_KEYS}
        inflight = out["steady_inflight_sessions"]
        out["sessions_per_instance"] = (
            inflight / cmp.instances if inflight is not None and math.isfinite(inflight) else None
        )
        rows.append(out)
    return rows


def _prepared(run: KneeRun, load: float, seed: int) -> tuple[Comparison, PreparedTrace]:
    """The trace at `load` for `seed`, prepared afresh: a replay's own memory then bounds a
    process's (a prepared WEKA trace at the knee's copies takes gigabytes; keeping several
    for the probes they share would not fit two jobs in a small machine)."""
    cmp = run.comparison_at(load, seed)
    return cmp, prepare(cmp.trace, seed=seed)


def search_seed(
    run: KneeRun, policies: Sequence[str], searched: Sequence[str], seed: int
) -> dict[str, Any]:
    """The knees of `searched` on `seed`, searched side by side, then every policy at the
    seed's reference load. Each round takes the lowest load a search asks for, prepares that
    trace once and replays there every search asking for it (their probes coincide where
    their knees lie close, as the bracket's ends always do). Returns the seed's part of the
    report."""
    steps = {spec: knee_steps(run.search) for spec in searched}
    asked = {spec: next(gen) for spec, gen in steps.items()}
    rows: dict[str, dict[str, dict[str, Any]]] = {spec: {} for spec in policies}
    found: dict[str, dict[str, Any]] = {}
    while asked:
        load = min(asked.values())
        here = [spec for spec in searched if asked.get(spec) == load]
        for spec, row in zip(here, replay_rows(run, here, load, seed, probe=True), strict=True):
            rows[spec][f"{load:g}"] = row
            value = row["slo_attainment"]
            try:
                asked[spec] = steps[spec].send(math.nan if value is None else float(value))
            except StopIteration as done:
                found[spec] = done.value
                del asked[spec]
    peers = [found[spec]["goodput_load"] for spec in run.reference if spec in found]
    reference = max(peers, default=0.0)
    apc_ceiling = reference_apc_ceiling(run, reference, seed) if reference > 0 else None
    key = f"{reference:g}"
    # A probe that stopped early at the reference load is replayed there in full.
    missing = [spec for spec in policies if rows[spec].get(key, _STOPPED).get("stopped_early")]
    if reference > 0 and missing:
        for spec, row in zip(missing, replay_rows(run, missing, reference, seed), strict=True):
            rows[spec][key] = row
    entries = {}
    for spec in policies:
        result = found.get(spec) or {**_result([], 0.0, None), "goodput_load": None}
        goodput = result["goodput_load"]
        per_instance = rows[spec][f"{goodput:g}"]["sessions_per_instance"] if goodput else None
        entries[spec] = {
            **result,
            "sessions_per_instance": 0.0 if spec in found and not goodput else per_instance,
            "rows": rows[spec],
            "at_reference": rows[spec].get(key),
        }
    return {"reference_load": reference, "apc_ceiling": apc_ceiling, "policies": entries}


def reference_apc_ceiling(run: KneeRun, load: float, seed: int) -> float:
    """The APC no placement can beat at `load` on `seed`: every prefix any earlier call
    computed still cached (`ceiling.ideal_apc`, any session's), over the measured calls (the
    replay's window: its sessions' starts are drawn as the replay draws them)."""
    cmp = run.comparison_at(load, seed)
    starts = draw_group_starts(cmp.trace.calls, cmp.instances, cmp.load, seed)
    window = measured_calls(cmp.trace, replay_config(cmp), starts)
    return ceiling.ideal_apc(cmp.trace, scope="global", window=list(window))


def _seed_task(args: tuple[KneeRun, tuple[str, ...], tuple[str, ...], int]) -> dict[str, Any]:
    return search_seed(*args)


def run_knees(
    run: KneeRun,
    policies: Sequence[str],
    *,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
    searched: Sequence[str] | None = None,
    finished: Mapping[int, dict[str, Any]] | None = None,
    on_seed: Callable[[int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The knee of every policy of `searched` (default: all) on every seed, then every policy
    at each seed's reference load; `jobs` processes share the seeds. The seeds in `finished`
    (their parts of an earlier report of this run) are not searched again; `on_seed` is told
    each other seed's part as soon as it is done. Returns the `knee` report: per seed and
    policy the search (none for a policy not searched: its goodput and knee loads None) and
    the reference row."""
    searched = tuple(policies if searched is None else searched)
    if not set(run.reference) & set(searched):
        raise ValueError("no reference baseline is searched: nothing sets the reference load")
    finished = finished or {}
    tasks = [(run, tuple(policies), searched, s) for s in run.seeds if s not in finished]

    def done(task: tuple[Any, ...], part: dict[str, Any]) -> None:
        if on_seed is not None:
            on_seed(task[3], part)
        if progress is not None:
            progress(f"seed {task[3]}")

    parts = dict(zip((t[3] for t in tasks), _map(_seed_task, tasks, jobs, done), strict=True))
    parts |= {seed: finished[seed] for seed in run.seeds if seed in finished}
    return {
        "search": {
            "lo": run.search.lo,
            "hi": run.search.hi,
            "tolerance": run.search.tolerance,
            "target": run.search.target,
            "stop_early": run.search.stop_early,
            "base_load": run.base.load,
            "base_repeat": run.base.repeat,
        },
        "reference_policies": list(run.reference),
        "policies": list(policies),
        "searched": list(searched),
        "seeds": {str(seed): parts[seed] for seed in run.seeds},
    }


def _map(
    fn: Callable[[Any], Any],
    tasks: list[Any],
    jobs: int,
    done: Callable[[Any, Any], None],
) -> list[Any]:
    """`fn` of every task, in the tasks' order; `done(task, result)` as each ends."""
    if jobs <= 1 or len(tasks) <= 1:
        out = []
        for task in tasks:
            out.append(fn(task))
            done(task, out[-1])
        return out
    # A fresh process per task: nothing a replay allocated outlives it.
    with ProcessPoolExecutor(max_workers=jobs, max_tasks_per_child=1) as pool:
        futures = {pool.submit(fn, task): k for k, task in enumerate(tasks)}
        results: list[Any] = [None] * len(tasks)
        for future in as_completed(futures):
            k = futures[future]
            results[k] = future.result()
            done(tasks[k], results[k])
        return results
