"""The node's KV pool (`NodePool`) on its own: its memory created by the first engine to attach,
formats refused or replaced, the format remembered across restarts, imports checked against
their token ids before their blocks become visible, exports pinning blocks against eviction,
and its blocks announced as KV events with medium CPU. After every operation the cache, the
memory and the transfers must agree (`check_integrity`)."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.errors import PoolError, PoolFull, PoolRefused
from services.dataplane.kv_layout import KvLayout, expected_chunk
from services.dataplane.kv_pool import NodePool
from services.dataplane.pool_format import BlockFormat
from services.kv_events.vllm_wire import BlockRemoved, BlockStored, EngineHash, Event
from tests.fixtures.poll import wait_for

BS = 4
FMT = BlockFormat("test/float32/2x4x8", layers=2, chunk_bytes=64, block_size=BS)
BLOCK_BYTES = FMT.layers * FMT.chunk_bytes
OTHER = BlockFormat("test/float16/3x4x4", layers=3, chunk_bytes=32, block_size=BS)
HASHER = VllmBlockHasher(BS)
HOLD_S = 30.0


def tokens(blocks: int, seed: int) -> list[int]:
    """`blocks` full blocks of token ids, distinct per seed."""
    return [(seed * 1009 + i * 7) % 50_000 + 1 for i in range(blocks * BS)]


def chain(ids: Sequence[int], salt: str | None = None) -> list[int]:
    return HASHER.hash_prompt(ids, salt)


def read_chunk(path: Path, layout: KvLayout, layer: int, page: int) -> bytes:
    """One chunk as another process (an engine's connector) sees it: through its own mapping."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        offset = layout.offset(layer, page)
        return mm[offset : offset + layout.chunk_bytes]


def write_pages(pool: NodePool, pages: Sequence[int], hashes: Sequence[int]) -> None:
    """What an engine does for a save: write each block's chunks into its staged page."""
    chunks, chunk_bytes = pool.memory.chunks, pool.memory.layout.chunk_bytes
    for page, h in zip(pages, hashes, strict=True):
        for layer in range(pool.memory.layout.layers):
            chunks[layer, page] = np.frombuffer(expected_chunk(h, layer, chunk_bytes), np.uint8)


def holds(pool: NodePool, pages: Sequence[int], hashes: Sequence[int]) -> bool:
    """Every layer of every page holds its block's content, read from the file."""
    memory = pool.memory
    return all(
        read_chunk(memory.path, memory.layout, layer, page)
        == expected_chunk(h, layer, memory.layout.chunk_bytes)
        for page, h in zip(pages, hashes, strict=True)
        for layer in range(memory.layout.layers)
    )


async def put(pool: NodePool, ids: Sequence[int], salt: str | None = None) -> list[int]:
    """Import the full blocks of `ids` (after those the pool holds) and commit them."""
    hashes = chain(ids, salt)
    slots = await pool.begin_import(hashes, len(hashes), hold_s=HOLD_S)
    assert slots.import_id is not None, "the pool held the whole chain already"
    write_pages(pool, slots.pages, hashes[slots.have :])
    stored = await pool.commit_import(slots.import_id, ids[slots.have * BS :], salt)
    assert stored == len(hashes) - slots.have
    pool.check_integrity()
    return hashes


def pinned_and_staged(pool: NodePool) -> tuple[int, int, int]:
    """(exports, imports, pinned blocks + staged pages) of an attached pool."""
    usage = pool.usage()
    return usage.exports, usage.imports, usage.pinned + usage.staged


def stored_events(events: Sequence[Event]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def snapshot_hashes(pool: NodePool) -> set[EngineHash]:
    return {h for e in pool.snapshot() if isinstance(e, BlockStored) for h in e.block_hashes}


def removed_hashes(events: Sequence[Event]) -> list[EngineHash]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


@dataclass
class Pools:
    """Makes pools in `directory`, each publishing into `events`; closes them after."""

    directory: Path
    events: list[Event] = field(default_factory=list)
    made: list[NodePool] = field(default_factory=list)

    def __call__(
        self, blocks: int = 4, *, attach: bool = True, extra_bytes: int = 0, **kw: Any
    ) -> NodePool:
        pool = NodePool(
            blocks * BLOCK_BYTES + extra_bytes,
            node="node-0",
            hasher_for=VllmBlockHasher,
            on_events=self.events.extend,
            directory=self.directory,
            **kw,
        )
        self.made.append(pool)
        if attach:
            pool.attach(FMT)
        return pool


@pytest.fixture
def make_pool(tmp_path: Path) -> Iterator[Pools]:
    directory = tmp_path / "shm"
    directory.mkdir()
    pools = Pools(directory)
    yield pools
    for pool in pools.made:
        pool.close()


def memory_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("kvsched-kv-"))


# ---- attaching ------------------------------------------------------------------------------


def test_the_first_attach_creates_the_memory(make_pool: Pools) -> None:
    pool = make_pool(5, attach=False, extra_bytes=BLOCK_BYTES - 1)
    assert (pool.attached, pool.format, memory_files(make_pool.directory)) == (False, None, [])
    memory = pool.attach(FMT)
    assert pool.attached and pool.format == FMT
    assert memory.layout == KvLayout(FMT.layers, 5, FMT.chunk_bytes, BS)  # 5 whole blocks
    assert memory.path.parent == make_pool.directory and memory.path.exists()
    assert stat.S_IMODE(memory.path.stat().st_mode) == 0o600
    assert memory.path.stat().st_size == FMT.layers * 5 * FMT.chunk_bytes
    assert memory.free_pages == 5 and pool.usage().blocks == 0
    assert pool.attach(FMT) is memory  # the same format again: the same pool
    assert memory_files(make_pool.directory) == [memory.path]
    pool.check_integrity()


def test_a_pool_too_small_for_one_block_refuses(make_pool: Pools) -> None:
    pool = make_pool(0, attach=False, extra_bytes=BLOCK_BYTES - 1)
    with pytest.raises(PoolRefused, match="cannot hold one block"):
        pool.attach(FMT)
    assert not pool.attached and pool.format is None
    assert memory_files(make_pool.directory) == []


async def test_another_format_is_refused_while_the_pool_holds_a_block(make_pool: Pools) -> None:
    pool = make_pool(4)
    path = pool.memory.path
    hashes = await put(pool, tokens(1, 1))
    with pytest.raises(PoolRefused, match="holds blocks of"):
        pool.attach(OTHER)
    assert pool.format == FMT and pool.memory.path == path and path.exists()
    assert snapshot_hashes(pool) == set(hashes)
    pool.check_integrity()


async def test_another_format_is_refused_while_a_save_is_staged(make_pool: Pools) -> None:
    pool = make_pool(4)
    slots = await pool.begin_import(chain(tokens(1, 1)), 1, hold_s=HOLD_S)
    assert slots.import_id is not None and pool.usage().blocks == 0
    with pytest.raises(PoolRefused):
        pool.attach(OTHER)
    assert pool.format == FMT and pool.memory.staged_pages == 1
    assert pool.abort(slots.import_id)
    pool.attach(OTHER)  # nothing held any more: replaced
    assert pool.format == OTHER


def test_another_format_replaces_a_pool_that_holds_nothing(make_pool: Pools) -> None:
    pool = make_pool(4, format_file=make_pool.directory / "pool.format")
    old = pool.memory
    memory = pool.attach(OTHER)
    assert pool.format == OTHER and pool.memory is memory and memory is not old
    assert memory.layout == OTHER.layout(4 * BLOCK_BYTES // (OTHER.layers * OTHER.chunk_bytes))
    assert memory.layout.pages == 5 and old.chunks.size == 0  # 512 // 96; the old one closed
    assert memory_files(make_pool.directory) == [memory.path]  # the old file is gone
    assert memory.path.stat().st_size == memory.layout.size != old.layout.size
    assert json.loads((make_pool.directory / "pool.format").read_text()) == asdict(OTHER)
    pool.check_integrity()


def test_a_refused_replacement_keeps_the_empty_pool(make_pool: Pools) -> None:
    pool = make_pool(4)
    path = pool.memory.path
    huge = BlockFormat("test/huge", layers=2, chunk_bytes=8 * BLOCK_BYTES, block_size=BS)
    with pytest.raises(PoolRefused, match="cannot hold one block"):
        pool.attach(huge)
    assert pool.attached and pool.format == FMT
    assert pool.memory.path == path and path.exists()


# ---- the format remembered across restarts ------------------------------------------------


def test_the_format_file_attaches_a_restarted_pool(make_pool: Pools) -> None:
    format_file = make_pool.directory / "run" / "pool.format"
    first = make_pool(4, format_file=format_file)
    assert json.loads(format_file.read_text()) == asdict(FMT)
    assert stat.S_IMODE(format_file.stat().st_mode) == 0o600
    first.close()
    assert memory_files(make_pool.directory) == []
    again = make_pool(4, attach=False, format_file=format_file)
    assert again.attached and again.format == FMT
    assert again.memory.layout.pages == 4 and again.memory.path.exists()
    assert again.attach(FMT) is again.memory
    never = make_pool(4, attach=False)  # no format file: nothing attached
    assert not never.attached


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        "null",
        '{"kind": "x"}',
        '{"kind": "", "layers": 2, "chunk_bytes": 64, "block_size": 4}',
        '{"kind": "x", "layers": 0, "chunk_bytes": 64, "block_size": 4}',
        '{"kind": "x", "layers": "2", "chunk_bytes": 64, "block_size": 4}',
        '{"kind": "x", "layers": 2, "chunk_bytes": 64, "block_size": 4, "more": 1}',
    ],
)
def test_a_corrupt_format_file_is_ignored(make_pool: Pools, text: str) -> None:
    format_file = make_pool.directory / "pool.format"
    format_file.write_text(text)
    pool = make_pool(4, attach=False, format_file=format_file)
    assert not pool.attached and pool.format is None
    pool.attach(FMT)  # the first engine then attaches as on a fresh node
    assert json.loads(format_file.read_text()) == asdict(FMT)


