"""Tracing interceptors end to end: a real grpc.aio server and client on loopback, spans
exported by the real OTLP exporter to the in-process receiver."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, Tracer

from services.common.telemetry import (
    TelemetrySettings,
    client_interceptors,
    get_tracer,
    inject_metadata,
    server_interceptor,
    setup_tracing,
    shutdown_tracing,
)
from services.common.telemetry.spans import child_span
from tests.fixtures.otlp import OtlpReceiver, ReceivedSpan

SERVICE = "kvsched.test.v1.Echo"
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_PARENT_ID = 0x00F067AA0BA902B7
STATUS_CODE = "rpc.grpc.status_code"


# --------------------------------------------------------------------------- servicer


async def unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    trace.get_current_span().set_attribute("echo.bytes", len(request))
    if request == b"abort":
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")
    if request == b"boom":
        raise RuntimeError("handler bug")
    return request


async def chat(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    n = 0
    async for request in requests:
        n += 1
        yield request.upper()
    trace.get_current_span().set_attribute("chat.messages", n)


async def countdown(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
    """Unary-stream in the ``context.write`` style (a coroutine, not a generator)."""
    start = int(request)
    for i in range(start, 0, -1):
        await context.write(str(i).encode())
    trace.get_current_span().set_attribute("countdown.from", start)


async def total(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> bytes:
    values = [int(r) async for r in requests]
    trace.get_current_span().set_attribute("total.count", len(values))
    return str(sum(values)).encode()


HANDLERS = grpc.method_handlers_generic_handler(
    SERVICE,
    {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Chat": grpc.stream_stream_rpc_method_handler(chat),
        "Countdown": grpc.unary_stream_rpc_method_handler(countdown),
        "Total": grpc.stream_unary_rpc_method_handler(total),
    },
)


# --------------------------------------------------------------------------- rig


@dataclass
class Rig:
    receiver: OtlpReceiver
    providers: tuple[TracerProvider, TracerProvider]
    client_tracer: Tracer
    channel: grpc.aio.Channel  # with the client interceptors
    target: str

    def flush(self) -> None:
        for provider in self.providers:
            assert provider.force_flush(5000)

    async def span(self, method: str, kind: str) -> ReceivedSpan:
        return await self.receiver.wait_for_span(f"{SERVICE}/{method}", kind=kind)


@pytest_asyncio.fixture
async def rig(otlp_receiver: OtlpReceiver) -> AsyncIterator[Rig]:
    # Two providers in one process, as a client and a server would have.
    server_provider = setup_tracing(TelemetrySettings("echo-server", otlp_receiver.endpoint))
    client_provider = setup_tracing(TelemetrySettings("echo-client", otlp_receiver.endpoint))
    server = grpc.aio.server(interceptors=[server_interceptor(get_tracer(server_provider))])
    server.add_generic_rpc_handlers((HANDLERS,))
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    client_tracer = get_tracer(client_provider)
    channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors(client_tracer))
    try:
        yield Rig(otlp_receiver, (server_provider, client_provider), client_tracer, channel, target)
    finally:
        await channel.close(None)
        await server.stop(None)
        shutdown_tracing(server_provider)
        shutdown_tracing(client_provider)


def remote_parent() -> Context:
    """A context whose current span is a sampled remote span of the known trace."""
    parent = SpanContext(
        TRACE_ID, CALLER_PARENT_ID, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


ARITY = {
    "Unary": "unary_unary",
    "Chat": "stream_stream",
    "Countdown": "unary_stream",
    "Total": "stream_unary",
}


def method(channel: grpc.aio.Channel, name: str) -> Any:
    """The multi-callable for ``name``; bytes in, bytes out (no serializers)."""
    return getattr(channel, ARITY[name])(f"/{SERVICE}/{name}", None, None)


# --------------------------------------------------------------------------- tests


async def test_server_span_continues_the_callers_trace(rig: Rig) -> None:
    with rig.client_tracer.start_as_current_span("caller", context=remote_parent()):
        assert await method(rig.channel, "Unary")(b"hello") == b"hello"
    rig.flush()

    server = await rig.span("Unary", "SERVER")
    client = await rig.span("Unary", "CLIENT")
    caller = await rig.receiver.wait_for_span("caller")
    trace_id = f"{TRACE_ID:032x}"
    assert caller.trace_id == client.trace_id == server.trace_id == trace_id
    assert caller.parent_span_id == f"{CALLER_PARENT_ID:016x}"
    assert client.parent_span_id == caller.span_id
    assert server.parent_span_id == client.span_id
    assert server.service_name == "echo-server"
    assert client.service_name == "echo-client"
    assert server.attributes == {
        "rpc.system": "grpc",
        "rpc.service": SERVICE,
        "rpc.method": "Unary",
        STATUS_CODE: 0,
        "echo.bytes": 5,  # set by the handler through get_current_span()
    }
    assert server.status_code == client.status_code == "UNSET"
    assert client.attributes[STATUS_CODE] == 0


async def test_aborted_rpc_gives_an_error_span(rig: Rig) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await method(rig.channel, "Unary")(b"abort")
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert raised.value.details() == "no such thing"
    rig.flush()

    server = await rig.span("Unary", "SERVER")
    client = await rig.span("Unary", "CLIENT")
    assert server.parent_span_id == client.span_id
    for span in (server, client):
        assert span.status_code == "ERROR"
        assert span.status_message == "no such thing"
        assert span.attributes[STATUS_CODE] == grpc.StatusCode.NOT_FOUND.value[0]
    assert server.attributes["echo.bytes"] == 5
    assert server.events == ()  # an abort is a status, not an exception


async def test_handler_exception_is_unknown_with_the_exception_recorded(rig: Rig) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await method(rig.channel, "Unary")(b"boom")
    assert raised.value.code() == grpc.StatusCode.UNKNOWN
    rig.flush()

    server = await rig.span("Unary", "SERVER")
    assert server.status_code == "ERROR"
    assert server.attributes[STATUS_CODE] == grpc.StatusCode.UNKNOWN.value[0]
    assert server.events == ("exception",)


async def test_streaming_rpcs_of_every_shape_are_traced(rig: Rig) -> None:
    async def requests() -> AsyncIterator[bytes]:
        for r in (b"a", b"b", b"c"):
            yield r

    with rig.client_tracer.start_as_current_span("caller", context=remote_parent()):
        replies = [r async for r in method(rig.channel, "Chat")(requests())]
        counted = [r async for r in method(rig.channel, "Countdown")(b"3")]
        call = method(rig.channel, "Total")()  # the call.write() style
        for number in (b"1", b"2", b"39"):
            await call.write(number)
        await call.done_writing()
        summed = await call
    assert replies == [b"A", b"B", b"C"]
    assert counted == [b"3", b"2", b"1"]
    assert summed == b"42"
    rig.flush()

    handler_attribute = {"Chat": ("chat.messages", 3), "Countdown": ("countdown.from", 3)}
    handler_attribute["Total"] = ("total.count", 3)
    for name, (key, value) in handler_attribute.items():
        server = await rig.span(name, "SERVER")
        client = await rig.span(name, "CLIENT")
        assert server.trace_id == client.trace_id == f"{TRACE_ID:032x}", name
        assert server.parent_span_id == client.span_id, name
        assert server.attributes[key] == value, name
        assert server.attributes[STATUS_CODE] == client.attributes[STATUS_CODE] == 0, name


async def test_without_interceptors_inject_metadata_carries_the_trace(rig: Rig) -> None:
    async with grpc.aio.insecure_channel(rig.target) as plain:
        call = method(plain, "Unary")
        await call(b"untraced")
        with rig.client_tracer.start_as_current_span("by-hand") as by_hand:
            await call(b"by-hand", metadata=inject_metadata([("x-extra", "1")]))
            expected_parent = f"{by_hand.get_span_context().span_id:016x}"
    rig.flush()

    untraced = await rig.receiver.wait_for_span(
        f"{SERVICE}/Unary", where=lambda s: s.attributes["echo.bytes"] == 8
    )
    assert untraced.parent_span_id is None  # no traceparent: a root span
    traced = await rig.receiver.wait_for_span(
        f"{SERVICE}/Unary", where=lambda s: s.attributes["echo.bytes"] == 7
    )
    assert traced.parent_span_id == expected_parent


def test_settings_from_env() -> None:
    env = {
        "OTEL_SERVICE_NAME": "conductor",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert TelemetrySettings.from_env(environ=env) == TelemetrySettings(
        "conductor", "http://collector:4317", True, 0.25
    )
    assert TelemetrySettings.from_env("router", environ={}) == TelemetrySettings("router")
    with pytest.raises(ValueError, match="sample_ratio"):
        TelemetrySettings("x", sample_ratio=2.0)


def test_inject_metadata_replaces_stale_headers() -> None:
    stale = [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"), ("k", "v")]
    with_parent = inject_metadata(stale, context=remote_parent())
    assert with_parent == [("k", "v"), ("traceparent", f"00-{TRACE_ID:032x}-00f067aa0ba902b7-01")]
    assert inject_metadata(stale, context=Context()) == [("k", "v")]


def test_child_span_only_under_a_recording_span() -> None:
    """An unsampled request's children are not made at all (its own span stays current); a
    sampled one's are real children, current while their block runs."""
    tracer = TracerProvider().get_tracer("test")  # samples every root
    unsampled = NonRecordingSpan(SpanContext(TRACE_ID, CALLER_PARENT_ID, is_remote=False))
    with trace.use_span(unsampled), child_span(tracer, "tokenize") as span:
        assert span is unsampled
        assert trace.get_current_span() is unsampled
    with tracer.start_as_current_span("request") as parent:
        with child_span(tracer, "upstream", SpanKind.CLIENT) as span:
            assert isinstance(span, ReadableSpan) and span.is_recording() and span is not parent
            assert trace.get_current_span() is span
            assert span.get_span_context().trace_id == parent.get_span_context().trace_id
            assert (
                span.parent is not None and span.parent.span_id == parent.get_span_context().span_id
            )
            assert span.kind is SpanKind.CLIENT
        assert trace.get_current_span() is parent
