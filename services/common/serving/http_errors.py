"""OpenAI-shaped JSON for every error an aiohttp server answers, aiohttp's own included: an
unknown route (404), a wrong method (405), a request the HTTP parser refuses (a malformed
request line or header), never aiohttp's plain-text pages.

Two places, as aiohttp makes them: `json_errors`, a middleware, turns the `HTTPException`s
that routing and handlers raise into `ApiError` responses; `JsonErrorRunner` answers what the
parser refuses before any middleware runs (aiohttp builds that answer in its connection
handler, which has no hook but its class). Client mistakes are logged as rate-limited
warnings without a traceback, through the application's own `ClientErrorLog` (`CLIENT_ERRORS`;
`JsonErrorRunner` gives an application without one its own), so two servers in one process
(or two tests) do not spend each other's burst; a bug (an unexpected exception) is still
logged with a traceback."""

from __future__ import annotations

import logging
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from services.common.serving.api_errors import ApiError
from services.common.serving.client_errors import ClientErrorLog

log = logging.getLogger(__name__)

# The application's rate-limited log of client mistakes (a server may share it with its own
# handlers, as the Router does).
CLIENT_ERRORS = web.AppKey("client_errors", ClientErrorLog)


def http_error(status: int, message: str) -> ApiError:
    """The `ApiError` for an HTTP error status aiohttp would answer itself."""
    type_ = "invalid_request_error" if status < 500 else "internal_error"
    return ApiError(status, message, type_=type_)


def _message(request: BaseRequest, exc: web.HTTPException) -> str:
    if exc.status == 404:  # OpenAI's words for a path it does not serve
        return f"Invalid URL ({request.method} {request.path})"
    if exc.status == 405:
        return f"Method {request.method} is not allowed on {request.path}"
    text = exc.text or ""
    # aiohttp's texts start with the status ("413: Request Entity Too Large")
    return text.partition(": ")[2] if text.startswith(f"{exc.status}: ") else text or exc.reason


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Middleware: an `HTTPException` of 400 or more as OpenAI error JSON (its headers, such
    as a 405's Allow, kept); an unexpected exception as a JSON 500, logged with its traceback."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status < 500:
            _client_errors(request.app).warning(
                "%s %s: %d", request.method, request.path, exc.status
            )
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in _BODY_HEADERS}
        return http_error(exc.status, _message(request, exc)).response(headers)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return http_error(500, "internal error").response()


_BODY_HEADERS = frozenset({"content-type", "content-length", "content-encoding"})


def _client_errors(app: web.Application) -> ClientErrorLog:
    found = app.get(CLIENT_ERRORS)
    # (an application served without `JsonErrorRunner` may have none: a limiter just for now)
    return found if found is not None else ClientErrorLog(log)


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler, answering what it refuses itself (a request it cannot
    parse, a handler's timeout) with OpenAI error JSON."""

    _manager: _JsonErrorServer

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:  # a bug or a timeout here: aiohttp logs it with its traceback
            super().handle_error(request, status, exc, message)
            text = "internal error" if status == 500 else "the request timed out"
        else:
            # The parser's reason ("Bad status line ..."), without a traceback.
            text = message or str(exc or "") or "bad request"
            self._manager.client_errors.warning(
                "unparsable request from %s: %s", request.remote, text
            )
            if request.writer.output_size > 0:  # as aiohttp: nothing more can be sent
                raise ConnectionError("a response was sent already")
        response = http_error(status, text).response()
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    client_errors: ClientErrorLog  # the application's (set by `JsonErrorRunner`)

    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """`web.AppRunner` whose server answers the requests aiohttp refuses with OpenAI error
    JSON (see `_JsonErrorHandler`); gives the application its own `CLIENT_ERRORS` log if it
    has none."""

    async def _make_server(self) -> web.Server:
        app = self.app
        if CLIENT_ERRORS not in app:  # (before aiohttp freezes the application, below)
            app[CLIENT_ERRORS] = ClientErrorLog(log)
        server = await super()._make_server()
        # The application builds its `Server` itself; only that server's class says which
        # connection handler it makes (its state stays as aiohttp set it).
        server.__class__ = _JsonErrorServer
        cast(_JsonErrorServer, server).client_errors = app[CLIENT_ERRORS]
        return server