def test_a_format_file_with_an_impossible_layout_is_ignored(make_pool: Pools) -> None:
    format_file = make_pool.directory / "pool.format"
    format_file.write_text(json.dumps({**asdict(FMT), "chunk_bytes": 60}))
    pool = make_pool(4, attach=False, format_file=format_file)
    assert not pool.attached


def test_a_remembered_format_that_no_longer_fits_is_not_fatal(make_pool: Pools) -> None:
    format_file = make_pool.directory / "pool.format"
    format_file.write_text(json.dumps(asdict(FMT)))
    pool = make_pool(0, attach=False, extra_bytes=BLOCK_BYTES - 1, format_file=format_file)
    assert not pool.attached


# ---- imports and exports --------------------------------------------------------------------


@pytest.mark.parametrize("salt", [None, "tenant-a"])
async def test_an_import_makes_its_blocks_exportable(make_pool: Pools, salt: str | None) -> None:
    pool = make_pool(4)
    ids = tokens(3, 1)
    hashes = chain(ids, salt)
    slots = await pool.begin_import(hashes, 3, hold_s=HOLD_S)
    assert slots.import_id and slots.have == 0 and slots.pages == (0, 1, 2)
    assert pool.memory.staged_pages == 3 and pool.usage().blocks == 0
    pool.check_integrity()
    write_pages(pool, slots.pages, hashes)
    assert make_pool.events == []  # nothing visible before the commit
    assert await pool.commit_import(slots.import_id, ids, salt) == 3
    pool.check_integrity()
    assert pool.usage().blocks == 3 and pool.memory.staged_pages == 0
    [event] = make_pool.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(hashes) and event.parent_block_hash is None
    assert event.token_ids == tuple(ids) and event.block_size == BS and event.medium == "CPU"
    assert event.extra_keys == (None if salt is None else [[salt], None, None])

    got = await pool.export_blocks(hashes, 0, 3, wait_s=0.0, hold_s=HOLD_S)
    assert got.export_id and got.blocks == 3 and got.pages == slots.pages
    assert got.token_ids == tuple(ids) and got.cache_salt == salt
    assert holds(pool, got.pages, hashes)
    tail = await pool.export_blocks(hashes, 1, 3, wait_s=0.0, hold_s=HOLD_S)
    assert tail.blocks == 2 and tail.pages == slots.pages[1:]
    assert tail.token_ids == tuple(ids[BS:])
    assert pinned_and_staged(pool)[0] == 2
    pool.check_integrity()
    assert pool.release(got.export_id) and pool.release(tail.export_id)
    assert not pool.release(got.export_id)
    assert pinned_and_staged(pool) == (0, 0, 0)
    assert len(make_pool.events) == 1  # exports and releases announce nothing
    pool.check_integrity()


