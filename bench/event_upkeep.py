"""What a KV event of new blocks costs the Conductor from its wire bytes to the index: a
2,048-block BlocksStored and the BlocksRemoved that later evicts the same blocks, each one
`KvEventBatch` as a Messenger sends it (packed hashes), parsed, converted and applied by the
core (`Scheduler.apply`, no etcd observer), on an index already loaded (`bench.index_scale`).

Two paths, interleaved round by round on the same index: `packed`, the Conductor's path (the
event's packed bytes go to the compiled store whole, `kv_event_batches.kv_events`), and
`ints`, the path before it (the bytes unpacked into a tuple of Python ints the store reads one
by one), kept here as the baseline.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from clients.python.packed_hashes import pack_hashes, unpack_hashes
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.cluster import ClusterConfig
from kvsched.core.events import BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import PrefixIndex, Tier
from kvsched.core.scheduler import Scheduler
from services.conductor import kv_event_batches

EVENT_BLOCKS = 2048  # a 32K-token prompt's blocks at block size 16
PATHS = ("ints", "packed")


@dataclass(frozen=True, slots=True)
class EventTimes:
    """Seconds per event, per path: stored and removed, one entry a round."""

    stored: dict[str, list[float]]
    removed: dict[str, list[float]]


def unpacked_events(batch: pb.KvEventBatch) -> list[KvEvent]:
    """The path before packed events: every hash a Python int (what
    `kv_event_batches.kv_events` did)."""
    out: list[KvEvent] = []
    for event in batch.events:
        if event.HasField("blocks_stored"):
            s = event.blocks_stored
            parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
            out.append(BlocksStored(tuple(unpack_hashes(s.packed_block_hashes)), parent, Tier.GPU))
        else:
            r = event.blocks_removed
            out.append(BlocksRemoved(tuple(unpack_hashes(r.packed_block_hashes)), Tier.GPU))
    return out


def wire(slot: int, hashes: list[int], parent: int | None, *, stored: bool) -> bytes:
    batch = pb.KvEventBatch(instance_id=f"i{slot}", sequence=1)
    if stored:
        s = batch.events.add().blocks_stored
        s.tier, s.packed_block_hashes = common.TIER_GPU, pack_hashes(hashes)
        if parent is not None:
            s.parent_block_hash = parent
    else:
        r = batch.events.add().blocks_removed
        r.tier, r.packed_block_hashes = common.TIER_GPU, pack_hashes(hashes[::-1])  # leaves first
    return batch.SerializeToString()


def timed_event_paths(
    index: PrefixIndex, sample: list[tuple[int, list[int]]], rounds: int, seed: int
) -> EventTimes:
    """Each round a fresh chain of EVENT_BLOCKS blocks continues a sampled chain on its
    instance and then leaves it, once by each path (the order alternating), so the index ends
    as it began. Changes nothing for good."""
    scheduler = Scheduler(
        ClusterConfig(n_instances=index.n_slots, block_size=16),
        "round_robin",
        seed,
        max_prompt_tokens=EVENT_BLOCKS * 16,
    )
    scheduler.cluster.index = index
    limit = scheduler.limits.max_blocks

    def packed_events(batch: pb.KvEventBatch) -> list[KvEvent]:
        return kv_event_batches.kv_events(batch, limit)

    decode = {"ints": unpacked_events, "packed": packed_events}
    rng = random.Random(f"event_upkeep {seed}")  # not the stream that drew the index
    stored: dict[str, list[float]] = {p: [] for p in PATHS}
    removed: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        slot, chain = sample[r % len(sample)]
        hashes = [rng.getrandbits(64) for _ in range(EVENT_BLOCKS)]
        add = wire(slot, hashes, chain[-1], stored=True)
        drop = wire(slot, hashes, None, stored=False)
        for path in PATHS if r % 2 else PATHS[::-1]:
            for data, times in ((add, stored), (drop, removed)):
                t = time.perf_counter()
                scheduler.apply(slot, decode[path](pb.KvEventBatch.FromString(data)))
                times[path].append(time.perf_counter() - t)
    return EventTimes(stored, removed)
