"""The TCP backend's server: answers peers' reads of this Messenger's exports (wire format
in `tcp_wire`), sending chunks straight from the mapped regions.

It serves only exports allowed in its `ExportTable`, and only their granted pages; anything
else (bad frame, unknown or revoked export, out-of-range layer or page, oversize request)
is refused with a logged reason and that connection closed. No request can take the server,
or the Messenger, down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from array import array
from dataclasses import dataclass

from services.dataplane.kv_layout import chunk_checksums
from services.dataplane.transfer import tcp_wire as wire
from services.dataplane.transfer.exports import ExportTable, Grant
from services.dataplane.transfer.runs import Span, merge_spans
from services.dataplane.transfer.sockio import (
    PeerClosed,
    Stalled,
    recv_views,
    send_pieces,
    send_views,
    tune,
)

log = logging.getLogger(__name__)
REFUSAL_LINGER_S = 1.0  # how long a refused peer gets to read the reason before the close


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A request's runs (`raw`, as received) checked against `grant`: the byte spans of a
    layer they move and their pages."""

    raw: bytes
    grant: Grant
    spans: list[Span]
    pages: int


class Refused(Exception):
    """A request the server will not answer (the message is the reason sent back)."""


class TcpServer:
    """Listens on `host:port` (0: any free port) and serves the exports of `table`.

    `idle_s` bounds how long a peer may stall mid-frame or leave sent bytes unread;
    `sndbuf` sets SO_SNDBUF of served connections (None: kernel autotuning)."""

    def __init__(
        self,
        table: ExportTable,
        host: str,
        port: int = 0,
        *,
        idle_s: float = 30.0,
        sndbuf: int | None = None,
    ) -> None:
        self.table = table
        self.host = host
        self.port = port
        self.idle_s = idle_s
        self.sndbuf = sndbuf
        self.refused = 0  # requests or hellos refused since start
        self.requests = 0  # requests answered
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def connections(self) -> int:
        """Connections being served now."""
        return len(self._connections)

    async def start(self) -> None:
        """Bind and listen; `port` is then the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept(listener), name="kv-tcp-accept")

    async def stop(self) -> None:
        """Stop accepting and close every connection (requests being answered are cut)."""
        tasks = list(self._connections)
        if self._accepting is not None:
            tasks.append(self._accepting)
            self._accepting = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as e:  # e.g. out of file descriptors: keep serving the others
                log.warning("accepting a transfer connection failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            tune(sock, sndbuf=self.sndbuf)
            task = asyncio.create_task(self._serve(sock, f"{addr[0]}:{addr[1]}"))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        export_id = "?"
        try:
            export_id = await self._hello(sock)
            prepared: _Prepared | None = None
            while True:
                answered = await self._answer(sock, export_id, prepared)
                if answered is None:
                    break
                prepared = answered
        except (Refused, wire.Malformed) as e:
            self.refused += 1
            log.warning("refused transfer peer %s (export %r): %s", peer, export_id, e)
            await self._refuse(sock, str(e))
        except (PeerClosed, Stalled, OSError) as e:
            log.info("transfer peer %s (export %r) dropped: %s", peer, export_id, e)
        except Exception:  # never let one connection take the Messenger down
            log.exception("serving transfer peer %s (export %r) failed", peer, export_id)
        finally:
            sock.close()

    async def _hello(self, sock: socket.socket) -> str:
        head = bytearray(wire.HELLO.size)
        await recv_views(sock, [head], self.idle_s)
        raw = bytearray(wire.decode_hello(head))
        await recv_views(sock, [raw], self.idle_s)
        export_id = wire.decode_export_id(raw)
        lay = self._grant(export_id).region.layout
        await send_views(sock, [wire.encode_layout(lay.layers, lay.pages, lay.chunk_bytes)])
        return export_id

    def _grant(self, export_id: str) -> Grant:
        grant = self.table.get(export_id)
        if grant is None:
            raise Refused(f"export {export_id!r} is unknown here or was revoked")
        return grant

    async def _answer(
        self, sock: socket.socket, export_id: str, last: _Prepared | None
    ) -> _Prepared | None:
        """Answer one request; None when the peer closed cleanly between requests. Returns the
        request's runs as checked, and reuses `last` (the previous request's) when they are
        the same: a reader asks the same runs of every layer."""
        head = bytearray(wire.REQUEST.size)
        try:
            await recv_views(sock, [head])  # no timeout: a reader may idle between reads
        except PeerClosed as e:
            if e.received == 0:
                return None
            raise
        # Looked up per request, so a revoke takes effect at the next one.
        grant = self._grant(export_id)
        lay = grant.region.layout
        layer, nruns = wire.decode_request(head, lay.pages)
        raw = bytearray(nruns * wire.RUN.size)
        await recv_views(sock, [raw], self.idle_s)
        if not 0 <= layer < lay.layers:
            raise Refused(f"layer {layer} is outside the source's {lay.layers} layers")
        if last is None or last.raw != raw or last.grant is not grant:
            runs = wire.decode_runs(raw)
            pages = self._check_runs(grant, runs)
            last = _Prepared(bytes(raw), grant, merge_spans(runs, lay.chunk_bytes), pages)
        views = grant.region.slices(layer, last.spans)
        try:
            sums = array("Q", chunk_checksums(views, lay.chunk_bytes))
            if sys.byteorder == "big":
                sums.byteswap()
            payload = last.pages * (wire.SUM_BYTES + lay.chunk_bytes)
            reply = memoryview(wire.REPLY.pack(wire.OK, payload) + sums.tobytes())
            await send_pieces(sock, [reply, *views], self.idle_s)
        finally:
            for v in views:
                v.release()  # the region may be closed once no request uses it
        self.requests += 1
        return last

    @staticmethod
    def _check_runs(grant: Grant, runs: list[tuple[int, int]]) -> int:
        """Pages the runs move; `Refused` unless all are exported and within a layer."""
        lay = grant.region.layout
        total = 0
        for page, count in runs:
            if count <= 0 or page + count > lay.pages:
                raise Refused(f"pages {page}+{count} are outside the source's {lay.pages}")
            if not grant.covers(page, count):
                raise Refused(f"pages {page}+{count} are not all exported by {grant.export_id!r}")
            total += count
        if total > lay.pages:
            raise Refused(f"a request may move at most one layer ({lay.pages} pages), not {total}")
        return total

    async def _refuse(self, sock: socket.socket, reason: str) -> None:
        """Tell the peer why, then let it read that before the connection closes (closing
        with its unread requests still queued would reset the connection and lose it)."""
        with contextlib.suppress(OSError, Stalled, PeerClosed, TimeoutError):
            async with asyncio.timeout(REFUSAL_LINGER_S):
                await send_views(sock, [wire.encode_refusal(reason)])
                sock.shutdown(socket.SHUT_WR)
                sink = bytearray(65536)
                while True:  # until the peer closes
                    await recv_views(sock, [sink])
