"""Requests the servers refuse, as OpenAI's error JSON (`{"error": {"message", "type", "param",
"code"}}`), never as a stack trace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web


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

    def response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        """The error as an aiohttp response (with Retry-After on a 429)."""
        out = dict(headers or {})
        if self.retry_after_s is not None:
            out["Retry-After"] = str(max(1, round(self.retry_after_s + 0.4999)))
        return web.json_response(self.body(), status=self.status, headers=out)


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
