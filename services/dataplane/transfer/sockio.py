"""Moving bytes between a non-blocking socket and memory views on the running event loop,
without copies in user space: `sendmsg` gathers straight from the views and `recvmsg_into`
scatters straight into them, as many views per system call as the kernel takes.

A read of small scattered chunks moves hundreds of views per request, so the per-view work
in Python is kept to slicing them once: progress through the views is found by bisecting
their cumulative sizes, not by walking them.
"""

from __future__ import annotations

import asyncio
import os
import socket
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate

# Views per sendmsg/recvmsg_into call: the kernel's limit on an I/O vector.
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)

Buffer = memoryview | bytes | bytearray


class PeerClosed(ConnectionError):
    """The peer closed the connection after `received` bytes of the ones awaited."""

    def __init__(self, received: int, wanted: int) -> None:
        super().__init__(f"connection closed after {received} of {wanted} bytes")
        self.received = received
        self.wanted = wanted


class Stalled(TimeoutError):
    """The peer neither sent nor took bytes for the idle timeout."""


async def _ready(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, writable: bool, idle_s: float | None
) -> None:
    """Wait until `sock` is readable (or writable); `Stalled` after `idle_s` seconds."""
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    def expire() -> None:
        if not fut.done():
            fut.set_exception(Stalled(f"no progress for {idle_s:g} s"))

    if writable:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    timer = loop.call_later(idle_s, expire) if idle_s is not None else None
    try:
        await fut
    finally:
        if timer is not None:
            timer.cancel()
        if writable:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


def byte_views(views: Sequence[Buffer]) -> list[memoryview]:
    """The non-empty buffers as 1-D views of bytes (so slicing them counts bytes)."""
    out = []
    for v in views:
        mv = memoryview(v)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes:
            out.append(mv)
    return out


async def _move(
    sock: socket.socket,
    pieces: list[memoryview],
    call: Callable[[list[memoryview]], int],
    writable: bool,
    idle_s: float | None,
) -> None:
    """Pass `pieces` (non-empty 1-D byte views) to `call` (one system call on a window of
    them, returning the bytes moved) until every byte moved, waiting for the socket when it
    would block."""
    loop = asyncio.get_running_loop()
    ends = list(accumulate(map(len, pieces)))  # end offset of each piece in the stream
    total = ends[-1] if ends else 0
    done = first = 0
    window = pieces[:IOV_MAX]
    while done < total:
        try:
            n = call(window)
        except (BlockingIOError, InterruptedError):
            await _ready(loop, sock, writable, idle_s)
            continue
        if n == 0:
            raise PeerClosed(done, total)
        done += n
        if done == total:
            return
        first = bisect_right(ends, done, first)  # the piece `done` falls in
        into = done - (ends[first - 1] if first else 0)
        head = pieces[first][into:] if into else pieces[first]
        window = [head, *pieces[first + 1 : first + IOV_MAX]]


async def send_views(
    sock: socket.socket, views: Sequence[Buffer], idle_s: float | None = None
) -> None:
    """Send every view, in order (returns when the kernel has taken all of them); `Stalled`
    when the peer takes nothing for `idle_s`."""
    await send_pieces(sock, byte_views(views), idle_s)


async def send_pieces(
    sock: socket.socket, pieces: list[memoryview], idle_s: float | None = None
) -> None:
    """`send_views` of views already non-empty 1-D bytes (no per-view checks)."""
    await _move(sock, pieces, sock.sendmsg, True, idle_s)


async def recv_views(
    sock: socket.socket, views: Sequence[Buffer], idle_s: float | None = None
) -> None:
    """Fill every view, in order; `PeerClosed` when the peer closes first, `Stalled` when it
    sends nothing for `idle_s`."""
    await recv_pieces(sock, byte_views(views), idle_s)


async def recv_pieces(
    sock: socket.socket, pieces: list[memoryview], idle_s: float | None = None
) -> None:
    """`recv_views` into views already non-empty 1-D bytes (no per-view checks)."""

    def recv(window: list[memoryview]) -> int:
        if len(window) == 1:
            return sock.recv_into(window[0])
        return sock.recvmsg_into(window)[0]

    await _move(sock, pieces, recv, False, idle_s)


def tune(sock: socket.socket, *, sndbuf: int | None = None, rcvbuf: int | None = None) -> None:
    """Make `sock` non-blocking, without Nagle (request frames are small and must leave at
    once); set its buffer sizes when given (None keeps the kernel's autotuning)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
