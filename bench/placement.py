"""Placement-decision time in process: 64 instances, 1M indexed blocks, 32K-token prompts.

Builds a cluster whose index holds 1,000,000 blocks (16-token blocks: 4,096-token chains spread
over the instances, half of them under a shared 2K-token system prefix; drawn by
bench.prefix_workload, as bench.grpc_placement and bench.index_scale draw them), then times
`recording.place()` — index lookup, scoring every instance, and recording the decision (load
charge and speculative index entries) — for 32,768-token prompts that share a random part of an
existing chain. Every measurement runs in three builds of the same cluster, on the same
prompts, the three taking turns every 20 decisions (so the machine's other work weighs on
each alike; the builds' objects are frozen out of the garbage collector's passes): the
references (pure-Python block store and numpy scoring: `--pure` runs only these), the
compiled block store (`kvsched.core.holdings`) with numpy scoring, and both compiled
(`kvsched.core.scoring`). Printed: p50 and p99 of each, the compiled scoring's speed-up
(compiled index with numpy scoring over both compiled, p50) and the whole one (references
over both compiled). The first row is one bare `PrefixIndex.match` of the same prompts (the
index walk every cache-aware policy pays; no scoring); the rest are whole decisions, which
the three builds must make identically (the bench fails otherwise).

`--pooled` puts the DRAM tier in: every chain is also held in its holder's node pool (the CPU
tier of the node's four instances), and the holder's GPU memory keeps only its first half, so
most prompts have pool-only blocks whose load the TTFT-scoring policies price
(`cost.pool_load`); compare its rows with a run without it for what that pricing costs.

`--profile SPEC` then runs that policy's decisions once more, compiled, under cProfile and
prints where their time goes.

    .venv/bin/python -m bench.placement [--decisions 400] [--policies elastic,...] [--pure]
        [--pooled] [--profile elastic]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import time
from dataclasses import dataclass

from bench.common import percentile
from bench.prefix_workload import draw_chains, draw_loads, draw_prompt
from kvsched.core import recording
from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.decision import RequestInfo
from kvsched.core.index import PrefixIndex, Tier
from kvsched.core.policies import Policy, make_policy

N, BLOCK, PROMPT, TOTAL_BLOCKS = 64, 16, 32_768, 1_000_000
GOAL_MS = 0.03  # issue 16's goal for elastic
STRIDE = 20  # decisions a build makes before the next build takes its turn
POLICIES = (
    "least_loaded",
    "cache_aware",
    "dynamo",
    "sglang",
    "llmd",
    "lmetric",
    "mooncake:colocated=1",
    "sticky",
    "ear",
    "elastic",
)


def build(
    spec: str, rng: random.Random, build_: Build, pooled: bool = False
) -> tuple[ClusterState, Policy, list[list[int]]]:
    config = ClusterConfig(n_instances=N, block_size=BLOCK, speculative_ttl_s=1.0)
    cluster = build_cluster(config, pure=build_.pure_scoring)
    cluster.index = PrefixIndex(N, pure=build_.pure_index)
    node_of = cluster.cost.topology.node_of
    chains: list[list[int]] = []
    for slot, chain in draw_chains(rng, TOTAL_BLOCKS, N):
        if pooled:  # in the node's pool whole, half of it still in the holder's GPU memory
            for peer in (s for s in range(N) if node_of[s] == node_of[slot]):
                cluster.index.store(peer, chain, None, Tier.CPU)
            cluster.index.store(slot, chain[: len(chain) // 2], None)
        else:
            cluster.index.store(slot, chain, None)
        chains.append(chain)
    for slot, report in enumerate(draw_loads(rng, N)):
        cluster.load.report(slot, report)
    return cluster, make_policy(spec, cluster), chains


def requests(chains: list[list[int]], count: int, rng: random.Random) -> list[RequestInfo]:
    out = []
    for i in range(count):
        hashes = draw_prompt(rng, chains, PROMPT // BLOCK)
        out.append(RequestInfo(i, PROMPT + 7, 256, tuple(hashes), f"s{i % 50}"))
    return out


def p50(times: list[float]) -> str:
    return f"{percentile(times, 50) * 1e3:>8.4f}"


def timed_match(cluster: ClusterState, reqs: list[RequestInfo]) -> list[float]:
    times = []
    for req in reqs:
        t = time.perf_counter()
        cluster.index.match(req.block_hashes)
        times.append(time.perf_counter() - t)
    return times


@dataclass(frozen=True)
class Build:
    """One way to build and score: which block store and which scoring."""

    name: str
    pure_index: bool
    pure_scoring: bool


BUILDS = (
    Build("reference", pure_index=True, pure_scoring=True),
    Build("compiled index", pure_index=False, pure_scoring=True),
    Build("both compiled", pure_index=False, pure_scoring=False),
)


def timed_decisions(
    cluster: ClusterState, policy: Policy, reqs: list[RequestInfo], seed: int
) -> list[float]:
    """Each decision's time, on one cluster with its own scoring (bench.index_scale)."""
    times = []
    play = random.Random(seed + 1)
    for i, req in enumerate(reqs):
        now = i * 0.01  # 100 decisions a second: speculative entries live 1 s
        t = time.perf_counter()
        recording.place(cluster, policy, req, now, play)
        times.append(time.perf_counter() - t)
    return times


