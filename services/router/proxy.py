"""The upstream relay: send a request to an engine and stream its answer back unchanged.

One aiohttp `ClientSession` (one pooled `TCPConnector`) serves every request of the Router.
The engine's status, body bytes and headers reach the client as they are (hop-by-hop headers
aside); a stream is relayed read by read: each piece of the engine's SSE stream is written to
the client as soon as it is read, with no parsing and no re-serialisation on the way (the
only per-read work besides the write is keeping a reference to the last two reads, whose
usage chunk is parsed once the stream ended, and, when no usage will come, counting `data:`
events with `bytes.count`). Writes are syscalls on loopback's hot path, so a stream costs as
few as its reads allow: the response head goes out with the first piece, and the last piece
with the chunked body's end when the engine's end came with it (two writes fewer a stream).

Failures before the client got anything raise `EngineRefused` (the connection was refused:
nothing reached the engine, so the caller may try another instance) or `EngineFailed`
(anything else: the caller answers 502). After the first byte a failure can only end the
stream: a broken engine stream gets an OpenAI-style `data: {"error": ...}` event first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, istr

from services.router.metrics import RouterMetrics
from services.router.usage import Usage, from_body, from_sse_tail

# Not relayed: hop-by-hop headers, and what aiohttp sets itself for the client connection.
_DROP: Final = frozenset(
    istr(h)
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Content-Length",
        "Date",
        "Server",
        "Proxy-Connection",
        "Upgrade",
        "Trailer",
        "TE",
    )
)
_EVENT_STREAM: Final = "text/event-stream"
_STREAM_BROKE: Final = (
    b'data: {"error": {"message": "the inference engine stopped answering mid-stream", '
    b'"type": "upstream_error", "param": null, "code": 502}}\n\n'
)


class EngineRefused(Exception):
    """The engine refused the connection (or could not be reached at all): nothing was sent."""


class EngineFailed(Exception):
    """The engine failed before the client got anything; `kind` names how."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Relayed:
    """How a relayed answer went."""

    status: int  # the engine's status, as the client got it
    ok: bool  # a success status, relayed to the end
    first_byte_at: float | None  # perf_counter() when the first body bytes were written
    usage: Usage | None  # the engine's usage, when the answer carried it
    events: int  # `data:` events relayed (counted only when no usage was expected)


