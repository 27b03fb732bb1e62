"""A KV region: offsets and views of the engine's file, mapped shared."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest

from services.dataplane.kv_layout import KvLayout, expected_chunk
from services.dataplane.transfer.region import KvRegion
from tests.dataplane.transfer.conftest import LAYOUT, block_hash


def test_views_sit_at_the_layout_offsets_of_the_file(region: Callable[..., KvRegion]) -> None:
    r = region()
    chunk = LAYOUT.chunk_bytes
    r.view(2, 5)[:] = b"\x07" * chunk
    r.view(3, 30, 2)[:] = b"\x09" * (2 * chunk)
    data = r.path.read_bytes()  # what the engine, sharing the file, sees
    assert data[LAYOUT.offset(2, 5) : LAYOUT.offset(2, 6)] == b"\x07" * chunk
    assert data[LAYOUT.offset(3, 30) : LAYOUT.offset(3, 30) + 2 * chunk] == b"\x09" * (2 * chunk)
    assert data.count(0) == len(data) - 3 * chunk
    # The address Mooncake registers is byte 0 of the same memory.
    assert ctypes.string_at(r.address + LAYOUT.offset(2, 5), chunk) == b"\x07" * chunk


def test_blocks_fill_every_layer_of_a_page(region: Callable[..., KvRegion]) -> None:
    r = region(pages=[3, 17], hashes=[block_hash(0), block_hash(1)])
    for layer in range(LAYOUT.layers):
        assert r.view(layer, 3) == expected_chunk(block_hash(0), layer, LAYOUT.chunk_bytes)
        assert r.view(layer, 17) == expected_chunk(block_hash(1), layer, LAYOUT.chunk_bytes)
        assert r.view(layer, 4) == bytes(LAYOUT.chunk_bytes)


def test_gather_and_slices_merge_adjacent_pages(region: Callable[..., KvRegion]) -> None:
    r = region()
    views = r.gather(1, [(4, 2), (6, 1), (0, 1)])
    assert [v.nbytes for v in views] == [3 * LAYOUT.chunk_bytes, LAYOUT.chunk_bytes]
    views[0][:] = b"\x01" * views[0].nbytes
    assert r.view(1, 6) == b"\x01" * LAYOUT.chunk_bytes
    assert r.view(1, 7) == bytes(LAYOUT.chunk_bytes)
    for v in views:
        v.release()
    with pytest.raises(IndexError):
        r.slices(1, [(0, LAYOUT.pages * LAYOUT.chunk_bytes + 1)])


@pytest.mark.parametrize(
    ("layer", "page", "count"), [(4, 0, 1), (0, 32, 1), (0, 31, 2), (0, -1, 1)]
)
def test_views_out_of_range_are_refused(
    region: Callable[..., KvRegion], layer: int, page: int, count: int
) -> None:
    with pytest.raises(IndexError):
        region().view(layer, page, count)


def test_a_file_of_another_size_is_refused(kv_file: Callable[[KvLayout], Path]) -> None:
    path = kv_file(LAYOUT)
    with pytest.raises(ValueError, match="disagree on the geometry"):
        KvRegion(path, KvLayout(LAYOUT.layers, LAYOUT.pages + 1, LAYOUT.chunk_bytes, 16))


def test_close_waits_for_views(kv_file: Callable[[KvLayout], Path]) -> None:
    r = KvRegion(kv_file(LAYOUT), LAYOUT)
    view = r.view(0, 0)
    with pytest.raises(BufferError, match="still in use"):
        r.close()
    assert r.view(0, 1).nbytes == LAYOUT.chunk_bytes  # still usable
    view.release()
    r.close()
    with pytest.raises(ValueError):  # unmapped
        r.view(0, 1)
    r.close()  # idempotent
