"""Reading one export of a transfer into the target's reserved pages: `SegmentReader` moves
the export's blocks layer by layer, in the transfer's layer order, with the next layers on
the wire while a layer's chunks are verified; a chunk whose checksum does not match is read
again, up to `chunk_retries` times."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.dataplane.kv_layout import KvLayout, checksums
from services.dataplane.local_kv import LocalKv
from services.dataplane.transfer.backend import Reader, SourceExport
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run, coalesce
from services.dataplane.transfer_progress import Transfer, TransferFailed, TransferLimits

log = logging.getLogger(__name__)
READ_AHEAD = 4  # layers requested ahead of the one being verified


class SegmentReader:
    """Reads exports through the node's backend under `limits` (retries, pace, fault
    injection)."""

    def __init__(self, local: LocalKv, limits: TransferLimits) -> None:
        self._local = local
        self.limits = limits
        self._corrupt_left = limits.corrupt_chunks  # for every transfer of this Messenger

    async def read(
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
            raise TransferFailed(f"the source's KV layout {src} does not match the target's {dst}")
        theirs, ours = export.layout.format, region.block_format
        if theirs and theirs != ours:
            raise TransferFailed(
                f"the source's blocks are {theirs}, the target's {ours}: KV moves only between "
                "engines of one model, dtype and attention backend"
            )
        if len(export.pages) != n or len(export.checksums) not in (0, n * src.layers):
            raise TransferFailed("the source's export is inconsistent (pages or checksums missing)")
        try:
            reader = await self._local.backend.open_reader(
                SourceExport(export.endpoint, export.base_address, src, export.export_id)
            )
        except TransferError as exc:
            raise TransferFailed(f"cannot read from the source: {exc}") from None
        segment = Segment(reader, region, list(export.pages), list(pages[:n]), export.checksums)
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
            raise TransferFailed(f"reading from the source failed: {exc}") from None
        finally:
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
            await reader.close()
        transfer.mark(f"read {n} blocks in {len(segment.runs)} runs a layer")

    async def _verify(self, transfer: Transfer, segment: Segment, layer: int) -> None:
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
            raise TransferFailed(
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
class Segment:
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
