"""The Messenger's gRPC API: thin handlers over `Transfers` (transfers this Messenger runs, as
the target's) and `Exporter` (blocks it exports to peers, as the source's). Every refusal is a
gRPC status with a message a person can act on; nothing is changed by a refused call."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc
from services.dataplane import Exporter, TransferRefused, Transfers

Context = grpc.aio.ServicerContext[object, object]


async def _abort(context: Context, exc: TransferRefused) -> NoReturn:
    await context.abort(exc.code, str(exc))
    raise AssertionError("unreachable")  # abort raises


class MessengerServicer(pb_grpc.MessengerServiceServicer):
    """Transfer and export RPCs."""

    def __init__(self, transfers: Transfers, exporter: Exporter) -> None:
        self.transfers = transfers
        self.exporter = exporter

    async def StartTransfer(
        self, request: pb.StartTransferRequest, context: Context
    ) -> pb.StartTransferResponse:
        try:
            transfer = self.transfers.start(request)
        except TransferRefused as exc:
            await _abort(context, exc)
        return pb.StartTransferResponse(
            transfer_id=transfer.transfer_id,
            state=transfer.state,
        )

    async def WatchTransfer(
        self, request: pb.WatchTransferRequest, context: Context
    ) -> AsyncIterator[pb.WatchTransferResponse]:
        try:
            progress = self.transfers.watch(request.transfer_id)
            async for item in progress:
                yield item
        except TransferRefused as exc:
            await _abort(context, exc)

    async def CancelTransfer(
        self, request: pb.CancelTransferRequest, context: Context
    ) -> pb.CancelTransferResponse:
        try:
            state = self.transfers.cancel(request.transfer_id)
        except TransferRefused as exc:
            await _abort(context, exc)
        return pb.CancelTransferResponse(state=state)

    async def ExportBlocks(
        self, request: pb.ExportBlocksRequest, context: Context
    ) -> pb.ExportBlocksResponse:
        try:
            return await self.exporter.export(request)
        except TransferRefused as exc:
            await _abort(context, exc)

    async def ReleaseExport(
        self, request: pb.ReleaseExportRequest, context: Context
    ) -> pb.ReleaseExportResponse:
        return pb.ReleaseExportResponse(released=await self.exporter.release(request.export_id))
