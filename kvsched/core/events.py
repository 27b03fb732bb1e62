"""KV events: what an instance's caches did, in vLLM's vocabulary, as the core indexes them.

One vocabulary for every producer and consumer: the simulator's caches drain these, the
simulated engine and the node KV pool name them for vLLM's wire format, a Messenger turns
vLLM's events into these (and they cross to the Conductor as `KvEvent` messages), and the
scheduler applies them (`Scheduler.apply`). Blocks are named by the low 64 bits of vLLM's
block hash; a stored chain continues `parent` (None: it starts at the root).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvsched.core.index import Tier
from kvsched.core.load import LoadReport


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """A chain of blocks now held in `tier`, each continuing the one before, the first
    continuing `parent`. `hashes`: a tuple, or `PackedHashes` as the wire brought them."""

    hashes: Sequence[int]
    parent: int | None = None
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks no longer held in `tier` (their descendants leave with them); `hashes` as in
    `BlocksStored`."""

    hashes: Sequence[int]
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the instance dropped, in every tier."""


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared | LoadReport


def split(events: Iterable[KvEvent], max_blocks: int) -> Iterator[KvEvent]:
    """`events` with none naming more than `max_blocks` blocks: a long stored chain becomes
    pieces that continue one another, a long removal consecutive removals. Applying the
    pieces in order has the effect of applying the event whole."""
    if max_blocks < 1:
        raise ValueError("max_blocks must be at least 1")
    for event in events:
        if not isinstance(event, BlocksStored | BlocksRemoved) or len(event.hashes) <= max_blocks:
            yield event
            continue
        hashes = event.hashes
        for start in range(0, len(hashes), max_blocks):
            part = hashes[start : start + max_blocks]
            if isinstance(event, BlocksStored):
                parent = hashes[start - 1] if start else event.parent
                yield BlocksStored(part, parent, event.tier)
            else:
                yield BlocksRemoved(part, event.tier)
