"""A simulated engine on its node's KV pool, through the same socket and calls as kvsched's
vLLM connector: a real `NodePool` served by a real `PoolServer`, and engines served in process.
What one engine computes is saved into the pool; another engine of the node loads it instead
of computing it, byte for byte; a pool that is absent or of another format is only a miss."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.dataplane.kv_layout import SIM_FORMAT
from services.dataplane.kv_memory import KvMemory
from services.dataplane.kv_pool import NodePool
from services.dataplane.kv_transfer import WrongBlocks
from services.dataplane.pool_format import BlockFormat
from services.dataplane.pool_server import PoolServer
from services.dataplane.pool_store import PoolStore
from tests.engine.conftest import FAST, RunningEngine
from tests.fixtures.kv_content import reference_chunk
from tests.fixtures.poll import wait_for
from tests.fixtures.vllm_metrics import prompt_sources

BS = FAST.block_size


@dataclass
class Pool:
    pool: NodePool
    socket: Path
    server: PoolServer


def new_pool(directory: Path) -> NodePool:
    """A node's pool of 64 MiB, no one listening to its events."""
    return NodePool(
        64 << 20,
        node="node-0",
        hasher_for=FAST.block_hashes.hasher,
        on_events=lambda events: None,
        directory=directory,
    )


@contextlib.asynccontextmanager
async def served_pool() -> AsyncIterator[Pool]:
    """A node's pool served on a socket, as its Messenger serves it."""
    directory = Path(tempfile.mkdtemp(prefix="kp"))  # a socket path must fit in 108 bytes
    kv_pool = new_pool(directory)
    server = PoolServer(kv_pool, directory / "pool.sock")
    await server.start()
    try:
        yield Pool(kv_pool, directory / "pool.sock", server)
    finally:
        await server.stop()
        kv_pool.close()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    async with served_pool() as served:
        yield served


async def stop_pool(served: Pool) -> None:
    """The node's Messenger goes away: its socket closes and its pool's file is removed
    (idempotent: `served_pool` stops it again)."""
    await served.server.stop()
    served.pool.close()


def prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 3900 for i in range(n)]


async def cached_tokens(engine: RunningEngine, ids: list[int]) -> int:
    answer = await engine.complete({"model": FAST.model, "prompt": ids, "max_tokens": 2})
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def held_right(memory: KvMemory, hashes: list[int]) -> bool:
    """Every block of `hashes` has a page holding the bytes its hash and each layer imply
    (computed apart from the engine's own code)."""
    layout = memory.layout
    for h in hashes:
        page = memory.page_of[h]
        for layer in range(layout.layers):
            want = np.frombuffer(reference_chunk(h, layer, layout.chunk_bytes), dtype=np.uint8)
            if not np.array_equal(memory.chunks[layer, page], want):
                return False
    return True


async def test_blocks_one_engine_computed_are_loaded_by_another_not_computed(
    start_engine: Any, pool: Pool
) -> None:
    start = start_engine
    first = await start(instance_id="e-0", kv_pool_socket=str(pool.socket))
    second = await start(instance_id="e-1", kv_pool_socket=str(pool.socket))
    ids = prompt(1, 10 * BS + 5)
    assert await cached_tokens(first, ids) == 0
    hashes = list(first.live.cache.nodes)[:10]

    await wait_for(lambda: pool.pool.usage().blocks >= 10, 5.0, message="the prompt saved")
    assert pool.pool.format == BlockFormat(
        SIM_FORMAT, first.live.memory.layout.layers, first.live.memory.layout.chunk_bytes, BS
    )
    # The second engine finds the ten blocks in the pool: loaded, cached, never computed.
    assert await cached_tokens(second, ids) == 10 * BS
    link = second.live.pool
    assert link is not None and link.loaded_blocks == 10
    # Counted as vLLM counts its KV connector's loads.
    assert await prompt_sources(second.http, second.url) == {
        "local_compute": len(ids) - 10 * BS,
        "local_cache_hit": 0,
        "external_kv_transfer": 10 * BS,
    }
    assert held_right(second.live.memory, hashes)
    second.live.check_integrity()
    usage = pool.pool.usage()
    assert (usage.pinned, usage.staged, usage.exports, usage.imports) == (0, 0, 0, 0)
    # A longer prompt loads only what its own cache lacks.
    longer = [*ids[: 10 * BS], *prompt(2, 4 * BS + 3)]
    assert await cached_tokens(first, longer) == 10 * BS
    await wait_for(lambda: pool.pool.usage().blocks >= 14, 5.0, message="the longer prompt saved")
    assert await cached_tokens(second, longer) == 14 * BS
    assert link.loaded_blocks == 14


async def test_without_a_reachable_pool_the_engine_computes_as_before(
    start_engine: Any, tmp_path: Path
) -> None:
    start = start_engine
    engine = await start(kv_pool_socket=str(tmp_path / "none.sock"))
    ids = prompt(3, 4 * BS + 1)
    assert await cached_tokens(engine, ids) == 0
    assert await cached_tokens(engine, ids) == 4 * BS  # its own cache still works
    link = engine.live.pool
    assert link is not None and link.loaded_blocks == link.saved_blocks == 0
    engine.live.check_integrity()


