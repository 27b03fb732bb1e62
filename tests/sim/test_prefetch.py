"""Idle-gap prefetch in the engine model: a session's KV evicted to its node's DRAM during a
long gap is loaded back into its host's GPU before its next turn, which then starts as a GPU
hit would; without prefetch (`elastic`'s default; `elastic:prefetch=1` switches it on) that
turn loads it on its critical path."""

from __future__ import annotations

import pytest

from kvsched.core.cluster import ClusterConfig
from kvsched.sim.clock import PREFETCH_DUE, WAKE, EventQueue
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig, ReplayResult
from kvsched.sim.replay import Replay
from kvsched.sim.tiers import TierConfig, TierSize
from kvsched.sim.traces.model import Trace, TraceCall
from tests.conftest import SLICES
from tools.prefetch_eval import main as prefetch_eval

BT = 16
GAP_S = 60.0
TURNS = 5
# A long context growing by one block a turn: its load (about 40 ms over PCIe) outlasts the
# prefill of the new block it overlaps, so loading it on the path delays the first token.
BASE_BLOCKS, GROWTH_BLOCKS = 1024, 1
GPU_PAGES = 1500
FILLER_BLOCKS = 1200  # one filler prompt pushes the session out of the GPU


def _trace() -> Trace:
    """Session `a`: a turn every minute, its prompt growing by a block each turn; during each
    gap, 20 s after the turn, a one-turn session with a fresh prompt that needs the GPU."""
    calls: list[TraceCall] = []
    fresh = 10_000_000
    for k in range(TURNS):
        blocks = BASE_BLOCKS + GROWTH_BLOCKS * k
        t = GAP_S * k
        calls.append(
            TraceCall(len(calls), "a", "a", t, blocks * BT, 8, tuple(range(blocks)), turn=k + 1)
        )
        ids = tuple(range(fresh + k * FILLER_BLOCKS, fresh + (k + 1) * FILLER_BLOCKS))
        calls.append(TraceCall(len(calls), f"f{k}", f"f{k}", t + 20.0, FILLER_BLOCKS * BT, 8, ids))
    return Trace("prefetch", "synthetic", BT, tuple(calls), closed_loop=False)


def _run(spec: str, *, gpu_pages: int, dram: bool = True) -> tuple[Replay, ReplayResult]:
    cluster = ClusterConfig(n_instances=1, kv_capacity_tokens=gpu_pages * BT)
    tier = TierConfig(dram=TierSize(factor=8.0)) if dram else TierConfig()
    config = ReplayConfig(cluster, seed=1, check_integrity=True, tier=tier)
    replay = Replay(prepare(_trace(), seed=1), spec, config)
    return replay, replay.run()


def _turns(result: ReplayResult) -> list[tuple[float, int, int]]:
    """(TTFT, GPU-hit tokens, loaded tokens) of session `a`'s turns, in order."""
    return [
        (r.first_token_at - r.arrival, r.local_hit, r.tier_hit)
        for r in result.reqs
        if r.call % 2 == 0
    ]


def test_a_session_evicted_to_dram_is_prefetched_before_its_next_turn() -> None:
    on_replay, on = _run("elastic:prefetch=1", gpu_pages=GPU_PAGES)
    _, off = _run("elastic:prefetch=0", gpu_pages=GPU_PAGES)
    # A GPU that never evicts: every turn a GPU hit.
    _, roomy = _run("elastic:prefetch=0", gpu_pages=10 * GPU_PAGES)
    with_prefetch, without, gpu_hits = _turns(on), _turns(off), _turns(roomy)
    assert on_replay.transfers.prefetches["loaded"] >= 1
    assert on.transfers["prefetch"][0] >= 1 and "prefetch" not in {
        k for k, v in off.transfers.items() if v[0]
    }
    # Turns 4 and 5 follow two observed gaps: prefetched, they find their context on the GPU.
    for k in (3, 4):
        previous = (BASE_BLOCKS + GROWTH_BLOCKS * (k - 1)) * BT
        ttft_on, gpu_on, loaded_on = with_prefetch[k]
        ttft_off, gpu_off, loaded_off = without[k]
        assert loaded_off > 0 and gpu_off < previous  # without: evicted, loaded on the path
        assert loaded_on == 0 and gpu_on == previous  # with: already back on the GPU
        assert ttft_on < ttft_off
        assert ttft_on == pytest.approx(gpu_hits[k][0], rel=1e-3)
    # The run ends with its last call: checks planned after the last turns are dropped.
    for result in (on, off):
        assert result.end_time == max(r.finished_at for r in result.reqs)
    # Before two gaps are seen nothing is planned: turn 3 loads either way.
    assert with_prefetch[2][2] > 0 and with_prefetch[2][0] == pytest.approx(without[2][0])


def test_without_a_dram_tier_elastic_plans_no_prefetch() -> None:
    replay, result = _run("elastic:prefetch=1", gpu_pages=GPU_PAGES, dram=False)
    assert not result.transfers["prefetch"][0]
    assert replay.transfers.prefetches == {"loaded": 0, "not_needed": 0, "skipped": 0, "no_pool": 0}


def test_the_clock_drops_the_pending_events_of_one_kind_and_keeps_the_rest_in_order() -> None:
    clock = EventQueue()
    for t, kind in ((3.0, WAKE), (1.0, PREFETCH_DUE), (2.0, WAKE), (2.0, PREFETCH_DUE)):
        clock.push(t, kind, t)
    assert clock.discard(PREFETCH_DUE) == 2 and clock.discard(PREFETCH_DUE) == 0
    seen: list[float] = []
    handlers = [seen.append] * 5
    clock.run(handlers)
    assert clock.handled == 2
    assert seen == [2.0, 3.0] and clock.now == 3.0


def test_the_prefetch_eval_tool_prints_one_row_per_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--long-gap", "5", "replay", "--trace", str(SLICES / "weka_cc_agentic_sample.jsonl.xz"),
        "--max-requests", "200", "--instances", "2", "--dram-tier", "4", "--kv-capacity",
        "140000", "--policies", "elastic:prefetch=1,elastic", "--quiet",
    ]  # fmt: skip
    assert prefetch_eval(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| elastic")]
    assert [row.split(" | ")[0] for row in rows] == ["| elastic:prefetch=1", "| elastic"]
    assert rows[1].endswith("| 0 / 0 / 0 |")  # prefetch off: no checks
    with pytest.raises(SystemExit):
        prefetch_eval(["replay", "--trace", "no-such-trace.jsonl", "--policies", "elastic"])
