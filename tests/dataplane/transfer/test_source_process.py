"""Each backend with the source in a process of its own, as in production: byte-exact reads,
and a source killed mid-transfer fails the reads promptly instead of hanging them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.dataplane.kv_layout import KvLayout, expected_chunk
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.mooncake_backend import MooncakeBackend
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run, coalesce
from tests.conftest import MOONCAKE
from tests.dataplane.transfer.conftest import SourceProcess
from tests.dataplane.transfer.kvfiles import fill_pages
from tests.dataplane.transfer.scenario import (
    SHAPES,
    fill_background,
    fill_source,
    move_and_check,
)
from tests.fixtures.poll import wait_for

BIG = KvLayout(layers=8, pages=64, chunk_bytes=64 << 10, block_size=16)  # 32 MiB


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("tcp", "scattered"),
        ("tcp", "consecutive"),
        # about 1.2 s: destroying an engine takes a second
        pytest.param("mooncake", "scattered", marks=MOONCAKE),
        pytest.param("mooncake", "consecutive", marks=[pytest.mark.slow, MOONCAKE]),
    ],
)
async def test_reads_from_a_source_process_are_byte_exact(
    backend: Callable[..., Any],
    region: Callable[..., KvRegion],
    source_process: Callable[..., SourceProcess],
    name: str,
    shape: str,
) -> None:
    src = region()
    fill_source(src, shape)
    source = source_process(name, src.path, allow=SHAPES[shape][0])
    dest = await backend(name)
    dst = region()
    fill_background(dst)
    dest.register(dst)
    reader = await dest.open_reader(source.export)
    await move_and_check(reader, dst, shape, range(dst.layout.layers))
    await reader.close()


@pytest.mark.parametrize("name", ["tcp", pytest.param("mooncake", marks=MOONCAKE)])
async def test_a_killed_source_fails_the_read_promptly(
    backend: Callable[..., Any],
    region: Callable[..., KvRegion],
    source_process: Callable[..., SourceProcess],
    name: str,
) -> None:
    src = region(BIG, pages=range(BIG.pages), hashes=range(1, BIG.pages + 1))
    source = source_process(name, src.path, BIG)
    dest = await backend(name, timeout_s=30.0)  # the failure must come from the death
    dst = region(BIG)
    dest.register(dst)
    reader = await dest.open_reader(source.export)
    pages = list(range(BIG.pages))
    runs = coalesce(pages, pages[::-1])  # 64 runs of one page: a read takes a while
    await reader.read(0, runs, dst)  # it works...
    layer, killed_at = 1, 0.0
    with pytest.raises(TransferError) as failure:
        async with asyncio.timeout(20):  # a hang fails the test, not the suite
            while True:
                read = asyncio.create_task(reader.read(layer, runs, dst))
                if not killed_at:
                    await asyncio.sleep(0)  # let the read start
                    source.kill()  # ...until the source dies mid-read
                    killed_at = time.monotonic()
                await read
                layer = (layer + 1) % BIG.layers
    assert time.monotonic() - killed_at < 5.0, "the read must fail within a few seconds"
    assert source.export.endpoint in str(failure.value)
    with pytest.raises(TransferError):  # and the reader stays failed
        await reader.read(0, runs, dst)


def test_fill_pages_of_the_big_layout(region: Callable[..., KvRegion]) -> None:
    # The killed-source test relies on the source's content being what it computed.
    r = region(BIG, pages=[0, 63], hashes=[5, 6])
    assert r.view(7, 63) == expected_chunk(6, 7, BIG.chunk_bytes)
    assert isinstance(r.path, Path)
    fill_pages(r, [1], [9])
    assert r.view(0, 1) == expected_chunk(9, 0, BIG.chunk_bytes)


@pytest.mark.parametrize(
    "name", ["tcp", pytest.param("mooncake", marks=[pytest.mark.slow, MOONCAKE])]
)
async def test_a_hung_source_fails_the_read_after_the_timeout(
    backend: Callable[..., Any],
    region: Callable[..., KvRegion],
    source_process: Callable[..., SourceProcess],
    name: str,
) -> None:
    src = region(pages=[0], hashes=[1])
    source = source_process(name, src.path)
    dest = await backend(name, timeout_s=0.5)
    dst = region()
    dest.register(dst)
    reader = await dest.open_reader(source.export)
    await reader.read(0, [Run(0, 1, 1)], dst)
    source.freeze()
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"0\.5 s"):
        await reader.read(1, [Run(0, 1, 1)], dst)
    assert time.monotonic() - start < 3.0
    source.kill()
    if isinstance(dest, MooncakeBackend):
        # The library's own batch ends once the peer is gone; only then may `dst` go.
        await wait_for(lambda: dest.in_flight == 0, 10.0)
