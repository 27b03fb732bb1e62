"""Blocks this Messenger exports: the source side of a transfer another Messenger runs.

`ExportBlocks` pins cached blocks on the source engine (which may first wait for a prefill
still computing them), checksums every chunk of them in place, and lets the backend serve
their pages to readers of the export; `ReleaseExport`, or the export's hold time running out,
ends that (the engine also unpins at the hold time on its own, so a Messenger that dies leaves
nothing pinned).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import grpc

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.common.serving.durations import seconds
from services.dataplane.errors import PoolError
from services.dataplane.kv_layout import checksums
from services.dataplane.kv_pool import NodePool
from services.dataplane.local_kv import LocalKv, TransferRefused
from services.dataplane.transfer.region import KvRegion

log = logging.getLogger(__name__)
MAX_HOLD_S = 600.0
DEFAULT_HOLD_S = 60.0


@dataclass(slots=True)
class _Export:
    api: NodePool
    expiry: asyncio.TimerHandle


class Exporter:
    """The exports of one Messenger."""

    def __init__(self, local: LocalKv) -> None:
        self._local = local
        self._exports: dict[str, _Export] = {}

    async def export(self, request: pb.ExportBlocksRequest) -> pb.ExportBlocksResponse:
        """Pin, checksum and grant the asked blocks; raises `TransferRefused`."""
        backend = self._local.backend
        self._local.require_backend(request.backend)
        hashes = list(request.block_hashes)
        end = request.end_block or len(hashes)
        if not 0 <= request.start_block < end <= len(hashes):
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"blocks {request.start_block}..{end} are not within the {len(hashes)} hashes",
            )
        hold = seconds(request.hold) or DEFAULT_HOLD_S
        wait = seconds(request.wait)
        if not 0 < hold <= MAX_HOLD_S or not 0 <= wait <= MAX_HOLD_S:
            raise TransferRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hold must be in (0, {MAX_HOLD_S:.0f}] s and wait in [0, {MAX_HOLD_S:.0f}] s",
            )
        api, region = self._local.engine(request.instance_id)
        try:
            exported = await api.export_blocks(
                hashes, request.start_block, end, wait_s=wait, hold_s=hold
            )
        except PoolError as exc:
            raise TransferRefused(
                grpc.StatusCode.UNAVAILABLE, f"the source engine did not export: {exc}"
            ) from None
        layout = region.layout
        answer = pb.ExportBlocksResponse(
            blocks=exported.blocks,
            layout=pb.KvLayout(
                layers=layout.layers,
                pages=layout.pages,
                chunk_bytes=layout.chunk_bytes,
                block_size=layout.block_size,
                format=region.block_format,
            ),
        )
        if exported.blocks == 0:
            return answer
        pages = exported.pages
        try:
            # A backend that sends each chunk's checksum with its bytes needs none up front.
            sums = (
                []
                if backend.sends_checksums
                else await asyncio.to_thread(_checksums, region, pages)
            )
            backend.allow(exported.export_id, region, pages)
        except (ValueError, IndexError, BufferError) as exc:
            await _quietly(api.release_export(exported.export_id))
            raise TransferRefused(
                grpc.StatusCode.INTERNAL, f"the engine exported pages it does not have: {exc}"
            ) from None
        loop = asyncio.get_running_loop()
        expiry = loop.call_later(hold, self._expire, exported.export_id)
        self._exports[exported.export_id] = _Export(api, expiry)
        source = backend.source_export(region, exported.export_id)
        answer.export_id = exported.export_id
        answer.pages.extend(pages)
        answer.token_ids.extend(exported.token_ids)
        answer.cache_salt = exported.cache_salt or ""
        if exported.adapter is not None:
            answer.lora_name, answer.lora_path = exported.adapter
        answer.checksums.extend(sums)
        answer.endpoint = source.endpoint
        answer.base_address = source.base_address
        return answer

    async def release(self, export_id: str) -> bool:
        """End an export; False when it had already ended."""
        record = self._exports.pop(export_id, None)
        if record is None:
            return False
        record.expiry.cancel()
        self._local.backend.revoke(export_id)
        await _quietly(record.api.release_export(export_id))
        return True

    def _expire(self, export_id: str) -> None:
        # The engine unpins on its own at the same hold time; only the grant is ours to end.
        if self._exports.pop(export_id, None) is not None:
            self._local.backend.revoke(export_id)
            log.info("export %s ended at its hold time", export_id)

    async def close(self) -> None:
        for export_id in list(self._exports):
            await self.release(export_id)


def _checksums(region: KvRegion, pages: Sequence[int]) -> list[int]:
    """Every exported chunk's checksum, layer by layer (index layer × blocks + block)."""
    layout = region.layout
    memory = region.whole()
    try:
        return checksums(memory, layout, range(layout.layers), pages)
    finally:
        memory.release()


async def _quietly(call: Awaitable[object]) -> None:
    """Await an engine call whose failure changes nothing (the hold time covers it)."""
    with contextlib.suppress(PoolError):
        await call
