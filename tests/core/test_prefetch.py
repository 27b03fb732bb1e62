"""Idle-gap prefetch's pure parts: the gap predictor, when a load is planned and when a due
one may start."""

from __future__ import annotations

import math

import pytest

from kvsched.core.cluster import ClusterConfig, build_cluster
from kvsched.core.decision import Completion, TransferKind, TransferPlan
from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from kvsched.core.prefetch import (
    GapHistory,
    PrefetchRule,
    may_start,
    pool_load_s,
    predict_gap_s,
    prefetch_plan,
    prefetch_times,
)
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, request


def test_the_predicted_gap_is_a_quantile_of_the_observed_gaps() -> None:
    gaps = [40.0, 10.0, 30.0, 20.0]
    assert predict_gap_s(gaps, 0.0) == 10.0
    assert predict_gap_s(gaps, 1.0) == 40.0
    assert predict_gap_s(gaps, 0.5) == pytest.approx(25.0)
    assert predict_gap_s(gaps, 0.25) == pytest.approx(17.5)  # as numpy's default quantile
    assert math.isnan(predict_gap_s([], 0.25))


def test_the_history_keeps_the_last_gaps_once_per_finish() -> None:
    history = GapHistory(keep=2)
    history.observe("s", -math.inf, 5.0)  # a first turn: no gap yet
    assert history.gaps("s") == ()
    history.observe("s", 10.0, 40.0)
    history.observe("s", 10.0, 41.0)  # a retried arrival after the same finish: no new gap
    history.observe("s", 50.0, 70.0)
    history.observe("s", 80.0, 79.0)  # clock noise: a gap is never negative
    assert history.gaps("s") == (20.0, 0.0)
    history.forget("s")
    assert history.gaps("s") == () and len(history) == 0
    with pytest.raises(ValueError):
        GapHistory(keep=0)


def test_prefetches_are_timed_to_land_before_the_predicted_arrivals() -> None:
    rule = PrefetchRule(quantile=0.5, checks=1, min_gaps=2, min_gap_s=10.0, lead_s=1.0)
    assert prefetch_times(rule, [60.0], 100.0, 0.5) == ()  # too few gaps seen
    assert prefetch_times(rule, [5.0, 8.0], 100.0, 0.5) == ()  # gaps too short to bother
    assert prefetch_times(rule, [50.0, 70.0], 100.0, 0.5) == pytest.approx((100.0 + 60.0 - 1.5,))
    # A load longer than the gap starts at once, never before the turn ended.
    assert prefetch_times(rule, [12.0, 12.0], 100.0, 30.0) == (100.0,)
    # Several checks: one per quantile from the first to the last, short ones left out,
    # equal times once.
    spread = PrefetchRule(quantile=0.0, last_quantile=1.0, checks=3, min_gaps=1, lead_s=0.0)
    assert spread.quantiles() == (0.0, 0.5, 1.0)
    assert prefetch_times(spread, [5.0, 20.0, 40.0], 0.0, 0.0) == (20.0, 40.0)
    assert prefetch_times(spread, [30.0], 0.0, 0.0) == (30.0,)
    with pytest.raises(ValueError):
        PrefetchRule(quantile=1.5)
    with pytest.raises(ValueError):
        PrefetchRule(quantile=0.5, last_quantile=0.25)
    with pytest.raises(ValueError):
        PrefetchRule(checks=0)


def test_a_due_prefetch_starts_only_on_a_host_with_no_queue_and_room() -> None:
    assert may_start(queued_jobs=0, room_pages=10, needed_pages=10)
    assert not may_start(queued_jobs=1, room_pages=100, needed_pages=10)  # work waits there
    assert not may_start(queued_jobs=0, room_pages=9, needed_pages=10)  # no room
    assert not may_start(queued_jobs=0, room_pages=10, needed_pages=0)  # nothing to load


