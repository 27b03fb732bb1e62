"""The server interceptor: one SERVER span per RPC, parented on the caller's trace context
and current while the handler runs (the whole stream for streaming RPCs). It also answers a
request that does not decode INVALID_ARGUMENT (`grpc_requests`), inside that span."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.context import Context, attach, detach, get_current
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from services.common.serving import grpc_requests
from services.common.serving.client_errors import ClientErrorLog
from services.common.serving.grpc_handlers import (
    Behavior,
    Handler,
    WrappingInterceptor,
    behavior_of,
    same_kind,
)
from services.common.telemetry.propagation import extract
from services.common.telemetry.spans import MethodInfo, end_with_code, method_info


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
        end_with_code(span, code, None)
    else:
        end_with_code(span, code, _context_details(context))


class _TracingServerInterceptor(WrappingInterceptor):
    """Wraps each method handler once (cached per method) and keeps its kind: coroutine,
    async generator or plain function, which is how grpc.aio picks the calling convention
    (async vs thread pool; generator vs ``context.write``). Requests are decoded tolerantly
    and one that does not decode is refused (`grpc_requests`; a plain handler's request
    stream excepted), with a warning through this server's own `client_errors`."""

    def __init__(self, tracer: Tracer, client_errors: ClientErrorLog | None = None) -> None:
        super().__init__()
        self._tracer = tracer
        self.client_errors = client_errors or grpc_requests.client_error_log()

    def wrap_handler(self, handler: Handler, method: str) -> Handler:
        behavior = behavior_of(handler)
        stream_in = handler.request_streaming
        # A sync handler's request stream is not checked: it keeps grpc's own decoding.
        des = None
        if not stream_in or not _is_sync(behavior):
            des = grpc_requests.tolerant(handler.request_deserializer)
        wrapped = self._wrap(
            behavior,
            method_info(method),
            streaming=bool(handler.response_streaming),
            stream_in=stream_in,
        )
        return same_kind(handler, wrapped, des)

    def _start(self, info: MethodInfo, context: Any) -> tuple[Span, Context]:
        parent = extract(context.invocation_metadata())
        span = self._tracer.start_span(
            info.name, parent, kind=SpanKind.SERVER, attributes=info.attributes
        )
        return span, trace.set_span_in_context(span, parent)

    def _wrap(
        self, behavior: Behavior, info: MethodInfo, *, streaming: bool, stream_in: bool
    ) -> Behavior:
        # Same dispatch order as grpc.aio's server: coroutine functions first (for streaming
        # responses that is the ``context.write`` style), then async generators, else sync.
        errors = self.client_errors
        if inspect.iscoroutinefunction(behavior):
            return self._wrap_coroutine(_checking(behavior, info, stream_in, errors), info)
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_async_gen(_checking_gen(behavior, info, stream_in, errors), info)
        checked = behavior if stream_in else _checking_sync(behavior, info, errors)
        if streaming:
            return self._wrap_sync_gen(checked, info)
        return self._wrap_sync(checked, info)

    def _wrap_coroutine(self, behavior: Behavior, info: MethodInfo) -> Behavior:
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

    def _wrap_async_gen(self, behavior: Behavior, info: MethodInfo) -> Behavior:
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

    def _wrap_sync(self, behavior: Behavior, info: MethodInfo) -> Behavior:
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

    def _wrap_sync_gen(self, behavior: Behavior, info: MethodInfo) -> Behavior:
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


def _is_sync(behavior: Behavior) -> bool:
    return not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior))


def _checking(
    behavior: Behavior, info: MethodInfo, stream_in: bool, errors: ClientErrorLog
) -> Behavior:
    """A coroutine handler that refuses an undecodable request (or request in its stream)."""
    method = info.name

    async def handler(request: Any, context: Any) -> Any:
        if stream_in:
            requests = grpc_requests.checked(request, context, method, errors)
            return await behavior(requests, context)
        await grpc_requests.refuse(request, context, method, errors)
        return await behavior(request, context)

    return handler


def _checking_gen(
    behavior: Behavior, info: MethodInfo, stream_in: bool, errors: ClientErrorLog
) -> Behavior:
    """`_checking` for an async-generator handler: returns its response stream."""
    method = info.name

    def handler(request: Any, context: Any) -> AsyncIterator[Any]:
        if stream_in:
            responses: AsyncIterator[Any] = behavior(
                grpc_requests.checked(request, context, method, errors), context
            )
            return responses
        return _refused_first(behavior, request, context, method, errors)

    return handler


async def _refused_first(
    behavior: Behavior, request: Any, context: Any, method: str, errors: ClientErrorLog
) -> AsyncIterator[Any]:
    await grpc_requests.refuse(request, context, method, errors)
    responses: AsyncIterator[Any] = behavior(request, context)
    try:
        async for item in responses:
            yield item
    finally:
        await _aclose(responses)


def _checking_sync(behavior: Behavior, info: MethodInfo, errors: ClientErrorLog) -> Behavior:
    """`_checking` for a handler grpc runs on its thread pool (one request)."""
    method = info.name

    def handler(request: Any, context: Any) -> Any:
        grpc_requests.refuse_sync(request, context, method, errors)
        return behavior(request, context)

    return handler


async def _aclose(responses: AsyncIterator[Any]) -> None:
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        await aclose()


def server_interceptor(
    tracer: Tracer, client_errors: ClientErrorLog | None = None
) -> grpc.aio.ServerInterceptor[Any, Any]:
    """For ``grpc.aio.server(interceptors=[server_interceptor(tracer)])``; undecodable
    requests are warned about through `client_errors` (default: a log of its own, so one per
    server)."""
    return _TracingServerInterceptor(tracer, client_errors)
