"""The upstream relay against an engine that ends its stream in the same write as its last
event and one that sends each event on its own: the client gets the engine's bytes either
way, the stream's end once, and the usage of its tail; an engine's cookie goes to its client
and never with another request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from services.common.serving.http_site import start_site
from services.router.metrics import RouterMetrics
from services.router.proxy import Relayed, Upstream

USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
EVENTS = (b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n')
STREAM = b"".join((*EVENTS, USAGE, b"data: [DONE]\n\n"))


COOKIES_SEEN: list[str | None] = []  # the Cookie header of each request the engine got


async def engine_stream(request: web.Request) -> web.StreamResponse:
    """The whole stream: in one write with the body's end (`?whole`), else event by event,
    each a write of its own after a turn of the loop; `?cookie` sets a cookie."""
    COOKIES_SEEN.append(request.headers.get("Cookie"))
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    if "cookie" in request.query:
        out.set_cookie("engine_session", "client-a")
    await out.prepare(request)
    if "whole" in request.query:
        await out.write_eof(STREAM)
        return out
    for event in (*EVENTS, USAGE, b"data: [DONE]\n\n"):
        await out.write(event)
        await asyncio.sleep(0)  # (a turn of the loop, not a wait for a condition)
    await out.write_eof()
    return out


@pytest.fixture
async def relay_url() -> AsyncIterator[tuple[str, list[Relayed]]]:
    """A front server that relays every POST to the engine's stream through `Upstream`;
    yields its URL and the `Relayed` of each request."""
    engine_app = web.Application()
    engine_app.router.add_post("/v1/completions", engine_stream)
    engine_runner, engine_port = await start_site(engine_app, "127.0.0.1:0")
    upstream = Upstream(RouterMetrics(), timeout_s=5.0, max_connections=0)
    await upstream.start()
    relayed: list[Relayed] = []

    async def front(request: web.Request) -> web.StreamResponse:
        query = f"?{request.query_string}" if request.query_string else ""
        # (`?localhost`: the engine by a host name, whose cookies a default jar would keep)
        host = "localhost" if "localhost" in request.query else "127.0.0.1"
        url = f"http://{host}:{engine_port}/v1/completions{query}"
        response, how = await upstream.relay(
            request, url, b"{}", {}, {"x-kvsched-instance": "e0"}, count_events=False
        )
        relayed.append(how)
        return response

    front_app = web.Application()
    front_app.router.add_post("/v1/completions", front)
    front_runner, front_port = await start_site(front_app, "127.0.0.1:0")
    try:
        yield f"http://127.0.0.1:{front_port}/v1/completions", relayed
    finally:
        await front_runner.cleanup()
        await upstream.close()
        await engine_runner.cleanup()


@pytest.mark.parametrize("query", ["?whole", ""])
async def test_a_stream_is_relayed_whole_however_the_engine_ends_it(
    relay_url: tuple[str, list[Relayed]], query: str
) -> None:
    url, relayed = relay_url
    async with aiohttp.ClientSession() as http:
        for _ in range(2):  # the second over the pooled engine connection
            async with http.post(url + query, data=b"{}") as resp:
                assert resp.status == 200
                assert resp.headers["x-kvsched-instance"] == "e0"
                assert resp.content_type == "text/event-stream"
                assert await resp.read() == STREAM
    assert len(relayed) == 2
    for how in relayed:
        assert how.ok and how.status == 200 and how.first_byte_at is not None
        assert how.usage is not None
        assert (how.usage.prompt_tokens, how.usage.completion_tokens) == (3, 2)


async def test_an_engines_cookie_reaches_its_client_and_no_later_request(
    relay_url: tuple[str, list[Relayed]],
) -> None:
    url, _ = relay_url
    COOKIES_SEEN.clear()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with http.post(url + "?whole&cookie&localhost", data=b"{}") as resp:
            assert resp.status == 200
            assert resp.headers.getall("Set-Cookie") == ["engine_session=client-a; Path=/"]
            assert await resp.read() == STREAM
        async with http.post(url + "?whole&localhost", data=b"{}") as resp:  # another client
            assert await resp.read() == STREAM
    assert COOKIES_SEEN == [None, None]
