"""Whole replays on the shipped trace slices: invariants, determinism, metric bounds."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest

from kvsched.core.cluster import ClusterConfig
from kvsched.core.policies import ALL_POLICIES
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.records import ReplayConfig, ReplayResult
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import measured_calls, summarize
from kvsched.sim.traces import ceiling, transform
from kvsched.sim.traces.model import Trace
from tests.conftest import SLICES


@cache
def mooncake(n: int = 400) -> PreparedTrace:
    return prepare(transform.load(SLICES / "mooncake_conversation_head.jsonl", max_requests=n))


@cache
def weka(groups: int = 6) -> PreparedTrace:
    trace = transform.load(SLICES / "weka_cc_agentic_sample.jsonl.xz", max_sessions=groups)
    return prepare(transform.scale_tokens(transform.cap_gaps(trace, 60.0), 0.25))


def config(
    n: int = 4, load: float = 4.0, closed: bool = False, check: bool = False
) -> ReplayConfig:
    return ReplayConfig(
        ClusterConfig(n_instances=n), seed=3, load=load, closed_loop=closed, check_integrity=check
    )


def run(
    prepared: PreparedTrace, spec: str, cfg: ReplayConfig
) -> tuple[ReplayResult, dict[str, Any]]:
    result = run_replay(prepared, spec, cfg)
    row = summarize(result, prepared.trace, cfg)
    row.pop("wall_seconds")
    return result, row


@pytest.mark.parametrize("spec", [*ALL_POLICIES, "mooncake:colocated=1"])
def test_every_policy_keeps_engine_invariants_after_every_step(spec: str) -> None:
    cfg = config(check=True)
    result, row = run(mooncake(150), spec, cfg)
    assert row["completed"] + row["rejected"] == row["offered"]
    assert all(r.done for r in result.reqs)
    result.cluster.index.check_integrity()
    for engine in result.engines:
        assert engine.cache.locked == 0  # everything finished, nothing leaks


@pytest.mark.parametrize("spec", ["ear", "elastic", "sticky", "mooncake"])
def test_closed_loop_invariants(spec: str) -> None:
    result, row = run(weka(), spec, config(closed=True, load=20.0, check=True))
    calls = weka().trace.calls
    for call in calls:
        if call.after >= 0:
            dep = result.reqs[call.after]
            assert result.reqs[call.index].arrival >= dep.finished_at + call.gap_s - 1e-9
    assert row["cooldown_violations"] == 0
    assert math.isfinite(row["amplification"]) and row["amplification_ideal"] > 0


def test_same_trace_and_seed_give_identical_results() -> None:
    for prepared, cfg in ((mooncake(), config()), (weka(), config(closed=True, load=20.0))):
        for spec in ("elastic", "mooncake", "random"):
            first = run(prepared, spec, cfg)[1]
            assert run(prepared, spec, cfg)[1] == first


def _window(trace: Trace, cfg: ReplayConfig, result: ReplayResult) -> list[bool]:
    return list(measured_calls(trace, cfg, result.group_start))


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_metrics_stay_within_their_bounds(spec: str) -> None:
    cfg = config(load=6.0)
    prepared = mooncake()
    result, row = run(prepared, spec, cfg)
    window = _window(prepared.trace, cfg, result)
    ideal = ceiling.ideal_apc(prepared.trace, scope="global", window=window)
    assert 0.0 <= row["apc"] <= ideal + 1e-9
    assert 1.0 <= row["hotspot_pmr"] <= cfg.cluster.n_instances + 1e-9
    # Seconds of queued prefill above the mean: never negative, and below the whole window.
    assert 0.0 <= row["hotspot_index"] < row["simulated_seconds"]
    assert 0.0 <= row["slo_attainment"] <= 1.0
    lat = result.cluster.cost.latency
    chunk = cfg.cluster.chunk_tokens
    served = 0
    for call, req in zip(prepared.trace.calls, result.reqs, strict=True):
        if req.rejected or req.first_token_at < 0:
            continue
        served += 1
        hit = req.local_hit + req.transfer_hit
        isolated = lat.prefill_scalar(call.input_tokens - hit, hit, chunk)
        assert req.first_token_at - req.arrival >= isolated - 1e-9
    assert served > 0


def test_migrations_happen_and_never_inside_the_cooldown() -> None:
    cooldown = 20.0
    for spec in ("ear", "elastic"):
        cfg = config(n=2, closed=True, load=80.0)
        result, row = run(weka(24), f"{spec}:t_hot_tokens=64,t_cool_s={cooldown}", cfg)
        assert row["migrations"] > 0, spec
        last: dict[str, float] = {}
        for start, source, target, session in result.migrations.events:
            assert source != target
            assert start - last.get(session, -math.inf) >= cooldown
            last[session] = start
        assert row["cooldown_violations"] == 0