async def test_an_import_continues_the_prefix_the_pool_holds(make_pool: Pools) -> None:
    pool = make_pool(4)
    ids = tokens(4, 2)
    hashes = chain(ids)
    await put(pool, ids[: 2 * BS])
    slots = await pool.begin_import(hashes, 4, hold_s=HOLD_S)
    assert slots.import_id and slots.have == 2 and slots.pages == (2, 3)
    write_pages(pool, slots.pages, hashes[2:])
    assert await pool.commit_import(slots.import_id, ids[2 * BS :], None) == 2
    pool.check_integrity()
    last = stored_events(make_pool.events)[-1]
    assert last.block_hashes == tuple(hashes[2:]) and last.parent_block_hash == hashes[1]
    assert last.medium == "CPU"
    again = await pool.begin_import(hashes, 4, hold_s=HOLD_S)
    assert again.import_id is None and again.have == 4 and again.pages == ()
    got = await pool.export_blocks(hashes, 0, 4, wait_s=0.0, hold_s=HOLD_S)
    assert got.token_ids == tuple(ids) and holds(pool, got.pages, hashes)
    assert pool.release(got.export_id)


async def test_an_export_of_blocks_the_pool_lacks_pins_nothing(make_pool: Pools) -> None:
    pool = make_pool(4)
    got = await pool.export_blocks(chain(tokens(2, 3)), 0, 2, wait_s=0.0, hold_s=HOLD_S)
    assert got.export_id == "" and got.blocks == 0 and got.pages == ()
    assert pinned_and_staged(pool) == (0, 0, 0)


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(lambda ids: [t + 1 for t in ids], id="other-tokens"),
        pytest.param(lambda ids: ids[:-1], id="partial-block"),
        pytest.param(lambda ids: [], id="none"),
        pytest.param(lambda ids: ids + tokens(1, 9), id="more-blocks-than-staged"),
        pytest.param(lambda ids: ids[BS:] + ids[:BS], id="blocks-out-of-order"),
    ],
)
async def test_a_commit_with_wrong_token_ids_stores_nothing(
    make_pool: Pools, wrong: Callable[[list[int]], list[int]]
) -> None:
    pool = make_pool(4)
    free = pool.memory.free_pages
    ids = tokens(2, 4)
    hashes = chain(ids)
    slots = await pool.begin_import(hashes, 2, hold_s=HOLD_S)
    assert slots.import_id is not None and pool.memory.free_pages == free - 2
    write_pages(pool, slots.pages, hashes)
    with pytest.raises(PoolError):
        await pool.commit_import(slots.import_id, wrong(ids), None)
    pool.check_integrity()
    assert pool.usage().blocks == 0 and pool.snapshot() == [] and make_pool.events == []
    assert pool.memory.free_pages == free and pool.memory.staged_pages == 0
    assert pinned_and_staged(pool) == (0, 0, 0)
    with pytest.raises(PoolError, match="no import"):  # the import was aborted
        await pool.commit_import(slots.import_id, ids, None)
    assert not pool.abort(slots.import_id)


