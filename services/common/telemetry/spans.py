"""What server and client spans share: their name and RPC attributes, taken from the full
method, and how one ends with a gRPC status; and child spans made only where they can be
recorded (`child_span`)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Final

import grpc
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, get_current_span

ATTR_RPC_SYSTEM: Final = "rpc.system"
ATTR_RPC_SERVICE: Final = "rpc.service"
ATTR_RPC_METHOD: Final = "rpc.method"
ATTR_GRPC_STATUS_CODE: Final = "rpc.grpc.status_code"


@dataclass(frozen=True, slots=True)
class MethodInfo:
    """A span's name and attributes for one RPC method."""

    name: str
    attributes: Mapping[str, str]


def method_info(full_method: str) -> MethodInfo:
    """`/package.Service/Method` → name `package.Service/Method` and the rpc.* attributes."""
    name = full_method.lstrip("/")
    service, _, method = name.rpartition("/")
    return MethodInfo(
        name,
        {ATTR_RPC_SYSTEM: "grpc", ATTR_RPC_SERVICE: service, ATTR_RPC_METHOD: method},
    )


def end_with_code(span: Span, code: grpc.StatusCode, description: str | None) -> None:
    """Record the status code (an error status unless OK) and end the span."""
    span.set_attribute(ATTR_GRPC_STATUS_CODE, code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, description or code.name))
    span.end()


def child_span(
    tracer: Tracer, name: str, kind: SpanKind = SpanKind.INTERNAL
) -> AbstractContextManager[Span]:
    """A child of the current span, made current while the block runs; when the current span
    is not recording (the request was not sampled), the current span itself, untouched.

    Same traces as `tracer.start_as_current_span`: under the parent-based samplers these
    services use, a child of an unsampled span is never sampled either, so the SDK span
    (sampler call, ids, context attach and detach: ~6 µs a span) is skipped where it could
    never be exported. Propagated `traceparent`s then name the unsampled parent, which is as
    good: nothing records it."""
    current = get_current_span()
    if not current.is_recording():
        return nullcontext(current)
    return tracer.start_as_current_span(name, kind=kind)
