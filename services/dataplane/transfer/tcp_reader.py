"""The TCP backend's reader: one connection to the source Messenger's server per export,
requests pipelined, each answer received straight into the destination region."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from array import array
from collections.abc import Callable, Sequence

from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer import tcp_wire as wire
from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import LastRuns, Run, check_read
from services.dataplane.transfer.sockio import (
    PeerClosed,
    Stalled,
    recv_pieces,
    recv_views,
    send_views,
    tune,
)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of "host:port" (or "[v6]:port")."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class TcpReader:
    """Reads one export over one connection. Reads may overlap: each request is sent as soon
    as it is made and the answers arrive in request order, so the source streams layer l+1
    while layer l is being verified. Use `open` to make one."""

    def __init__(self, sock: socket.socket, export: SourceExport, idle_s: float) -> None:
        self._sock = sock
        self.export = export
        self.idle_s = idle_s
        self._send_lock = asyncio.Lock()
        # The answer before ours has been received once this is done (answers come in order).
        self._turn: asyncio.Future[None] | None = None
        self._broken: str | None = None
        self._active = 0  # reads between their request and their end
        self._prepare = LastRuns()
        self.on_close: Callable[[TcpReader], None] | None = None  # told once it is closed

    @classmethod
    async def open(
        cls,
        export: SourceExport,
        *,
        connect_timeout_s: float = 5.0,
        idle_s: float = 30.0,
        rcvbuf: int | None = None,
    ) -> TcpReader:
        """Connect to the export's server and say hello; `TransferError` when it cannot be
        reached, refuses the export, or serves a layout other than the export's."""
        host, port = split_endpoint(export.endpoint)
        where = f"source {export.endpoint} (export {export.export_id!r})"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            tune(sock, rcvbuf=rcvbuf)
            async with asyncio.timeout(connect_timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
                await send_views(sock, [wire.encode_hello(export.export_id)])
                size = await _reply(sock, where)
                if size != wire.LAYOUT.size:
                    raise TransferError(f"{where} answered hello with {size} bytes")
                raw = bytearray(size)
                await recv_views(sock, [raw])
        except TimeoutError as e:
            sock.close()
            raise TransferError(f"{where} did not answer within {connect_timeout_s:g} s") from e
        except (OSError, PeerClosed) as e:
            sock.close()
            raise TransferError(f"cannot reach {where}: {e}") from e
        except BaseException:
            sock.close()
            raise
        layers, pages, chunk_bytes = wire.LAYOUT.unpack(raw)
        lay = export.layout
        if (layers, pages, chunk_bytes) != (lay.layers, lay.pages, lay.chunk_bytes):
            sock.close()
            served = KvLayout(layers, pages, chunk_bytes, lay.block_size)
            raise TransferError(f"{where} serves layout {served}, the export says {lay}")
        return cls(sock, export, idle_s)

    async def read(self, layer: int, runs: Sequence[Run], dst: KvRegion) -> list[int]:
        """See `Reader.read`: the source sends each chunk's checksum ahead of the chunks."""
        plan = self._prepare(runs)
        check_read(layer, plan, self.export.layout, dst.layout)
        self._check_usable()
        where = (
            f"layer {layer} from source {self.export.endpoint} (export {self.export.export_id!r})"
        )
        chunk = dst.layout.chunk_bytes
        views = dst.slices(layer, plan.spans("dst", chunk))
        sums = array("Q", bytes(plan.pages * wire.SUM_BYTES))
        expected = plan.pages * (wire.SUM_BYTES + chunk)
        loop = asyncio.get_running_loop()
        mine: asyncio.Future[None] = loop.create_future()
        self._active += 1
        try:
            async with self._send_lock:
                self._check_usable()
                before, self._turn = self._turn, mine
                await send_views(self._sock, [wire.encode_request(layer, plan)], self.idle_s)
            if before is not None:
                await asyncio.shield(before)  # ours is the answer after that one
            self._check_usable()
            size = await _reply(self._sock, where, self.idle_s)
            if size != expected:
                raise TransferError(f"{where}: {size} bytes announced, {expected} expected")
            with memoryview(sums) as into:
                await recv_pieces(self._sock, [into.cast("B"), *views], self.idle_s)
        except TransferError as e:
            raise self._fail(str(e)) from None
        except Stalled as e:
            raise self._fail(f"{where}: the source sent nothing for {self.idle_s:g} s") from e
        except PeerClosed as e:
            raise self._fail(f"{where}: the source closed the connection ({e})") from e
        except OSError as e:
            raise self._fail(f"{where}: {e}") from e
        except asyncio.CancelledError:
            # Its answer would still come and be taken for the next one's.
            self._fail(f"a read of {where} was cancelled mid-stream")
            raise
        finally:
            if not mine.done():
                mine.set_result(None)
            for v in views:
                v.release()
            self._active -= 1
            self._close_if_idle()
        if sys.byteorder == "big":
            sums.byteswap()
        return sums.tolist()

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise TransferError(f"the reader is closed: {self._broken}")

    def _fail(self, reason: str) -> TransferError:
        """Break the connection: later reads fail with the first reason, and reads waiting on
        the socket wake up (shutdown ends their waits; the descriptor is closed once no read
        uses it). Returns the error to raise."""
        if self._broken is None:
            self._broken = reason
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._close_if_idle()
            return TransferError(reason)
        return TransferError(f"the reader is closed: {self._broken}")

    def _close_if_idle(self) -> None:
        if self._broken is not None and self._active == 0 and self._sock.fileno() >= 0:
            self._sock.close()
            if self.on_close is not None:
                self.on_close(self)

    async def close(self) -> None:
        """See `Reader.close`."""
        self._fail("closed by its owner")


async def _reply(sock: socket.socket, where: str, idle_s: float | None = None) -> int:
    """Receive a REPLY; its payload size when OK, `TransferError` with the reason when not."""
    head = bytearray(wire.REPLY.size)
    await recv_views(sock, [head], idle_s)
    status, size = wire.decode_reply(head)
    if status == wire.OK:
        return size
    reason = bytearray(min(size, wire.MAX_REASON))
    with contextlib.suppress(PeerClosed, OSError, Stalled):
        await recv_views(sock, [reason], idle_s)
    text = reason.decode(errors="replace") if status == wire.REFUSED else f"status {status}"
    raise TransferError(f"{where} refused: {text}")
