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
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.context import Context, attach, detach, get_current
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    _ServerInterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
    _UnaryUnaryBase = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
    _UnaryStreamBase = grpc.aio.UnaryStreamClientInterceptor[Any, Any]
    _StreamUnaryBase = grpc.aio.StreamUnaryClientInterceptor[Any, Any]
    _StreamStreamBase = grpc.aio.StreamStreamClientInterceptor[Any, Any]
else:  # the runtime classes are plain ABCs, not subscriptable
    _ServerInterceptorBase = grpc.aio.ServerInterceptor
    _UnaryUnaryBase = grpc.aio.UnaryUnaryClientInterceptor
    _UnaryStreamBase = grpc.aio.UnaryStreamClientInterceptor
    _StreamUnaryBase = grpc.aio.StreamUnaryClientInterceptor
    _StreamStreamBase = grpc.aio.StreamStreamClientInterceptor

__all__ = [
    "TelemetrySettings",
    "client_interceptors",
    "get_tracer",
    "inject_metadata",
    "server_interceptor",
    "setup_tracing",
    "shutdown_tracing",
]

TRACER_NAME: Final = "kvsched.services"

ATTR_RPC_SYSTEM: Final = "rpc.system"
ATTR_RPC_SERVICE: Final = "rpc.service"
ATTR_RPC_METHOD: Final = "rpc.method"
ATTR_GRPC_STATUS_CODE: Final = "rpc.grpc.status_code"

_TRACEPARENT: Final = "traceparent"
_TRACESTATE: Final = "tracestate"
_TRACE_KEYS: Final = frozenset((_TRACEPARENT, _TRACESTATE))

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_EMPTY_CONTEXT: Final = Context()  # server spans take their parent from the wire only

MetadataPairs = Sequence[tuple[str, str | bytes]]
_Behavior = Callable[..., Any]


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """How a service traces.  ``otlp_endpoint=None`` keeps spans in-process (no export)."""

    service_name: str
    otlp_endpoint: str | None = None
    otlp_insecure: bool = True
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")

    @classmethod
    def from_env(
        cls, default_service_name: str = "kvsched", environ: Mapping[str, str] | None = None
    ) -> TelemetrySettings:
        """Read the standard OTel variables.

        ``OTEL_SERVICE_NAME``; ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or else
        ``OTEL_EXPORTER_OTLP_ENDPOINT`` (unset or empty: no export);
        ``OTEL_EXPORTER_OTLP_TRACES_INSECURE`` / ``OTEL_EXPORTER_OTLP_INSECURE`` (default
        true; an ``https://`` endpoint is always secure); ``OTEL_TRACES_SAMPLER_ARG``
        (ratio, default 1.0).
        """
        env = os.environ if environ is None else environ
        endpoint = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        ) or None
        insecure_raw = env.get("OTEL_EXPORTER_OTLP_TRACES_INSECURE") or env.get(
            "OTEL_EXPORTER_OTLP_INSECURE"
        )
        insecure = True if not insecure_raw else insecure_raw.strip().lower() == "true"
        ratio_raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        ratio = float(ratio_raw) if ratio_raw else 1.0
        return cls(
            service_name=env.get("OTEL_SERVICE_NAME") or default_service_name,
            otlp_endpoint=endpoint,
            otlp_insecure=insecure,
            sample_ratio=ratio,
        )


