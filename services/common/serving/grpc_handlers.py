"""The mechanism the project's server interceptors share: each method's handler wrapped once
(cached per method) into a handler of the same kind (unary or streaming each way), which is
how grpc.aio picks the calling convention. An interceptor says only how it wraps."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

if TYPE_CHECKING:
    _ServerInterceptorBase = grpc.aio.ServerInterceptor[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]
else:  # the runtime classes are plain ABCs, not subscriptable
    _ServerInterceptorBase = grpc.aio.ServerInterceptor
    Handler = grpc.RpcMethodHandler
Behavior = Callable[..., Any]


class WrappingInterceptor(_ServerInterceptorBase):
    """Wraps each method's handler with `wrap_handler`, once per method and handler."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    def wrap_handler(self, handler: Handler, method: str) -> Handler:
        """The handler to serve `method` with instead of `handler` (changes nothing else)."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return handler  # type: ignore[return-value]  # the stubs miss the Optional
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and (cached[0] is handler or cached[0] == handler):
            return cached[1]
        wrapped = self.wrap_handler(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped


def behavior_of(handler: Handler) -> Behavior:
    """The function `handler` calls, whichever its kind."""
    if handler.request_streaming:
        behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
    else:
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
    assert behavior is not None
    return behavior


def same_kind(
    handler: Handler, behavior: Behavior, request_deserializer: Any | None = None
) -> Handler:
    """A handler of `handler`'s kind and serializers calling `behavior` (and decoding with
    `request_deserializer` when given)."""
    des = request_deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior, des, ser)
    return grpc.unary_unary_rpc_method_handler(behavior, des, ser)
