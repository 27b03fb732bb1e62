"""The RouterService gRPC admin API of one Router: status and draining."""

from __future__ import annotations

from typing import Protocol

import grpc

from kvsched.api.router.v1 import router_service_pb2 as pb
from kvsched.api.router.v1 import router_service_pb2_grpc as pb_grpc
from services.router.placer import Placer
from services.router.settings import RouterSettings

Context = grpc.aio.ServicerContext[object, object]
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RouterService"].full_name


class Administered(Protocol):
    """What the admin API reads of a Router, and the one thing it changes (draining)."""

    @property
    def settings(self) -> RouterSettings: ...
    @property
    def placer(self) -> Placer: ...
    @property
    def draining(self) -> bool: ...
    @property
    def streams_open(self) -> int: ...
    @property
    def requests_served(self) -> int: ...

    async def set_draining(self, draining: bool) -> None:
        """Refuse (or accept again) new requests."""


class RouterServicer(pb_grpc.RouterServiceServicer):
    """Reads the Router's live state; `SetDraining` flips what new requests get (503)."""

    def __init__(self, router: Administered) -> None:
        self.router = router

    async def GetRouterStatus(
        self, request: pb.GetRouterStatusRequest, context: Context
    ) -> pb.GetRouterStatusResponse:
        r = self.router
        return pb.GetRouterStatusResponse(
            router_id=r.settings.router_id,
            conductor_leader=r.placer.conductor_leader,
            fallback_active=not r.placer.conductor_up,
            fallback_decisions=r.placer.fallback_decisions,
            streams_open=r.streams_open,
            draining=r.draining,
            requests_served=r.requests_served,
        )

    async def SetDraining(
        self, request: pb.SetDrainingRequest, context: Context
    ) -> pb.SetDrainingResponse:
        await self.router.set_draining(request.draining)
        return pb.SetDrainingResponse(
            draining=self.router.draining, streams_open=self.router.streams_open
        )
