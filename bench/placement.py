"""Placement-decision time in process: 64 instances, 1M indexed blocks, 32K-token prompts.

Builds a cluster whose index holds 1,000,000 blocks (16-token blocks: 4,096-token chains spread
over the instances, half of them under a shared 2K-token system prefix; drawn by
bench.prefix_workload, as bench.grpc_placement and bench.index_scale draw them), then times
`recording.place()` — index lookup, scoring every instance, and recording the decision (load
charge and speculative index entries) — for 32,768-token prompts that share a random part of an
existing chain. Every measurement runs twice in the same run, on the same cluster and
prompts: with the pure-Python block store (`--pure` only: just that one) and with the compiled
one (`kvsched.core.holdings`), and the compiled time is printed as a ratio to the pure one.
The first row is one bare `PrefixIndex.match` of the same prompts (the index walk every
cache-aware policy pays); the rest are whole decisions.

    .venv/bin/python -m bench.placement [--decisions 400] [--policies elastic,...] [--pure]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import percentile
from bench.prefix_workload import draw_chains, draw_loads, draw_prompt
from kvsched.core import recording
from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.decision import RequestInfo
from kvsched.core.index import PrefixIndex
from kvsched.core.policies import Policy, make_policy

N, BLOCK, PROMPT, TOTAL_BLOCKS = 64, 16, 32_768, 1_000_000
GOAL_MS = 0.03  # issue 16's goal for elastic
POLICIES = (
    "least_loaded",
    "cache_aware",
    "kv_cost",
    "lmetric",
    "mooncake:colocated=1",
    "sticky",
    "ear",
    "elastic",
)


def build(
    spec: str, rng: random.Random, pure: bool
) -> tuple[ClusterState, Policy, list[list[int]]]:
    cluster = build_cluster(ClusterConfig(n_instances=N, block_size=BLOCK, speculative_ttl_s=1.0))
    cluster.index = PrefixIndex(N, pure=pure)
    chains: list[list[int]] = []
    for slot, chain in draw_chains(rng, TOTAL_BLOCKS, N):
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


def timed_decisions(
    cluster: ClusterState, policy: Policy, reqs: list[RequestInfo], seed: int
) -> list[float]:
    times = []
    play = random.Random(seed + 1)
    for i, req in enumerate(reqs):
        now = i * 0.01  # 100 decisions a second: speculative entries live 1 s
        t = time.perf_counter()
        recording.place(cluster, policy, req, now, play)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--pure", action="store_true", help="the pure-Python index only")
    args = parser.parse_args()
    impls = (True,) if args.pure else (True, False)
    print(f"{N} instances, {TOTAL_BLOCKS:,} indexed blocks, {PROMPT:,}-token prompts")
    print("p50 ms per call; compiled vs pure: the pure p50 over the compiled p50")
    head = f"{'measure':<22} {'pure p50':>9} {'p99':>8}"
    if not args.pure:
        head += f" {'compiled':>9} {'p99':>8} {'speedup':>8}"
    print(head)
    first = True
    for spec in args.policies.split(","):
        rows: list[list[float]] = []
        match_rows: list[list[float]] = []
        for pure in impls:
            rng = random.Random(args.seed)
            cluster, policy, chains = build(spec, rng, pure)
            reqs = requests(chains, args.decisions, rng)
            if first:
                match_rows.append(timed_match(cluster, reqs))
            rows.append(timed_decisions(cluster, policy, reqs, args.seed))
        if first:
            _line("index.match", match_rows)
            first = False
        _line(spec, rows)
    print(f"goal: p50 <= {GOAL_MS} ms per elastic decision")
    print("reproduce: .venv/bin/python -m bench.placement")


def _line(name: str, rows: list[list[float]]) -> None:
    text = f"{name:<22} {p50(rows[0]):>9} {percentile(rows[0], 99) * 1e3:>8.3f}"
    if len(rows) > 1:
        speedup = percentile(rows[0], 50) / percentile(rows[1], 50)
        text += f" {p50(rows[1]):>9} {percentile(rows[1], 99) * 1e3:>8.3f} {speedup:>7.2f}x"
    print(text)


if __name__ == "__main__":
    main()
