"""Scale by simulation: placement decisions over 1,024 instances and a 10M-block index, against
the same decisions over 64 instances in the same run, and the largest cluster one Conductor
serves at the measured rates.

For each instance count (`--baseline-instances` 64 first, then `--instances` 1,024) loads
`--blocks` blocks (10M; `--blocks 100000000` for 100M: 3 GB, about 3 minutes) into one compiled
prefix index, drawn as bench.placement draws them (bench.prefix_workload: 256-block chains
each on one instance, half under a shared 128-block system prefix that every instance ends up
holding), and reports the process's resident memory after loading (this process holds what a
Conductor's core holds: the index, numpy, the policies) and its growth per block. Then, on
the same 32,768-token prompts (the first 1 to 256 blocks of an indexed chain, then new
blocks), times a bare `PrefixIndex.match` and, per policy, `recording.place()` (the index
walk, every instance scored, the decision recorded) on a fresh cluster state around the loaded
index, and prints p50 and p99 with the ratio of the large p50 to the baseline's. Last it times
the index's own upkeep, storing and removing blocks (the KV events every placement brings back):
bare `PrefixIndex.store` / `remove` per block, and a 2,048-block KV event from its wire bytes to
the index by the Conductor's path (packed hashes into the compiled store) against the path
before it (a Python int per hash), interleaved (bench.event_upkeep, `--event-rounds`). From
those it works out one Conductor's capacity: a decision's p50 plus its gRPC and Finish cost
(`--grpc-ms`, from bench.grpc_placement) plus the events storing and evicting the prompt's new
blocks, against how many such prompts an instance prefills a second (the cost model's H100
profile).

    .venv/bin/python -m bench.index_scale [--blocks 10000000] [--instances 1024]
        [--baseline-instances 64] [--decisions 400] [--policies elastic,...] [--grpc-ms 1.0]
        [--event-rounds 200] [--profile elastic]

`--profile SPEC` runs that policy's large-cluster decisions under cProfile once more and prints
the functions that took the most time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import math
import os
import pstats
import random
import time
from collections import Counter
from dataclasses import dataclass

from bench.common import percentile
from bench.event_upkeep import EVENT_BLOCKS, PATHS, EventTimes, timed_event_paths
from bench.placement import POLICIES, timed_decisions, timed_match
from bench.prefix_workload import (
    CHAIN,
    SYSTEM,
    SYSTEM_SHARE,
    draw_chains,
    draw_loads,
    draw_prompt,
)
from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.decision import RequestInfo
from kvsched.core.index import PrefixIndex
from kvsched.core.load import LoadReport
from kvsched.core.policies import make_policy

BLOCK, PROMPT = 16, 32_768
SAMPLE_CHAINS = 4096  # chains kept to draw prompts from (the rest are only indexed)
# bench.grpc_placement's figure in the README: about 1,000 decisions/s at best from one
# Conductor (4 streams x 16 in flight, each decision finished and followed by a load report)
# of which 0.10 ms is the decision itself.
GRPC_MS = 1.0


@dataclass(frozen=True, slots=True)
class Loaded:
    """An index loaded for one instance count, and what loading it cost."""

    index: PrefixIndex
    loads: list[LoadReport]
    sample: list[tuple[int, list[int]]]  # (holding slot, chain) of the first chains drawn
    blocks: int  # (block, holder) pairs stored
    store_s: float  # in index.store alone
    rss_before: int
    rss_after: int


@dataclass(frozen=True, slots=True)
class Capacity:
    """One Conductor's capacity at the measured costs (per placement, milliseconds)."""

    decision_ms: float
    grpc_ms: float
    upkeep_ms: float  # storing and later evicting the prompt's new blocks
    instance_rate: float  # such placements a second one instance prefills

    @property
    def conductor_rate(self) -> float:
        """Placements a second one Conductor process makes, one core busy."""
        return 1e3 / (self.decision_ms + self.grpc_ms + self.upkeep_ms)

    def instances_at(self, per_instance: float) -> int:
        """Instances one Conductor serves when each asks `per_instance` placements a second."""
        return int(self.conductor_rate / per_instance)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory() -> None:
    """Hand the memory of freed objects back to the system (glibc keeps freed heap pages)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load(n: int, blocks: int, seed: int) -> Loaded:
    """A compiled index of `blocks` blocks over `n` slots and a load report per slot."""
    rng = random.Random(seed)
    before = rss_bytes()
    index = PrefixIndex(n, pure=False)
    sample: list[tuple[int, list[int]]] = []
    store_s, pairs = 0.0, 0
    for slot, chain in draw_chains(rng, blocks, n):
        t = time.perf_counter()
        index.store(slot, chain, None)
        store_s += time.perf_counter() - t
        pairs += len(chain)
        if len(sample) < SAMPLE_CHAINS:
            sample.append((slot, chain))
    return Loaded(index, draw_loads(rng, n), sample, pairs, store_s, before, rss_bytes())


def cluster_around(loaded: Loaded) -> ClusterState:
    """A fresh cluster state (load, sessions) around the loaded index, its claims expired."""
    n = loaded.index.n_slots
    cluster = build_cluster(ClusterConfig(n_instances=n, block_size=BLOCK, speculative_ttl_s=1.0))
    loaded.index.expire(math.inf)  # a previous policy's speculative placements
    cluster.index = loaded.index
    for slot, report in enumerate(loaded.loads):
        cluster.load.report(slot, report)
    return cluster


def requests(loaded: Loaded, count: int, seed: int) -> list[RequestInfo]:
    """`count` prompts of PROMPT tokens continuing the sampled chains (the same prompts for
    every instance count: the sample is the first chains drawn, alike for any count)."""
    rng = random.Random(seed + 1)
    chains = [chain for _, chain in loaded.sample]
    return [
        RequestInfo(
            i, PROMPT + 7, 256, tuple(draw_prompt(rng, chains, PROMPT // BLOCK)), f"s{i % 50}"
        )
        for i in range(count)
    ]


@dataclass(frozen=True, slots=True)
class Eviction:
    """What removing blocks costs (microseconds)."""

    leaf_us: float  # a block whose parent has one child
    hot_unlink_us: float  # on top, once a chain: its first block leaves the system prefix's
    # last block, whose children are every chain under the system prefix


def evict(loaded: Loaded) -> Eviction:
    """The sampled chains' last CHAIN - SYSTEM blocks leave their instance, leaves first as
    engines evict; chains with and without the system prefix timed apart. Changes the index:
    run it last."""
    spent = {True: 0.0, False: 0.0}
    chains = {True: 0, False: 0}
    prefixes = Counter(tuple(chain[:SYSTEM]) for _, chain in loaded.sample)
    system = list(prefixes.most_common(1)[0][0]) if prefixes else []
    for slot, chain in loaded.sample:
        under = chain[:SYSTEM] == system
        body = chain[SYSTEM:]
        body.reverse()
        t = time.perf_counter()
        loaded.index.remove(slot, body)
        spent[under] += time.perf_counter() - t
        chains[under] += 1
    body_blocks = CHAIN - SYSTEM
    leaf = spent[False] / max(chains[False], 1) / body_blocks
    hot = spent[True] / max(chains[True], 1) - leaf * body_blocks
    return Eviction(leaf * 1e6, max(hot, 0.0) * 1e6)


def profile(cluster: ClusterState, spec: str, reqs: list[RequestInfo], seed: int) -> None:
    policy = make_policy(spec, cluster)
    profiler = cProfile.Profile()
    profiler.runcall(timed_decisions, cluster, policy, reqs, seed)
    print(f"profile of {spec} over {cluster.n} instances ({len(reqs)} decisions), by own time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


@dataclass(frozen=True, slots=True)
class Upkeep:
    """The index's upkeep over one instance count."""

    store_us: float  # bare `PrefixIndex.store`, a block
    eviction: Eviction
    events: EventTimes  # 2,048-block KV events from wire bytes, per path

    def event_ms(self, path: str) -> tuple[float, float]:
        """p50 ms of a stored and of a removed event by `path`."""
        return (
            percentile(self.events.stored[path], 50) * 1e3,
            percentile(self.events.removed[path], 50) * 1e3,
        )


