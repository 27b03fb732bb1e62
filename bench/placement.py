"""Placement-decision time in process: 64 instances, 1M indexed blocks, 32K-token prompts.

Builds a cluster whose index holds 1,000,000 blocks (16-token blocks: 4,096-token chains spread
over the instances, a shared 2K-token system prefix held by a few of them), then times
`recording.place()` — index lookup, scoring every instance, and recording the decision (load
charge and speculative index entries) — for 32,768-token prompts that share a random part of an
existing chain. The baseline measured in the same run is one bare `PrefixIndex.match` of the
same prompts (the index walk every cache-aware policy pays), so each policy's cost is also
printed as a ratio to it.

    .venv/bin/python -m bench.placement [--decisions 400]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import percentile
from kvsched.core import recording
from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.decision import RequestInfo
from kvsched.core.load import LoadReport
from kvsched.core.policies import Policy, make_policy

N, BLOCK, PROMPT, TOTAL_BLOCKS = 64, 16, 32_768, 1_000_000
GOAL_MS = 0.2
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


def build(spec: str, rng: random.Random) -> tuple[ClusterState, Policy, list[list[int]]]:
    cluster = build_cluster(ClusterConfig(n_instances=N, block_size=BLOCK, speculative_ttl_s=1.0))
    system = [rng.getrandbits(64) for _ in range(128)]
    chains: list[list[int]] = []
    stored = 0
    while stored < TOTAL_BLOCKS:
        body = [rng.getrandbits(64) for _ in range(256 - 128)]
        chain = system + body if rng.random() < 0.5 else [rng.getrandbits(64) for _ in range(256)]
        slot = rng.randrange(N)
        cluster.index.store(slot, chain, None)
        chains.append(chain)
        stored += len(chain)
    for slot in range(N):
        report = LoadReport(rng.randrange(0, 20_000), rng.random(), 2, 8, 40_000, 20_000)
        cluster.load.report(slot, report)
    return cluster, make_policy(spec, cluster), chains


def requests(chains: list[list[int]], count: int, rng: random.Random) -> list[RequestInfo]:
    out = []
    for i in range(count):
        shared = rng.choice(chains)[: rng.randrange(1, 257)]
        tail = [rng.getrandbits(64) for _ in range(PROMPT // BLOCK - len(shared))]
        out.append(RequestInfo(i, PROMPT + 7, 256, tuple(shared + tail), f"s{i % 50}"))
    return out


def line(times: list[float], name: str, baseline: float) -> None:
    p50, p99 = percentile(times, 50), percentile(times, 99)
    print(f"{name:<22} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {p50 / baseline:>8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"{N} instances, {TOTAL_BLOCKS:,} indexed blocks, {PROMPT:,}-token prompts")
    baseline = None
    print(f"{'policy':<22} {'p50 ms':>8} {'p99 ms':>8} {'vs match':>9}")
    for spec in POLICIES:
        rng = random.Random(args.seed)
        cluster, policy, chains = build(spec, rng)
        reqs = requests(chains, args.decisions, rng)
        if baseline is None:
            times = []
            for req in reqs:
                t = time.perf_counter()
                cluster.index.match(req.block_hashes)
                times.append(time.perf_counter() - t)
            baseline = percentile(times, 50)
            line(times, "index.match (baseline)", baseline)
        times = []
        play = random.Random(args.seed + 1)
        for i, req in enumerate(reqs):
            now = i * 0.01  # 100 decisions a second: speculative entries live 1 s
            t = time.perf_counter()
            recording.place(cluster, policy, req, now, play)
            times.append(time.perf_counter() - t)
        line(times, spec, baseline)
    print(f"goal: p50 <= {GOAL_MS} ms per decision")
    print("reproduce: .venv/bin/python -m bench.placement")


if __name__ == "__main__":
    main()
