"""The hotspot index: the time-averaged excess of the hottest instance's queued prefill seconds
over the mean, on hand-built timelines, through the engine's queue and through whole replays."""

from __future__ import annotations

import math
import random

import pytest

from kvsched.core.cluster import ClusterConfig
from kvsched.core.latency import load_latency
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from kvsched.sim.jobs import Job, JobKind
from kvsched.sim.meters import HotspotMeter
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import run_replay
from kvsched.sim.summary import measured_from, summarize
from kvsched.sim.traces.model import Trace, TraceCall

LAT = load_latency()
BS = 16


def test_one_request_waiting_two_seconds_beside_an_idle_instance() -> None:
    meter = HotspotMeter(2, chunk_tokens=512)
    meter.set_queued(1.0, 0, 2.0)  # 2 s of prefill waits on instance 0 from t = 1 …
    meter.set_queued(3.0, 0, 0.0)  # … until admitted at t = 3; instance 1 stays idle
    # max − mean = 2 − 1 = 1 s for 2 s of the window.
    assert meter.hotspot_index(0.0, 10.0) == pytest.approx(2.0 / 10.0)
    assert meter.hotspot_index(2.0, 10.0) == pytest.approx(1.0 / 8.0)  # the warm-up cuts half
    assert meter.hotspot_index(3.0, 10.0) == 0.0
    assert meter.hotspot_index(1.5, 2.5) == pytest.approx(1.0)


def test_three_instances_by_hand_and_an_even_queue_counts_nothing() -> None:
    meter = HotspotMeter(3, chunk_tokens=512)
    meter.set_queued(0.0, 0, 3.0)
    meter.set_queued(0.0, 1, 1.0)  # the same instant: only the last value holds from t = 0
    meter.set_queued(2.0, 0, 2.0)
    meter.set_queued(2.0, 1, 2.0)
    meter.set_queued(2.0, 2, 2.0)  # every instance has 2 s queued: nothing avoidable
    meter.set_queued(2.0, 2, 2.0)  # no change: nothing recorded
    # [0, 2): queues (3, 1, 0), max − mean = 3 − 4/3 = 5/3; [2, 4]: (2, 2, 2), 0.
    assert meter.hotspot_index(0.0, 4.0) == pytest.approx((2 * 5 / 3) / 4)
    assert meter.hotspot_index(2.0, 4.0) == 0.0


def test_the_index_is_unknown_for_an_empty_window_or_unknown_queues() -> None:
    meter = HotspotMeter(2, chunk_tokens=512)
    assert meter.hotspot_index(0.0, 5.0) == 0.0  # nothing ever queued
    assert math.isnan(meter.hotspot_index(5.0, 5.0))
    meter.queued_known = False
    assert math.isnan(meter.hotspot_index(0.0, 5.0))
    assert math.isnan(meter.summary(0.0, 5.0)["hotspot_index"])


def _reference(n: int, changes: list[tuple[float, int, float]], start: float, end: float) -> float:
    """The index by brute force: integrate max − mean over every interval in the window."""
    queued = [0.0] * n
    area, last = 0.0, 0.0
    for now, slot, value in [*changes, (end, 0, math.nan)]:
        lo, hi = max(last, start), min(now, end)
        if hi > lo:
            area += (hi - lo) * max(max(queued) - sum(queued) / n, 0.0)
        last = max(last, now)
        if not math.isnan(value):
            queued[slot] = value
    return area / (end - start)


def test_the_index_is_the_brute_force_integral_over_any_window() -> None:
    rng = random.Random(11)
    for n in (1, 2, 5, 8):
        t = 0.0
        changes: list[tuple[float, int, float]] = []
        for _ in range(300):
            t += rng.choice((0.0, rng.random()))
            changes.append((t, rng.randrange(n), rng.choice((0.0, rng.uniform(0.0, 4.0)))))
        meter = HotspotMeter(n, chunk_tokens=512)
        for now, slot, value in changes:
            meter.set_queued(now, slot, value)
        for start, end in ((0.0, t), (0.1 * t, t), (0.3 * t, 0.6 * t), (0.5 * t, 1.5 * t)):
            want = _reference(n, changes, start, end)
            assert meter.hotspot_index(start, end) == pytest.approx(want, rel=1e-9, abs=1e-12)
        if n == 1:  # one instance is always the mean: nothing is ever avoidable
            assert meter.hotspot_index(0.0, t) == 0.0


