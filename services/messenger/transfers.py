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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode, Tracer

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc
from services.common.durations import duration, seconds
from services.common.kv_layout import KvLayout, checksums
from services.messenger.engine_api import EngineError
from services.messenger.kv_pool import KvPool, PoolFull
from services.messenger.local_kv import LocalKv, TransferRefused
from services.messenger.transfer.backend import Reader, SourceExport
from services.messenger.transfer.errors import TransferError
from services.messenger.transfer.region import KvRegion
from services.messenger.transfer.runs import Run, coalesce

log = logging.getLogger(__name__)
_PeerStub: TypeAlias = "pb_grpc.MessengerServiceAsyncStub"  # exists only in the stubs
ENDED_KEPT = 4096  # ended transfers a late WatchTransfer can still see
PEER_CALL_S = 5.0  # an ExportBlocks call beyond the time it may wait for a prefill
READ_AHEAD = 4  # layers requested ahead of the one being verified
_ENDED = frozenset({pb.TRANSFER_STATE_DONE, pb.TRANSFER_STATE_FAILED, pb.TRANSFER_STATE_CANCELLED})


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


class Transfers:
    """Every transfer this Messenger runs or has recently ended."""

    def __init__(
        self,
        local: LocalKv,
        limits: TransferLimits,
        stub: Callable[[str], _PeerStub],
        *,
        tracer: Tracer,
        on_end: Callable[[Transfer], None] | None = None,
    ) -> None:
        self._local = local
        self._tracer = tracer
        self.limits = limits
        self._stub = stub
        self._on_end = on_end
        self._slots = asyncio.Semaphore(limits.max_transfers)
        self._live: dict[str, Transfer] = {}
        self._ended: OrderedDict[str, Transfer] = OrderedDict()
        self._corrupt_left = limits.corrupt_chunks
        self._background: set[asyncio.Task[None]] = set()  # export releases under way

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
            if progress.state in _ENDED:
                return
            await changed.wait()

    def cancel(self, transfer_id: str) -> pb.TransferState.ValueType:
        """Cancel a transfer; returns its state (CANCELLED, or how it had already ended)."""
        transfer = self.get(transfer_id)
        if transfer.state in _ENDED or transfer.task is None:
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
                        await self._move(transfer, source_url)
            transfer.state = pb.TRANSFER_STATE_DONE
        except asyncio.CancelledError:
            transfer.state = pb.TRANSFER_STATE_CANCELLED
            transfer.error = "cancelled"
        except TimeoutError:
            transfer.state = pb.TRANSFER_STATE_FAILED
            transfer.error = f"did not finish within its {transfer.deadline_s:.3g} s deadline"
        except _Failed as exc:
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

    async def _move(self, transfer: Transfer, source_url: str) -> None:
        """Steps 1–3 of the module docstring; raises `_Failed` (or is cancelled), having
        aborted the import."""
        plan = transfer.plan
        try:
            api, region = self._local.engine(plan.target_instance_id)
        except TransferRefused as exc:
            raise _Failed(f"the target: {exc}") from None
        hashes = list(plan.block_hashes)
        try:
            slots = await api.begin_import(hashes, len(hashes), hold_s=transfer.deadline_s)
        except PoolFull as exc:
            raise _Failed(f"the target engine has no room: {exc}") from None
        except EngineError as exc:
            raise _Failed(f"the target engine did not reserve pages: {exc}") from None
        transfer.mark("pages reserved")
        if slots.import_id is None:
            transfer.blocks = 0
            return  # it holds every block already
        transfer.blocks = len(hashes) - slots.have
        transfer.touch()
        committed = False
        try:
            tokens, salt = await self._segments(
                transfer, source_url, region, slots.have, slots.pages
            )
            if tokens:
                try:
                    await api.commit_import(slots.import_id, tokens, salt)
                except EngineError as exc:
                    raise _Failed(f"the target engine refused the blocks: {exc}") from None
                committed = True
                transfer.mark("committed")
        finally:
            if not committed:
                await _quietly(api, slots.import_id)

    async def _segments(
        self,
        transfer: Transfer,
        source_url: str,
        region: KvRegion,
        have: int,
        pages: Sequence[int],
    ) -> tuple[list[int], str | None]:
        """Read blocks `have..` into `pages`, a segment per export; returns their token ids
        and the chain's cache salt. A source holding fewer blocks of the chain ends the
        reading where its prefix ends (the target then holds as much of it as the source);
        a hand-off's source must produce them all, waiting for its prefill."""
        plan = transfer.plan
        hashes = plan.block_hashes
        stub = self._stub(source_url)
        handoff = plan.kind == common.TRANSFER_KIND_HANDOFF
        tokens: list[int] = []
        salt: str | None = None
        start = have
        while start < len(hashes):
            remaining = transfer.deadline_s - transfer.elapsed_s
            request = pb.ExportBlocksRequest(
                transfer_id=transfer.transfer_id,
                instance_id=plan.source_instance_id,
                block_hashes=hashes,
                start_block=start,
                hold=duration(max(remaining, 1.0)),
                backend=self._local.backend_value,
            )
            if handoff:  # the prefill may still be computing block `start`
                request.wait.CopyFrom(duration(max(remaining - 0.5, 0.0)))
            try:
                export = await stub.ExportBlocks(
                    request, timeout=seconds(request.wait) + PEER_CALL_S
                )
            except grpc.aio.AioRpcError as exc:
                raise _Failed(
                    f"the source Messenger {source_url}: {exc.code().name}: {exc.details()}"
                ) from None
            transfer.mark(f"exported {start}")
            if export.blocks == 0 and handoff:
                raise _Failed(f"the prefill did not produce block {start} of the prompt in time")
            if export.blocks == 0:
                break
            try:
                await self._read_segment(transfer, region, export, pages[start - have :])
            finally:
                release = asyncio.get_running_loop().create_task(_release(stub, export.export_id))
                self._background.add(release)
                release.add_done_callback(self._background.discard)
            tokens.extend(export.token_ids)
            if start == 0:
                salt = export.cache_salt or None
            start += export.blocks
            transfer.blocks_done = start - have
            transfer.touch()
            if not handoff and start < len(hashes):
                break  # the source's prefix ended: it holds no more of the chain
        transfer.blocks = start - have
        return tokens, salt

    async def _read_segment(
        self,
        transfer: Transfer,
        region: KvRegion,
        export: pb.ExportBlocksResponse,
        pages: Sequence[int],
    ) -> None:
        """Move one export's blocks, layer by layer, verifying each layer's chunks."""
        n = export.blocks
        src = KvLayout(
            export.layout.layers,
            export.layout.pages,
            export.layout.chunk_bytes,
            export.layout.block_size,
        )
        dst = region.layout
        if (src.layers, src.chunk_bytes, src.block_size) != (
            dst.layers,
            dst.chunk_bytes,
            dst.block_size,
        ):
            raise _Failed(f"the source's KV layout {src} does not match the target's {dst}")
        theirs, ours = export.layout.format, region.block_format
        if theirs and theirs != ours:
            raise _Failed(
                f"the source's blocks are {theirs}, the target's {ours}: KV moves only between "
                "engines of one model, dtype and attention backend"
            )
        if len(export.pages) != n or len(export.checksums) not in (0, n * src.layers):
            raise _Failed("the source's export is inconsistent (pages or checksums missing)")
        try:
            reader = await self._local.backend.open_reader(
                SourceExport(export.endpoint, export.base_address, src, export.export_id)
            )
        except TransferError as exc:
            raise _Failed(f"cannot read from the source: {exc}") from None
        segment = _Segment(reader, region, list(export.pages), list(pages[:n]), export.checksums)
        transfer.layers_done = 0
        layers = transfer.layers
        # Later layers are on the wire while a layer is verified (`READ_AHEAD` in flight).
        pending = deque(asyncio.create_task(segment.read(x)) for x in layers[:READ_AHEAD])
        try:
            for k, layer in enumerate(layers):
                await pending.popleft()
                if k + READ_AHEAD < len(layers):
                    pending.append(asyncio.create_task(segment.read(layers[k + READ_AHEAD])))
                self._damage(region, layer, segment.dst_pages)
                await self._verify(transfer, segment, layer)
                transfer.layers_done = k + 1
                transfer.bytes_done += n * dst.chunk_bytes
                if transfer.first_layer_s < 0:
                    transfer.first_layer_s = transfer.elapsed_s
                    transfer.mark("first layer")
                transfer.touch()
                await self._pace(transfer)
        except TransferError as exc:
            raise _Failed(f"reading from the source failed: {exc}") from None
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            await reader.close()
        transfer.mark(f"read {n} blocks in {len(segment.runs)} runs a layer")

    async def _verify(self, transfer: Transfer, segment: _Segment, layer: int) -> None:
        """Check each chunk of `layer`; read a bad one again, up to `chunk_retries` times."""
        bad = segment.bad_chunks(layer)
        for _ in range(self.limits.chunk_retries):
            if not bad:
                return
            transfer.chunks_retried += len(bad)
            log.warning(
                "transfer %s: %d chunk(s) of layer %d failed their checksum; reading again",
                transfer.transfer_id,
                len(bad),
                layer,
            )
            await segment.read(layer, bad)
            self._damage(segment.region, layer, [segment.dst_pages[i] for i in bad])
            bad = segment.bad_chunks(layer, bad)
        if bad:
            raise _Failed(
                f"{len(bad)} chunk(s) of layer {layer} still failed their checksum after "
                f"{self.limits.chunk_retries} reads; nothing was committed"
            )

    def _damage(self, region: KvRegion, layer: int, pages: Sequence[int]) -> None:
        """Fault injection (`corrupt_chunks`): flip a byte of chunks as they arrive."""
        for page in pages:
            if self._corrupt_left <= 0:
                return
            self._corrupt_left -= 1
            view = region.view(layer, page)
            view[0] ^= 0xFF

    async def _pace(self, transfer: Transfer) -> None:
        rate = self.limits.rate_bytes_per_s
        if rate > 0:
            ahead = transfer.bytes_done / rate - transfer.elapsed_s
            if ahead > 0:
                await asyncio.sleep(ahead)


