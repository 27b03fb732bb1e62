"""How failed Conductor calls reach the caller: `ConductorError` and its subclasses, one per
status the caller acts on, built from a gRPC error with the server's trailers (a refusal's
`retry-after-ms`, a standby's `kvsched-leader`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Final, cast

import grpc
from grpc import aio

LEADER_TRAILER: Final = "kvsched-leader"
RETRY_AFTER_TRAILER: Final = "retry-after-ms"
STATUS_CODES: Final = {status.value[0]: status for status in grpc.StatusCode}
"""gRPC status codes by their number (as a stream item's error carries them)."""


class ConductorError(Exception):
    """A call failed. `code` is the gRPC status, `trailers` the server's trailing metadata."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_s: float | None = None,
        *,
        trailers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.trailers: dict[str, str] = trailers or {}


class Rejected(ConductorError):
    """RESOURCE_EXHAUSTED: no instance can take the request now (none meets the latency
    objectives, or none has a slot for its LoRA adapter); retry after `retry_after_s` (None
    when the server did not say)."""


class InvalidRequest(ConductorError):
    """INVALID_ARGUMENT: the request is malformed; retrying will not help."""


class NotFound(ConductorError):
    """NOT_FOUND: no such instance, session or transfer."""


class Unavailable(ConductorError):
    """No leader (or no Conductor at all) answered within the retry budget: UNAVAILABLE,
    DEADLINE_EXCEEDED, or FAILED_PRECONDITION from standbys that kept refusing."""


_ERRORS: Final[dict[grpc.StatusCode, type[ConductorError]]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Rejected,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def error_for(
    code: grpc.StatusCode,
    message: str,
    trailers: dict[str, str] | None = None,
    retry_after_s: float | None = None,
) -> ConductorError:
    """The `ConductorError` subclass for `code`; `retry_after_s` from the trailers unless
    given."""
    trailers = trailers or {}
    if retry_after_s is None and RETRY_AFTER_TRAILER in trailers:
        with contextlib.suppress(ValueError):
            retry_after_s = float(trailers[RETRY_AFTER_TRAILER]) / 1000.0
    return _ERRORS.get(code, ConductorError)(code, message, retry_after_s, trailers=trailers)


def _trailers(err: grpc.RpcError) -> dict[str, str]:
    # At run time an AioRpcError's trailing metadata iterates as (key, value) pairs.
    pairs = cast("Iterable[tuple[str, str | bytes]]", err.trailing_metadata() or ())
    out: dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key.lower(), value.decode() if isinstance(value, bytes) else value)
    return out


def from_rpc_error(err: grpc.RpcError) -> ConductorError:
    """What a failed call raises instead of the grpc error."""
    if not isinstance(err, aio.AioRpcError):  # e.g. raised by an interceptor
        return ConductorError(grpc.StatusCode.UNKNOWN, str(err))
    return error_for(err.code(), err.details() or "", _trailers(err))