def measure(
    n: int, args: argparse.Namespace, specs: list[str], times: dict[tuple[str, int], list[float]]
) -> Upkeep:
    """Load the index over `n` instances, print its memory row, add the match's and every
    policy's decision times to `times`; returns the upkeep. The index is freed on return,
    before the next size loads."""
    loaded = load(n, args.blocks, args.seed)
    grown = loaded.rss_after - loaded.rss_before
    print(
        f"{n:>9} {loaded.store_s:>7.1f} {loaded.rss_after / 1e6:>8.0f} {grown / 1e6:>9.0f} "
        f"{grown / len(loaded.index):>8.1f}",
        flush=True,
    )
    reqs = requests(loaded, args.decisions, args.seed)
    times["index.match", n] = timed_match(cluster_around(loaded), reqs)
    for spec in specs:
        cluster = cluster_around(loaded)
        times[spec, n] = timed_decisions(cluster, make_policy(spec, cluster), reqs, args.seed)
    if args.profile and n == args.instances:
        profile(cluster_around(loaded), args.profile, reqs, args.seed)
    events = timed_event_paths(loaded.index, loaded.sample, args.event_rounds, args.seed)
    return Upkeep(loaded.store_s / loaded.blocks * 1e6, evict(loaded), events)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=10_000_000)
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--baseline-instances", type=int, default=64)
    parser.add_argument("--decisions", type=int, default=400)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--grpc-ms", type=float, default=GRPC_MS)
    parser.add_argument("--event-rounds", type=int, default=200)
    parser.add_argument("--profile", metavar="SPEC", help="cProfile this policy's decisions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (
        args.blocks < CHAIN
        or args.decisions < 1
        or args.event_rounds < 1
        or min(args.instances, args.baseline_instances) < 2
    ):
        parser.error("needs a chain's worth of blocks, a decision, an event and two instances")
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    sizes = (args.baseline_instances, args.instances)
    print(f"{args.blocks:,} indexed blocks, {PROMPT:,}-token prompts, {args.decisions} decisions")
    print(f"{'instances':>9} {'store s':>7} {'RSS MB':>8} {'grown MB':>9} {'B/block':>8}")
    times: dict[tuple[str, int], list[float]] = {}
    upkeep: dict[int, Upkeep] = {}
    for n in sizes:
        upkeep[n] = measure(n, args, specs, times)
        release_freed_memory()  # so the next size's RSS growth is its own
    small, big = sizes
    print(f"ms per call; ratio: the p50 over {big:,} instances to the p50 over {small:,}")
    print(
        f"{'measure':<22} {f'{small} p50':>9} {'p99':>8} {f'{big} p50':>9} {'p99':>8} {'ratio':>7}"
    )
    for (name, n), row in times.items():
        if n != small:
            continue
        other = times[name, big]
        print(
            f"{name:<22} {percentile(row, 50) * 1e3:>9.4f} {percentile(row, 99) * 1e3:>8.3f} "
            f"{percentile(other, 50) * 1e3:>9.4f} {percentile(other, 99) * 1e3:>8.3f} "
            f"{percentile(other, 50) / percentile(row, 50):>6.2f}x"
        )
    children = args.blocks // CHAIN // 2
    print(
        "index upkeep, us: store a block; remove a leaf block; take a chain off the system "
        f"prefix's last block (about {children:,} children)"
    )
    print(f"{'instances':>9} {'store':>9} {'remove':>9} {'unlink':>12}")
    for n in sizes:
        up, ev = upkeep[n], upkeep[n].eviction
        print(f"{n:>9} {up.store_us:>9.3f} {ev.leaf_us:>9.3f} {ev.hot_unlink_us:>12.1f}")
    print(
        f"a {EVENT_BLOCKS:,}-block KV event from wire bytes to the index, ms p50 "
        f"({args.event_rounds} rounds); ratio: packed hashes into the compiled store to a "
        "Python int per hash"
    )
    print(f"{'instances':>9} {'path':>7} {'stored':>8} {'removed':>8} {'both':>8} {'ratio':>7}")
    for n in sizes:
        base = sum(upkeep[n].event_ms("ints"))
        for path in PATHS:
            stored, removed = upkeep[n].event_ms(path)
            print(
                f"{n:>9} {path:>7} {stored:>8.3f} {removed:>8.3f} {stored + removed:>8.3f} "
                f"{(stored + removed) / base:>6.2f}x"
            )
    if "elastic" in specs:
        for path in PATHS:
            print_capacity(times["elastic", big], upkeep[big], path, args.grpc_ms, big)
    print("reproduce: .venv/bin/python -m bench.index_scale")