async def test_a_pool_holding_another_format_is_a_miss(start_engine: Any, pool: Pool) -> None:
    start = start_engine
    first = await start(instance_id="e-0", kv_pool_socket=str(pool.socket))
    ids = prompt(4, 4 * 2 * BS + 1)
    await cached_tokens(first, ids)
    await wait_for(lambda: pool.pool.usage().blocks >= 8, 5.0, message="blocks saved")
    fmt = pool.pool.format
    # An engine of twice the block size cannot share the pool: it computes, saves nothing.
    other = await start(instance_id="e-1", kv_pool_socket=str(pool.socket), block_size=2 * BS)
    assert await cached_tokens(other, ids) == 0
    assert await cached_tokens(other, ids) == 4 * 2 * BS  # its own cache
    assert pool.pool.format == fmt and pool.pool.usage().blocks == 8
    link = other.live.pool
    assert link is not None and link.saved_blocks == link.loaded_blocks == 0


async def test_requests_arriving_together_both_find_the_loaded_blocks(
    start_engine: Any, pool: Pool
) -> None:
    first = await start_engine(instance_id="e-0", kv_pool_socket=str(pool.socket))
    second = await start_engine(instance_id="e-1", kv_pool_socket=str(pool.socket))
    ids = prompt(5, 10 * BS + 5)
    await cached_tokens(first, ids)
    await wait_for(lambda: pool.pool.usage().blocks >= 10, 5.0, message="the prompt saved")
    got = await asyncio.gather(
        cached_tokens(second, [*ids, 1, 2, 3]), cached_tokens(second, [*ids, 4, 5, 6])
    )
    assert list(got) == [10 * BS, 10 * BS]


async def test_an_engine_finds_a_restarted_messengers_new_pool(start_engine: Any) -> None:
    """The Messenger restarted: a new pool in a new file behind the same socket. The engine's
    next request reconnects, attaches again, and its blocks are saved into the new pool."""
    directory = Path(tempfile.mkdtemp(prefix="kp"))
    socket = directory / "pool.sock"

    async def serve() -> tuple[NodePool, PoolServer]:
        pool = new_pool(directory)
        server = PoolServer(pool, socket)
        await server.start()
        return pool, server

    try:
        old, server = await serve()
        engine = await start_engine(kv_pool_socket=str(socket))
        await cached_tokens(engine, prompt(6, 4 * BS + 1))
        await wait_for(lambda: old.usage().blocks >= 4, 5.0, message="saved into the first")
        await server.stop()
        old.close()
        new, server = await serve()
        try:
            ids = prompt(7, 4 * BS + 1)
            assert await cached_tokens(engine, ids) == 0  # the new pool holds nothing yet
            await wait_for(lambda: new.usage().blocks >= 4, 5.0, message="saved into the new")
            engine.live.check_integrity()
        finally:
            await server.stop()
            new.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- byte-exact round trips, and loads that fail ---------------------------------------


async def saved(engine: RunningEngine, pool: Pool, ids: list[int], blocks: int) -> list[int]:
    """`engine` computes the prompt `ids`; its first `blocks` blocks' hashes, once the node's
    pool holds them all."""
    assert await cached_tokens(engine, ids) == 0
    hashes = engine.live.hasher.hash_prompt(ids)[:blocks]
    await wait_for(lambda: pool_holds(pool, hashes), 5.0, message="the prompt saved")
    return hashes


def pool_holds(pool: Pool, hashes: list[int]) -> bool:
    page_of = pool.pool.memory.page_of
    return all(h in page_of for h in hashes)


async def test_a_block_written_back_and_loaded_again_holds_its_own_bytes(
    start_engine: Any, pool: Pool
) -> None:
    """Saved into the pool, evicted from the engine's own memory (its pages reused by other
    blocks), asked again: loaded, not computed, and every layer's bytes are the ones its hash
    implies."""
    engine = await start_engine(kv_pool_socket=str(pool.socket), capacity_blocks=16)
    ids = prompt(11, 10 * BS + 5)
    hashes = await saved(engine, pool, ids, 10)
    old_pages = {engine.live.memory.page_of[h] for h in hashes}
    for seed in range(20, 30):  # other prompts push the first out of the engine's memory
        if not any(h in engine.live.cache.nodes for h in hashes):
            break
        await cached_tokens(engine, prompt(seed, 10 * BS + 5))
    assert not any(h in engine.live.cache.nodes for h in hashes), "never evicted"
    assert old_pages & set(engine.live.memory.page_of.values()), "no page was reused"
    assert pool_holds(pool, hashes)

    assert await cached_tokens(engine, ids) == 10 * BS
    link = engine.live.pool
    assert link is not None and link.loaded_blocks == 10 and link.refused_blocks == 0
    assert held_right(engine.live.memory, hashes)
    engine.live.check_integrity()
    pool.pool.check_integrity()


