"""The byte-exact check every backend passes: blocks computed into source pages, read layer
by layer (two reads in flight, as the runner pipelines them) into other pages of a
destination whose every other chunk must stay as it was."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.dataplane.kv_layout import expected_chunk
from services.dataplane.transfer.backend import Reader
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run, coalesce
from tests.dataplane.transfer.conftest import LAYOUT, block_hash
from tests.dataplane.transfer.kvfiles import fill_pages, mismatches

# (source pages, destination pages) of 8 blocks
SHAPES = {
    "scattered": ([3, 17, 4, 29, 10, 11, 12, 0], [20, 1, 2, 31, 6, 7, 8, 25]),
    "consecutive": (list(range(8, 16)), list(range(16, 24))),
}
HASHES = [block_hash(i) for i in range(8)]
BACKGROUND = [block_hash(1000 + p) for p in range(LAYOUT.pages)]  # what dst holds before


def fill_source(src: KvRegion, shape: str) -> None:
    fill_pages(src, SHAPES[shape][0], HASHES)


def fill_background(dst: KvRegion) -> None:
    fill_pages(dst, range(LAYOUT.pages), BACKGROUND)


async def read_layers(
    reader: Reader, runs: Sequence[Run], dst: KvRegion, layers: Sequence[int], depth: int = 2
) -> None:
    in_flight: list[asyncio.Task[Sequence[int] | None]] = []
    try:
        for layer in layers:
            in_flight.append(asyncio.create_task(reader.read(layer, runs, dst)))
            if len(in_flight) >= depth:
                await in_flight.pop(0)
        await asyncio.gather(*in_flight)
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)


async def move_and_check(reader: Reader, dst: KvRegion, shape: str, layers: Sequence[int]) -> None:
    """Read `layers` of the shape's blocks; assert every targeted chunk holds its block and
    every other chunk of `dst` still holds the background."""
    src_pages, dst_pages = SHAPES[shape]
    runs = coalesce(src_pages, dst_pages)
    assert len(runs) == (6 if shape == "scattered" else 1)
    await read_layers(reader, runs, dst, layers)
    assert mismatches(dst, layers, dst_pages, HASHES) == []
    targeted = {(layer, page) for layer in layers for page in dst_pages}
    chunk = dst.layout.chunk_bytes
    changed = [
        (layer, page)
        for layer in range(dst.layout.layers)
        for page in range(dst.layout.pages)
        if (layer, page) not in targeted
        and dst.view(layer, page) != expected_chunk(BACKGROUND[page], layer, chunk)
    ]
    assert changed == []
