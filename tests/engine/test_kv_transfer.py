"""Exports and imports over the engine's HTTP API, with the test in a Messenger's place: it maps
the engine's KV memory file itself, reads exported pages and writes imported ones. After every
operation the cache, the memory and the transfers must agree (`LiveEngine.check_integrity`)."""

from __future__ import annotations

import asyncio
import mmap
import time
from pathlib import Path
from typing import Any

import pytest

from kvsched.core.models import MINI_MODEL
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.kv_events import BlockStored
from services.common.kv_layout import KvLayout, expected_chunk
from tests.engine.conftest import RunningEngine
from tests.engine.test_api import scrape
from tests.engine.test_kv_events import rehash
from tests.engine.test_kv_memory import read_chunk
from tests.fixtures.poll import wait_for

MINI: dict[str, Any] = {"model_config": MINI_MODEL, "capacity_blocks": 64}
BS = 16
HASHER = VllmBlockHasher(BS)


def prompt(blocks: int, seed: int) -> list[int]:
    """`blocks` full blocks of token ids (distinct per seed) and one token more."""
    return [(seed * 131 + i * 7) % 4000 + 1 for i in range(blocks * BS)] + [4001]


def chain(ids: list[int], salt: str | None = None) -> list[int]:
    return HASHER.hash_prompt(ids, salt)