def test_the_plan_loads_the_context_into_its_host_at_the_planned_time() -> None:
    cost = build_cluster(ClusterConfig(n_instances=2)).cost
    hashes = (1, 2, 3)
    plan = prefetch_plan(cost, 1, hashes, session_id="s", not_before=42.0)
    assert plan.kind is TransferKind.PREFETCH
    assert (plan.source, plan.target, plan.not_before) == (1, 1, 42.0)
    assert plan.tokens == 3 * cost.block_size and not plan.on_critical_path
    assert plan.est_seconds == pytest.approx(pool_load_s(cost, plan.tokens))
    link = cost.pool_link
    expected = link.setup_s + plan.nbytes / link.bandwidth_bytes_per_s
    assert plan.est_seconds == pytest.approx(expected) and pool_load_s(cost, 0) == 0.0


def _session_turns(core: Scheduler, *, gap_s: float, turns: int) -> list[TransferPlan]:
    """Turns of session `s` on one instance, each `gap_s` after the last ended; the plans the
    last completion returned."""
    hashes = chain(7, 40)
    plans: list[TransferPlan] = []
    at = 0.0
    for rid in range(1, turns + 1):
        req = request(rid, hashes, session="s")
        d = core.place(req, at)
        done = Completion(
            rid, "s", d.instance, d.decode_instance, req.prompt_tokens, 16, 0,
            req.block_hashes, at, at + 0.5, at + 1.0,
        )  # fmt: skip
        plans = list(core.finish(done, at + 1.0))
        at += 1.0 + gap_s
    return plans


def _core(
    *, pool: bool, runs_engine_orders: bool = True, spec: str = "elastic:prefetch=1"
) -> Scheduler:
    core = Scheduler(
        ClusterConfig(n_instances=1), spec, seed=0, max_prompt_tokens=131_072,
        runs_engine_orders=runs_engine_orders,
    )  # fmt: skip
    if pool:  # the node's DRAM tier holds something: the index has seen a CPU-tier store
        core.apply(0, [BlocksStored(chain(99, 4), None, Tier.CPU)])
    return core


def test_elastic_plans_prefetches_before_the_predicted_turn_only_with_a_pool() -> None:
    plans = _session_turns(_core(pool=True), gap_s=60.0, turns=3)
    assert [p.kind for p in plans] == [TransferKind.PREFETCH]  # equal gaps: one time
    (plan,) = plans
    assert plan.source == plan.target == 0 and plan.session_id == "s"
    finished = 2 * 61.0 + 1.0
    # Due the lead (1 s) and the load's time before the arrival 60 s after the turn ended.
    assert finished + 60.0 - 1.0 - plan.est_seconds == pytest.approx(plan.not_before)
    assert plan.block_hashes == chain(7, 40)
    assert _session_turns(_core(pool=False), gap_s=60.0, turns=3) == []  # no pool: none
    assert _session_turns(_core(pool=True), gap_s=60.0, turns=2) == []  # one gap seen
    assert _session_turns(_core(pool=True), gap_s=5.0, turns=3) == []  # short gaps
    off = _core(pool=True, spec="elastic")  # off by default (docs/evaluation.md)
    assert _session_turns(off, gap_s=60.0, turns=3) == []
    # A Scheduler whose caller cannot run them (the live Conductor) hands none out.
    assert _session_turns(_core(pool=True, runs_engine_orders=False), gap_s=60.0, turns=3) == []


def test_a_gap_history_keeps_the_sessions_observed_last() -> None:
    history = GapHistory(keep=2, max_sessions=2)
    history.observe("a", 0.0, 5.0)
    history.observe("b", 0.0, 6.0)
    history.observe("a", 10.0, 12.0)  # a observed again: b is now the oldest
    history.observe("c", 0.0, 7.0)
    assert len(history) == 2
    assert history.gaps("b") == ()
    assert history.gaps("a") == (5.0, 2.0)
    assert history.gaps("c") == (7.0,)
