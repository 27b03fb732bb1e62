"""Transfers this Messenger runs, as the Messenger of the node whose engine receives the KV.

One transfer of a plan (blocks `block_hashes[skip:]` of the source instance, an engine of any
node, to the target instance, an engine of this node) goes:

1. Reserve pages on the target engine for the blocks it lacks (`begin_import`); an engine that
   holds them all already ends the transfer at once, done.
2. Segment by segment, ask the source's Messenger to pin blocks (`ExportBlocks`: their pages
   and token ids, and for Mooncake every chunk's checksum; the TCP backend brings each
   chunk's checksum with its bytes) and read them through the backend into the reserved
   pages, layer by layer in order: the next layers are on the wire while a layer's chunks are
   verified, and each verified layer is reported at once, so a consumer may start on layer 0
   while later layers are in flight. A chunk whose checksum does not match is read again, up
   to `chunk_retries` times, then the transfer fails. A hand-off's source is still
   prefilling: its Messenger waits for each next block, so the KV streams while the prefill
   runs. A source holding fewer blocks of the chain moves what it holds.
3. Commit the import: the engine checks the tokens hash to the blocks; only then are they
   cached (visible, evictable) and published as BlockStored.

Anything failing, the deadline passing, or a cancel aborts the import (the reserved pages go
back, nothing became visible) and releases the exports: a transfer never half-commits. At
most `max_transfers` run at once; the others wait, queued.

`Transfers` keeps the transfers and runs each (`transfer_mover` moves its blocks,
`segment_reader` reads each export, `transfer_progress` holds its record).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode, Tracer

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.common.serving.durations import seconds
from services.dataplane.local_kv import LocalKv, TransferRefused
from services.dataplane.transfer_mover import PeerStub, TransferMover
from services.dataplane.transfer_progress import (
    ENDED_STATES,
    Transfer,
    TransferFailed,
    TransferLimits,
)

log = logging.getLogger(__name__)
ENDED_KEPT = 4096  # ended transfers a late WatchTransfer can still see


class Transfers:
    """Every transfer this Messenger runs or has recently ended."""

    def __init__(
        self,
        local: LocalKv,
        limits: TransferLimits,
        stub: Callable[[str], PeerStub],
        *,
        tracer: Tracer,
        on_end: Callable[[Transfer], None] | None = None,
    ) -> None:
        self._local = local
        self._tracer = tracer
        self.limits = limits
        self._mover = TransferMover(local, limits, stub)
        self._on_end = on_end
        self._slots = asyncio.Semaphore(limits.max_transfers)
        self._live: dict[str, Transfer] = {}
        self._ended: OrderedDict[str, Transfer] = OrderedDict()

    @property
    def running(self) -> int:
        return sum(t.state == pb.TRANSFER_STATE_RUNNING for t in self._live.values())

    @property
    def queued(self) -> int:
        return sum(t.state == pb.TRANSFER_STATE_QUEUED for t in self._live.values())

    def get(self, transfer_id: str) -> Transfer:
        """Raises `TransferRefused` NOT_FOUND for an unknown (or long ended) transfer."""
        found = self._live.get(transfer_id) or self._ended.get(transfer_id)
        if found is None:
            raise TransferRefused(
                grpc.StatusCode.NOT_FOUND, f"no transfer {transfer_id!r} on this Messenger"
            )
        return found

    # ---- the API ---------------------------------------------------------------------------

    def start(self, request: pb.StartTransferRequest) -> Transfer:
        """Accept a transfer (validated before anything changes); a repeated id answers the
        transfer it names. Raises `TransferRefused`."""
        plan = request.plan
        tid = plan.transfer_id
        if not tid:
            raise TransferRefused(grpc.StatusCode.INVALID_ARGUMENT, "plan.transfer_id is required")
        known = self._live.get(tid) or self._ended.get(tid)
        if known is not None:
            return known
        if plan.kind not in common.TransferKind.values() or not plan.kind:
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT, f"plan.kind must be set, got {plan.kind}"
            )
        n = len(plan.block_hashes)
        if n == 0 or plan.skip_blocks >= n:
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"nothing to move: {n} block hashes, {plan.skip_blocks} skipped",
            )
        if not request.source_messenger_url:
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT, "source_messenger_url is required"
            )
        self._local.require_backend(request.backend)
        if plan.source_instance_id == plan.target_instance_id:
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT, "source and target are the same instance"
            )
        _, region = self._local.engine(plan.target_instance_id)
        layers = tuple(request.layers) or tuple(range(region.layout.layers))
        if sorted(layers) != list(range(region.layout.layers)):
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"layers must name each of the model's {region.layout.layers} layers once (in "
                "the order they should move): a block becomes visible only with all of them",
            )
        deadline = seconds(request.timeout)
        if deadline <= 0:
            raise TransferRefused(grpc.StatusCode.INVALID_ARGUMENT, "timeout must be positive")
        if self.queued >= self.limits.max_queued:
            raise TransferRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.queued} transfers are queued here already; try again later",
            )
        transfer = Transfer(tid, plan, layers, deadline)
        self._live[tid] = transfer
        transfer.task = asyncio.get_running_loop().create_task(
            self._run(transfer, request.source_messenger_url), name=f"transfer {tid}"
        )
        return transfer

    async def watch(self, transfer_id: str) -> AsyncIterator[pb.WatchTransferResponse]:
        """The transfer's progress now, then at every change, until (and including) its end."""
        transfer = self.get(transfer_id)
        while True:
            changed = transfer.changed
            progress = transfer.progress()
            yield progress
            if progress.state in ENDED_STATES:
                return
            await changed.wait()

    def cancel(self, transfer_id: str) -> pb.TransferState.ValueType:
        """Cancel a transfer; returns its state (CANCELLED, or how it had already ended)."""
        transfer = self.get(transfer_id)
        if transfer.state in ENDED_STATES or transfer.task is None:
            return transfer.state
        transfer.task.cancel()
        return pb.TRANSFER_STATE_CANCELLED

    async def close(self) -> None:
        tasks = [t.task for t in self._live.values() if t.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one transfer ----------------------------------------------------------------------

    async def _run(self, transfer: Transfer, source_url: str) -> None:
        plan = transfer.plan
        span = self._tracer.start_span(
            "transfer",
            attributes={
                "kvsched.transfer.id": transfer.transfer_id,
                "kvsched.transfer.kind": common.TransferKind.Name(plan.kind),
                "kvsched.transfer.source": plan.source_instance_id,
                "kvsched.transfer.target": plan.target_instance_id,
                "kvsched.transfer.backend": self._local.backend.name,
            },
        )
        try:
            with trace.use_span(span, end_on_exit=False):
                async with asyncio.timeout(transfer.deadline_s):
                    async with self._slots:
                        transfer.state = pb.TRANSFER_STATE_RUNNING
                        transfer.started_at = time.monotonic()
                        transfer.touch()
                        await self._mover.move(transfer, source_url)
            transfer.state = pb.TRANSFER_STATE_DONE
        except asyncio.CancelledError:
            transfer.state = pb.TRANSFER_STATE_CANCELLED
            transfer.error = "cancelled"
        except TimeoutError:
            transfer.state = pb.TRANSFER_STATE_FAILED
            transfer.error = f"did not finish within its {transfer.deadline_s:.3g} s deadline"
        except TransferFailed as exc:
            transfer.state = pb.TRANSFER_STATE_FAILED
            transfer.error = str(exc)
        except Exception as exc:  # a bug: fail this transfer, keep the Messenger
            log.exception("transfer %s failed unexpectedly", transfer.transfer_id)
            transfer.state = pb.TRANSFER_STATE_FAILED
            transfer.error = f"internal error: {type(exc).__name__}"
        finally:
            transfer.ended_at = time.monotonic()
            self._live.pop(transfer.transfer_id, None)
            self._ended[transfer.transfer_id] = transfer
            if len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)
            transfer.touch()
            span.set_attribute("kvsched.transfer.bytes", transfer.bytes_done)
            span.set_attribute("kvsched.transfer.blocks", transfer.blocks)
            span.set_attribute("kvsched.transfer.chunks_retried", transfer.chunks_retried)
            span.set_attribute("kvsched.transfer.state", pb.TransferState.Name(transfer.state))
            if transfer.state != pb.TRANSFER_STATE_DONE:
                span.set_status(Status(StatusCode.ERROR, transfer.error))
                log.warning("transfer %s: %s", transfer.transfer_id, transfer.error)
            else:
                log.info(
                    "transfer %s: %d blocks, %d bytes in %.1f ms (%s)",
                    transfer.transfer_id,
                    transfer.blocks,
                    transfer.bytes_done,
                    transfer.elapsed_s * 1e3,
                    ", ".join(f"{k} {v * 1e3:.1f}" for k, v in transfer.phases.items()),
                )
            span.end()
            if self._on_end is not None:
                self._on_end(transfer)
