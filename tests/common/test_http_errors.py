"""`http_errors` on a bare application: a client's mistakes as OpenAI error JSON logged as
warnings, a handler's bug as a JSON 500 still logged with its traceback."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from services.common.serving.client_errors import ClientErrorLog
from services.common.serving.http_errors import CLIENT_ERRORS, JsonErrorRunner, json_errors
from services.common.serving.http_site import start_site


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


async def test_each_application_has_its_own_client_error_budget(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Two servers in one process: the one given a budget of 2 spends it; the other, given
    # its own by the runner, still logs. Unparsable requests count against the same budget.
    given = ClientErrorLog(logging.getLogger("test.given"), burst=2)
    apps = [web.Application(middlewares=[json_errors]) for _ in range(2)]
    apps[0][CLIENT_ERRORS] = given
    sites = [await start_site(app, "127.0.0.1:0", runner_class=JsonErrorRunner) for app in apps]
    try:
        for (_, port), count in zip(sites, (5, 1), strict=True):
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
                for _ in range(count):
                    async with http.get("/missing") as resp:
                        assert resp.status == 404
        reader, writer = await asyncio.open_connection("127.0.0.1", sites[1][1])
        writer.write(b"NOT HTTP\r\n\r\n")
        assert b" 400 " in await reader.readline()
        writer.close()
    finally:
        for runner, _ in sites:
            await runner.cleanup()
    assert apps[0][CLIENT_ERRORS] is given
    assert apps[1][CLIENT_ERRORS] is not given
    warned = [(r.name, r.getMessage()[:11]) for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        ("test.given", "GET /missin"),
        ("test.given", "GET /missin"),
        ("services.common.serving.http_errors", "GET /missin"),
        ("services.common.serving.http_errors", "unparsable "),
    ]