async def test_a_salted_chain_needs_its_salt(make_pool: Pools) -> None:
    pool = make_pool(4)
    ids = tokens(1, 5)
    slots = await pool.begin_import(chain(ids, "tenant-a"), 1, hold_s=HOLD_S)
    assert slots.import_id is not None
    with pytest.raises(PoolError, match="do not hash"):
        await pool.commit_import(slots.import_id, ids, None)
    assert pool.usage().blocks == 0 and pool.memory.staged_pages == 0
    pool.check_integrity()


async def test_an_abort_gives_the_staged_pages_back(make_pool: Pools) -> None:
    pool = make_pool(4)
    ids = tokens(3, 6)
    hashes = chain(ids)
    await put(pool, ids[:BS])
    slots = await pool.begin_import(hashes, 3, hold_s=HOLD_S)
    assert slots.import_id and slots.have == 1 and len(slots.pages) == 2
    assert pinned_and_staged(pool) == (0, 1, 3)  # the held prefix and two reserved pages
    assert pool.abort(slots.import_id)
    assert not pool.abort(slots.import_id)
    assert pinned_and_staged(pool) == (0, 0, 0)
    assert pool.memory.free_pages == 3 and pool.usage().blocks == 1
    pool.check_integrity()


async def test_a_hold_time_ends_exports_and_imports(make_pool: Pools) -> None:
    pool = make_pool(4)
    hashes = await put(pool, tokens(1, 7))
    got = await pool.export_blocks(hashes, 0, 1, wait_s=0.0, hold_s=0.05)
    slots = await pool.begin_import(chain(tokens(1, 8)), 1, hold_s=0.05)
    assert got.export_id and slots.import_id
    assert pinned_and_staged(pool) == (1, 1, 2)
    await wait_for(lambda: pinned_and_staged(pool) == (0, 0, 0), 2.0, message="holds expired")
    assert pool.memory.staged_pages == 0 and not pool.release(got.export_id)
    pool.check_integrity()


