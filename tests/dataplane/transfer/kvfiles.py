"""KV files as an engine makes them (zero-filled, then blocks "computed" into pages), on a
shared-memory filesystem when there is one."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from services.dataplane.kv_layout import KvLayout, expected_chunk, fill
from services.dataplane.transfer.region import KvRegion

SHM = Path("/dev/shm")


def kv_dir() -> Path:
    """Where KV files go: the shared-memory filesystem, else the temporary directory."""
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def new_kv_path(directory: Path | None = None) -> Path:
    return (directory or kv_dir()) / f"kvsched-test-kv-{uuid.uuid4().hex}"


def create_kv_file(path: Path, layout: KvLayout) -> Path:
    """A new zero-filled file the size of `layout` (fails if `path` exists)."""
    with path.open("xb") as f:
        f.truncate(layout.size)
    return path


def fill_pages(region: KvRegion, pages: Sequence[int], hashes: Sequence[int]) -> None:
    """Compute block `hashes[i]` into page `pages[i]`, every layer."""
    for page, block_hash in zip(pages, hashes, strict=True):
        fill(region.blocks(page, 1), [block_hash])


def mismatches(
    region: KvRegion, layers: Sequence[int], pages: Sequence[int], hashes: Sequence[int]
) -> list[tuple[int, int]]:
    """(layer, page) of every chunk that does not hold its block's content."""
    chunk = region.layout.chunk_bytes
    bad = []
    for layer in layers:
        for page, block_hash in zip(pages, hashes, strict=True):
            if region.view(layer, page) != expected_chunk(block_hash, layer, chunk):
                bad.append((layer, page))
    return bad