async def call(eng: RunningEngine, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with eng.http.request(method, f"{eng.url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def ok(eng: RunningEngine, method: str, path: str, body: Any = None) -> Any:
    status, answer = await call(eng, method, path, body)
    assert status == 200, answer
    eng.live.check_integrity()
    return answer


async def layout_of(eng: RunningEngine) -> tuple[Path, KvLayout]:
    mem = (await eng.get_json("/kvsched/info"))["kv_memory"]
    layout = KvLayout(mem["layers"], mem["pages"], mem["chunk_bytes"], mem["block_size"])
    return Path(mem["path"]), layout


async def holds(eng: RunningEngine, pages: list[int], hashes: list[int]) -> bool:
    """Every layer of every page holds its block's content, read from the file."""
    path, layout = await layout_of(eng)
    return all(
        read_chunk(path, layout, layer, page) == expected_chunk(h, layer, layout.chunk_bytes)
        for page, h in zip(pages, hashes, strict=True)
        for layer in range(layout.layers)
    )


def write_blocks(path: Path, layout: KvLayout, pages: list[int], hashes: list[int]) -> None:
    """What a Messenger does for an import: write each block's chunks into its staged page."""
    with path.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        for page, h in zip(pages, hashes, strict=True):
            for layer in range(layout.layers):
                offset = layout.offset(layer, page)
                mm[offset : offset + layout.chunk_bytes] = expected_chunk(
                    h, layer, layout.chunk_bytes
                )


def cached_tokens(answer: Any) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---- computed blocks and exports ------------------------------------------------------------


async def test_computed_blocks_hold_their_content_in_the_shared_file(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(5, 1)
    await eng.complete({"prompt": ids, "max_tokens": 1})
    hashes = chain(ids)
    pages = [eng.live.memory.page_of[h] for h in hashes]
    assert pages == [0, 1, 2, 3, 4]  # a fresh engine lays a chain out on consecutive pages
    assert await holds(eng, pages, hashes)
    eng.live.check_integrity()


async def test_an_export_pins_blocks_until_released(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**{**MINI, "capacity_blocks": 16})
    ids = prompt(4, 1)
    await eng.complete({"prompt": ids, "max_tokens": 1})
    hashes = chain(ids)
    got = await ok(eng, "POST", "/kvsched/kv/export", {"block_hashes": hashes, "start": 1})
    assert got["blocks"] == 3 and got["export_id"] and got["cache_salt"] is None
    assert got["token_ids"] == ids[BS : 4 * BS]
    assert got["pages"] == [eng.live.memory.page_of[h] for h in hashes[1:]]
    # Pressure: 6 more prompts of 4 blocks through 16 pages; the pinned chain stays put.
    for seed in range(2, 8):
        await eng.complete({"prompt": prompt(4, seed), "max_tokens": 1})
        eng.live.check_integrity()
    assert eng.live.engine.cache.evicted_total > 0
    assert eng.live.engine.cache.match(hashes, 4) == 4
    assert await holds(eng, got["pages"], hashes[1:])
    release = f"/kvsched/kv/export/{got['export_id']}"
    assert await ok(eng, "DELETE", release) == {"released": True}
    assert await ok(eng, "DELETE", release) == {"released": False}
    assert eng.live.engine.cache.locked == 0
    for seed in range(8, 12):
        await eng.complete({"prompt": prompt(4, seed), "max_tokens": 1})
    assert eng.live.engine.cache.match(hashes, 4) == 0  # unpinned: evicted like any other
    eng.live.check_integrity()


async def test_an_export_is_released_when_its_hold_time_passes(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(2, 1)
    await eng.complete({"prompt": ids, "max_tokens": 1})
    body = {"block_hashes": chain(ids), "hold_s": 0.2}
    got = await ok(eng, "POST", "/kvsched/kv/export", body)
    assert got["blocks"] == 2 and eng.live.engine.cache.locked == 2
    await wait_for(lambda: eng.live.engine.cache.locked == 0, message="the export expires")
    assert not eng.live.transfers.exports
    assert await ok(eng, "DELETE", f"/kvsched/kv/export/{got['export_id']}") == {"released": False}


async def test_an_export_waits_for_the_blocks_a_prefill_stores(start_engine: Any) -> None:
    # 32-token chunks: the 4-block prompt's blocks are stored two by two, one step apart.
    eng: RunningEngine = await start_engine(**MINI, chunk_tokens=32, time_scale=0.2)
    ids = prompt(4, 1)
    hashes = chain(ids)
    body = {"block_hashes": hashes, "wait_s": 0}
    assert await ok(eng, "POST", "/kvsched/kv/export", body) == {
        "export_id": None, "blocks": 0, "pages": [], "token_ids": [], "cache_salt": None,
    }  # fmt: skip
    waiting = asyncio.ensure_future(ok(eng, "POST", "/kvsched/kv/export", {**body, "wait_s": 10}))
    await wait_for(lambda: eng.live.transfers.waiting_exports, message="the export waits")
    t0 = time.monotonic()
    completion = asyncio.ensure_future(eng.complete({"prompt": ids, "max_tokens": 1}))
    first = await waiting
    assert time.monotonic() - t0 < 5  # woken by the store, not by the wait running out
    n = first["blocks"]
    assert 1 <= n <= 4 and first["token_ids"] == ids[: n * BS]
    # The hand-off reads on from where it got to.
    rest = await ok(eng, "POST", "/kvsched/kv/export", {**body, "start": n, "wait_s": 10})
    assert n + rest["blocks"] == 4 and rest["token_ids"] == ids[n * BS : 4 * BS]
    await completion
    assert eng.live.engine.cache.locked == 4  # both exports hold the chain's blocks
    for got in (first, rest):
        await ok(eng, "DELETE", f"/kvsched/kv/export/{got['export_id']}")
    assert eng.live.engine.cache.locked == 0


# ---- imports ----------------------------------------------------------------------------------


async def test_an_imported_chain_is_a_cache_hit_and_announced(
    start_engine: Any, events_of: Any
) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    events = await events_of(eng)
    path, layout = await layout_of(eng)
    ids = prompt(4, 1)
    hashes = chain(ids)
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes, "upto": 4})
    assert grant["have"] == 0 and len(grant["pages"]) == 4 and grant["import_id"]
    assert eng.live.engine.cache.match(hashes, 4) == 0  # staged: not visible yet
    write_blocks(path, layout, grant["pages"], hashes)
    before = eng.live.publisher.next_seq
    commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
    done = await ok(eng, "POST", commit, {"token_ids": ids[: 4 * BS], "cache_salt": None})
    assert done == {"stored": 4, "blocks": 4}
    assert eng.live.publisher.next_seq == before + 1  # published at once
    got = await events.upto(eng.live.publisher.next_seq)
    stored = [e for b in events.batches if b.seq >= before for e in b.events]
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert list(stored[0].token_ids) == ids[: 4 * BS] and stored[0].parent_block_hash is None
    assert set(hashes) <= set(rehash(got))
    # Evictable, most recently used, on the pages the Messenger wrote.
    cache = eng.live.engine.cache
    assert cache.match(hashes, 4) == 4 and cache.locked == 0 and cache.private == 0
    assert [eng.live.memory.page_of[h] for h in hashes] == grant["pages"]
    answer = await eng.complete({"prompt": ids, "max_tokens": 2})
    assert cached_tokens(answer) == 4 * BS
    assert await holds(eng, grant["pages"], hashes)  # the engine did not overwrite them
    status, _ = await call(eng, "POST", commit, {"token_ids": ids[: 4 * BS]})
    assert status == 404  # committed: the import is over
    eng.live.check_integrity()
    got = await ok(eng, "POST", "/kvsched/kv/export", {"block_hashes": hashes, "start": 1})
    async with eng.http.get(f"{eng.url}/metrics") as resp:
        values = scrape(await resp.text())
    assert values["kvsched_engine_kv_imported_blocks_total"] == 4
    assert values["kvsched_engine_kv_exported_blocks_total"] == got["blocks"] == 3


async def test_an_import_extends_the_cached_prefix_of_a_salted_chain(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    path, layout = await layout_of(eng)
    ids = prompt(5, 2)
    hashes = chain(ids, "tenant-a")
    await eng.complete({"prompt": ids[: 2 * BS + 1], "max_tokens": 1, "cache_salt": "tenant-a"})
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes, "upto": 5})
    assert grant["have"] == 2 and len(grant["pages"]) == 3
    assert eng.live.engine.cache.locked == 2 + 3  # the held prefix and the reserved pages
    write_blocks(path, layout, grant["pages"], hashes[2:])
    commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
    # Beyond the prefix the salt is the held blocks' business: none needed.
    done = await ok(eng, "POST", commit, {"token_ids": ids[2 * BS : 5 * BS]})
    assert done == {"stored": 3, "blocks": 3}
    answer = await eng.complete({"prompt": ids, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert cached_tokens(answer) == 5 * BS
    again = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes})
    assert again == {"import_id": None, "have": 5, "pages": []}  # nothing left to import
    got = await ok(eng, "POST", "/kvsched/kv/export", {"block_hashes": hashes})
    assert got["cache_salt"] == "tenant-a" and got["token_ids"] == ids[: 5 * BS]
    await ok(eng, "DELETE", f"/kvsched/kv/export/{got['export_id']}")


async def test_a_salted_chain_imported_from_the_root_needs_its_salt(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(2, 3)
    hashes = chain(ids, "t")
    body = {"block_hashes": hashes}
    for salt, status in ((None, 400), ("other", 400), ("t", 200)):
        grant = await ok(eng, "POST", "/kvsched/kv/import", body)
        commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
        got, _ = await call(eng, "POST", commit, {"token_ids": ids[: 2 * BS], "cache_salt": salt})
        assert got == status
    answer = await eng.complete({"prompt": ids, "max_tokens": 1, "cache_salt": "t"})
    assert cached_tokens(answer) == 2 * BS
    snap = (await eng.get_json("/kvsched/kv/snapshot"))["blocks"]
    assert snap[0]["extra_keys"] == ["t"]  # the salt rides on the chain's first block


async def test_wrong_token_ids_abort_the_import_and_show_nothing(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(3, 4)
    hashes = chain(ids)
    cache, memory = eng.live.engine.cache, eng.live.memory
    free = (cache.free, memory.free_pages)
    wrong = [[*ids[: 3 * BS - 1], 9], ids[: 2 * BS + 3], [*ids[: 3 * BS], *[1] * BS], []]
    for tokens in wrong:
        grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes})
        before = eng.live.publisher.next_seq
        commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
        status, answer = await call(eng, "POST", commit, {"token_ids": tokens})
        assert status == 400 and answer["error"]["param"] == "token_ids", answer
        assert "import aborted" in answer["error"]["message"]
        assert cache.match(hashes, 3) == 0 and eng.live.publisher.next_seq == before
        assert (cache.free, memory.free_pages) == free and not eng.live.transfers.imports
        eng.live.check_integrity()
        status, _ = await call(eng, "POST", commit, {"token_ids": ids[: 3 * BS]})
        assert status == 404  # aborted for good
    answer = await eng.complete({"prompt": ids, "max_tokens": 1})
    assert cached_tokens(answer) == 0


async def test_a_commit_of_the_first_blocks_returns_the_rest(start_engine: Any) -> None:
    """A source that held fewer blocks than asked for: the blocks that came are committed,
    the pages reserved for the others go back."""
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(5, 4)
    hashes = chain(ids)
    cache, memory = eng.live.engine.cache, eng.live.memory
    free = (cache.available, memory.free_pages)
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes})
    assert len(grant["pages"]) == len(hashes) > 2
    commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
    done = await ok(eng, "POST", commit, {"token_ids": ids[: 2 * BS]})
    assert done == {"stored": 2, "blocks": 2}
    assert cache.match(hashes, len(hashes)) == 2 and not eng.live.transfers.imports
    assert (cache.available, memory.free_pages) == (free[0], free[1] - 2)  # evictable now
    eng.live.check_integrity()
    answer = await eng.complete({"prompt": ids, "max_tokens": 1})
    assert cached_tokens(answer) == 2 * BS


