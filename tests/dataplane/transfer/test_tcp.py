"""The `tcp` backend in this process: byte-exact reads, and a server that serves only what
is allowed and survives anything a peer sends."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from services.dataplane.kv_layout import checksum
from services.dataplane.transfer import tcp_wire as wire
from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run
from services.dataplane.transfer.tcp_backend import TcpBackend
from tests.dataplane.transfer.conftest import LAYOUT
from tests.dataplane.transfer.kvfiles import mismatches
from tests.dataplane.transfer.scenario import (
    HASHES,
    SHAPES,
    fill_background,
    fill_source,
    move_and_check,
)
from tests.fixtures.poll import wait_for


async def _pair(
    backend: Callable[..., Any], region: Callable[..., KvRegion], shape: str = "scattered"
) -> tuple[TcpBackend, KvRegion, TcpBackend, KvRegion, SourceExport]:
    """A source backend exporting a filled region, a destination backend and region."""
    source, dest = await backend("tcp"), await backend("tcp")
    src, dst = region(), region()
    fill_source(src, shape)
    fill_background(dst)
    source.register(src)
    dest.register(dst)
    source.allow("e1", src, SHAPES[shape][0])
    return source, src, dest, dst, source.source_export(src, "e1")


@pytest.mark.parametrize("shape", ["scattered", "consecutive"])
async def test_reads_are_byte_exact(
    backend: Callable[..., Any], region: Callable[..., KvRegion], shape: str
) -> None:
    _, _, dest, dst, export = await _pair(backend, region, shape)
    assert export.endpoint == f"127.0.0.1:{export.endpoint.rsplit(':')[1]}"
    reader = await dest.open_reader(export)
    await move_and_check(reader, dst, shape, range(LAYOUT.layers))
    await reader.close()


async def test_many_reads_in_flight_each_land_in_their_layer(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    _, _, dest, dst, export = await _pair(backend, region, "consecutive")
    reader = await dest.open_reader(export)
    src_pages, dst_pages = SHAPES["consecutive"]
    # Every layer at once, page by page, in reverse: answers must not be mixed up.
    reads = [
        reader.read(layer, [Run(s, d, 1)], dst)
        for layer in reversed(range(LAYOUT.layers))
        for s, d in zip(src_pages, dst_pages, strict=True)
    ]
    await asyncio.gather(*reads)
    assert mismatches(dst, range(LAYOUT.layers), dst_pages, HASHES) == []


async def test_each_chunk_comes_with_the_checksum_of_what_the_source_sent(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    _, src, dest, dst, export = await _pair(backend, region, "scattered")
    reader = await dest.open_reader(export)
    src_pages, dst_pages = SHAPES["scattered"]
    runs = [Run(s, d, 1) for s, d in zip(src_pages, dst_pages, strict=True)]
    sums = await reader.read(2, runs, dst)
    assert sums == [checksum(src.view(2, p)) for p in src_pages]
    assert sums == [checksum(dst.view(2, p)) for p in dst_pages]  # the bytes as they landed
    await reader.close()


async def test_a_revoked_export_is_refused_and_others_still_served(
    backend: Callable[..., Any], region: Callable[..., KvRegion], caplog: pytest.LogCaptureFixture
) -> None:
    source, src, dest, dst, export = await _pair(backend, region)
    source.allow("e2", src, SHAPES["scattered"][0])
    reader = await dest.open_reader(export)
    other = await dest.open_reader(source.source_export(src, "e2"))
    run = [Run(3, 20, 1)]
    await reader.read(0, run, dst)
    assert source.revoke("e1")
    with caplog.at_level(logging.WARNING), pytest.raises(TransferError, match="revoked"):
        await reader.read(1, run, dst)
    assert "revoked" in caplog.text
    with pytest.raises(TransferError, match="closed"):  # the reader is done for
        await reader.read(0, run, dst)
    await other.read(1, run, dst)  # the server serves the others
    with pytest.raises(TransferError, match="unknown here or was revoked"):
        await dest.open_reader(export)


async def test_pages_not_exported_are_refused(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    source, _, dest, dst, export = await _pair(backend, region)
    reader = await dest.open_reader(export)
    with pytest.raises(TransferError, match="not all exported"):
        await reader.read(0, [Run(4, 0, 2)], dst)  # page 4 is exported, 5 is not
    assert source.server.refused == 1


async def test_unreachable_source_fails_fast(backend: Callable[..., Any]) -> None:
    dest = await backend("tcp")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    export = SourceExport(f"127.0.0.1:{port}", 0, LAYOUT, "e1")
    with pytest.raises(TransferError, match="cannot reach"):
        await dest.open_reader(export)


async def test_a_layout_other_than_the_exports_is_refused(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    _, _, dest, _, export = await _pair(backend, region)
    wrong = replace(export, layout=replace(LAYOUT, pages=LAYOUT.pages * 2))
    with pytest.raises(TransferError, match="serves layout"):
        await dest.open_reader(wrong)


async def test_runs_that_do_not_fit_are_a_caller_error(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    _, _, dest, dst, export = await _pair(backend, region)
    reader = await dest.open_reader(export)
    with pytest.raises(ValueError):
        await reader.read(0, [Run(0, LAYOUT.pages - 1, 2)], dst)
    await reader.read(0, [Run(3, 20, 1)], dst)  # and the reader still works


async def test_stop_fails_reads_in_flight(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    source, _, dest, dst, export = await _pair(backend, region)
    reader = await dest.open_reader(export)
    await source.stop()
    with pytest.raises(TransferError):
        await reader.read(0, [Run(3, 20, 1)], dst)


# ---- what a malicious or broken peer may send ---------------------------------------------


async def _raw(port: int, *frames: bytes) -> tuple[bytes, bool]:
    """Send `frames` on a new connection; what came back, and whether the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for frame in frames:
        writer.write(frame)
    await writer.drain()
    try:
        async with asyncio.timeout(5):
            data = await reader.read()  # until the server closes
        return data, True
    except TimeoutError:
        return b"", False
    finally:
        writer.close()


