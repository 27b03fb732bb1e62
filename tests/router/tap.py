"""A recording TCP relay for tests: put it between the Router and an engine to see the exact
bytes each side sent (and when the engine sent them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field


@dataclass
class Exchange:
    """One TCP connection through the tap."""

    to_engine: bytearray = field(default_factory=bytearray)
    from_engine: bytearray = field(default_factory=bytearray)
    from_engine_at: list[float] = field(default_factory=list)  # perf_counter of each read


class Tap:
    """Listens on a free loopback port and forwards every connection to `target_port`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.exchanges: list[Exchange] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        exchange = Exchange()
        self.exchanges.append(exchange)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self._pipe(reader, up_writer, exchange.to_engine, None)),
            loop.create_task(
                self._pipe(up_reader, writer, exchange.from_engine, exchange.from_engine_at)
            ),
        ]
        self._tasks.update(tasks)
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        record: bytearray,
        times: list[float] | None,
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if times is not None:
                    times.append(time.perf_counter())
                record += data
                writer.write(data)
                await writer.drain()


@dataclass(frozen=True)
class HttpMessage:
    start_line: str
    headers: dict[str, str]  # lower-case names
    body: bytes


def parse_http(data: bytes) -> list[HttpMessage]:
    """The HTTP/1.1 messages in one direction of a connection (Content-Length or chunked)."""
    out: list[HttpMessage] = []
    rest = bytes(data)
    while rest:
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                body += rest[:size]
                rest = rest[size + 2 :]
                if size == 0:
                    break
            out.append(HttpMessage(lines[0], headers, bytes(body)))
        else:
            n = int(headers.get("content-length", "0"))
            out.append(HttpMessage(lines[0], headers, rest[:n]))
            rest = rest[n:]
    return out
