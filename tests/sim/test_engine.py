"""The simulated engine: step times, chunking, macro-steps, memory, invariants."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.core.latency import load_latency
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from kvsched.sim.jobs import Job, JobKind

LAT = load_latency()
BS = 16


def engine(pages: int = 4000, chunk: int = 512, max_running: int = 64) -> Engine:
    return Engine(0, EngineSpec(BS, pages, chunk, max_running, layers=32), LAT)


def job(rid: int, prompt: int, output: int, hashes: tuple[int, ...] = (), at: float = 0.0) -> Job:
    return Job(
        rid,
        JobKind.FULL,
        prompt,
        output,
        hashes or tuple(rid * 10_000 + i for i in range(prompt // BS)),
        at,
    )


def drive(
    eng: Engine,
    arrivals: list[tuple[float, Job]],
    interrupts: list[float] | None = None,
    check: bool = True,
) -> list[Job]:
    """A tiny event loop: submit jobs at their times, step the engine, collect finished jobs."""
    pending = sorted(arrivals, key=lambda a: a[0])
    cuts = sorted(interrupts or [])
    done: list[Job] = []
    now, end = 0.0, None
    while pending or end is not None or eng.waiting or eng.running:
        next_arrival = pending[0][0] if pending else float("inf")
        next_cut = cuts[0] if cuts else float("inf")
        if end is None and next_arrival == float("inf"):
            raise AssertionError("engine stalled with work left")
        if end is not None and end <= min(next_arrival, next_cut):
            now = end
            out = eng.complete(now)
            done += out.finished
            if check:
                eng.check_integrity()
            end = eng.plan(now)
            continue
        if next_cut < next_arrival:
            now = cuts.pop(0)
            if end is not None:
                end = eng.interrupt(now) or end
            continue
        now, j = pending.pop(0)
        eng.submit(j)
        end = eng.plan(now) if end is None else (eng.interrupt(now) or end)
    return done


def test_isolated_prefill_takes_the_model_time_in_chunks() -> None:
    eng = engine(chunk=512)
    j = job(1, prompt=2000, output=1)
    drive(eng, [(0.0, j)])
    assert j.first_token_at == pytest.approx(LAT.prefill(2000.0, 0.0, 512), rel=1e-12)
    assert eng.passes == 4


def test_a_profiles_request_overhead_delays_admission_by_exactly_that() -> None:
    slow = dataclasses.replace(LAT, request_overhead_s=0.015)
    eng = Engine(0, EngineSpec(BS, 4000, 512, 64, layers=32), slow)
    j = job(1, prompt=2000, output=1)
    eng.submit(j)
    assert j.ready_at == 0.015
    assert eng.plan(0.0) is None  # in the server, not yet in the engine's queue
    end = eng.plan(0.015)
    while end is not None and j.first_token_at < 0:
        eng.complete(end)
        end = eng.plan(end)
    assert j.first_token_at == pytest.approx(0.015 + LAT.prefill(2000.0, 0.0, 512), rel=1e-12)


def test_a_turn_on_a_cached_prefix_pays_for_reading_it_once_per_pass() -> None:
    # vLLM's CPU build: a few new tokens on a long cached prefix cost more than the pairs say.
    reads = dataclasses.replace(LAT, prefill_ctx_s=1.36e-6)
    ttfts = []
    for latency in (LAT, reads):
        eng = Engine(0, EngineSpec(BS, 4000, 512, 64, layers=32), latency)
        first = job(1, prompt=1024, output=1)
        drive(eng, [(0.0, first)])
        turn = job(2, prompt=1124, output=1, hashes=(*first.hashes, 7, 8, 9, 10, 11, 12), at=1.0)
        drive(eng, [(1.0, turn)])
        assert turn.cached_tokens == 1024
        ttfts.append(turn.first_token_at - 1.0)
    assert ttfts[1] - ttfts[0] == pytest.approx(1.36e-6 * 1024, rel=1e-6)


def test_decode_runs_one_token_per_pass_as_one_macro_step() -> None:
    eng = engine()
    j = job(1, prompt=100, output=50)
    drive(eng, [(0.0, j)])
    ttft = LAT.prefill(100.0, 0.0, 512)
    assert j.first_token_at == pytest.approx(ttft)
    assert j.finished_at == pytest.approx(ttft + LAT.decode_steps(1, 101, 49))
    assert eng.passes == 1 + 49


@given(st.lists(st.floats(0.0, 2.0), max_size=12), st.integers(2, 5))
@settings(max_examples=60, deadline=None)
def test_interrupted_macro_steps_match_uninterrupted_ones(cuts: list[float], n: int) -> None:
    def run(interrupts: list[float]) -> list[float]:
        eng = engine()
        jobs = [job(i, prompt=64 + 16 * i, output=40 + 7 * i) for i in range(n)]
        drive(eng, [(0.0, j) for j in jobs], interrupts)
        return [j.finished_at for j in jobs]

    assert run(cuts) == pytest.approx(run([]), rel=1e-9, abs=1e-12)


def test_one_prompt_token_is_always_recomputed() -> None:
    eng = engine()
    first = job(1, prompt=64, output=2)  # exactly 4 blocks
    drive(eng, [(0.0, first)])
    again = job(2, prompt=64, output=2, hashes=first.hashes)
    drive(eng, [(1.0, again)])
    # Whole prompt cached, yet only 3 blocks count: the last block is recomputed for logits.
    assert again.cached_tokens == 48
    assert again.computed == 64


def test_prefill_budget_leaves_a_token_for_each_running_decode() -> None:
    eng = engine(chunk=256)
    decoders = [job(i, prompt=32, output=500) for i in range(10)]
    big = job(99, prompt=4000, output=2)
    passes: list[tuple[int, int]] = []
    plan = eng.plan

    def planned(now: float, max_passes: int | None = None) -> float | None:
        end = plan(now, max_passes)
        if eng.step is not None and eng.step.chunks:
            passes.append((sum(take for _, take in eng.step.chunks), eng.step.decode_seqs))
        return end

    eng.plan = planned  # type: ignore[method-assign]
    drive(eng, [(0.0, j) for j in decoders] + [(0.5, big)])
    assert passes and all(p + d <= 256 for p, d in passes)
    assert any(d == 10 and p == 246 for p, d in passes)  # 10 decode tokens reserved
    assert eng.mixed_passes > 0  # decodes kept running while the big prompt was chunked


def test_admission_waits_for_memory_and_runs_in_order() -> None:
    eng = engine(pages=40, chunk=4096)
    a = job(1, prompt=400, output=160)  # 25 + 10 pages
    b = job(2, prompt=300, output=16)  # 19 + 1 pages: does not fit until a finishes
    drive(eng, [(0.0, a), (0.0, b)])
    assert b.admitted_at >= a.finished_at
    assert eng.cache.free + eng.cache.evictable == 40


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_random_workload_keeps_invariants_and_ttft_above_isolated(seed: int) -> None:
    rng = random.Random(seed)
    eng = engine(pages=300, chunk=512, max_running=8)
    roots = [tuple(r * 1000 + i for i in range(40)) for r in range(3)]
    arrivals = []
    t = 0.0
    for i in range(25):
        t += rng.expovariate(20.0)
        root = rng.choice(roots)
        blocks = rng.randint(1, 39)
        prompt = blocks * BS + rng.randint(0, BS - 1)
        arrivals.append((t, job(i, prompt, rng.randint(1, 30), root[:blocks], t)))
    done = drive(eng, arrivals)
    assert len(done) == 25
    for _, j in arrivals:
        isolated = LAT.prefill_scalar(j.prompt - j.cached_tokens, j.cached_tokens, 512)
        assert j.first_token_at - j.arrival >= isolated - 1e-9
        assert j.finished_at >= j.first_token_at
        assert j.cached_tokens <= j.prompt - 1
    assert eng.cache.locked == 0


def test_capped_decode_steps_take_the_same_time_as_one_macro_step() -> None:
    # The live engine streams every few passes; the model time must not change with that.
    def run(max_passes: int | None) -> tuple[float, int]:
        eng = engine()
        j = job(1, prompt=100, output=50)
        eng.submit(j)
        now, steps = 0.0, 0
        end = eng.plan(now, max_passes)
        while end is not None:
            now = end
            eng.complete(now)
            steps += 1
            eng.check_integrity()
            end = eng.plan(now, max_passes)
        return j.finished_at, steps

    whole, whole_steps = run(None)
    capped, capped_steps = run(4)
    assert capped == pytest.approx(whole, rel=1e-9)
    assert (whole_steps, capped_steps) == (2, 1 + 13)  # prefill, then 49 passes by 4


@pytest.mark.parametrize("where", ["waiting", "prefilling", "decoding"])
def test_abort_frees_a_job_wherever_it_is(where: str) -> None:
    eng = engine(pages=64, chunk=64, max_running=1)
    first = job(1, prompt=96, output=40)  # two prefill passes of 64 tokens, then decodes
    second = job(2, prompt=32, output=4)
    eng.submit(first)
    eng.submit(second)  # waits: one running slot
    now = eng.plan(0.0)
    assert now is not None
    eng.complete(now)
    if where == "decoding":
        now = eng.plan(now)
        assert now is not None
        eng.complete(now)
        assert first in eng.decoding
    target = second if where == "waiting" else first
    assert (target in eng.waiting) == (where == "waiting")
    assert eng.abort(target, now)
    assert not eng.abort(target, now)  # gone already
    eng.check_integrity()
    if where != "waiting":
        assert eng.running == 0 and eng.cache.private == 0 and eng.cache.locked == 0
        assert eng.pending_tokens == second.prompt - second.computed  # only the other one
    else:
        assert list(eng.waiting) == [] and eng.pending_tokens == first.prompt - first.computed
    # The engine carries on with what is left.
    end = eng.plan(now)
    while end is not None:
        now = end
        eng.complete(now)
        eng.check_integrity()
        end = eng.plan(now)
    assert eng.running == 0 and not eng.waiting and eng.pending_tokens == 0