def _hello(export_id: str = "e1") -> bytes:
    return wire.encode_hello(export_id)


def _request(layer: int, runs: list[tuple[int, int]], nruns: int | None = None) -> bytes:
    head = wire.REQUEST.pack(wire.REQUEST_MAGIC, layer, len(runs) if nruns is None else nruns)
    return head + b"".join(wire.RUN.pack(p, c) for p, c in runs)


HELLO_OK = wire.encode_layout(LAYOUT.layers, LAYOUT.pages, LAYOUT.chunk_bytes)


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"GET / HTTP/1.1\r\n\r\n"], "bad hello magic"),
        ([struct.pack("!4sH", b"KVT1", 0)], "export id of 0 bytes"),
        ([struct.pack("!4sH", b"KVT1", 2000)], "export id of 2000 bytes"),
        ([_hello("nope")], "unknown here"),
        ([_hello(), b"JUNKJUNKJUNK"], "bad request magic"),
        ([_hello(), _request(0, [], nruns=10**6)], "runs in one request"),
        ([_hello(), _request(0, [], nruns=0)], "runs in one request"),
        ([_hello(), _request(LAYOUT.layers, [(3, 1)])], "layer 4 is outside"),
        ([_hello(), _request(0, [(LAYOUT.pages - 1, 2)])], "outside the source"),
        ([_hello(), _request(0, [(3, 0)])], "outside the source"),
        ([_hello(), _request(0, [(5, 1)])], "not all exported"),
        ([_hello(), _request(0, [(3, 1)] * (LAYOUT.pages + 1))], "runs in one request"),
    ],
)
async def test_malformed_frames_are_refused_and_the_server_keeps_serving(
    backend: Callable[..., Any],
    region: Callable[..., KvRegion],
    caplog: pytest.LogCaptureFixture,
    frames: list[bytes],
    reason: str,
) -> None:
    source, _, dest, dst, export = await _pair(backend, region)
    assert isinstance(source, TcpBackend)
    with caplog.at_level(logging.WARNING):
        answer, closed = await _raw(source.server.port, *frames)
    assert closed, "the server must close a connection it refuses"
    assert reason in answer.decode(errors="replace")
    assert reason in caplog.text
    await wait_for(lambda: source.server.refused == 1 and source.server.connections == 0)
    reader = await dest.open_reader(export)  # and it still serves everyone else
    await move_and_check(reader, dst, "scattered", [0])


async def test_a_peer_that_hangs_up_mid_frame_is_dropped_quietly(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    source, _, dest, dst, export = await _pair(backend, region)
    assert isinstance(source, TcpBackend)
    _, silent = await asyncio.open_connection("127.0.0.1", source.server.port)
    await wait_for(lambda: source.server.connections == 1)
    silent.close()  # connected, said nothing, left
    reader, writer = await asyncio.open_connection("127.0.0.1", source.server.port)
    writer.write(_hello() + _request(0, [(3, 1)])[:7])  # half a request header
    await writer.drain()
    assert await reader.readexactly(len(HELLO_OK)) == HELLO_OK
    writer.close()
    await wait_for(lambda: source.server.connections == 0)
    assert source.server.refused == 0
    r = await dest.open_reader(export)
    await move_and_check(r, dst, "scattered", [1])


async def test_a_peer_stalling_mid_frame_is_dropped_after_the_timeout(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    source = await backend("tcp", timeout_s=0.2)
    src = region()
    source.register(src)
    source.allow("e1", src, [0, 1])
    reader, writer = await asyncio.open_connection("127.0.0.1", source.server.port)
    writer.write(_hello() + _request(0, [(0, 1)], nruns=2))  # promises two runs, sends one
    await writer.drain()
    assert await reader.readexactly(len(HELLO_OK)) == HELLO_OK
    async with asyncio.timeout(5):
        assert await reader.read() == b""  # dropped: closed without an answer
    writer.close()
    await wait_for(lambda: source.server.connections == 0)
    assert source.server.refused == 0 and source.server.requests == 0


async def test_a_read_cancelled_mid_stream_closes_the_reader(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    _, _, dest, dst, export = await _pair(backend, region)
    reader = await dest.open_reader(export)
    read = asyncio.create_task(reader.read(0, [Run(3, 20, 1)], dst))
    await asyncio.sleep(0)  # the request is out, its answer not yet in
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    # Its answer would be taken for the next read's: the reader must refuse to go on.
    with pytest.raises(TransferError, match="cancelled mid-stream"):
        await reader.read(1, [Run(3, 20, 1)], dst)
