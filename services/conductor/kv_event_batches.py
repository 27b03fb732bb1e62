"""A Messenger's `KvEventBatch` read into core KV events (blocks stored and removed, all
cleared, load reports); an unset event or enum raises `RequestError`, and packed block
hashes stay packed (`block_hash_fields.event_hashes`)."""

from __future__ import annotations

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from services.conductor.block_hash_fields import event_hashes
from services.conductor.instance_messages import load_report
from services.kv_events.messages import TIER_VALUES

TIERS: dict[int, Tier] = {value: tier for tier, value in TIER_VALUES.items()}


def tier(value: int) -> Tier:
    found = TIERS.get(value)
    if found is None:
        raise RequestError("invalid", f"tier must be TIER_GPU, TIER_CPU or TIER_DISK, got {value}")
    return found


def kv_events(batch: pb.KvEventBatch, max_blocks: int) -> list[KvEvent]:
    """Decode a batch's events; raises RequestError on an unset event or enum, or on an
    event's block hashes as `block_hashes` refuses them (`max_blocks` bounds a packed
    list; the core checks the others). Packed hashes stay packed (`event_hashes`)."""
    out: list[KvEvent] = []
    for i, event in enumerate(batch.events):
        kind = event.WhichOneof("event")
        if kind == "blocks_stored":
            s = event.blocks_stored
            parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
            hashes = event_hashes(s.block_hashes, s.packed_block_hashes, max_blocks, f"event {i}: ")
            out.append(BlocksStored(hashes, parent, tier(s.tier)))
        elif kind == "blocks_removed":
            r = event.blocks_removed
            hashes = event_hashes(r.block_hashes, r.packed_block_hashes, max_blocks, f"event {i}: ")
            out.append(BlocksRemoved(hashes, tier(r.tier)))
        elif kind == "all_blocks_cleared":
            out.append(AllBlocksCleared())
        elif kind == "load":
            out.append(load_report(event.load))
        else:
            raise RequestError("invalid", f"event {i} of the batch has no event set")
    return out
