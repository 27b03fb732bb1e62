"""Moving one transfer's blocks (steps 1-3 of `services.dataplane.transfers`): reserve pages
on the target engine, take the blocks segment by segment from the source's Messenger
(`ExportBlocks`) through a `SegmentReader`, and commit the import, or abort it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import TypeAlias

import grpc

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc
from kvsched.core.vllm_hashing import AdapterKey
from services.common.serving.durations import duration, seconds
from services.dataplane.errors import PoolError, PoolFull
from services.dataplane.kv_pool import NodePool
from services.dataplane.local_kv import LocalKv, TransferRefused
from services.dataplane.segment_reader import SegmentReader
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer_progress import Transfer, TransferFailed, TransferLimits

PeerStub: TypeAlias = "pb_grpc.MessengerServiceAsyncStub"  # exists only in the stubs
PEER_CALL_S = 5.0  # an ExportBlocks call beyond the time it may wait for a prefill


class TransferMover:
    """Moves transfers' blocks into this node's engines from their sources' Messengers
    (`stub` gives the one at a URL)."""

    def __init__(self, local: LocalKv, limits: TransferLimits, stub: Callable[[str], PeerStub]):
        self._local = local
        self._stub = stub
        self._reader = SegmentReader(local, limits)
        self._background: set[asyncio.Task[None]] = set()  # export releases under way

    async def move(self, transfer: Transfer, source_url: str) -> None:
        """Steps 1–3 of `services.dataplane.transfers`; raises `TransferFailed` (or is
        cancelled), having aborted the import."""
        plan = transfer.plan
        try:
            api, region = self._local.engine(plan.target_instance_id)
        except TransferRefused as exc:
            raise TransferFailed(f"the target: {exc}") from None
        hashes = list(plan.block_hashes)
        try:
            slots = await api.begin_import(hashes, len(hashes), hold_s=transfer.deadline_s)
        except PoolFull as exc:
            raise TransferFailed(f"the target engine has no room: {exc}") from None
        except PoolError as exc:
            raise TransferFailed(f"the target engine did not reserve pages: {exc}") from None
        transfer.mark("pages reserved")
        if slots.import_id is None:
            transfer.blocks = 0
            return  # it holds every block already
        transfer.blocks = len(hashes) - slots.have
        transfer.touch()
        committed = False
        try:
            tokens, salt, adapter = await self._segments(
                transfer, source_url, region, slots.have, slots.pages
            )
            if tokens:
                try:
                    await api.commit_import(slots.import_id, tokens, salt, adapter)
                except PoolError as exc:
                    raise TransferFailed(f"the target engine refused the blocks: {exc}") from None
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
    ) -> tuple[list[int], str | None, AdapterKey | None]:
        """Read blocks `have..` into `pages`, a segment per export; returns their token ids,
        the chain's cache salt and its LoRA adapter. A source holding fewer blocks of the
        chain ends the reading where its prefix ends (the target then holds as much of it as
        the source); a hand-off's source must produce them all, waiting for its prefill."""
        plan = transfer.plan
        hashes = plan.block_hashes
        stub = self._stub(source_url)
        handoff = plan.kind == common.TRANSFER_KIND_HANDOFF
        tokens: list[int] = []
        salt: str | None = None
        adapter: AdapterKey | None = None
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
                raise TransferFailed(
                    f"the source Messenger {source_url}: {exc.code().name}: {exc.details()}"
                ) from None
            transfer.mark(f"exported {start}")
            if export.blocks == 0 and handoff:
                raise TransferFailed(
                    f"the prefill did not produce block {start} of the prompt in time"
                )
            if export.blocks == 0:
                break
            try:
                await self._reader.read(transfer, region, export, pages[start - have :])
            finally:
                release = asyncio.get_running_loop().create_task(_release(stub, export.export_id))
                self._background.add(release)
                release.add_done_callback(self._background.discard)
            tokens.extend(export.token_ids)
            if start == 0:
                salt = export.cache_salt or None
            if export.lora_name:
                adapter = (export.lora_name, export.lora_path)
            start += export.blocks
            transfer.blocks_done = start - have
            transfer.touch()
            if not handoff and start < len(hashes):
                break  # the source's prefix ended: it holds no more of the chain
        transfer.blocks = start - have
        return tokens, salt, adapter


async def _quietly(api: NodePool, import_id: str) -> None:
    """Abort an import; if the engine does not answer, its hold time aborts it."""
    with contextlib.suppress(PoolError):
        await api.abort_import(import_id)


async def _release(stub: PeerStub, export_id: str) -> None:
    """Release an export; if its Messenger does not answer, the hold time ends it."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.ReleaseExport(pb.ReleaseExportRequest(export_id=export_id), timeout=PEER_CALL_S)
