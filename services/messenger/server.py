"""The Messenger's gRPC API. KV transfers (StartTransfer, WatchTransfer, CancelTransfer) are
not implemented yet: every call is answered UNIMPLEMENTED with a message saying so."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc

Context = grpc.aio.ServicerContext[object, object]

NOT_YET = (
    "this Messenger relays KV events only; KV transfers ({method}) are not implemented yet, "
    "so plan no transfers through it (e.g. a policy without migration or replication)"
)


class MessengerServicer(pb_grpc.MessengerServiceServicer):
    """Transfer RPCs: refused, changing nothing."""

    async def StartTransfer(
        self, request: pb.StartTransferRequest, context: Context
    ) -> pb.StartTransferResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(method="StartTransfer"))

    async def WatchTransfer(
        self, request: pb.WatchTransferRequest, context: Context
    ) -> AsyncIterator[pb.WatchTransferResponse]:
        for _ in ():  # an async generator (a streaming handler) that yields nothing
            yield pb.WatchTransferResponse()
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(method="WatchTransfer"))

    async def CancelTransfer(
        self, request: pb.CancelTransferRequest, context: Context
    ) -> pb.CancelTransferResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(method="CancelTransfer"))
