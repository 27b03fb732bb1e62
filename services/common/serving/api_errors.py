"""Requests the servers refuse, as OpenAI's error JSON (`{"error": {"message", "type", "param",
"code"}}`), never as a stack trace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

# Retry-After on a 503, in whole seconds. What a 503 waits out passes in about a second: a
# Router's instance list refilling after etcd or the Conductor restarts, an engine or a
# Messenger finishing its start, a load balancer taking a draining server out of rotation. A
# client refused again waits again: 1 s (the least the header can say) retries soon without
# piling up.
UNAVAILABLE_RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request the server refuses; `status` and the OpenAI error fields say why."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        if retry_after_s is None and status == 503:
            retry_after_s = UNAVAILABLE_RETRY_AFTER_S  # every 503 says when to try again
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's Messages API (and vLLM's `/v1/messages`) shapes it."""
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def response(
        self, headers: Mapping[str, str] | None = None, *, anthropic: bool = False
    ) -> web.Response:
        """The error as an aiohttp response (with Retry-After on a 429 or a 503), OpenAI's
        JSON or, with `anthropic`, Anthropic's."""
        out = dict(headers or {})
        if self.retry_after_s is not None:
            out["Retry-After"] = str(max(1, round(self.retry_after_s + 0.4999)))
        body = self.anthropic_body() if anthropic else self.body()
        return web.json_response(body, status=self.status, headers=out)


def unavailable_headers() -> dict[str, str]:
    """The headers a 503 made without `ApiError` (a health or readiness answer) carries."""
    return {"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type_="service_unavailable", code="service_unavailable")


def rate_limited(message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        message,
        type_="rate_limit_error",
        code="rate_limit_exceeded",
        retry_after_s=retry_after_s,
    )


def overloaded(message: str, retry_after_s: float) -> ApiError:
    """A 429 for load shed before it could be admitted (a bounded queue was full, or the
    scheduler did not answer in time): OpenAI's rate-limit shape, with the code saying it is
    the server's load, not the client's quota."""
    return ApiError(
        429,
        message,
        type_="rate_limit_error",
        code="server_overloaded",
        retry_after_s=retry_after_s,
    )
