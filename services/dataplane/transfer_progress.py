"""A transfer's record (`Transfer`: its plan, state and progress, which wakes its watchers),
the limits transfers run under, and how a transfer that cannot complete fails."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Final

from opentelemetry import trace

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.common.serving.durations import duration
from services.dataplane.errors import DataPlaneError

ENDED_STATES: Final = frozenset(
    {pb.TRANSFER_STATE_DONE, pb.TRANSFER_STATE_FAILED, pb.TRANSFER_STATE_CANCELLED}
)


@dataclass(frozen=True, slots=True)
class TransferLimits:
    """How transfers run on this Messenger."""

    max_transfers: int = 4  # running at once
    max_queued: int = 1024  # accepted and waiting
    chunk_retries: int = 3  # reads of a chunk whose checksum did not match
    rate_bytes_per_s: float = 0.0  # pace each transfer at most this fast (0: no limit)
    corrupt_chunks: int = 0  # fault injection: damage this many received chunks (tests)


@dataclass(slots=True, eq=False)
class Transfer:
    """One transfer and its progress; `changed` wakes its watchers."""

    transfer_id: str
    plan: common.TransferPlan
    layers: tuple[int, ...]
    deadline_s: float
    state: pb.TransferState.ValueType = pb.TRANSFER_STATE_QUEUED
    blocks: int = 0
    blocks_done: int = 0
    layers_done: int = 0
    bytes_done: int = 0
    chunks_retried: int = 0
    error: str = ""
    started_at: float = 0.0  # monotonic, once it runs
    ended_at: float = 0.0
    first_layer_s: float = -1.0  # from running to the first verified layer
    phases: dict[str, float] = field(default_factory=dict)  # step -> seconds since running
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def elapsed_s(self) -> float:
        if not self.started_at:
            return 0.0
        return (self.ended_at or time.monotonic()) - self.started_at

    def progress(self) -> pb.WatchTransferResponse:
        elapsed = self.elapsed_s
        return pb.WatchTransferResponse(
            transfer_id=self.transfer_id,
            state=self.state,
            layers_done=self.layers_done,
            bytes_done=self.bytes_done,
            bytes_per_second=self.bytes_done / elapsed if elapsed > 0 else 0.0,
            error=self.error,
            blocks_done=self.blocks_done,
            blocks=self.blocks,
            elapsed=duration(elapsed),
        )

    def mark(self, phase: str) -> None:
        """Note when a step ended (in the transfer's span and its end-of-transfer log)."""
        at = self.elapsed_s
        self.phases[phase] = at
        trace.get_current_span().add_event(phase, {"kvsched.elapsed_s": at})

    def touch(self) -> None:
        """Wake every watcher (each waits on the event it saw)."""
        event, self.changed = self.changed, asyncio.Event()
        event.set()


class TransferFailed(DataPlaneError):
    """The transfer cannot complete (its message says why)."""