async def test_blocks_the_engine_computed_meanwhile_are_shared(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    ids = prompt(4, 5)
    hashes = chain(ids)
    await eng.complete({"prompt": ids[: BS + 1], "max_tokens": 1})  # block 0 cached
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes, "upto": 3})
    assert grant["have"] == 1 and len(grant["pages"]) == 2
    await eng.complete({"prompt": ids, "max_tokens": 1})  # computes blocks 1…3 itself
    engines_pages = [eng.live.memory.page_of[h] for h in hashes[1:3]]
    assert not set(engines_pages) & set(grant["pages"])
    commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
    done = await ok(eng, "POST", commit, {"token_ids": ids[BS : 3 * BS]})
    assert done == {"stored": 0, "blocks": 2}
    assert [eng.live.memory.page_of[h] for h in hashes[1:3]] == engines_pages
    assert eng.live.memory.staged_pages == 0 and eng.live.engine.cache.private == 0
    assert eng.live.engine.cache.locked == 0


async def test_abort_and_expiry_give_every_page_back(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    cache, memory = eng.live.engine.cache, eng.live.memory
    ids = prompt(4, 6)
    hashes = chain(ids)
    await eng.complete({"prompt": ids[: BS + 1], "max_tokens": 1})
    free = (cache.free, memory.free_pages)
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes})
    assert grant["have"] == 1 and memory.staged_pages == 3 and cache.private == 3
    path = f"/kvsched/kv/import/{grant['import_id']}"
    assert await ok(eng, "DELETE", path) == {"aborted": True}
    assert await ok(eng, "DELETE", path) == {"aborted": False}
    assert (cache.free, memory.free_pages) == free and cache.locked == 0
    short = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": hashes, "hold_s": 0.2})
    assert memory.staged_pages == 3
    await wait_for(lambda: not eng.live.transfers.imports, message="the import expires")
    assert (cache.free, memory.free_pages) == free and cache.locked == 0
    eng.live.check_integrity()
    status, answer = await call(
        eng, "POST", f"/kvsched/kv/import/{short['import_id']}/commit", {"token_ids": []}
    )
    assert status == 404 and answer["error"]["code"] == 404


