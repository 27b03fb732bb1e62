"""The service skeleton's gRPC server: health and reflection beside the API, statuses as
asked, mutual TLS refusing a client without a certificate, a taken port refused."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from services.common.security.tls import ClientTls, ServerTls, aio_channel
from services.common.serving.grpc_server import GrpcApi, health_servicer, start_grpc_server
from tests.fixtures.etcd import make_tls

API = GrpcApi("kvsched.test.v1.Nothing", lambda server: None)
TRACER = TracerProvider().get_tracer("test")
Status = health_pb2.HealthCheckResponse


async def _status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(answer.status)


async def test_health_and_reflection_stand_beside_the_api() -> None:
    server, port = await start_grpc_server(
        "127.0.0.1:0", API, health_servicer(), tracer=TRACER, serving=False
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await _status(channel, "") == Status.SERVING
            assert await _status(channel, API.name) == Status.NOT_SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            async for answer in reflect.ServerReflectionInfo(iter([ask])):
                names = {s.name for s in answer.list_services_response.service}
            assert {API.name, "grpc.health.v1.Health"} <= names
    finally:
        await server.stop(None)


async def test_a_taken_port_is_refused() -> None:
    server, port = await start_grpc_server("127.0.0.1:0", API, health_servicer(), tracer=TRACER)
    try:
        with pytest.raises(OSError, match="cannot listen"):
            await start_grpc_server(f"127.0.0.1:{port}", API, health_servicer(), tracer=TRACER)
    finally:
        await server.stop(None)


async def test_mutual_tls_admits_only_clients_with_a_certificate(tmp_path: Path) -> None:
    tls = make_tls(tmp_path)
    files = ServerTls(str(tls.server_cert), str(tls.server_key), str(tls.ca_file))
    server, port = await start_grpc_server(
        "127.0.0.1:0", API, health_servicer(), tracer=TRACER, tls=files
    )
    target = f"127.0.0.1:{port}"
    try:
        with_cert = ClientTls(str(tls.ca_file), str(tls.client_cert), str(tls.client_key))
        async with aio_channel(target, with_cert) as channel:
            assert await _status(channel, API.name) == Status.SERVING
        async with aio_channel(target, ClientTls(str(tls.ca_file))) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _status(channel, API.name)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def _count(requests: Any, context: Any) -> health_pb2.HealthCheckResponse:
    async for _ in requests:
        pass
    return health_pb2.HealthCheckResponse(status=Status.SERVING)


def _sync_check(request: Any, context: Any) -> health_pb2.HealthCheckResponse:
    return health_pb2.HealthCheckResponse(status=Status.SERVING)


def _add_probes(server: grpc.aio.Server) -> None:
    """Handler kinds the standard services lack: a coroutine taking a request stream, and a
    plain function (run on grpc's thread pool)."""
    decode = health_pb2.HealthCheckRequest.FromString
    encode = health_pb2.HealthCheckResponse.SerializeToString
    handlers = {
        "Count": grpc.stream_unary_rpc_method_handler(_count, decode, encode),
        "SyncCheck": grpc.unary_unary_rpc_method_handler(_sync_check, decode, encode),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PROBES, handlers),))


PROBES = "kvsched.test.v1.Probes"


@pytest.mark.parametrize(
    "method, streams",
    [
        ("/grpc.health.v1.Health/Check", (False, False)),
        ("/grpc.health.v1.Health/Watch", (False, True)),
        ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", (True, True)),
        (f"/{PROBES}/Count", (True, False)),
        (f"/{PROBES}/SyncCheck", (False, False)),
    ],
)
async def test_an_undecodable_request_is_invalid_argument_without_a_traceback(
    method: str, streams: tuple[bool, bool], caplog: pytest.LogCaptureFixture
) -> None:
    garbage = b"\xff\x00garbage"
    api = GrpcApi(PROBES, _add_probes)
    server, port = await start_grpc_server("127.0.0.1:0", api, health_servicer(), tracer=TRACER)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                match streams:
                    case (False, False):
                        await channel.unary_unary(method, None, None)(garbage, timeout=5)
                    case (True, False):
                        await channel.stream_unary(method, None, None)(iter([garbage]), timeout=5)
                    case (False, True):
                        async for _ in channel.unary_stream(method, None, None)(garbage, timeout=5):
                            pass
                    case _:
                        async for _ in channel.stream_stream(method, None, None)(
                            iter([garbage]), timeout=5
                        ):
                            pass
            # A well-formed request still gets its answer on the same server.
            assert await _status(channel, "") == Status.SERVING
            check = health_pb2.HealthCheckRequest().SerializeToString()
            sync = await channel.unary_unary(f"/{PROBES}/SyncCheck", None, None)(check, timeout=5)
            count = channel.stream_unary(f"/{PROBES}/Count", None, None)
            assert sync == await count(iter([check, check]), timeout=5) != b""
    finally:
        await server.stop(None)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid" in (refused.value.details() or "")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("undecodable request" in r.getMessage() for r in caplog.records)


async def test_each_server_has_its_own_client_error_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two servers in one process: one's flood of undecodable requests spends its own burst
    # (10 lines), never the other's.
    method = "/grpc.health.v1.Health/Check"
    servers = [
        await start_grpc_server("127.0.0.1:0", API, health_servicer(), tracer=TRACER)
        for _ in range(2)
    ]
    try:
        for (_, port), count in zip(servers, (15, 1), strict=True):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for _ in range(count):
                    with pytest.raises(grpc.aio.AioRpcError):
                        await channel.unary_unary(method, None, None)(b"\xff\x00", timeout=5)
    finally:
        for server, _ in servers:
            await server.stop(None)
    warned = [r for r in caplog.records if "undecodable request" in r.getMessage()]
    assert len(warned) == 11  # the first server's burst, then the second's first
