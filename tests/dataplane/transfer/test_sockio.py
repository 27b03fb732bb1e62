"""Gathering sends and scattering receives on the event loop: every byte lands in order,
whatever the views and however the kernel splits the stream."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest

from services.dataplane.transfer.sockio import (
    IOV_MAX,
    PeerClosed,
    Stalled,
    recv_views,
    send_views,
    tune,
)


def _pair(buffer: int) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        # Small buffers: the transfers below need many partial sends and receives.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
    return a, b


def _split(data: memoryview, sizes: list[int]) -> list[memoryview]:
    out, at = [], 0
    for size in sizes:
        out.append(data[at : at + size])
        at += size
    return out


async def test_scattered_views_arrive_byte_exact() -> None:
    rng = random.Random(7)
    # More views than one system call takes, some empty, some large.
    sizes = [rng.choice([0, 1, 7, 64, 4096, 100_000]) for _ in range(3 * IOV_MAX)]
    total = sum(sizes)
    payload = bytes(rng.getrandbits(8) for _ in range(4096)) * (total // 4096 + 1)
    payload = payload[:total]
    # The receiver splits the same stream differently.
    cuts = sorted(rng.sample(range(1, total), 2 * IOV_MAX))
    recv_sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    into = bytearray(total)
    a, b = _pair(16384)
    try:
        await asyncio.gather(
            send_views(a, _split(memoryview(payload), sizes), 5.0),
            recv_views(b, _split(memoryview(into), recv_sizes), 5.0),
        )
    finally:
        a.close()
        b.close()
    assert into == payload


async def test_a_peer_closing_early_is_reported() -> None:
    a, b = _pair(65536)
    try:
        await send_views(a, [b"x" * 10])
        a.close()
        with pytest.raises(PeerClosed) as caught:
            await recv_views(b, [bytearray(100)], 5.0)
        assert (caught.value.received, caught.value.wanted) == (10, 100)
    finally:
        b.close()


async def test_a_silent_peer_stalls_the_receive() -> None:
    a, b = _pair(65536)
    try:
        with pytest.raises(Stalled):
            await recv_views(b, [bytearray(1)], 0.05)
    finally:
        a.close()
        b.close()


def test_tune_makes_a_socket_non_blocking_without_nagle() -> None:
    with socket.socket() as s:
        tune(s, sndbuf=1 << 20)
        assert not s.getblocking()
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 1 << 20