async def test_no_room_is_507_and_changes_nothing(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**{**MINI, "capacity_blocks": 8})
    ids = prompt(6, 7)
    await eng.complete({"prompt": ids, "max_tokens": 1})
    pinned = await ok(eng, "POST", "/kvsched/kv/export", {"block_hashes": chain(ids)})
    assert pinned["blocks"] == 6
    cache = eng.live.engine.cache
    other = chain(prompt(4, 8))
    state = (cache.free, cache.evictable, cache.locked, list(cache.nodes))
    status, answer = await call(eng, "POST", "/kvsched/kv/import", {"block_hashes": other})
    assert status == 507 and answer["error"]["code"] == 507, answer
    assert (cache.free, cache.evictable, cache.locked, list(cache.nodes)) == state
    eng.live.check_integrity()
    await ok(eng, "DELETE", f"/kvsched/kv/export/{pinned['export_id']}")
    grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": other})
    assert len(grant["pages"]) == 4 and cache.evicted_total == 2  # the LRU blocks made room


async def test_imports_are_refused_while_the_engine_drains(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    eng.api.draining = True
    status, answer = await call(eng, "POST", "/kvsched/kv/import", {"block_hashes": [1]})
    assert status == 503 and answer["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/kvsched/kv/export", {}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": []}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": [-1]}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": [1 << 64]}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": [True]}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": [1.0]}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": list(range(65))}, "block_hashes"),
        ("/kvsched/kv/export", {"block_hashes": [1, 2], "start": 3}, "start"),
        ("/kvsched/kv/export", {"block_hashes": [1, 2], "start": 2, "end": 1}, "start"),
        ("/kvsched/kv/export", {"block_hashes": [1], "end": "1"}, "end"),
        ("/kvsched/kv/export", {"block_hashes": [1], "wait_s": -1}, "wait_s"),
        ("/kvsched/kv/export", {"block_hashes": [1], "wait_s": 1e9}, "wait_s"),
        ("/kvsched/kv/export", {"block_hashes": [1], "hold_s": 0}, "hold_s"),
        ("/kvsched/kv/export", {"block_hashes": [1], "hold_s": None}, "hold_s"),
        ("/kvsched/kv/import", {"block_hashes": "1"}, "block_hashes"),
        ("/kvsched/kv/import", {"block_hashes": [1], "upto": 2}, "upto"),
        ("/kvsched/kv/import", {"block_hashes": [1], "upto": -1}, "upto"),
        ("/kvsched/kv/import", {"block_hashes": [1], "hold_s": "30"}, "hold_s"),
        ("/kvsched/kv/import/i-1/commit", {}, "token_ids"),
        ("/kvsched/kv/import/i-1/commit", {"token_ids": [1 << 32]}, "token_ids"),
        ("/kvsched/kv/import/i-1/commit", {"token_ids": [0] * (64 * BS + 1)}, "token_ids"),
        ("/kvsched/kv/import/i-1/commit", {"token_ids": [1], "cache_salt": 5}, "cache_salt"),
    ],
)
async def test_malformed_bodies_are_400_openai_errors(
    start_engine: Any, path: str, body: Any, param: str
) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    status, answer = await call(eng, "POST", path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["code"] == 400, error
    assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
    eng.live.check_integrity()


async def test_bodies_that_are_not_json_objects_and_nan_seconds(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(**MINI)
    for path in ("/kvsched/kv/export", "/kvsched/kv/import", "/kvsched/kv/import/x/commit"):
        for raw in (b"{oops", b"[1, 2]"):
            async with eng.http.post(f"{eng.url}{path}", data=raw) as resp:
                assert resp.status == 400
                assert (await resp.json())["error"]["code"] == 400
    raw = b'{"block_hashes": [1], "wait_s": NaN}'  # Python's json takes NaN; we do not
    async with eng.http.post(f"{eng.url}/kvsched/kv/export", data=raw) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "wait_s"
    status, answer = await call(eng, "DELETE", "/kvsched/kv/export/nope")
    assert (status, answer) == (200, {"released": False})


@pytest.mark.parametrize("ending", ["release", "abort"])
async def test_a_request_waiting_for_memory_runs_once_a_transfer_gives_pages_back(
    start_engine: Any, ending: str
) -> None:
    """Pages pinned by an export (or reserved by an import) keep a request waiting; ending
    the transfer wakes the engine, which then admits it (without any other request)."""
    eng: RunningEngine = await start_engine(**MINI)
    held = prompt(40, 6)
    await eng.complete({"prompt": held, "max_tokens": 1})
    if ending == "release":
        grant = await ok(eng, "POST", "/kvsched/kv/export", {"block_hashes": chain(held)})
        end = f"/kvsched/kv/export/{grant['export_id']}"
    else:
        other = chain(prompt(40, 7))
        grant = await ok(eng, "POST", "/kvsched/kv/import", {"block_hashes": other})
        end = f"/kvsched/kv/import/{grant['import_id']}"
    # 40 of the 64 pages are taken: a 30-block request waits.
    waiting = asyncio.create_task(eng.complete({"prompt": prompt(30, 8), "max_tokens": 1}))
    await wait_for(lambda: eng.live.engine.waiting, 5.0, message="the request waits")
    assert not waiting.done()
    await ok(eng, "DELETE", end)
    answer = await asyncio.wait_for(waiting, 10.0)
    assert answer["usage"]["prompt_tokens"] == 30 * BS + 1
