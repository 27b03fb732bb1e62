"""aiohttp's own errors on the Router answered as OpenAI error JSON: an unknown route, a
wrong method, a request line or header the parser refuses, a body cut short; never its
plain-text pages, never a logged traceback."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack
from tests.router.test_errors import openai_error
from tests.router.test_malformed_input import no_traceback, raw_http

HEAD = b"Host: x\r\nConnection: close\r\n"

REFUSED: list[tuple[str, bytes, int]] = [
    ("unknown route", b"GET /v1/nothing HTTP/1.1\r\n" + HEAD + b"\r\n", 404),
    ("unknown route, POST", b"POST /v1/engines HTTP/1.1\r\n" + HEAD + b"\r\n", 404),
    ("wrong method", b"GET /v1/chat/completions HTTP/1.1\r\n" + HEAD + b"\r\n", 405),
    ("malformed request line", b"GET /v1/models HTTP/9 junk\r\n" + HEAD + b"\r\n", 400),
    ("not HTTP at all", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    ("malformed header", b"GET /v1/models HTTP/1.1\r\n" + HEAD + b"No colon\r\n\r\n", 400),
    (
        "two Content-Lengths",
        b"POST /v1/completions HTTP/1.1\r\n" + HEAD + b"Content-Length: 2\r\n"
        b"Content-Length: 3\r\n\r\n{}",
        400,
    ),
]


@pytest.mark.parametrize(
    "request_bytes, status", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
async def test_aiohttps_own_errors_are_openai_json(
    stack: Stack, caplog: pytest.LogCaptureFixture, request_bytes: bytes, status: int
) -> None:
    _, _, router = await stack.up(0)
    got, headers, data = await raw_http(router, request_bytes)
    assert got == status, data
    assert headers["content-type"].startswith("application/json")
    error = openai_error(data)
    assert error["type"] == "invalid_request_error" and error["code"] == status
    if status == 405:
        assert headers["allow"] == "POST"
    no_traceback(caplog)


async def test_a_body_cut_short_by_the_client_is_not_a_500(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, router = await stack.up(0)
    host, _, port = router.url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"prompt": "hi", "model": "m"}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\n" + HEAD + b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(body) + 50).encode() + b"\r\n\r\n" + body
    )
    writer.write_eof()  # the body ends with the client's side of the connection
    assert await asyncio.wait_for(reader.read(), 10) == b""  # aiohttp closes: nobody to answer
    writer.close()

    async def counted_as_400() -> bool:
        return 'route="/v1/completions",status="400"} 1.0' in await stack.metrics(router)

    await wait_for(counted_as_400, 5.0, message="the cut request counted as a 400")
    assert 'status="500"' not in await stack.metrics(router)
    no_traceback(caplog)