@dataclass(slots=True)
class _Segment:
    """One export being read: its reader, the pages on both sides, and the chunks' checksums:
    the export's (layer × blocks + block), or, from a backend that sends them with the
    bytes, those of each layer's last read."""

    reader: Reader
    region: KvRegion
    src_pages: list[int]
    dst_pages: list[int]
    checksums: Sequence[int]
    runs: list[Run] = field(init=False)
    sent: dict[int, dict[int, int]] = field(default_factory=dict)  # layer -> block -> sum

    def __post_init__(self) -> None:
        self.runs = coalesce(self.src_pages, self.dst_pages)

    async def read(self, layer: int, blocks: Sequence[int] | None = None) -> None:
        """Read `layer` of every block (coalesced), or of `blocks` (indices) one by one."""
        picked = range(len(self.dst_pages)) if blocks is None else blocks
        runs = (
            self.runs
            if blocks is None
            else [Run(self.src_pages[i], self.dst_pages[i], 1) for i in blocks]
        )
        sums = await self.reader.read(layer, runs, self.region)
        if sums is not None:  # in run order, which is block order
            if len(sums) != len(picked):
                raise TransferError(f"{len(sums)} checksums for {len(picked)} chunks")
            self.sent.setdefault(layer, {}).update(zip(picked, sums, strict=True))

    def bad_chunks(self, layer: int, blocks: Sequence[int] | None = None) -> list[int]:
        """The blocks (indices; default all) whose chunk of `layer` does not match its
        checksum."""
        picked = range(len(self.dst_pages)) if blocks is None else blocks
        pages = [self.dst_pages[i] for i in picked]
        memory = self.region.whole()
        try:
            got = checksums(memory, self.region.layout, (layer,), pages)
        finally:
            memory.release()
        sent = self.sent.get(layer)
        if sent is not None:
            return [i for i, g in zip(picked, got, strict=True) if g != sent[i]]
        want, base = self.checksums, layer * len(self.dst_pages)
        return [i for i, g in zip(picked, got, strict=True) if g != want[base + i]]


class _Failed(Exception):
    """The transfer cannot complete (its message says why)."""


async def _quietly(api: KvPool, import_id: str) -> None:
    """Abort an import; if the engine does not answer, its hold time aborts it."""
    with contextlib.suppress(EngineError):
        await api.abort_import(import_id)


async def _release(stub: _PeerStub, export_id: str) -> None:
    """Release an export; if its Messenger does not answer, the hold time ends it."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.ReleaseExport(pb.ReleaseExportRequest(export_id=export_id), timeout=PEER_CALL_S)
