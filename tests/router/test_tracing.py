"""One trace from the client through the Router, the Conductor and the engine, exported to
an in-process OTLP receiver, with every parent link in place."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider

from services.common.telemetry import TelemetrySettings, setup_tracing
from tests.fixtures.otlp import OtlpReceiver
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, chat
from tests.router.tap import Tap, parse_http

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SCHEDULE = "kvsched.conductor.v1.ConductorService/Schedule"


async def test_a_request_is_one_trace_across_router_conductor_and_engine(
    otlp_receiver: OtlpReceiver,  # first: torn down after the services that export to it
    stack: Stack,
) -> None:
    endpoint = otlp_receiver.endpoint
    c = await stack.start_conductor(otlp_endpoint=endpoint)
    # (The engine exports from its own process: a short batch delay brings its spans soon.)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    (engine,) = await stack.start_engines(1, env=env)
    tap = Tap(engine.port)
    await tap.start()
    provider: TracerProvider = setup_tracing(TelemetrySettings("kvsched-router", endpoint))
    try:
        await stack.registry(c.url).add(engine.instance_id, tap.url)
        router = await stack.start_router(c.url, tracer_provider=provider)
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        status, _, data = await stack.post(
            router.url + "/v1/chat/completions",
            chat(stream=True),
            traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
        )
        assert status == 200, data
        await asyncio.to_thread(provider.force_flush)
        await asyncio.to_thread(c.tracer_provider.force_flush)

        def in_trace(span: object) -> bool:
            return getattr(span, "trace_id", None) == CALLER_TRACE

        def routers(span: object) -> bool:  # the engine serves the same route in this trace
            return in_trace(span) and getattr(span, "service_name", "") == "kvsched-router"

        server = await otlp_receiver.wait_for_span(
            "POST /v1/chat/completions", kind="SERVER", where=routers
        )
        assert server.parent_span_id == CALLER_SPAN
        assert server.attributes["http.response.status_code"] == 200
        children = {}
        for name in ("tokenize", "placement", "upstream"):
            span = await otlp_receiver.wait_for_span(name, where=in_trace)
            assert span.parent_span_id == server.span_id, name
            children[name] = span
        assert children["upstream"].kind == "CLIENT"
        client = await otlp_receiver.wait_for_span(SCHEDULE, kind="CLIENT", where=in_trace)
        assert client.parent_span_id == children["placement"].span_id
        conductor = await otlp_receiver.wait_for_span(SCHEDULE, kind="SERVER", where=in_trace)
        assert conductor.parent_span_id == client.span_id
        assert conductor.service_name == "kvsched-conductor"
        assert conductor.attributes["kvsched.instance"] == engine.instance_id
        # The engine was handed the upstream span as its parent.
        (sent,) = parse_http(bytes(tap.exchanges[0].to_engine))
        upstream = children["upstream"].span_id
        assert sent.headers["traceparent"] == f"00-{CALLER_TRACE}-{upstream}-01"
        served = await otlp_receiver.wait_for_span(
            "POST /v1/chat/completions",
            10.0,
            kind="SERVER",
            where=lambda s: in_trace(s) and s.service_name != "kvsched-router",
        )
        assert served.parent_span_id == upstream
    finally:
        await tap.stop()
        await asyncio.to_thread(provider.shutdown)
