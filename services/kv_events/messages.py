"""The core's KV events as the Conductor API's `KvEvent` messages (a Messenger sends them;
the Conductor reads them back in `services.conductor.kv_event_batches`, with its boundary
checks).
Block hashes go packed (`packed_block_hashes`), which the Conductor reads fastest."""

from __future__ import annotations

from clients.python.packed_hashes import pack_hashes
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import AdapterReport
from kvsched.core.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import Tier
from services.common.serving.durations import duration

TIER_VALUES: dict[Tier, common.Tier.ValueType] = {
    Tier.GPU: common.TIER_GPU,
    Tier.CPU: common.TIER_CPU,
    Tier.DISK: common.TIER_DISK,
}


def event_message(event: KvEvent) -> pb.KvEvent:
    """`event` as a message."""
    if isinstance(event, BlocksStored):
        stored = pb.BlocksStored(
            packed_block_hashes=pack_hashes(event.hashes), tier=TIER_VALUES[event.tier]
        )
        if event.parent is not None:
            stored.parent_block_hash = event.parent
        return pb.KvEvent(blocks_stored=stored)
    if isinstance(event, BlocksRemoved):
        removed = pb.BlocksRemoved(
            packed_block_hashes=pack_hashes(event.hashes), tier=TIER_VALUES[event.tier]
        )
        return pb.KvEvent(blocks_removed=removed)
    if isinstance(event, AllBlocksCleared):
        return pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())
    load = common.LoadReport(
        pending_prefill_tokens=event.pending_prefill_tokens,
        pending_prefill=duration(event.pending_prefill_s),
        waiting=event.waiting,
        running=event.running,
        decode_tokens=event.decode_tokens,
        free_blocks=max(event.free_blocks, 0),
    )
    if event.adapters is not None:
        load.adapters.CopyFrom(adapter_message(event.adapters))
    return pb.KvEvent(load=load)


def adapter_message(report: AdapterReport) -> common.AdapterReport:
    """An engine's adapters as a message (names sorted: equal reports, equal bytes)."""
    return common.AdapterReport(
        capacity=report.capacity, held=sorted(report.held), busy=sorted(report.busy)
    )
