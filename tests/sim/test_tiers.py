"""The node KV pool in the engine model: write-back on eviction, LRU, loads instead of
recomputes, sharing within a node only, the index's CPU-tier holdings, and the replay flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsched.core.cluster import ClusterConfig
from kvsched.core.decision import TransferKind, TransferPlan
from kvsched.core.events import BlocksRemoved, BlocksStored
from kvsched.core.index import Tier
from kvsched.core.latency import load_latency
from kvsched.core.scheduler import Scheduler
from kvsched.sim.cli import main
from kvsched.sim.compare import Comparison, replay_config
from kvsched.sim.engine import Engine
from kvsched.sim.engine_state import EngineSpec
from kvsched.sim.jobs import Job, JobKind
from kvsched.sim.prepare import prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import Replay
from kvsched.sim.summary import summarize
from kvsched.sim.tiers import NodeTier, TierConfig, TierSize, build_tiers
from kvsched.sim.traces import transform
from tests.conftest import SLICES
from tools.tier_sweep import main as sweep_main

LAT = load_latency()
BS = 16
KV_BYTES = 131_072  # Llama-3.1-8B's KV bytes per token


def chain(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 1000 + i for i in range(n))


def tiers(
    node_of: tuple[int, ...], chains: list[tuple[int, ...]], dram_tokens: int
) -> list[NodeTier | None]:
    config = TierConfig(dram=TierSize(tokens=dram_tokens))
    return build_tiers(
        config,
        node_of,
        gpu_pages=100,
        block_size=BS,
        kv_bytes_per_token=KV_BYTES,
        layers=32,
        chains=chains,
    )


def test_an_evicted_block_is_written_back_with_its_ancestors_and_announced_as_cpu() -> None:
    a = chain(1, 4)
    (tier,) = tiers((0,), [a], dram_tokens=10 * BS)
    assert tier is not None
    tier.evicted(0, [a[3]], now=1.0)  # the GPU evicts the leaf; the rest is still on it
    assert tier.match(a, 4) == 4  # the tier holds the chain from the root
    events = tier.drain_events()
    assert events == [BlocksStored(a, None, Tier.CPU)]
    tier.evicted(0, [a[2]], now=2.0)  # the parent follows: already there, nothing to copy
    assert tier.drain_events() == []
    assert tier.stats()["dram_written_blocks"] == 4


def test_dram_evicts_the_least_recently_used_chain_first() -> None:
    a, b, c = chain(1, 2), chain(2, 2), chain(3, 2)
    (tier,) = tiers((0,), [a, b, c], dram_tokens=4 * BS)
    assert tier is not None
    tier.evicted(0, [a[1]], now=1.0)
    tier.evicted(0, [b[1]], now=2.0)
    tier.drain_events()
    tier.load(0, a, 0, 2, now=3.0)  # a is used again: b is now the oldest
    tier.evicted(0, [c[1]], now=4.0)
    assert tier.match(a, 2) == 2 and tier.match(c, 2) == 2 and tier.match(b, 2) == 0
    removed = [e for e in tier.drain_events() if isinstance(e, BlocksRemoved)]
    assert [h for e in removed for h in e.hashes] == [b[1], b[0]]  # leaf first
    assert all(e.tier is Tier.CPU for e in removed)


def test_dram_evicts_to_the_ssd_when_there_is_one() -> None:
    a, b = chain(1, 2), chain(2, 2)
    config = TierConfig(dram=TierSize(tokens=2 * BS), ssd=TierSize(tokens=8 * BS))
    (tier,) = build_tiers(
        config, (0,), gpu_pages=100, block_size=BS, kv_bytes_per_token=KV_BYTES, layers=32,
        chains=[a, b],
    )  # fmt: skip
    assert tier is not None and tier.ssd is not None
    tier.evicted(0, [a[1]], now=1.0)
    tier.evicted(0, [b[1]], now=2.0)  # DRAM has room for one chain: a goes down to the SSD
    assert tier.dram.store.match(a, 2) == 0 and tier.ssd.store.match(a, 2) == 2
    assert tier.match(a, 2) == 2
    media = {e.tier for e in tier.drain_events()}
    assert media == {Tier.CPU, Tier.DISK}
    ssd_load = tier.load(0, a, 0, 2, now=10.0)
    dram_load = tier.load(0, b, 0, 2, now=20.0)
    assert ssd_load.done_at - 10.0 > dram_load.done_at - 20.0  # the SSD is the slower path


def test_the_tier_is_shared_by_a_nodes_instances_and_not_by_another_node() -> None:
    a = chain(1, 3)
    node_tiers = tiers((0, 0, 1), [a], dram_tokens=10 * BS)
    assert node_tiers[0] is node_tiers[1] is not node_tiers[2]
    first, _, other = node_tiers
    assert first is not None and other is not None
    assert first.slots == (0, 1) and other.slots == (2,)
    first.evicted(0, [a[2]], now=1.0)
    assert first.match(a, 3) == 3  # instance 1 finds what instance 0 wrote back
    assert other.match(a, 3) == 0


def _run_alone(eng: Engine, job: Job, now: float) -> float:
    """Run `job` alone on `eng` from `now` until its first token; returns that time."""
    eng.submit(job)
    end = eng.plan(now)
    for _ in range(1000):
        assert end is not None
        out = eng.complete(end)
        eng.check_integrity()
        if job in out.first_tokens:
            return end
        end = eng.plan(end)
    raise AssertionError("no first token")


@pytest.mark.parametrize("with_tier", [True, False])
def test_a_prefix_evicted_to_dram_is_loaded_not_recomputed(with_tier: bool) -> None:
    # A GPU of 40 pages: the second prompt pushes the first one's blocks out.
    a, b = chain(1, 32), chain(2, 32)
    tier = tiers((0,), [a, b], dram_tokens=64 * BS)[0] if with_tier else None
    eng = Engine(0, EngineSpec(BS, 40, 2048, 8, layers=32), LAT, tier=tier)
    t = _run_alone(eng, Job(0, JobKind.FULL, 32 * BS, 1, a, 0.0), 0.0)
    t = _run_alone(eng, Job(1, JobKind.FULL, 32 * BS, 1, b, t), t)
    removed = [e for e in eng.cache.drain_events() if isinstance(e, BlocksRemoved)]
    assert removed and eng.cache.match(a, 32) < 32  # a's blocks left the GPU
    if tier is not None:  # what the replay's feedback does with the GPU's evictions
        for e in removed:
            tier.evicted(0, e.hashes, t)
        assert tier.match(a, 31) == 31
    gpu_hit = eng.cache.match(a, 32)
    again = Job(2, JobKind.FULL, 32 * BS + 5, 1, a, t + 1.0)
    ttft = _run_alone(eng, again, t + 1.0) - (t + 1.0)
    recompute = LAT.prefill_scalar(32 * BS + 5 - gpu_hit * BS, gpu_hit * BS, 2048)
    if with_tier:
        assert again.tier_hit_tokens == (32 - gpu_hit) * BS
        assert again.cached_tokens == 32 * BS  # the loaded tokens count as cached
        assert ttft < 0.5 * recompute
    else:
        assert again.tier_hit_tokens == 0 and again.cached_tokens == gpu_hit * BS
        assert ttft == pytest.approx(recompute, rel=0.05)


def _replay(tier: TierConfig, spec: str = "cache_aware", n_instances: int = 4) -> Replay:
    # Half the instances of the setup on the bundled head of the conversation trace:
    # capacity-bound, so the GPUs evict, and so does DRAM at 1x.
    trace = transform.load(SLICES / "mooncake_conversation_head.jsonl")
    cluster = ClusterConfig(n_instances=n_instances)
    config = ReplayConfig(cluster, seed=1, check_integrity=True, tier=tier)
    return Replay(prepare(trace, seed=1), spec, config)


def test_the_index_sees_cpu_tier_holdings_appear_and_leave() -> None:
    config = TierConfig(dram=TierSize(factor=1.0))
    replay = _replay(config)
    applied: list[tuple[int, Tier, str]] = []
    apply = replay.scheduler.apply

    def spy(slot: int, events: object) -> None:
        for e in events:  # type: ignore[attr-defined]
            if isinstance(e, BlocksStored | BlocksRemoved) and e.tier is Tier.CPU:
                applied.append((slot, e.tier, type(e).__name__))
        apply(slot, events)  # type: ignore[arg-type]

    replay.scheduler.apply = spy  # type: ignore[method-assign]
    result = replay.run()
    index = result.cluster.index
    index.check_integrity()
    assert {kind for _, _, kind in applied} == {"BlocksStored", "BlocksRemoved"}
    assert {slot for slot, _, _ in applied} == {0, 1, 2, 3}
    for tier in replay.tiers:  # the index holds, for every instance, what its node's DRAM holds
        assert tier.stats()["dram_evicted_blocks"] > 0
        for slot in tier.slots:
            assert index.reported_count(slot, Tier.CPU) == len(tier.dram.store)
    row = summarize(result, replay.prepared.trace, replay.config)
    assert row["apc_load"] > 0
    assert row["apc"] == pytest.approx(row["apc_local"] + row["apc_transfer"] + row["apc_load"])
    for engine in result.engines:
        assert engine.cache.locked == 0


def test_the_tier_raises_apc_and_lowers_ttft_on_a_capacity_bound_replay() -> None:
    off = _replay(TierConfig())
    on = _replay(TierConfig(dram=TierSize(factor=4.0)))
    row_off = summarize(off.run(), off.prepared.trace, off.config)
    row_on = summarize(on.run(), on.prepared.trace, on.config)
    assert "apc_load" not in row_off and "tiers" not in row_off
    assert row_on["apc"] > row_off["apc"] + 0.05
    assert row_on["ttft_mean"] < row_off["ttft_mean"]


def test_tier_sizes_parse_and_refuse_nonsense() -> None:
    assert TierSize.parse("4") == TierSize(factor=4.0) == TierSize.parse("4x")
    assert TierSize.parse("2000000t") == TierSize(tokens=2_000_000)
    assert not TierSize.parse("0").on
    for bad in ("four", "-1", "12q", "t"):
        with pytest.raises(ValueError, match="tier size"):
            TierSize.parse(bad)
    with pytest.raises(ValueError, match="SSD tier needs a DRAM tier"):
        TierConfig(ssd=TierSize(factor=1.0))
    with pytest.raises(ValueError, match="bandwidths must be positive"):
        TierConfig(pcie_bandwidth=0.0)


def test_replay_flags_are_recorded_in_the_report(tmp_path: Path) -> None:
    args = ["--trace", str(SLICES / "mooncake_conversation_head.jsonl"), "--max-requests", "120"]
    args += ["--policies", "cache_aware", "--instances", "4", "--no-figures", "--quiet"]
    tier_args = ["--dram-tier", "2x", "--dram-bandwidth", "25", "--ssd-tier", "1000000t"]
    tier_args += ["--ssd-bandwidth", "3.5", "--instances-per-node", "2"]
    assert main(["replay", *args, *tier_args, "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "report.json").read_text())["config"]
    assert config["tier"] == {
        "dram": "2x",
        "ssd": "1000000t",
        "pcie_bandwidth_gb_per_s": 25.0,
        "pcie_latency_us": pytest.approx(20.0),
        "ssd_bandwidth_gb_per_s": 3.5,
        "ssd_latency_us": pytest.approx(100.0),
    }
    assert config["topology"]["instances_per_node"] == 2
    row = json.loads((tmp_path / "report.json").read_text())["policies"]["cache_aware"]
    assert "apc_load" in row and row["tiers"]["dram_written_blocks"] >= 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dram-tier", "lots"], "tier size"),
        (["--ssd-tier", "1"], "SSD tier needs a DRAM tier"),
        (["--dram-tier", "1", "--dram-bandwidth", "0"], "bandwidths must be positive"),
        (["--instances-per-node", "0"], "fan-outs must be positive"),
    ],
)
def test_bad_tier_flags_exit_with_a_clear_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(SLICES / "mooncake_conversation_head.jsonl")
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--trace", trace, "--max-requests", "10", "--quiet", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_with_the_tier_off_no_engine_loads_and_the_index_has_no_cpu_tier() -> None:
    # Decisions with the tier off are pinned by test_decision_digests.py; this checks the
    # capacity-bound configuration above, where the tier would change everything.
    replay = _replay(TierConfig())
    result = replay.run()
    assert all(e.tier is None for e in result.engines) and not replay.tiers
    assert result.tiers is None
    assert all(r.tier_hit == 0 for r in result.reqs)
    assert all(result.cluster.index.reported_count(s, Tier.CPU) == 0 for s in range(4))


def test_a_load_behind_a_busy_link_waits_for_its_first_layer_instead_of_stalling_the_pass() -> None:
    a, b = chain(1, 32), chain(2, 32)
    tier = tiers((0,), [a, b], dram_tokens=128 * BS)[0]
    assert tier is not None
    eng = Engine(0, EngineSpec(BS, 40, 2048, 8, layers=32), LAT, tier=tier)
    tier.evicted(0, [a[-1]], now=0.0)  # a is in DRAM
    tier.evicted(0, [b[-1]], now=1.0)  # b's write-back occupies the link from t=1
    job = Job(0, JobKind.FULL, 32 * BS + 5, 1, a, 1.0)
    eng.submit(job)
    assert eng.plan(1.0) is None  # nothing else to run: the engine idles meanwhile
    (wake,) = eng.take_wakes()
    assert wake == job.ready_at > 1.0 and eng.take_wakes() == []
    assert job.fetched == 32 and job.tier_hit_tokens == 32 * BS
    end = eng.plan(wake)
    assert end is not None and end >= job.kv_done_at
    assert eng.complete(end).first_tokens == [job]
    assert job.cached_tokens == 32 * BS
    eng.check_integrity()


def test_the_tier_sweep_tool_writes_its_table_json_and_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(SLICES / "mooncake_conversation_head.jsonl")
    args = ["--trace", trace, "--policies", "cache_aware", "--instances", "4"]
    assert sweep_main([*args, "--sizes", "0,2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert list(result) == ["0", "2"]
    assert result["2"]["tier"]["dram"] == "2x"
    apc = [result[s]["policies"]["cache_aware"]["apc"] for s in ("0", "2")]
    assert apc[1] > apc[0]
    assert (tmp_path / "tier_sweep.png").stat().st_size > 0
    assert "| 2× | cache_aware |" in (tmp_path / "sweep.md").read_text()
    with pytest.raises(SystemExit) as exc:
        sweep_main([*args, "--sizes", "-1", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--sizes" in capsys.readouterr().err


def test_the_policies_price_a_pool_load_at_the_tiers_host_link() -> None:
    trace = transform.load(SLICES / "mooncake_conversation_head.jsonl", max_requests=10)
    tier = TierConfig(dram=TierSize(factor=1.0), pcie_bandwidth=25e9, pcie_latency_s=5e-5)
    cluster = replay_config(Comparison(trace, "t.jsonl", ("cache_aware",), 4, tier=tier)).cluster
    assert cluster.pool_link == tier.pool_link()
    assert (cluster.pool_link.bandwidth_bytes_per_s, cluster.pool_link.setup_s) == (25e9, 5e-5)


def _fetch(replay: Replay, source: int, target: int, hashes: tuple[int, ...]) -> TransferPlan:
    """A prefix copy of `hashes` from `source` to `target`, opened with the replay's scheduler
    as a policy's would be."""
    core = replay.scheduler
    assert isinstance(core, Scheduler)
    plan = TransferPlan(TransferKind.FETCH_PREFIX, source, target, hashes, 0, 0, 0, 0.0, False)
    return core.transfers.open(plan)