# ---- eviction -------------------------------------------------------------------------------


async def test_a_full_pool_evicts_its_least_recently_used_leaf(make_pool: Pools) -> None:
    pool = make_pool(4)
    a_ids = tokens(3, 10)
    a = await put(pool, a_ids[: 2 * BS])
    b = await put(pool, tokens(1, 11))
    await put(pool, a_ids)  # continues a (a use of a's prefix): b is now the oldest
    assert pool.usage().blocks == 4 and removed_hashes(make_pool.events) == []
    c = await put(pool, tokens(1, 12))
    assert removed_hashes(make_pool.events) == b
    [removed] = [e for e in make_pool.events if isinstance(e, BlockRemoved)]
    assert removed.medium == "CPU"
    assert snapshot_hashes(pool) == {*a, chain(a_ids)[2], *c}
    d = await put(pool, tokens(1, 13))
    assert removed_hashes(make_pool.events) == [*b, chain(a_ids)[2]]  # a leaf, not a's root
    assert snapshot_hashes(pool) == {*a, *c, *d}
    pool.check_integrity()


async def test_an_exported_block_is_not_evicted(make_pool: Pools) -> None:
    pool = make_pool(3)
    a = await put(pool, tokens(2, 20))  # the oldest blocks
    b = await put(pool, tokens(1, 21))
    got = await pool.export_blocks(a, 1, 2, wait_s=0.0, hold_s=HOLD_S)  # pins a[1] and a[0]
    assert got.blocks == 1 and pinned_and_staged(pool)[2] == 2
    c = await put(pool, tokens(1, 22))
    assert removed_hashes(make_pool.events) == b  # not a, though older
    assert holds(pool, got.pages, a[1:])
    assert pool.release(got.export_id)
    await put(pool, tokens(1, 23))
    assert removed_hashes(make_pool.events) == [*b, a[1]]  # a is evictable again, and oldest
    assert snapshot_hashes(pool) == {*a[:1], *c, *chain(tokens(1, 23))}
    pool.check_integrity()