def setup_tracing(settings: TelemetrySettings, *, set_global: bool = False) -> TracerProvider:
    """A new provider: ``service.name`` resource, parent-based ratio sampler, and a
    BatchSpanProcessor over an OTLP/gRPC exporter when an endpoint is set.

    The global provider is left alone unless ``set_global`` (OTel lets it be set once per
    process; do that in a service's ``main``, never in tests).
    """
    root = ALWAYS_ON if settings.sample_ratio >= 1.0 else TraceIdRatioBased(settings.sample_ratio)
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: settings.service_name}),
        # With nowhere to send spans, record none (spans still carry the caller's context).
        sampler=ParentBased(root) if settings.otlp_endpoint else ALWAYS_OFF,
    )
    if settings.otlp_endpoint:
        exporter = OTLPSpanExporter(
            endpoint=settings.otlp_endpoint, insecure=settings.otlp_insecure
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def get_tracer(provider: TracerProvider, name: str = TRACER_NAME) -> Tracer:
    return provider.get_tracer(name)


def shutdown_tracing(provider: TracerProvider, timeout_s: float = 5.0) -> bool:
    """Flush queued spans (bounded by ``timeout_s``), then shut the provider down.

    Blocking: from a coroutine use ``await asyncio.to_thread(shutdown_tracing, provider)``,
    above all when the OTLP receiver runs on the same event loop.  Returns whether the
    flush completed in time.
    """
    flushed = provider.force_flush(int(timeout_s * 1000))
    provider.shutdown()
    return flushed


# --------------------------------------------------------------------------- propagation


class _MetadataGetter(Getter[MetadataPairs]):
    def get(self, carrier: MetadataPairs, key: str) -> list[str] | None:
        values = [v for k, v in carrier if k == key and isinstance(v, str)]
        return values or None

    def keys(self, carrier: MetadataPairs) -> list[str]:
        return [k for k, _ in carrier]


class _ListSetter(Setter[list[Any]]):
    def set(self, carrier: list[Any], key: str, value: str) -> None:
        carrier.append((key, value))


_GETTER: Final = _MetadataGetter()
_SETTER: Final = _ListSetter()


def inject_metadata(
    metadata: Iterable[tuple[str, str]] = (), context: Context | None = None
) -> list[tuple[str, str]]:
    """``metadata`` plus ``traceparent``/``tracestate`` for the current span (or the span in
    ``context``); any trace headers already present are replaced.  Nothing is added when
    there is no valid span."""
    out = [(k, v) for k, v in metadata if k not in _TRACE_KEYS]
    _PROPAGATOR.inject(out, context=context, setter=_SETTER)
    return out


def _extract(metadata: MetadataPairs | None) -> Context:
    if not metadata:
        return _EMPTY_CONTEXT
    return _PROPAGATOR.extract(metadata, context=_EMPTY_CONTEXT, getter=_GETTER)


# --------------------------------------------------------------------------- server side


@dataclass(frozen=True, slots=True)
class _MethodInfo:
    name: str
    attributes: Mapping[str, str]


def _method_info(full_method: str) -> _MethodInfo:
    name = full_method.lstrip("/")
    service, _, method = name.rpartition("/")
    return _MethodInfo(
        name,
        {ATTR_RPC_SYSTEM: "grpc", ATTR_RPC_SERVICE: service, ATTR_RPC_METHOD: method},
    )


def _end_with_code(span: Span, code: grpc.StatusCode, description: str | None) -> None:
    span.set_attribute(ATTR_GRPC_STATUS_CODE, code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, description or code.name))
    span.end()


def _context_code(context: Any) -> grpc.StatusCode | None:
    # ``code()`` reports what ``abort``/``set_code`` set (None if neither); the context grpc.aio
    # hands to sync handlers has no getters.
    getter = getattr(context, "code", None)
    return getter() if getter is not None else None


def _context_details(context: Any) -> str | None:
    getter = getattr(context, "details", None)
    return (getter() or None) if getter is not None else None


def _finish_server_span(span: Span, context: Any, exc: BaseException | None) -> None:
    """End ``span`` with the status grpc.aio will send for this outcome."""
    code = _context_code(context)
    if exc is None:
        code = code or grpc.StatusCode.OK
    elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # Client gone, deadline, or a stream abandoned after an abort / server stop.
        code = code if code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.CANCELLED
    elif isinstance(exc, grpc.aio.AbortError):
        if code is None:  # aborted through a sync-handler context: code not readable
            span.set_status(Status(StatusCode.ERROR, "aborted"))
            span.end()
            return
    else:
        span.record_exception(exc)
        code = code if code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNKNOWN
    if code is grpc.StatusCode.OK:
        _end_with_code(span, code, None)
    else:
        _end_with_code(span, code, _context_details(context))


