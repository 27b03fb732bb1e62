"""Turn one replay into the metrics DESIGN defines (times in seconds, rates as fractions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsched.sim.records import ReplayConfig, ReplayResult
from kvsched.sim.traces.ceiling import ideal_hits
from kvsched.sim.traces.model import Trace


def measured_calls(trace: Trace, config: ReplayConfig, group_start: dict[str, float]) -> np.ndarray:
    """Boolean mask of the calls inside the measurement window (after the warm-up).

    The window is the same for every policy: open loop drops calls in the first
    `warmup_fraction` of the trace span; closed loop drops the groups (agentic traces) whose
    drawn start falls in the first `warmup_fraction` of the start window."""
    calls = trace.calls
    frac = config.warmup_fraction
    if not calls:
        return np.zeros(0, dtype=bool)
    if config.closed_loop:
        last = max(group_start.values(), default=0.0)
        cut = frac * last
        return np.array([group_start[c.group] >= cut for c in calls], dtype=bool)
    t0 = calls[0].timestamp_s
    cut = t0 + frac * (calls[-1].timestamp_s - t0)
    return np.array([c.timestamp_s >= cut for c in calls], dtype=bool)


def measured_from(trace: Trace, config: ReplayConfig, group_start: dict[str, float]) -> float:
    """When the measurement window opens on the replay's clock (seconds from its start), for
    the figures of time rather than of calls (the hotspot index): the warm-up cut of
    `measured_calls`, where open loop places a call at (timestamp − first) / load."""
    calls = trace.calls
    frac = config.warmup_fraction
    if not calls:
        return 0.0
    if config.closed_loop:
        return frac * max(group_start.values(), default=0.0)
    return frac * (calls[-1].timestamp_s - calls[0].timestamp_s) / config.load


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(result: ReplayResult, trace: Trace, config: ReplayConfig) -> dict[str, Any]:
    """The policy's row of the report."""
    calls = trace.calls
    reqs = result.reqs
    cluster = result.cluster
    lat = cluster.cost.latency
    slo = cluster.config.slo
    measured = measured_calls(trace, config, result.group_start)
    prompt = np.array([c.input_tokens for c in calls], dtype=float)
    output = np.array([c.output_tokens for c in calls], dtype=float)
    arrival = np.array([r.arrival for r in reqs])
    first = np.array([r.first_token_at for r in reqs])
    finish = np.array([r.finished_at for r in reqs])
    rejected = np.array([r.rejected for r in reqs], dtype=bool)
    done = np.array([r.done for r in reqs], dtype=bool)
    served = measured & done & ~rejected & (first >= 0)
    ttft = (first - arrival)[served]
    e2e = (finish - arrival)[served]
    multi = served & (output > 1)
    tpot_all = np.full(len(calls), np.nan)
    tpot_all[multi] = (finish[multi] - first[multi]) / (output[multi] - 1)
    tpot = tpot_all[multi]
    local = np.array([r.local_hit for r in reqs], dtype=float)
    moved = np.array([r.transfer_hit for r in reqs], dtype=float)
    p_served = prompt[served].sum()
    apc_local = local[served].sum() / p_served if p_served else math.nan
    apc_transfer = moved[served].sum() / p_served if p_served else math.nan
    # SLO attainment over every offered request in the window; rejections count as misses.
    ok_ttft = np.zeros(len(calls), dtype=bool)
    ok_ttft[served] = (first - arrival)[served] <= slo.ttft_s
    ok_tpot = np.where(multi, np.nan_to_num(tpot_all, nan=np.inf) <= slo.tpot_s, True)
    offered = int(measured.sum())
    attained = int((ok_ttft & ok_tpot & served).sum())
    # Interference: TPOT against the same request decoding alone.
    iso_tpot = lat.step_s + lat.decode_seq_s + lat.decode_ctx_s * (prompt + output * 0.5)
    inflation = tpot_all[multi] / iso_tpot[multi]
    passes = sum(e.decode_passes for e in result.engines)
    mixed = sum(e.mixed_passes for e in result.engines)
    mig = result.migrations
    row: dict[str, Any] = {
        "ttft_mean": float(ttft.mean()) if len(ttft) else math.nan,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
        "tpot_mean": float(tpot.mean()) if len(tpot) else math.nan,
        "tpot_p50": _pct(tpot, 50),
        "tpot_p90": _pct(tpot, 90),
        "tpot_p99": _pct(tpot, 99),
        "itl_p99": result.gaps.percentile(99),
        "e2e_mean": float(e2e.mean()) if len(e2e) else math.nan,
        "e2e_p50": _pct(e2e, 50),
        "e2e_p90": _pct(e2e, 90),
        "e2e_p99": _pct(e2e, 99),
        "apc": apc_local + apc_transfer,
        "apc_local": apc_local,
        "apc_transfer": apc_transfer,
        "slo_attainment": attained / offered if offered else math.nan,
        "offered": offered,
        "completed": int(served.sum()),
        "rejected": int((measured & rejected).sum()),
        "rejections": int(sum(max(r.attempts - 1, 0) + r.rejected for r in reqs)),
        "migrations": mig.count,
        "migrations_on_path": mig.on_path,
        "migrated_bytes": mig.bytes,
        "migration_critical_path_s": mig.critical_path_s,
        "migration_downtime_s": mig.critical_path_s,  # the same in this model: see MigrationLog
        "migration_failed": mig.failed,
        "cooldown_violations": mig.cooldown_violations,
        "migration_target_cool_share": (mig.follow_cool / mig.follow_turns)
        if mig.follow_turns
        else math.nan,
        "tpot_inflation": float(inflation.mean()) if len(inflation) else math.nan,
        "mixed_pass_share": mixed / passes if passes else math.nan,
        "utilization": _engine_mean(result, "busy_s"),
        "kv_occupancy": _engine_mean(result, "kv_area") / result.cluster.capacity_blocks,
        "decode_batch": _engine_mean(result, "batch_area"),
        "transfers": {
            kind: {"count": int(v[0]), "bytes": int(v[1]), "seconds": float(v[2])}
            for kind, v in result.transfers.items()
            if v[0]
        },
        "simulated_seconds": result.end_time,
        "wall_seconds": result.wall_s,
        "events": result.events,
    }
    window_start = measured_from(trace, config, result.group_start)
    row.update(result.hotspot.summary(window_start, result.end_time))
    if result.tiers is not None:  # only with the node tier on: rows without it stay as pinned
        loaded = np.array([r.tier_hit for r in reqs], dtype=float)
        apc_load = loaded[served].sum() / p_served if p_served else math.nan
        row["apc"] += apc_load
        row["apc_load"] = apc_load
        row["tiers"] = dict(result.tiers)
    if config.closed_loop:
        row.update(amplification(result, trace, measured))
    else:
        row.update({"amplification": math.nan, "amplification_ideal": math.nan})
    return row