def print_capacity(elastic: list[float], up: Upkeep, path: str, grpc_ms: float, n: int) -> None:
    """One Conductor's capacity from elastic's decisions over `n` instances: each placement
    later stores its prompt's new blocks and, in a steady state, evicts as many (KV events
    from wire bytes by `path`, at the measured cost a block), one chain of them under the
    system prefix half the time (SYSTEM_SHARE)."""
    cost = build_cluster(ClusterConfig(n_instances=1, block_size=BLOCK)).cost
    new_blocks = PROMPT // BLOCK - (CHAIN + 1) // 2  # the prompts' mean hit: half a chain
    cached = (CHAIN + 1) // 2 * BLOCK
    event_us = sum(up.event_ms(path)) * 1e3 / EVENT_BLOCKS  # a block stored and evicted
    upkeep_us = new_blocks * event_us + SYSTEM_SHARE * up.eviction.hot_unlink_us
    cap = Capacity(
        decision_ms=percentile(elastic, 50) * 1e3,
        grpc_ms=grpc_ms,
        upkeep_ms=upkeep_us / 1e3,
        instance_rate=1 / cost.prefill_one(PROMPT - cached, cached),
    )
    print(
        f"one Conductor (elastic over {n:,} instances, events by the {path} path): "
        f"{cap.decision_ms:.3f} ms deciding + {cap.grpc_ms:.2f} ms gRPC, Finish and load report "
        f"+ {cap.upkeep_ms:.3f} ms of KV events storing and evicting {new_blocks:,} new blocks "
        f"= {cap.conductor_rate:,.0f} placements/s; "
        f"an H100 instance prefills {cap.instance_rate:.2f} such prompts/s, so one Conductor "
        f"serves {cap.instances_at(cap.instance_rate):,} such instances "
        f"({cap.instances_at(1.0):,} at 1 request/s each, {cap.instances_at(10.0):,} at 10)"
    )


if __name__ == "__main__":
    main()
