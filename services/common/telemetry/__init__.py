"""OpenTelemetry tracing for the gRPC (grpc.aio) services.

Nothing here touches the global tracer provider unless asked to: `setup_tracing` returns
the provider, and the interceptors take a tracer explicitly, so one process (a test run)
can hold several providers side by side.

Server side: `server_interceptor(tracer)` opens one SERVER span per RPC, named after the
full method without the leading slash (``kvsched.conductor.v1.ConductorService/Schedule``),
parented on the W3C ``traceparent``/``tracestate`` of the incoming metadata.  The span is
the current span while the handler runs (whole stream for streaming RPCs), so handlers
annotate it with ``opentelemetry.trace.get_current_span().set_attribute(...)``.

Client side: `client_interceptors(tracer)` for ``grpc.aio.insecure_channel(...,
interceptors=...)`` opens a CLIENT span per call and injects ``traceparent``;
`inject_metadata` does the injection alone for callers without interceptors.

Modules: `settings` (the provider and its exporter), `propagation` (W3C trace context in gRPC
metadata), `spans` (span names, attributes and status shared by both sides), `server` and
`client` (the interceptors).
"""

from services.common.telemetry.client import client_interceptors
from services.common.telemetry.propagation import inject_metadata
from services.common.telemetry.server import server_interceptor
from services.common.telemetry.settings import (
    TelemetrySettings,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)

__all__ = [
    "TelemetrySettings",
    "client_interceptors",
    "get_tracer",
    "inject_metadata",
    "server_interceptor",
    "setup_tracing",
    "shutdown_tracing",
]