def _engine_mean(result: ReplayResult, attr: str) -> float:
    """Time average over the replay of an engine integral, averaged over engines."""
    if result.end_time <= 0:
        return math.nan
    return float(np.mean([getattr(e, attr) for e in result.engines])) / result.end_time


def amplification(result: ReplayResult, trace: Trace, measured: np.ndarray) -> dict[str, Any]:
    """Wall-clock amplification of a closed-loop replay (DESIGN: A, A_ideal, per-session
    ratios and the achieved load), over the groups in the measurement window."""
    calls = trace.calls
    lat = result.cluster.cost.latency
    chunk = result.cluster.config.chunk_tokens
    starts = result.group_start
    hits = ideal_hits(trace, scope="global")
    ideal_finish = np.zeros(len(calls))
    recorded: dict[str, float] = {}
    replayed: dict[str, float] = {}
    ideal: dict[str, float] = {}
    for call in calls:
        s = starts[call.group]
        ready = s + call.start_offset_s if call.after < 0 else ideal_finish[call.after] + call.gap_s
        n_new = call.input_tokens - hits[call.index]
        service = float(lat.prefill(float(n_new), float(hits[call.index]), chunk))
        service += max(call.output_tokens - 1, 0) * lat.decode_step(
            1, call.input_tokens + call.output_tokens // 2
        )
        ideal_finish[call.index] = ready + service
        if not measured[call.index]:
            continue
        g = call.group
        recorded[g] = max(recorded.get(g, 0.0), call.timestamp_s + call.recorded_service_s)
        ideal[g] = max(ideal.get(g, 0.0), ideal_finish[call.index] - s)
        replayed[g] = max(replayed.get(g, 0.0), result.reqs[call.index].finished_at - s)
    if not recorded:
        return {"amplification": math.nan, "amplification_ideal": math.nan}
    groups: Sequence[str] = list(recorded)
    steady = steady_inflight(result, trace, min(starts[g] for g in groups))
    first_start = min(starts[g] for g in groups)
    span = max(starts[g] + recorded[g] for g in groups) - first_start
    makespan = max(starts[g] + replayed[g] for g in groups) - first_start
    ideal_span = max(starts[g] + ideal[g] for g in groups) - first_start
    ratios = np.array([replayed[g] / recorded[g] for g in groups if recorded[g] > 0])
    a = makespan / span if span > 0 else math.nan
    a_ideal = ideal_span / span if span > 0 else math.nan
    return {
        "amplification": a,
        "amplification_ideal": a_ideal,
        "amplification_vs_ideal": a / a_ideal if a_ideal else math.nan,
        "session_ratio_p50": _pct(ratios, 50),
        "session_ratio_p90": _pct(ratios, 90),
        "sessions_per_hour": len(groups) / (makespan / 3600.0) if makespan > 0 else math.nan,
        "mean_inflight_sessions": sum(replayed[g] for g in groups) / makespan
        if makespan > 0
        else math.nan,
        "steady_inflight_sessions": steady,
    }


def steady_inflight(result: ReplayResult, trace: Trace, cut: float) -> float:
    """Time-average of the sessions (groups) in flight from `cut` (the first measured start)
    to the last group's start: the steady state while sessions keep starting. The mean over
    the makespan also counts the ramp-down, where the longest sessions run on alone."""
    starts = result.group_start
    last = max(starts.values(), default=0.0)
    if last <= cut:
        return math.nan
    finish = dict(starts)
    for call in trace.calls:
        g = call.group
        finish[g] = max(finish[g], result.reqs[call.index].finished_at)
    inside = sum(max(0.0, min(finish[g], last) - max(s, cut)) for g, s in starts.items())
    return inside / (last - cut)
