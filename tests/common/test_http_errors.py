"""`http_errors` on a bare application: a client's mistakes as OpenAI error JSON logged as
warnings, a handler's bug as a JSON 500 still logged with its traceback."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web

from services.common import http_errors
from services.common.client_errors import ClientErrorLog
from services.common.http_errors import JsonErrorRunner, json_errors
from services.common.http_site import start_site


@pytest.fixture(autouse=True)
def fresh_client_error_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with a full burst of the process-wide client-error log (other tests
    in this process may have spent it: their lines would be left out here)."""
    monkeypatch.setattr(
        http_errors, "_client_errors", ClientErrorLog(logging.getLogger(http_errors.__name__))
    )


async def _broken(request: web.Request) -> web.Response:
    raise RuntimeError("a bug")


async def _too_large(request: web.Request) -> web.Response:
    raise web.HTTPRequestEntityTooLarge(max_size=1, actual_size=2)


async def test_errors_are_json_and_only_bugs_have_tracebacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = web.Application(middlewares=[json_errors])
    app.add_routes([web.get("/broken", _broken), web.get("/big", _too_large)])
    runner, port = await start_site(app, "127.0.0.1:0", runner_class=JsonErrorRunner)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            answers = {}
            for path in ("/broken", "/big", "/missing"):
                async with http.get(path) as resp:
                    answers[path] = (resp.status, (await resp.json())["error"])
    finally:
        await runner.cleanup()
    assert answers["/broken"] == (
        500,
        {"message": "internal error", "type": "internal_error", "param": None, "code": 500},
    )
    assert answers["/big"][0] == 413 and "size 1 exceeded" in answers["/big"][1]["message"]
    assert answers["/missing"] == (
        404,
        {
            "message": "Invalid URL (GET /missing)",
            "type": "invalid_request_error",
            "param": None,
            "code": 404,
        },
    )
    bugs = [r for r in caplog.records if r.exc_info]
    assert len(bugs) == 1 and "/broken" in bugs[0].getMessage()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["GET /big: 413", "GET /missing: 404"]
