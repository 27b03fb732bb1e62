"""The client interceptor: one CLIENT span per call with ``traceparent`` injected into the
outgoing metadata, whatever the call's kind.

One class, `TracingClientInterceptor`, implements the four interceptor interfaces over one
wrapper (`_intercept`). grpc.aio files each interceptor object under the first of the four
interfaces it is an instance of (an if/elif chain when the channel is made), so one object
cannot serve every kind of call: `client_interceptors` hands grpc four instances, each of a
subclass that declares one interface, sharing the tracer and the method-name cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from services.common.telemetry.propagation import PROPAGATOR, SETTER, TRACE_KEYS
from services.common.telemetry.spans import MethodInfo, end_with_code, method_info

if TYPE_CHECKING:
    _UnaryUnaryBase = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamBase = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnaryBase = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStreamBase = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:  # the runtime classes are plain ABCs, not subscriptable
    _UnaryUnaryBase = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStreamBase = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnaryBase = grpc.aio.StreamUnaryClientInterceptor
    _StreamStreamBase = grpc.aio.StreamStreamClientInterceptor

_CallDetails = grpc.aio.ClientCallDetails
_Continuation = Callable[[_CallDetails, Any], Any]


class TracingClientInterceptor:
    """Traces client calls of every kind for one tracer; `methods` caches span names and
    attributes per method (shared by the instances `client_interceptors` makes)."""

    def __init__(self, tracer: Tracer, methods: dict[str | bytes, MethodInfo] | None = None):
        self._tracer = tracer
        self._methods = {} if methods is None else methods

    async def intercept_unary_unary(
        self, continuation: _Continuation, client_call_details: _CallDetails, request: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request, to_end=True)

    async def intercept_unary_stream(
        self, continuation: _Continuation, client_call_details: _CallDetails, request: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request, to_end=False)

    async def intercept_stream_unary(
        self,
        continuation: _Continuation,
        client_call_details: _CallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        # Not awaited to the end: with the ``call.write`` API a stream's writes wait for the
        # interceptor to return, so the span is ended from the call's done callback.
        return await self._intercept(
            continuation, client_call_details, request_iterator, to_end=False
        )

    async def intercept_stream_stream(
        self,
        continuation: _Continuation,
        client_call_details: _CallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await self._intercept(
            continuation, client_call_details, request_iterator, to_end=False
        )

    async def _intercept(
        self, continuation: _Continuation, details: _CallDetails, request: Any, *, to_end: bool
    ) -> Any:
        """Start the call in a CLIENT span. With `to_end` (unary-unary calls) the call is
        awaited here and the span ends before the caller sees the answer; otherwise the span
        ends from the call's done callback, as the caller consumes the call."""
        span, details = self._start(details)
        try:
            call = await cast(Awaitable[Any], continuation(details, request))
            if to_end:
                await call
        except BaseException as exc:  # AioRpcError: the caller sees it as if not intercepted
            _end_client_exc(span, exc)
            raise
        if to_end:
            end_with_code(span, grpc.StatusCode.OK, None)
        else:
            call.add_done_callback(lambda done: _spawn_end(span, done))
        return call

    def _start(self, details: _CallDetails) -> tuple[Span, _CallDetails]:
        method: str | bytes = details.method  # bytes at runtime, str in the stubs
        info = self._methods.get(method)
        if info is None:
            name = method.decode() if isinstance(method, bytes) else method
            info = self._methods[method] = method_info(name)
        span = self._tracer.start_span(info.name, kind=SpanKind.CLIENT, attributes=info.attributes)
        pairs: list[tuple[str, str | bytes]] = [
            (k, v) for k, v in details.metadata or () if k not in TRACE_KEYS
        ]
        PROPAGATOR.inject(pairs, context=trace.set_span_in_context(span), setter=SETTER)
        new_details = grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*pairs),
            details.credentials,
            details.wait_for_ready,
        )
        return span, new_details


def _end_client_exc(span: Span, exc: BaseException) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        end_with_code(span, exc.code(), exc.details())
    elif isinstance(exc, asyncio.CancelledError):
        end_with_code(span, grpc.StatusCode.CANCELLED, "cancelled")
    else:
        span.record_exception(exc)
        end_with_code(span, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")


_ENDING: set[asyncio.Task[None]] = set()


def _spawn_end(span: Span, call: Any) -> None:
    # Done callbacks are synchronous and the call's status getters are coroutines (already
    # resolved here), so the span is ended from a small task.
    task = asyncio.get_running_loop().create_task(_end_from_call(span, call))
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)


async def _end_from_call(span: Span, call: Any) -> None:
    try:
        code: grpc.StatusCode = await call.code()
        details: str | None = await call.details()
    except BaseException as exc:
        _end_client_exc(span, exc)
        if not isinstance(exc, Exception):
            raise
    else:
        end_with_code(span, code, details)


# ---- the one interceptor, declared as each interface in turn (see the module's docstring)


class _AsUnaryUnary(TracingClientInterceptor, _UnaryUnaryBase):
    pass


class _AsUnaryStream(TracingClientInterceptor, _UnaryStreamBase):
    pass


class _AsStreamUnary(TracingClientInterceptor, _StreamUnaryBase):
    pass


class _AsStreamStream(TracingClientInterceptor, _StreamStreamBase):
    pass


def client_interceptors(tracer: Tracer) -> list[grpc.aio.ClientInterceptor]:
    """For ``grpc.aio.insecure_channel(target, interceptors=client_interceptors(tracer))``:
    one CLIENT span per call (unary-unary, unary-stream, stream-unary, stream-stream), with
    ``traceparent`` injected into the outgoing metadata."""
    methods: dict[str | bytes, MethodInfo] = {}
    kinds = (_AsUnaryUnary, _AsUnaryStream, _AsStreamUnary, _AsStreamStream)
    interceptors: list[object] = [kind(tracer, methods) for kind in kinds]
    return cast("list[grpc.aio.ClientInterceptor]", interceptors)
