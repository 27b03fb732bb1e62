"""The engine's KV memory file: real bytes where the layout says, lowest pages first, pages
accounted for exactly once, the file gone on close, and dead engines' files swept."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsched.core.models import MINI_MODEL, model_config
from services.dataplane.kv_layout import KvLayout, expected_chunk, intact_prefix
from services.dataplane.kv_memory import KvMemory, sweep_stale
from tests.fixtures.kv_content import reference_chunk

LAYOUT = KvLayout.for_model(model_config(MINI_MODEL), 16, 64)


def read_chunk(path: Path, layout: KvLayout, layer: int, page: int) -> bytes:
    """One chunk as another process sees it: through a mapping of its own."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        offset = layout.offset(layer, page)
        return mm[offset : offset + layout.chunk_bytes]


def assert_holds(memory: KvMemory, block_hash: int) -> None:
    page = memory.page_of[block_hash]
    for layer in range(memory.layout.layers):
        got = read_chunk(memory.path, memory.layout, layer, page)
        assert got == expected_chunk(block_hash, layer, memory.layout.chunk_bytes), (layer, page)


def test_the_mini_models_chunk_is_64_bytes_a_token() -> None:
    assert (LAYOUT.layers, LAYOUT.chunk_bytes, LAYOUT.pages) == (32, 16 * 64, 64)


def test_stored_blocks_hold_their_content_on_the_lowest_pages(tmp_path: Path) -> None:
    memory = KvMemory(LAYOUT, "node/e0", tmp_path)
    assert memory.path.parent == tmp_path
    assert memory.path.name == f"kvsched-kv-{os.getpid()}-node_e0"
    assert memory.path.stat().st_size == LAYOUT.size
    chain = [11, 12, 13, 14]
    memory.store(chain)
    assert [memory.page_of[h] for h in chain] == [0, 1, 2, 3]  # one run, consecutive
    for h in chain:
        assert_holds(memory, h)
    memory.remove([12, 13])
    memory.store([21, 22, 23])  # the freed pages first, then the next ones
    assert [memory.page_of[h] for h in (21, 22, 23)] == [1, 2, 4]
    for h in (11, 14, 21, 22, 23):
        assert_holds(memory, h)
    memory.store([21, 99])  # already there: skipped
    assert memory.page_of[21] == 1 and memory.page_of[99] == 5
    memory.check_integrity()
    assert memory.free_pages == 64 - 6
    memory.close()


def test_staged_pages_are_adopted_or_freed(tmp_path: Path) -> None:
    memory = KvMemory(LAYOUT, "e", tmp_path)
    memory.store([1])
    staged = memory.allocate(3)
    assert staged == [1, 2, 3] and memory.staged_pages == 3
    memory.store([2])  # the engine computes a block meanwhile: staged pages are not free
    assert memory.page_of[2] == 4
    memory.adopt(7, staged[0])
    memory.free(staged[1:])
    assert memory.page_of[7] == 1 and memory.staged_pages == 0
    memory.check_integrity()
    with pytest.raises(ValueError):
        memory.adopt(7, memory.allocate(1)[0])  # a block has one page
    with pytest.raises(KeyError):
        memory.free([memory.page_of[1]])  # a cached block's page is not staged
    with pytest.raises(RuntimeError):
        memory.allocate(memory.free_pages + 1)
    memory.close()


def test_integrity_catches_a_page_in_two_places(tmp_path: Path) -> None:
    memory = KvMemory(LAYOUT, "e", tmp_path)
    memory.store([1, 2])
    memory.page_of[2] = memory.page_of[1]
    with pytest.raises(AssertionError):
        memory.check_integrity()
    memory.close()


def test_blocks_stored_on_scattered_free_pages_hold_their_content(tmp_path: Path) -> None:
    layout = KvLayout.for_model(model_config(MINI_MODEL), 16, 4096)
    memory = KvMemory(layout, "e", tmp_path)
    memory.store(range(1, 2049))
    memory.remove(range(1, 2049, 2))  # every other page free: runs of one page
    for i in range(0, 1024, 8):  # 128 chains of 8 blocks: 1024 scattered + 1024 fresh
        memory.store(range(10_000 + i * 2, 10_000 + i * 2 + 16))
    assert_holds(memory, 10_001)
    assert_holds(memory, 10_000 + 1016 * 2 + 15)  # the last block stored
    memory.check_integrity()
    memory.close()


@pytest.mark.parametrize("chunk_bytes", [8, 64 * 3, 64 * 3 + 24])
def test_intact_prefix_counts_blocks_holding_their_content_up_to_the_first_that_does_not(
    tmp_path: Path, chunk_bytes: int
) -> None:
    layout = KvLayout(layers=3, pages=12, chunk_bytes=chunk_bytes, block_size=16)
    memory = KvMemory(layout, "e", tmp_path)
    memory.store([7, 8])  # pages 0 and 1, so the chain below lies on scattered pages
    memory.store([11, 12, 13, 14])
    hashes = [11, 12, 13, 14]
    pages = [memory.page_of[h] for h in hashes]
    for h, page in zip(hashes, pages, strict=True):  # as the rule, computed apart, says
        for layer in range(layout.layers):
            want = reference_chunk(h, layer, chunk_bytes)
            assert memory.chunks[layer, page].tobytes() == want
    assert intact_prefix(memory.chunks, pages, hashes) == 4
    assert intact_prefix(memory.chunks, pages, [11, 12, 99, 14]) == 2  # another block's name
    assert intact_prefix(memory.chunks, [], hashes) == 0
    memory.chunks[layout.layers - 1, pages[2], chunk_bytes - 1] ^= 1  # the very last byte
    assert intact_prefix(memory.chunks, pages, hashes) == 2
    memory.chunks[0, pages[0], 0] ^= np.uint8(0x80)
    assert intact_prefix(memory.chunks, pages, hashes) == 0
    memory.close()


def test_close_removes_the_file_and_is_idempotent(tmp_path: Path) -> None:
    memory = KvMemory(LAYOUT, "e", tmp_path)
    other = KvMemory(LAYOUT, "e", tmp_path)  # two engines of one process, one instance id
    assert other.path != memory.path and other.path.name.startswith(memory.path.name)
    memory.close()
    memory.close()
    assert not memory.path.exists() and other.path.exists()
    other.close()
    assert list(tmp_path.iterdir()) == []


def test_a_dead_engines_file_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid runs no process now
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)  # fmt: skip
    try:
        stale = tmp_path / f"kvsched-kv-{dead.pid}-gone"
        kept = tmp_path / f"kvsched-kv-{live.pid}-running"
        unrelated = tmp_path / "kvsched-kv-notapid"
        for path in (stale, kept, unrelated):
            path.write_bytes(b"x")
        memory = KvMemory(LAYOUT, "e", tmp_path)  # sweeps as it starts
        assert not stale.exists() and kept.exists() and unrelated.exists()
        assert sweep_stale(tmp_path) == []  # our own file is ours, not stale
        assert memory.path.exists()
        memory.close()
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait()
    assert sweep_stale(tmp_path) == [kept]  # now that its process is gone


def test_a_file_left_with_our_own_pid_by_an_earlier_process_is_stale(tmp_path: Path) -> None:
    leftover = tmp_path / f"kvsched-kv-{os.getpid()}-earlier"
    leftover.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [leftover]
