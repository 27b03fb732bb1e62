"""The Router's gRPC server: its admin API (`service`: status and draining) and gRPC health,
which says NOT_SERVING while the Router drains.
"""

from __future__ import annotations

from functools import partial

import grpc
from opentelemetry.trace import Tracer

from kvsched.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from services.common.serving.grpc_server import (
    NOT_SERVING,
    SERVING,
    GrpcApi,
    health_servicer,
    start_grpc_server,
)
from services.router.service import SERVICE_NAME, Administered, RouterServicer
from services.router.settings import RouterSettings


class AdminServer:
    """One Router's gRPC server: `start`, `set_serving` as the Router drains or resumes,
    `stop`."""

    def __init__(self, settings: RouterSettings, tracer: Tracer) -> None:
        self.health = health_servicer()
        self._listen = settings.grpc_listen
        self._tls = settings.grpc_tls
        self._tracer = tracer
        self._server: grpc.aio.Server | None = None

    async def start(self, router: Administered, *, serving: bool) -> str:
        """Listen, with the admin API answering for `router` and health saying `serving`;
        returns the host:port it listens on."""
        api = GrpcApi(
            SERVICE_NAME,
            partial(rpb_grpc.add_RouterServiceServicer_to_server, RouterServicer(router)),
        )
        # Shareable with other processes (grpc's default), as the Router always had it;
        # mutual TLS (operators' calls only) unless --insecure.
        self._server, port = await start_grpc_server(
            self._listen,
            api,
            self.health,
            tracer=self._tracer,
            reuse_port=True,
            tls=self._tls,
        )
        await self.set_serving(serving)
        return f"{self._listen.rpartition(':')[0]}:{port}"

    async def set_serving(self, serving: bool) -> None:
        """What gRPC health says of the server and of the admin API."""
        state = SERVING if serving else NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, state)

    async def stop(self, grace_s: float) -> None:
        """Stop listening; calls under way get `grace_s` seconds."""
        if self._server is not None:
            await self._server.stop(grace_s)