def test_a_copy_to_another_node_reads_what_the_source_gpu_evicted_from_its_node_pool() -> None:
    """Mooncake Store reads a node's DRAM: a prefix the source's GPU evicted to its node's
    pool still moves to an instance on another node, and is not read again for one on the
    source's own node (which loads it from the shared pool itself)."""
    replay = _replay(TierConfig(dram=TierSize(factor=4.0)), n_instances=8)  # 2 nodes of 4
    node_of = replay.cluster.cost.topology.node_of
    far = next(slot for slot in range(8) if node_of[slot] != node_of[0])
    near = next(slot for slot in range(1, 8) if node_of[slot] == node_of[0])
    hashes = next(h for h in replay.prepared.hashes if len(h) >= 8)[:8]
    source = replay.engines[0]
    assert source.tier is not None and source.cache.match(hashes, 8) == 0
    source.tier.evicted(0, [hashes[-1]], now=0.0)  # written back, ancestors and all
    assert source.tier.match(hashes, 8) == 8

    moved_before = replay.transfers.stats["fetch_prefix"][1]
    assert replay.transfers.start(_fetch(replay, 0, far, hashes), None)
    moved = replay.transfers.stats["fetch_prefix"][1] - moved_before
    assert moved == 8 * replay.cluster.block_size * replay.cluster.cost.kv_bytes_per_token
    assert replay.transfers.start(_fetch(replay, 0, near, hashes), None)
    assert replay.transfers.stats["fetch_prefix"][1] - moved_before == moved  # nothing more
    assert replay.engines[near].cache.match(hashes, 8) == 0