class _TracingServerInterceptor(_ServerInterceptorBase):
    """Wraps each method handler once (cached per method) and keeps its kind: coroutine,
    async generator or plain function, which is how grpc.aio picks the calling convention
    (async vs thread pool; generator vs ``context.write``)."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._wrapped: dict[
            str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]
        ] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler  # type: ignore[return-value]  # the stubs miss the Optional
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and (cached[0] is handler or cached[0] == handler):
            return cached[1]
        wrapped = self._wrap_handler(handler, _method_info(method))
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap_handler(
        self, handler: grpc.RpcMethodHandler[Any, Any], info: _MethodInfo
    ) -> grpc.RpcMethodHandler[Any, Any]:
        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.request_streaming and handler.response_streaming:
            assert handler.stream_stream is not None
            return grpc.stream_stream_rpc_method_handler(
                self._wrap(handler.stream_stream, info, streaming=True), des, ser
            )
        if handler.request_streaming:
            assert handler.stream_unary is not None
            return grpc.stream_unary_rpc_method_handler(
                self._wrap(handler.stream_unary, info, streaming=False), des, ser
            )
        if handler.response_streaming:
            assert handler.unary_stream is not None
            return grpc.unary_stream_rpc_method_handler(
                self._wrap(handler.unary_stream, info, streaming=True), des, ser
            )
        assert handler.unary_unary is not None
        return grpc.unary_unary_rpc_method_handler(
            self._wrap(handler.unary_unary, info, streaming=False), des, ser
        )

    def _start(self, info: _MethodInfo, context: Any) -> tuple[Span, Context]:
        parent = _extract(context.invocation_metadata())
        span = self._tracer.start_span(
            info.name, parent, kind=SpanKind.SERVER, attributes=info.attributes
        )
        return span, trace.set_span_in_context(span, parent)

    def _wrap(self, behavior: _Behavior, info: _MethodInfo, *, streaming: bool) -> _Behavior:
        # Same dispatch order as grpc.aio's server: coroutine functions first (for streaming
        # responses that is the ``context.write`` style), then async generators, else sync.
        if inspect.iscoroutinefunction(behavior):
            return self._wrap_coroutine(behavior, info)
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_async_gen(behavior, info)
        if streaming:
            return self._wrap_sync_gen(behavior, info)
        return self._wrap_sync(behavior, info)

    def _wrap_coroutine(self, behavior: _Behavior, info: _MethodInfo) -> _Behavior:
        start = self._start

        async def traced(request: Any, context: Any) -> Any:
            span, ctx = start(info, context)
            token = attach(ctx)
            try:
                result = await behavior(request, context)
            except BaseException as exc:
                detach(token)
                _finish_server_span(span, context, exc)
                raise
            detach(token)
            _finish_server_span(span, context, None)
            return result

        return traced

    def _wrap_async_gen(self, behavior: _Behavior, info: _MethodInfo) -> _Behavior:
        start = self._start

        async def traced(request: Any, context: Any) -> AsyncIterator[Any]:
            span, ctx = start(info, context)
            # The handler's steps run with `ctx` attached; the context is detached across our
            # own yields (and carried over between steps), so a generator finalised from
            # another task never detaches a token it does not own.
            responses: AsyncIterator[Any] = behavior(request, context)
            exc: BaseException | None = None
            try:
                while True:
                    token = attach(ctx)
                    try:
                        item = await anext(responses)
                    except StopAsyncIteration:
                        break
                    finally:
                        ctx = get_current()
                        detach(token)
                    yield item
            except BaseException as err:
                exc = err
                raise
            finally:
                if exc is not None:  # unfinished only when closed at our yield
                    token = attach(ctx)
                    try:
                        await _aclose(responses)
                    finally:
                        detach(token)
                _finish_server_span(span, context, exc)

        return traced

    def _wrap_sync(self, behavior: _Behavior, info: _MethodInfo) -> _Behavior:
        start = self._start

        def traced(request: Any, context: Any) -> Any:
            span, ctx = start(info, context)
            token = attach(ctx)
            try:
                result = behavior(request, context)
            except BaseException as exc:
                detach(token)
                _finish_server_span(span, context, exc)
                raise
            detach(token)
            _finish_server_span(span, context, None)
            return result

        return traced

    def _wrap_sync_gen(self, behavior: _Behavior, info: _MethodInfo) -> _Behavior:
        start = self._start

        def traced(request: Any, context: Any) -> Iterator[Any]:
            # Each step may run on a different pool thread: attach/detach per step.
            span, ctx = start(info, context)
            exc: BaseException | None = None
            responses: Iterator[Any] | None = None
            try:
                while True:
                    token = attach(ctx)
                    try:
                        if responses is None:
                            responses = iter(behavior(request, context))
                        item = next(responses)
                    except StopIteration:
                        break
                    finally:
                        ctx = get_current()
                        detach(token)
                    yield item
            except BaseException as err:
                exc = err
                raise
            finally:
                close = getattr(responses, "close", None)
                if close is not None:
                    close()
                _finish_server_span(span, context, exc)

        return traced


async def _aclose(responses: AsyncIterator[Any]) -> None:
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        await aclose()


def server_interceptor(tracer: Tracer) -> grpc.aio.ServerInterceptor[Any, Any]:
    """For ``grpc.aio.server(interceptors=[server_interceptor(tracer)])``."""
    return _TracingServerInterceptor(tracer)


# --------------------------------------------------------------------------- client side


_CallDetails = grpc.aio.ClientCallDetails


class _ClientTracing:
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._methods: dict[str | bytes, _MethodInfo] = {}

    def _start(self, details: _CallDetails) -> tuple[Span, _CallDetails]:
        method: str | bytes = details.method  # bytes at runtime, str in the stubs
        info = self._methods.get(method)
        if info is None:
            name = method.decode() if isinstance(method, bytes) else method
            info = self._methods[method] = _method_info(name)
        span = self._tracer.start_span(info.name, kind=SpanKind.CLIENT, attributes=info.attributes)
        pairs: list[tuple[str, str | bytes]] = [
            (k, v) for k, v in details.metadata or () if k not in _TRACE_KEYS
        ]
        _PROPAGATOR.inject(pairs, context=trace.set_span_in_context(span), setter=_SETTER)
        new_details = grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            grpc.aio.Metadata(*pairs),
            details.credentials,
            details.wait_for_ready,
        )
        return span, new_details

    async def _streaming(
        self, continuation: Callable[[_CallDetails, Any], Any], details: _CallDetails, arg: Any
    ) -> Any:
        """Start a streaming call in a CLIENT span that ends when the call does."""
        span, details = self._start(details)
        try:
            call = await cast(Awaitable[Any], continuation(details, arg))
        except BaseException as exc:
            _end_client_exc(span, exc)
            raise
        call.add_done_callback(lambda done: _spawn_end(span, done))
        return call


def _end_client_exc(span: Span, exc: BaseException) -> None:
    if isinstance(exc, grpc.aio.AioRpcError):
        _end_with_code(span, exc.code(), exc.details())
    elif isinstance(exc, asyncio.CancelledError):
        _end_with_code(span, grpc.StatusCode.CANCELLED, "cancelled")
    else:
        span.record_exception(exc)
        _end_with_code(span, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")


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
        _end_with_code(span, code, details)


class _UnaryUnaryTracing(_ClientTracing, _UnaryUnaryBase):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[_CallDetails, Any], grpc.aio.UnaryUnaryCall[Any, Any]],
        client_call_details: _CallDetails,
        request: Any,
    ) -> Any:
        span, details = self._start(client_call_details)
        try:
            call = await cast(Awaitable[Any], continuation(details, request))
            await call
        except BaseException as exc:  # AioRpcError: the caller sees it as if not intercepted
            _end_client_exc(span, exc)
            raise
        _end_with_code(span, grpc.StatusCode.OK, None)
        return call


class _UnaryStreamTracing(_ClientTracing, _UnaryStreamBase):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[_CallDetails, Any], grpc.aio.UnaryStreamCall[Any, Any]],
        client_call_details: _CallDetails,
        request: Any,
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request)


class _StreamUnaryTracing(_ClientTracing, _StreamUnaryBase):
    async def intercept_stream_unary(
        self,
        continuation: Callable[[_CallDetails, Any], grpc.aio.StreamUnaryCall[Any, Any]],
        client_call_details: _CallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        # Not awaited here: with the ``call.write`` API the caller's writes wait for this
        # interceptor to return, so the span is ended from the call's done callback.
        return await self._streaming(continuation, client_call_details, request_iterator)


class _StreamStreamTracing(_ClientTracing, _StreamStreamBase):
    async def intercept_stream_stream(
        self,
        continuation: Callable[[_CallDetails, Any], grpc.aio.StreamStreamCall[Any, Any]],
        client_call_details: _CallDetails,
        request_iterator: AsyncIterable[Any] | Iterable[Any],
    ) -> Any:
        return await self._streaming(continuation, client_call_details, request_iterator)


def client_interceptors(tracer: Tracer) -> list[grpc.aio.ClientInterceptor]:
    """For ``grpc.aio.insecure_channel(target, interceptors=client_interceptors(tracer))``:
    one CLIENT span per call (unary-unary, unary-stream, stream-unary, stream-stream), with
    ``traceparent`` injected into the outgoing metadata."""
    interceptors: list[object] = [
        _UnaryUnaryTracing(tracer),
        _UnaryStreamTracing(tracer),
        _StreamUnaryTracing(tracer),
        _StreamStreamTracing(tracer),
    ]
    return cast("list[grpc.aio.ClientInterceptor]", interceptors)
