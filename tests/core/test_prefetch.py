"""Idle-gap prefetch's pure parts: the gap predictor, when a load is planned and when a due
one may start."""

from __future__ import annotations

import math

import pytest

from kvsched.core.cluster import ClusterConfig, build_cluster
from kvsched.core.decision import TransferKind
from kvsched.core.prefetch import (
    GapHistory,
    PrefetchRule,
    may_start,
    pool_load_s,
    predict_gap_s,
    prefetch_at,
    prefetch_plan,
)


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


def test_a_prefetch_is_timed_to_land_before_the_predicted_arrival() -> None:
    rule = PrefetchRule(quantile=0.5, min_gaps=2, min_gap_s=10.0, lead_s=1.0)
    assert prefetch_at(rule, [60.0], 100.0, 0.5) is None  # too few gaps seen
    assert prefetch_at(rule, [5.0, 8.0], 100.0, 0.5) is None  # gaps too short to bother
    assert prefetch_at(rule, [50.0, 70.0], 100.0, 0.5) == pytest.approx(100.0 + 60.0 - 1.5)
    # A load longer than the gap starts at once, never before the turn ended.
    assert prefetch_at(rule, [12.0, 12.0], 100.0, 30.0) == 100.0
    with pytest.raises(ValueError):
        PrefetchRule(quantile=1.5)


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
