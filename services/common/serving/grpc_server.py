"""The gRPC server every service runs: its one API traced by the server interceptor, the
standard health service and server reflection beside it, listening with or without (mutual)
TLS; with mutual TLS, each call authorised by the caller's certificate (`authz`). Each
service still owns its servicer, its health servicer (it flips the statuses as it leads,
drains or stops) and the server's stop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Tracer

from services.common.security.authz import authz_interceptor
from services.common.security.tls import ServerTls, add_port
from services.common.telemetry import server_interceptor

ServingStatus: TypeAlias = health_pb2.HealthCheckResponse.ServingStatus.ValueType
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthServicer(Protocol):
    """grpc_health's asyncio health servicer as the services use it (it ships untyped)."""

    async def set(self, service: str, status: ServingStatus) -> None:
        """Report `status` for `service` ("" is the whole server) to checks and watchers."""

    async def enter_graceful_shutdown(self) -> None:
        """Report every service NOT_SERVING from now on, whatever is set later."""


def health_servicer() -> HealthServicer:
    """A new health servicer; every service but the server itself ("") is unknown to it."""
    return cast(HealthServicer, health_aio.HealthServicer())


@dataclass(frozen=True, slots=True)
class GrpcApi:
    """The API a server hosts: its full service name (what reflection lists and health
    reports on) and how its servicer is added, e.g.
    ``partial(pb_grpc.add_RouterServiceServicer_to_server, servicer)``."""

    name: str
    add_to: Callable[[grpc.aio.Server], None]


async def start_grpc_server(
    listen: str,
    api: GrpcApi,
    health_servicer: HealthServicer,
    *,
    tracer: Tracer,
    tls: ServerTls | None = None,
    serving: bool = True,
    reuse_port: bool = False,
    max_receive_bytes: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Start a server for `api` on `listen` (TLS when `tls` is given, mutual when it names a
    client CA: then every call is authorised by its caller's identity, `authz`) and return
    it with the port it bound. Sets `health_servicer`'s statuses: the
    server's ("") serving, the API's as `serving` says. `reuse_port` lets other processes
    bind the same port (grpc's own default); without it a taken port fails the start.
    Raises OSError when it cannot listen."""
    options: list[tuple[str, int]] = []
    if not reuse_port:
        options.append(("grpc.so_reuseport", 0))
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    interceptors = [server_interceptor(tracer)]
    if tls is not None and tls.client_ca_file:  # callers have identities: authorise each call
        interceptors.append(authz_interceptor())
    server = grpc.aio.server(interceptors=interceptors, options=options)
    api.add_to(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (api.name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        port = add_port(server, listen, tls)
    except RuntimeError as exc:  # how grpc reports a failed bind now (it used to return 0)
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    await health_servicer.set("", SERVING)
    await health_servicer.set(api.name, SERVING if serving else NOT_SERVING)
    return server, port
