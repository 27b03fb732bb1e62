"""The node's KV pool checks its blocks at rest: each block's checksum is kept when its save
commits, and a load or export ends at the first block whose bytes changed since; that block
and those below it leave the pool (announced as removed) and are counted. Blocks nobody
touched always verify, whatever pages evictions and reuse put them on."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from services.dataplane import kv_pool
from services.dataplane.kv_layout import KvLayout, block_checksums, checksum
from services.dataplane.kv_pool import NodePool
from services.messenger.metrics import MessengerMetrics
from tests.dataplane.test_kv_pool import (
    BS,
    HOLD_S,
    Pools,
    chain,
    holds,
    pinned_and_staged,
    put,
    removed_hashes,
    snapshot_hashes,
    tokens,
    write_pages,
)


@pytest.fixture(params=["inline", "thread"])
def make_pool(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Pools]:
    """Pools whose checks hash on the event loop (these tests' blocks are small) or, as
    larger ones do, in a thread."""
    if request.param == "thread":
        monkeypatch.setattr(kv_pool, "INLINE_CHECK_BYTES", 0)
    pools = Pools(tmp_path)
    yield pools
    for pool in pools.made:
        pool.close()


def flip(pool: NodePool, block_hash: int, layer: int = -1, at: int = -1) -> None:
    """A bit of a held block's page goes bad (by default its last layer's last byte)."""
    memory = pool.memory
    memory.chunks[layer, memory.page_of[block_hash], at] ^= 0x01


async def exported(pool: NodePool, hashes: Sequence[int], start: int = 0) -> tuple[int, str]:
    """How many blocks an export of `hashes` from `start` pins (released at once), and its id."""
    grant = await pool.export_blocks(hashes, start, len(hashes), wait_s=0.0, hold_s=HOLD_S)
    if grant.export_id:
        assert pool.release(grant.export_id)
    pool.check_integrity()
    return grant.blocks, grant.export_id


def test_a_block_checksum_is_one_stream_over_its_layers() -> None:
    """Pinned to xxh3 of the block's chunks one after the other, so a sum is the block's
    bytes and nothing else (not its page, not its neighbours)."""
    layout = KvLayout(layers=3, pages=4, chunk_bytes=16, block_size=BS)
    data = bytearray(random.Random(3).randbytes(layout.size))
    view = memoryview(data)
    want = [
        checksum(b"".join(bytes(view[layout.offset(layer, page) :][:16]) for layer in range(3)))
        for page in range(4)
    ]
    assert list(block_checksums(view, layout, range(4))) == want
    assert list(block_checksums(view, layout, [2, 0])) == [want[2], want[0]]
    data[layout.offset(1, 2)] ^= 0x80  # page 2's middle layer
    got = list(block_checksums(view, layout, range(4)))
    assert [s == w for s, w in zip(got, want, strict=True)] == [True, True, False, True]


@pytest.mark.parametrize("bad", [0, 2, 5])
async def test_a_block_written_over_after_its_save_ends_an_export_and_leaves_the_pool(
    make_pool: Pools, bad: int
) -> None:
    pool = make_pool(8)
    hashes = await put(pool, tokens(6, 1))
    flip(pool, hashes[bad])
    make_pool.events.clear()

    blocks, export_id = await exported(pool, hashes)
    assert blocks == bad
    assert (export_id is None or export_id == "") == (bad == 0)
    # Dropped with every block below it, and announced so the Conductor's index forgets them.
    assert removed_hashes(make_pool.events) == hashes[bad:]
    assert snapshot_hashes(pool) == set(hashes[:bad])
    assert (pool.checks.corrupt, pool.checks.dropped) == (1, 6 - bad)
    assert pinned_and_staged(pool) == (0, 0, 0)
    assert pool.usage().blocks == bad

    # Asked again: the same prefix, nothing more found; saved again, all of it is served.
    assert (await exported(pool, hashes))[0] == bad
    assert pool.checks.corrupt == 1
    await put(pool, tokens(6, 1))
    assert (await exported(pool, hashes))[0] == 6


async def test_an_export_from_a_later_start_checks_only_what_it_hands_out(
    make_pool: Pools,
) -> None:
    pool = make_pool(8)
    hashes = await put(pool, tokens(6, 2))
    flip(pool, hashes[1], layer=0, at=0)
    assert (await exported(pool, hashes, start=3))[0] == 3  # blocks 3..5: not the bad one
    assert pool.checks.corrupt == 0
    assert (await exported(pool, hashes, start=0))[0] == 1
    assert snapshot_hashes(pool) == {hashes[0]}


async def test_a_bad_block_pinned_by_another_export_is_cut_but_not_dropped(
    make_pool: Pools,
) -> None:
    """A reader already holds it pinned: removing it would pull its pages from under that
    reader, so it stays until a check finds it unpinned."""
    pool = make_pool(8)
    hashes = await put(pool, tokens(4, 3))
    first = await pool.export_blocks(hashes, 0, 4, wait_s=0.0, hold_s=HOLD_S)
    assert first.blocks == 4
    flip(pool, hashes[2])
    make_pool.events.clear()

    assert (await exported(pool, hashes))[0] == 2
    assert (pool.checks.corrupt, pool.checks.dropped) == (1, 0)
    assert removed_hashes(make_pool.events) == []
    assert pool.release(first.export_id)
    assert (await exported(pool, hashes))[0] == 2
    assert (pool.checks.corrupt, pool.checks.dropped) == (2, 2)
    assert removed_hashes(make_pool.events) == hashes[2:]


async def test_a_shared_prefix_gone_bad_takes_every_chain_below_it(make_pool: Pools) -> None:
    pool = make_pool(8)
    ids = tokens(2, 4)
    trunk = await put(pool, ids)
    left = await put(pool, [*ids, *tokens(2, 5)])
    right = await put(pool, [*ids, *tokens(1, 6)])
    flip(pool, trunk[1])
    make_pool.events.clear()

    assert (await exported(pool, right))[0] == 1
    assert sorted(removed_hashes(make_pool.events)) == sorted({*left[1:], *right[1:]})
    assert snapshot_hashes(pool) == {trunk[0]}
    assert pool.checks.dropped == 4


async def test_untouched_blocks_always_verify_through_eviction_and_page_reuse(
    make_pool: Pools,
) -> None:
    """Chains sharing prefixes saved into a pool too small for them (evictions reuse pages
    all the time), partial saves of a longer staged import among them: every export of what
    the pool holds is whole."""
    pool = make_pool(6)
    rng = random.Random(17)
    trunks = [tokens(2, seed) for seed in range(3)]
    for step in range(60):
        ids = [*rng.choice(trunks), *tokens(rng.randint(0, 4), 100 + rng.randint(0, 9))]
        hashes = chain(ids)
        held = pool.memory.page_of
        have = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
        if have < len(hashes):
            slots = await pool.begin_import(hashes, len(hashes), hold_s=HOLD_S)
            assert slots.import_id is not None
            write_pages(pool, slots.pages, hashes[slots.have :])
            part = rng.randint(1, len(hashes) - slots.have)  # a source that held fewer
            end = slots.have + part
            await pool.commit_import(slots.import_id, ids[slots.have * BS : end * BS], None)
        cached = pool.memory.page_of
        n = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        assert (await exported(pool, hashes))[0] == n, f"step {step}"
        assert holds(pool, [cached[h] for h in hashes[:n]], hashes[:n])
    assert pool.checks.corrupt == 0
    assert len(removed_hashes(make_pool.events)) > 10, "pages were hardly reused"
    assert pool.checks.checked["commit"] > 0 and pool.checks.checked["export"] > 0


async def test_corrupt_and_dropped_blocks_are_metrics(make_pool: Pools) -> None:
    pool = make_pool(8)
    metrics = MessengerMetrics(lambda: [], lambda: None)
    metrics.watch_pool(pool)
    hashes = await put(pool, tokens(5, 7))
    flip(pool, hashes[3])
    await exported(pool, hashes)
    text = generate_latest(metrics.registry).decode()
    assert "kvsched_messenger_pool_corrupt_blocks_total 1.0" in text
    assert "kvsched_messenger_pool_dropped_blocks_total 2.0" in text
    assert 'kvsched_messenger_pool_checksummed_bytes_total{when="commit"} 640.0' in text
