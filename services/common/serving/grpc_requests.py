"""Requests a gRPC server cannot decode: answered INVALID_ARGUMENT with a short message and a
rate-limited WARNING, where grpc would answer UNKNOWN ("Unexpected <class DecodeError>") and
log a traceback for each.

grpc deserializes a request before any handler or interceptor code runs, and an exception
there is treated as a server bug. So the deserializer is wrapped (`tolerant`) to hand the
handler an `Undecodable` in place of the message, and the handler wrapper (the server
interceptor) refuses it through its context (`refuse` for one request, `checked` for a
request stream). A plain (thread-pool) handler's request stream keeps grpc's own decoding.
Each is told which `ClientErrorLog` to warn through: the server's own (its interceptor's), so
two servers in one process do not share a budget."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from services.common.serving.client_errors import ClientErrorLog

log = logging.getLogger(__name__)

Deserializer = Callable[[bytes], Any]


class Undecodable:
    """What a request that failed to decode is handed to its handler as."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def tolerant(deserializer: Deserializer | None) -> Deserializer | None:
    """`deserializer`, returning an `Undecodable` where it would raise."""
    if deserializer is None:
        return None
    decode = deserializer

    def deserialize(raw: bytes) -> Any:
        try:
            return decode(raw)
        except Exception as exc:  # protobuf raises DecodeError; any failure is the client's
            return Undecodable(f"{type(exc).__name__}: {exc}"[:200])

    return deserialize


def client_error_log() -> ClientErrorLog:
    """A new rate-limited log for one server's undecodable requests."""
    return ClientErrorLog(log)


def _message(method: str, request: Undecodable, errors: ClientErrorLog) -> str:
    errors.warning("undecodable request to %s: %s", method, request.reason)
    return f"the request is not a valid {method.rpartition('/')[2]} message"


async def refuse(request: Any, context: Any, method: str, errors: ClientErrorLog) -> None:
    """Abort the call INVALID_ARGUMENT when `request` did not decode (async handlers), with a
    warning through `errors`."""
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request, errors))


def refuse_sync(request: Any, context: Any, method: str, errors: ClientErrorLog) -> None:
    """`refuse` for handlers that grpc runs on its thread pool."""
    if isinstance(request, Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request, errors))


async def checked(
    requests: AsyncIterator[Any], context: Any, method: str, errors: ClientErrorLog
) -> AsyncIterator[Any]:
    """A request stream that aborts the call at the first message that did not decode."""
    async for request in requests:
        await refuse(request, context, method, errors)
        yield request
