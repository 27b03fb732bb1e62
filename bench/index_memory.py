"""Prefix-index memory and match time at scale: the compiled block store against the
pure-Python reference, in the same run.

Loads `--blocks` blocks (default 10M) into the compiled block store as 256-block chains, each
stored on one instance and, with probability `--shared` (0.25), on a second one too, over
`--instances` instances (64); then loads `--pure-blocks` (1M) the same way into the reference
(a dict per tier, a parent map and child lists: 10M would take minutes and gigabytes), and the
same 1M into a second compiled store, so match times compare at one size. Reports
bytes per block and per (block, holder) — the compiled store's own allocation count and the
process's resident-memory growth for both — and the p50 of a chain match of 2,048-block prompts
that share a random part of a stored chain.

    .venv/bin/python -m bench.index_memory [--blocks 10000000] [--instances 64]
"""

from __future__ import annotations

import argparse
import os
import random
import time

from bench.common import percentile
from kvsched.core._holdings import Holdings
from kvsched.core.holdings import BlockHoldings, PyHoldings

CHAIN = 256
PROMPT_BLOCKS = 2048
GOAL_BYTES = 32  # issue 16: per (block, holder) at 10M blocks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load(
    store: BlockHoldings, blocks: int, instances: int, shared: float, seed: int
) -> tuple[int, list[list[int]], float]:
    """Store `blocks` blocks; returns the (block, holder) pairs, a sample of chains to probe
    and the seconds it took."""
    rng = random.Random(seed)
    pairs, sample = 0, list[list[int]]()
    started = time.perf_counter()
    for n in range(0, blocks, CHAIN):
        chain = [rng.getrandbits(64) for _ in range(min(CHAIN, blocks - n))]
        first = rng.randrange(instances)
        store.store(first, chain, None, 0)
        pairs += len(chain)
        if rng.random() < shared:
            store.store((first + 1 + rng.randrange(instances - 1)) % instances, chain, None, 0)
            pairs += len(chain)
        if len(sample) < 1000 and rng.random() < 0.01:
            sample.append(chain)
    return pairs, sample, time.perf_counter() - started


def match_p50(store: BlockHoldings, sample: list[list[int]], seed: int) -> float:
    rng = random.Random(seed + 1)
    times = []
    for chain in sample:
        shared = chain[: rng.randrange(1, len(chain) + 1)]
        prompt = shared + [rng.getrandbits(64) for _ in range(PROMPT_BLOCKS - len(shared))]
        t = time.perf_counter()
        store.match(prompt, 0)
        times.append(time.perf_counter() - t)
    return percentile(times, 50)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=10_000_000)
    parser.add_argument("--pure-blocks", type=int, default=1_000_000)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--shared", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(
        f"{args.instances} instances, {CHAIN}-block chains, {args.shared:.0%} of them on a "
        f"second instance; {PROMPT_BLOCKS}-block prompts"
    )
    print(
        f"{'store':<10} {'blocks':>11} {'pairs':>11} {'load s':>7} {'B/block':>8} "
        f"{'B/pair':>7} {'RSS B/pair':>10} {'match p50 us':>12}"
    )
    results = {}
    rows = (
        ("pure", args.pure_blocks),
        ("compiled", args.pure_blocks),  # the same load: the match times compare
        ("compiled", args.blocks),
    )
    for name, blocks in rows:
        before = rss_bytes()
        store: BlockHoldings = (
            PyHoldings(args.instances) if name == "pure" else Holdings(args.instances)
        )
        pairs, sample, load_s = load(store, blocks, args.instances, args.shared, args.seed)
        grown = rss_bytes() - before
        own = store.memory_bytes() if isinstance(store, Holdings) else grown
        p50 = match_p50(store, sample, args.seed)
        results[name, blocks] = (own / pairs, p50)
        print(
            f"{name:<10} {len(store):>11,} {pairs:>11,} {load_s:>7.1f} {own / len(store):>8.1f} "
            f"{own / pairs:>7.1f} {grown / pairs:>10.1f} {p50 * 1e6:>12.2f}"
        )
        del store, sample
    pure_b, pure_t = results["pure", args.pure_blocks]
    same_b, same_t = results["compiled", args.pure_blocks]
    big_b, _ = results["compiled", args.blocks]
    print(
        f"compiled vs pure at {args.pure_blocks:,} blocks: {pure_b / same_b:.1f}x less memory "
        f"per pair, {pure_t / same_t:.1f}x faster match; at {args.blocks:,} blocks "
        f"{big_b:.1f} B per (block, holder): {'meets' if big_b <= GOAL_BYTES else 'misses'} "
        f"the goal of <= {GOAL_BYTES}"
    )
    print("reproduce: .venv/bin/python -m bench.index_memory")


if __name__ == "__main__":
    main()