async def test_no_room_when_every_block_is_pinned(make_pool: Pools) -> None:
    pool = make_pool(2)
    a = await put(pool, tokens(2, 30))
    got = await pool.export_blocks(a, 0, 2, wait_s=0.0, hold_s=HOLD_S)
    hashes = chain(tokens(1, 31))
    with pytest.raises(PoolFull, match="no room"):
        await pool.begin_import(hashes, 1, hold_s=HOLD_S)
    assert pool.usage().blocks == 2 and removed_hashes(make_pool.events) == []
    assert pinned_and_staged(pool) == (1, 0, 2) and pool.memory.staged_pages == 0
    pool.check_integrity()
    assert pool.release(got.export_id)
    await put(pool, tokens(1, 31))
    assert removed_hashes(make_pool.events) == [a[1]]


# ---- views and life -------------------------------------------------------------------------


async def test_the_snapshot_lists_every_block_parents_first(make_pool: Pools) -> None:
    pool = make_pool(8)
    a_ids = tokens(3, 40)
    a = await put(pool, a_ids)
    branch_ids = a_ids[:BS] + tokens(2, 41)  # shares a's first block
    branch = await put(pool, branch_ids)
    assert branch[0] == a[0] and pool.usage().blocks == 5
    s = await put(pool, tokens(1, 42), "tenant-b")
    snapshot = pool.snapshot()
    # one event a chain as it was stored: a, the branch off a's first block, s
    assert [len(e.block_hashes) for e in snapshot if isinstance(e, BlockStored)] == [3, 2, 1]
    parent_of: dict[EngineHash, EngineHash | None] = {}
    for event in snapshot:
        assert isinstance(event, BlockStored)
        assert event.medium == "CPU" and event.block_size == BS
        assert event.parent_block_hash is None or event.parent_block_hash in parent_of
        prev = event.parent_block_hash
        for h in event.block_hashes:
            parent_of[h], prev = prev, h
    assert parent_of == {
        a[0]: None, a[1]: a[0], a[2]: a[1], branch[1]: a[0], branch[2]: branch[1], s[0]: None
    }  # fmt: skip
    by_first = {e.block_hashes[0]: e for e in snapshot if isinstance(e, BlockStored)}
    assert by_first[a[0]].token_ids == tuple(a_ids)
    assert by_first[branch[1]].token_ids == tuple(branch_ids[BS:])
    assert by_first[s[0]].extra_keys == [["tenant-b"]]
    assert by_first[a[0]].extra_keys is None
    pool.check_integrity()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda pool: pool.memory, id="memory"),
        pytest.param(lambda pool: pool.release("x-1"), id="release"),
        pytest.param(lambda pool: pool.abort("i-1"), id="abort"),
    ],
)
def test_calls_before_attach_raise(make_pool: Pools, call: Callable[[NodePool], object]) -> None:
    pool = make_pool(4, attach=False)
    with pytest.raises(PoolError, match="attached"):
        call(pool)
    assert not pool.attached


async def test_async_calls_before_attach_raise(make_pool: Pools) -> None:
    pool = make_pool(4, attach=False)
    hashes = chain(tokens(1, 50))
    with pytest.raises(PoolError, match="attached"):
        await pool.export_blocks(hashes, 0, 1, wait_s=0.0, hold_s=HOLD_S)
    with pytest.raises(PoolError, match="attached"):
        await pool.begin_import(hashes, 1, hold_s=HOLD_S)
    with pytest.raises(PoolError, match="attached"):
        await pool.commit_import("i-1", tokens(1, 50), None)
    with pytest.raises(PoolError, match="attached"):
        await pool.release_export("x-1")
    with pytest.raises(PoolError, match="attached"):
        await pool.abort_import("i-1")
    assert pool.snapshot() == [] and pool.usage().blocks == 0 and not pool.attached
    pool.check_integrity()  # nothing to check, and no error
    assert make_pool.events == []