@pytest.mark.parametrize("bad", [0, 3])
async def test_a_pool_page_written_over_after_the_save_is_recomputed_not_loaded(
    start_engine: Any, pool: Pool, bad: int
) -> None:
    """The pool finds the block's bytes changed since its save: it answers the blocks
    before it, drops it and the blocks after it, and the engine computes them (then saves
    them again, intact)."""
    first = await start_engine(instance_id="e-0", kv_pool_socket=str(pool.socket))
    second = await start_engine(instance_id="e-1", kv_pool_socket=str(pool.socket))
    ids = prompt(12 + bad, 10 * BS + 5)
    hashes = await saved(first, pool, ids, 10)
    memory = pool.pool.memory
    layer = memory.layout.layers - 1  # the last layer, the last byte: all of it is checked
    memory.chunks[layer, memory.page_of[hashes[bad]], -1] ^= 0xFF

    # The blocks before the bad one are loaded; it and those after it are computed.
    assert await cached_tokens(second, ids) == bad * BS
    link = second.live.pool
    # Refused by the pool, before the engine saw a byte of it.
    assert link is not None and link.loaded_blocks == bad and link.refused_blocks == 0
    assert (pool.pool.checks.corrupt, pool.pool.checks.dropped) == (1, 10 - bad)
    assert await prompt_sources(second.http, second.url) == {
        "local_compute": len(ids) - bad * BS,
        "local_cache_hit": 0,
        "external_kv_transfer": bad * BS,
    }
    assert held_right(second.live.memory, hashes)
    second.live.check_integrity()
    # The engine that computed them saves them again: the pool holds them intact.
    await wait_for(lambda: pool_holds(pool, hashes), 5.0, message="saved again")
    usage = pool.pool.usage()
    assert (usage.pinned, usage.staged, usage.exports, usage.imports) == (0, 0, 0, 0)
    pool.pool.check_integrity()


async def test_the_engines_own_check_refuses_what_a_pool_that_does_not_check_serves(
    start_engine: Any, pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: a pool that answers a block whose bytes changed (its check
    skipped here) does not get it served: the engine's own check finds it and computes it
    and the blocks after it."""
    monkeypatch.setattr(PoolStore, "intact", lambda self, pages: len(pages))
    first = await start_engine(instance_id="e-0", kv_pool_socket=str(pool.socket))
    second = await start_engine(instance_id="e-1", kv_pool_socket=str(pool.socket))
    ids = prompt(15, 10 * BS + 5)
    hashes = await saved(first, pool, ids, 10)
    memory = pool.pool.memory
    memory.chunks[memory.layout.layers - 1, memory.page_of[hashes[4]], -1] ^= 0xFF

    assert await cached_tokens(second, ids) == 4 * BS
    link = second.live.pool
    assert link is not None and link.loaded_blocks == 4 and link.refused_blocks == 6
    assert pool.pool.checks.corrupt == 0
    assert held_right(second.live.memory, hashes)
    second.live.check_integrity()


async def test_a_load_whose_commit_is_refused_is_recomputed(
    start_engine: Any, pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await start_engine(instance_id="e-0", kv_pool_socket=str(pool.socket))
    second = await start_engine(instance_id="e-1", kv_pool_socket=str(pool.socket))
    ids = prompt(16, 6 * BS + 1)
    hashes = await saved(first, pool, ids, 6)
    transfers = second.live.transfers

    def refuse(import_id: str, token_ids: Any, cache_salt: Any, adapter: Any) -> Any:
        transfers.import_abort(import_id)  # as a commit whose token ids do not hash does
        raise WrongBlocks("refused for the test")

    monkeypatch.setattr(transfers, "import_commit", refuse)
    assert await cached_tokens(second, ids) == 0
    link = second.live.pool
    assert link is not None and link.loaded_blocks == 0
    assert held_right(second.live.memory, hashes)
    second.live.check_integrity()


async def test_a_pool_gone_mid_load_leaves_the_request_answered_with_right_bytes(
    start_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Messenger (and its pool) goes away between pinning the blocks and the engine's
    release: the engine's copy, already mapped, is the pool's last bytes, checked; the
    release fails as a miss; the next request, with no pool, computes."""
    async with served_pool() as served:
        first = await start_engine(instance_id="e-0", kv_pool_socket=str(served.socket))
        second = await start_engine(instance_id="e-1", kv_pool_socket=str(served.socket))
        ids = prompt(17, 6 * BS + 1)
        hashes = await saved(first, served, ids, 6)
        link = second.live.pool
        assert link is not None
        call = link._call
        gone: list[str] = []

        async def then_vanish(op: str, **arguments: Any) -> dict[str, Any] | None:
            answer: dict[str, Any] | None = await call(op, **arguments)
            if op == "load" and not gone:
                gone.append(op)
                await stop_pool(served)
            return answer

        monkeypatch.setattr(link, "_call", then_vanish)
        assert await cached_tokens(second, ids) == 6 * BS
        assert gone and link.loaded_blocks == 6
        assert held_right(second.live.memory, hashes)
        second.live.check_integrity()
        other = prompt(18, 4 * BS + 1)
        assert await cached_tokens(second, other) == 0
        assert held_right(second.live.memory, second.live.hasher.hash_prompt(other)[:4])
