"""What the placement benches index and place, drawn alike by each of them: chains of blocks
(half of them under one shared system prefix) each held by one instance, a load per
instance, and long prompts that continue a random part of an indexed chain.

Every function draws from the `random.Random` it is given, in a fixed order, so a bench that
draws the same things in the same order from the same seed gets the same workload
(bench.placement, bench.grpc_placement and bench.index_scale share these draws).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator, Sequence

from kvsched.core.load import LoadReport

CHAIN, SYSTEM = 256, 128  # blocks per indexed chain; blocks of the shared system prefix
SYSTEM_SHARE = 0.5  # share of the chains that continue the system prefix


def draw_chains(
    rng: random.Random, total_blocks: int, n_slots: int, share: float = SYSTEM_SHARE
) -> Iterator[tuple[int, list[int]]]:
    """(holding slot, chain) pairs until `total_blocks` blocks are drawn: CHAIN-block chains,
    `share` of them the system prefix then new blocks, the rest new blocks throughout, each on
    one slot drawn uniformly. Lazy: a caller that keeps only some chains never holds them all
    (100M blocks as Python ints would take 4 GB); consume it whole before drawing anything
    else from `rng`."""
    system = [rng.getrandbits(64) for _ in range(SYSTEM)]
    drawn = 0
    while drawn < total_blocks:
        body = [rng.getrandbits(64) for _ in range(CHAIN - SYSTEM)]
        chain = (
            system + body if rng.random() < share else [rng.getrandbits(64) for _ in range(CHAIN)]
        )
        yield rng.randrange(n_slots), chain
        drawn += len(chain)


def draw_loads(rng: random.Random, n_slots: int) -> list[LoadReport]:
    """One engine load report per slot: up to 20,000 prompt tokens queued (up to 1 s of
    prefill), 2 waiting, 8 running, 40,000 decode tokens, 20,000 free blocks."""
    return [
        LoadReport(rng.randrange(0, 20_000), rng.random(), 2, 8, 40_000, 20_000)
        for _ in range(n_slots)
    ]


def draw_prompt(rng: random.Random, chains: Sequence[Sequence[int]], blocks: int) -> list[int]:
    """A `blocks`-block prompt's hashes: the first 1 to CHAIN blocks of a chain drawn from
    `chains` (the hit), then new blocks."""
    shared = list(rng.choice(chains)[: min(rng.randrange(1, CHAIN + 1), blocks)])
    return shared + list(array("Q", rng.randbytes(8 * (blocks - len(shared)))))