def _job(rid: int, prompt: int) -> Job:
    hashes = tuple(rid * 10_000 + i for i in range(prompt // BS))
    return Job(rid, JobKind.FULL, prompt, 4, hashes, 0.0)


def test_the_engine_queues_waiting_work_only_and_the_meter_follows_it() -> None:
    eng = Engine(0, EngineSpec(BS, 4000, 512, max_running=1, layers=32), LAT)
    first, second = _job(1, 2000), _job(2, 1000)
    eng.submit(first)
    eng.submit(second)
    wait = LAT.prefill_scalar(1000, 0, 512)
    assert eng.queued_s == pytest.approx(LAT.prefill_scalar(2000, 0, 512) + wait)
    meter = HotspotMeter(2, chunk_tokens=512)
    end = eng.plan(0.0)  # `first` is admitted; `second` waits for the one running slot
    assert end is not None and eng.queued_s == pytest.approx(wait)
    meter.set_queued(0.0, 0, eng.queued_s)
    now = 0.0
    for _ in range(100):  # until `second` is admitted (bounded: a few chunks and decodes)
        assert end is not None
        now = end
        eng.complete(now)
        eng.check_integrity()
        end = eng.plan(now)
        if eng.queued_s != meter.queued[0]:
            meter.set_queued(now, 0, eng.queued_s)
        if not eng.waiting:
            break
    assert eng.queued_s == 0.0 and second.admitted_at == now > 0.0
    # `second` waited from 0 to its admission beside an idle instance: max − mean is half of it.
    assert meter.hotspot_index(0.0, now) == pytest.approx(wait / 2)


def test_an_aborted_waiting_job_leaves_the_queue() -> None:
    eng = Engine(0, EngineSpec(BS, 4000, 512, max_running=1, layers=32), LAT)
    first, second, third = _job(1, 600), _job(2, 800), _job(3, 300)
    for j in (first, second, third):
        eng.submit(j)
    assert eng.abort(second, 0.0)
    eng.check_integrity()
    assert eng.queued_s == pytest.approx(first.est_prefill_s + third.est_prefill_s)
    eng.plan(0.0)  # `first` takes the one running slot
    eng.check_integrity()
    assert eng.queued_s == pytest.approx(third.est_prefill_s) and list(eng.waiting) == [third]


def _cold_starts(n_calls: int, spacing_s: float) -> Trace:
    """Requests sharing nothing, each long finished before the next arrives."""
    calls = tuple(
        TraceCall(
            index=i,
            session="",
            group=f"g{i}",
            timestamp_s=i * spacing_s,
            input_tokens=4096,
            output_tokens=8,
            block_ids=tuple(range(i * 1000, i * 1000 + 8)),
        )
        for i in range(n_calls)
    )
    return Trace("cold starts", "mooncake", 512, calls, closed_loop=False)


@pytest.mark.parametrize("spec", ["round_robin", "least_loaded", "elastic"])
def test_one_cold_start_at_a_time_scores_zero_where_hpmr_reads_n(spec: str) -> None:
    trace = _cold_starts(40, spacing_s=5.0)
    cfg = ReplayConfig(ClusterConfig(n_instances=8), seed=0, check_integrity=True)
    result = run_replay(prepare(trace), spec, cfg)
    row = summarize(result, trace, cfg)
    assert row["completed"] == row["offered"] > 0
    # Whenever prefill is pending, one instance holds all of it: the old figure reads N.
    assert row["hotspot_pmr"] == pytest.approx(8.0)
    # No request ever waited: nothing was avoidable.
    assert row["hotspot_index"] == 0.0


def test_the_window_opens_at_the_warm_up_cut() -> None:
    trace = _cold_starts(11, spacing_s=10.0)  # 100 s of arrivals
    cfg = ReplayConfig(ClusterConfig(n_instances=2), load=2.0, warmup_fraction=0.1)
    assert measured_from(trace, cfg, {}) == pytest.approx(0.1 * 100.0 / 2.0)
    closed = ReplayConfig(ClusterConfig(n_instances=2), closed_loop=True, warmup_fraction=0.2)
    assert measured_from(trace, closed, {"a": 0.0, "b": 40.0}) == pytest.approx(8.0)