async def test_close_ends_everything_and_removes_the_memory(make_pool: Pools) -> None:
    pool = make_pool(4)
    a = await put(pool, tokens(2, 60))
    got = await pool.export_blocks(a, 0, 2, wait_s=0.0, hold_s=HOLD_S)
    slots = await pool.begin_import(chain(tokens(1, 61)), 1, hold_s=HOLD_S)
    path = pool.memory.path
    assert got.export_id and slots.import_id and path.exists()
    pool.close()
    assert not path.exists() and memory_files(make_pool.directory) == []
    assert pinned_and_staged(pool) == (0, 0, 0)
    with pytest.raises(PoolError):  # a closed pool stages nothing more
        await pool.begin_import(chain(tokens(1, 62)), 1, hold_s=HOLD_S)
    assert os.listdir(make_pool.directory) == []


@pytest.mark.parametrize("ends", ["committed", "aborted"])
async def test_an_export_waits_for_blocks_being_committed_not_for_a_miss(
    make_pool: Pools, ends: str
) -> None:
    pool = make_pool(4)
    ids = tokens(3, 30)
    hashes = chain(ids)
    slots = await pool.begin_import(hashes, 3, hold_s=HOLD_S)
    assert slots.import_id
    write_pages(pool, slots.pages, hashes)
    waiting = asyncio.create_task(
        pool.export_blocks(hashes, 0, 3, wait_s=0.0, hold_s=HOLD_S, landing_s=HOLD_S)
    )
    await asyncio.sleep(0)  # let it start waiting
    assert not waiting.done()
    # A scheduler's load must not wait: the blocks are not in the pool yet.
    miss = await pool.export_blocks(hashes, 0, 3, wait_s=0.0, hold_s=HOLD_S, landing_s=0.0)
    assert miss.blocks == 0
    if ends == "committed":
        await pool.commit_import(slots.import_id, ids, None)
    else:
        pool.abort(slots.import_id)
    got = await asyncio.wait_for(waiting, 5.0)
    assert got.blocks == (3 if ends == "committed" else 0)
    if got.export_id:
        pool.release(got.export_id)
    assert pinned_and_staged(pool) == (0, 0, 0)


async def test_an_adapters_chain_is_checked_kept_and_exported_with_its_adapter(
    make_pool: Pools,
) -> None:
    """A LoRA adapter's blocks hash with its name and path (on every block, a continued
    chain's too); the pool takes them only with that adapter, publishes them as vLLM does and
    exports them with it, for the next holder's check."""
    pool = make_pool(4)
    adapter = ("sql-bot", "/adapters/sql-bot")
    ids = tokens(3, 9)
    hashes = HASHER.hash_prompt(ids, None, adapter)
    slots = await pool.begin_import(hashes, 1, hold_s=HOLD_S)
    assert slots.import_id is not None
    write_pages(pool, slots.pages, hashes[:1])
    with pytest.raises(PoolError, match="do not hash"):
        await pool.commit_import(slots.import_id, ids[:BS], None)  # without its adapter
    slots = await pool.begin_import(hashes, 1, hold_s=HOLD_S)
    assert slots.import_id is not None
    write_pages(pool, slots.pages, hashes[:1])
    assert await pool.commit_import(slots.import_id, ids[:BS], None, adapter) == 1
    rest = await pool.begin_import(hashes, 3, hold_s=HOLD_S)  # continues the held block
    assert rest.import_id is not None and rest.have == 1
    write_pages(pool, rest.pages, hashes[1:])
    assert await pool.commit_import(rest.import_id, ids[BS:], None, adapter) == 2
    first, second = make_pool.events
    for event, blocks in ((first, 1), (second, 2)):  # vLLM's shape: the name on every block
        assert isinstance(event, BlockStored) and event.lora_name == adapter[0]
        assert event.extra_keys == [[adapter[0]]] * blocks
    got = await pool.export_blocks(hashes, 0, 3, wait_s=0.0, hold_s=HOLD_S)
    assert got.blocks == 3 and got.adapter == adapter
    pool.check_integrity()