def interleaved_decisions(
    spec: str, builds: tuple[Build, ...], seed: int, count: int, pooled: bool = False
) -> Rows:
    """Each build's decision times for the same `count` prompts, interleaved; the first
    build's match times too. Every build must decide as the first did."""
    runs = []
    for build_ in builds:
        rng = random.Random(seed)
        cluster, policy, chains = build(spec, rng, build_, pooled)
        runs.append((build_, cluster, policy, random.Random(seed + 1)))
        reqs = requests(chains, count, rng)
    # What the builds hold lives to the end: keep the collector's full passes off it (they
    # would land on whichever build runs then, the reference's object graph being largest).
    gc.collect()
    gc.freeze()
    match = [timed_match(run[1], reqs) for run in runs]
    times: list[list[float]] = [[] for _ in runs]
    decided: list[list[tuple[int, str, str]]] = [[] for _ in runs]
    try:
        for start in range(0, len(reqs), STRIDE):
            for k, (_, cluster, policy, play) in enumerate(runs):
                for i in range(start, min(start + STRIDE, len(reqs))):
                    now = i * 0.01  # 100 decisions a second: speculative entries live 1 s
                    t = time.perf_counter()
                    decision = recording.place(cluster, policy, reqs[i], now, play)
                    times[k].append(time.perf_counter() - t)
                    ttft = repr(decision.estimated_ttft_s)
                    decided[k].append((decision.instance, decision.rule, ttft))
    finally:
        gc.unfreeze()
    if any(d != decided[0] for d in decided):
        raise AssertionError(f"{spec}: the builds decided differently")
    return Rows(match, times)


@dataclass(frozen=True)
class Rows:
    """Per build: the bare match's times and the whole decisions' times (seconds)."""

    match: list[list[float]]
    decisions: list[list[float]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--pure", action="store_true", help="the references only (pure index, numpy scoring)"
    )
    parser.add_argument(
        "--pooled", action="store_true", help="chains also in their node's pool (the DRAM tier)"
    )
    parser.add_argument("--profile", metavar="SPEC", help="profile this policy's decisions")
    args = parser.parse_args(argv)
    builds = BUILDS[:1] if args.pure else BUILDS
    tier = ", also in their node's pool (half in GPU memory)" if args.pooled else ""
    print(f"{N} instances, {TOTAL_BLOCKS:,} indexed blocks{tier}, {PROMPT:,}-token prompts")
    print("ms per call, p50 and p99, per build; scoring: compiled index with numpy scoring")
    print("over both compiled (p50); total: references over both compiled (p50)")
    head = f"{'measure':<22}" + "".join(f" {b.name:>16} {'p99':>7}" for b in builds)
    if len(builds) > 1:
        head += f" {'scoring':>8} {'total':>7}"
    print(head)
    first = True
    for spec in args.policies.split(","):
        rows = interleaved_decisions(spec, builds, args.seed, args.decisions, args.pooled)
        if first:
            _line("index.match", rows.match, scoring_ratio=False)
            first = False
        _line(spec, rows.decisions, scoring_ratio=True)
    print(f"goal: p50 <= {GOAL_MS} ms per elastic decision")
    print("reproduce: .venv/bin/python -m bench.placement" + (" --pooled" if args.pooled else ""))
    if args.profile:
        profile(args.profile, args.seed, args.decisions)


def profile(spec: str, seed: int, count: int) -> None:
    """Print where `spec`'s decisions spend their time, index and scoring compiled."""
    rng = random.Random(seed)
    cluster, policy, chains = build(spec, rng, BUILDS[-1])
    reqs = requests(chains, count, rng)
    profiler = cProfile.Profile()
    profiler.runcall(timed_decisions, cluster, policy, reqs, seed)
    print(f"profile of {spec} ({count} decisions, compiled), by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(16)


def _line(name: str, rows: list[list[float]], *, scoring_ratio: bool) -> None:
    p50s = [percentile(times, 50) for times in rows]
    text = f"{name:<22}" + "".join(
        f" {p50 * 1e3:>16.4f} {percentile(times, 99) * 1e3:>7.3f}"
        for p50, times in zip(p50s, rows, strict=True)
    )
    if len(rows) > 1:
        scoring_x = f"{p50s[1] / p50s[2]:.2f}x" if scoring_ratio else "-"
        text += f" {scoring_x:>8} {p50s[0] / p50s[-1]:>6.2f}x"
    print(text)


if __name__ == "__main__":
    main()