class Upstream:
    """The engines' side of the Router: one pooled HTTP client."""

    def __init__(self, metrics: RouterMetrics, *, timeout_s: float, max_connections: int) -> None:
        self._metrics = metrics
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=min(timeout_s, 5.0), sock_read=timeout_s
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,  # 0: unlimited; sized for thousands of open streams
            limit_per_host=0,
            ttl_dns_cache=60,
            keepalive_timeout=60.0,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            # Bytes are relayed as the engine sent them (we ask for identity anyway).
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            # An engine's cookies are its client's (relayed with the answer): a jar shared by
            # every client's requests must not keep them and send them with another's. (It
            # also spares each request the jar's filtering.)
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    async def relay(
        self,
        request: web.Request,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        reply_headers: Mapping[str, str],
        *,
        count_events: bool,
    ) -> tuple[web.StreamResponse, Relayed]:
        """POST `body` to `url` and relay the answer to `request`'s client, adding
        `reply_headers`; returns the (sent) response and how it went. Raises `EngineRefused` /
        `EngineFailed` before the first byte."""
        resp = await self._open(url, body, headers)
        done = False
        try:
            if resp.status >= 500:
                self._metrics.upstream_errors.labels("status").inc()
            if resp.status >= 400 or resp.content_type != _EVENT_STREAM:
                sent = await self._relay_body(request, resp, reply_headers)
                done = True
            else:
                sent = await self._relay_stream(request, resp, reply_headers, count_events)
                done = sent[1].ok
            return sent
        finally:
            if done:
                resp.release()  # read to the end: the connection goes back to the pool
            else:
                resp.close()  # dropping the connection tells the engine to stop generating

    async def _relay_body(
        self, request: web.Request, resp: aiohttp.ClientResponse, extra: Mapping[str, str]
    ) -> tuple[web.StreamResponse, Relayed]:
        data = await self._read_body(resp)
        out = web.Response(status=resp.status, body=data, headers=_reply_headers(resp, extra))
        first = time.perf_counter()
        ok = resp.status < 400
        try:
            await out.prepare(request)
            await out.write_eof()
        except ConnectionError:
            ok = False  # the client left
        usage = from_body(data) if resp.status < 400 else None
        return out, Relayed(resp.status, ok, first, usage, 0)

    async def _relay_stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        extra: Mapping[str, str],
        count_events: bool,
    ) -> tuple[web.StreamResponse, Relayed]:
        out = _StreamReply(status=resp.status, headers=_reply_headers(resp, extra))
        try:
            await out.prepare(request)
        except ConnectionError:
            return out, Relayed(resp.status, False, None, None, 0)
        first: float | None = None
        prev = last = b""
        events = 0
        content = resp.content
        reads = content.iter_any().__aiter__()
        while True:
            try:
                chunk = await reads.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError):
                self._metrics.upstream_errors.labels("broken").inc()
                try:
                    await out.write(_STREAM_BROKE)
                    await out.write_eof()
                except ConnectionError:
                    pass
                return out, Relayed(resp.status, False, first, None, events)
            # The engine's last piece goes out with the end of the client's chunked body, in
            # one write, when the engine's own end came with it (as it mostly does).
            ended = content.at_eof()
            try:
                await (out.write_eof(chunk) if ended else out.write(chunk))
            except ConnectionError:  # the client left; closing upstream aborts the request
                return out, Relayed(resp.status, False, first, None, events)
            if first is None:
                first = time.perf_counter()
            prev, last = last, chunk
            if count_events:
                events += chunk.count(b"data:")
            if ended:
                break
        try:
            await out.write_eof()  # (nothing more to write when it went with the last piece)
        except ConnectionError:
            return out, Relayed(resp.status, False, first, None, events)
        usage = None if count_events else from_sse_tail(prev + last)
        return out, Relayed(resp.status, True, first, usage, events)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> int:
        """POST `body` to `url` and read the whole answer (which nobody relays); returns the
        status. Raises `EngineRefused` / `EngineFailed` as `relay` does."""
        resp = await self._open(url, body, headers)
        try:
            await self._read_body(resp)
        finally:
            resp.release()
        if resp.status >= 500:
            self._metrics.upstream_errors.labels("status").inc()
        return resp.status

    async def _read_body(self, resp: aiohttp.ClientResponse) -> bytes:
        """The whole answer; a failure is counted and raised as `EngineFailed`."""
        try:
            return await resp.read()
        except TimeoutError as exc:
            self._metrics.upstream_errors.labels("timeout").inc()
            raise EngineFailed("timeout", f"the engine did not answer in time: {exc}") from None
        except aiohttp.ClientError as exc:
            self._metrics.upstream_errors.labels("broken").inc()
            raise EngineFailed("broken", f"the engine's answer broke off: {exc}") from None

    async def _open(
        self, url: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """POST and wait for the answer's head; a failure is counted and raised as
        `EngineRefused` (nothing reached the engine) or `EngineFailed`."""
        try:
            return await self.session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError as exc:
            self._metrics.upstream_errors.labels("refused").inc()
            raise EngineRefused(str(exc)) from None
        except TimeoutError as exc:
            self._metrics.upstream_errors.labels("timeout").inc()
            raise EngineFailed("timeout", f"the engine did not answer in time: {exc}") from None
        except aiohttp.ClientError as exc:
            self._metrics.upstream_errors.labels("broken").inc()
            raise EngineFailed("broken", f"the engine failed: {exc}") from None

    async def get(self, url: str, timeout_s: float = 2.0) -> tuple[int, bytes, str]:
        """A small GET (e.g. an engine's /v1/models): status, body, content type. Raises
        `EngineFailed` when the engine does not answer."""
        try:
            async with self.session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return resp.status, await resp.read(), resp.content_type
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineFailed("broken", str(exc)) from None


class _StreamReply(web.StreamResponse):
    """A relayed stream's response: its head waits for the first piece of the body and goes
    out with it in one write (one syscall and one TCP segment fewer for every stream; the
    client cannot use the head before the first event anyway). `web.Response` does the same
    for whole bodies; on an aiohttp without the switch the head goes out at `prepare`."""

    _send_headers_immediately = False


def _reply_headers(resp: aiohttp.ClientResponse, extra: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in resp.headers.items():
        if key not in _DROP:
            out.add(key, value)
    out.update(extra)
    return out


def with_cache_salt(raw: bytes, body: Mapping[str, object], salt: str) -> bytes:
    """The request body to forward: `raw` itself when its `cache_salt` is already `salt`,
    else `raw` with `cache_salt` set; with no salt (an anonymous tenant), without any
    `cache_salt` (vLLM refuses an empty one, and a client's own would split the cache from
    what we hash).

    A body without `cache_salt` gets the member appended before its closing brace, so every
    other byte stays as the client sent it. A body with another `cache_salt` is re-serialised
    (appending would leave a duplicate key, which parsers resolve differently)."""
    if not salt:
        if "cache_salt" not in body:
            return raw
        return json.dumps({k: v for k, v in body.items() if k != "cache_salt"}).encode()
    if body.get("cache_salt") == salt:
        return raw
    if "cache_salt" in body:
        return json.dumps({**body, "cache_salt": salt}).encode()
    end = raw.rstrip()
    if not end.endswith(b"}"):  # cannot happen for a parsed object; stay safe
        return json.dumps({**body, "cache_salt": salt}).encode()
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + b'"cache_salt":' + json.dumps(salt).encode() + b"}"
