"""The KV of an engine running as its own process (`python -m services.engine`), with the test
in its node Messenger's place, serving the node's KV pool: the engine saves the blocks it
computes into the pool, byte for byte, and serves blocks written into the pool (as a transfer
writes them) from its cache; its own memory file goes when it stops cleanly, and a killed
engine's file is swept by the next engine in the same directory."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from kvsched.core.models import MINI_MODEL
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.kv_layout import SIM_FORMAT, KvLayout, expected_chunk
from services.vllm_connector.pool_client import PoolClient
from tests.dataplane.test_pool_link import served_pool
from tests.engine.conftest import EngineProcess, engine_process
from tests.fixtures.poll import wait_for

BS = 16
HASHER = VllmBlockHasher(BS)


def prompt(blocks: int, seed: int) -> list[int]:
    """`blocks` full blocks of token ids (distinct per seed) and one token more."""
    return [(seed * 131 + i * 7) % 4000 + 1 for i in range(blocks * BS)] + [4001]


@contextlib.asynccontextmanager
async def kv_engine(kv_dir: Path, name: str, *flags: str) -> AsyncIterator[EngineProcess]:
    async with engine_process(
        kv_dir.parent / f"{name.replace('/', '_')}.log",
        "--instance-id", name, "--model-config", MINI_MODEL, "--capacity-blocks", "64",
        "--time-scale", "0.01", *flags,
        env={"KVSCHED_ENGINE_KV_MEMORY_DIR": str(kv_dir)},  # the flag from the environment
    ) as engine:  # fmt: skip
        yield engine


async def test_an_engine_process_saves_into_and_loads_from_its_node_pool(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    async with (
        served_pool() as served,
        kv_engine(kv_dir, "node-0/e0", "--kv-pool-socket", str(served.socket)) as eng,
    ):
        pool, socket = served.pool, str(served.socket)
        (own,) = kv_dir.iterdir()  # the engine's own KV memory
        assert own.name.startswith(f"kvsched-kv-{eng.proc.pid}-")
        await wait_for(lambda: pool.attached, 10.0, message="the engine attached")
        assert pool.format is not None and pool.format.kind == SIM_FORMAT
        layout = KvLayout(32, pool.memory.layout.pages, BS * 64, BS)
        assert pool.memory.layout == layout  # the mini-KV model's blocks
        client = PoolClient(socket)
        try:
            # Blocks the engine computed are saved into the pool: every layer as the layout says.
            ids = prompt(3, 1)
            await eng.call("POST", "/v1/completions", {"prompt": ids, "max_tokens": 1})
            hashes = HASHER.hash_prompt(ids)
            await wait_for(lambda: pool.usage().blocks == 3, 10.0, message="the prompt saved")
            got = await asyncio.to_thread(
                client.call, "load", block_hashes=hashes, start=0, end=3, hold_s=5.0
            )
            with open(got["path"], "rb") as fr, mmap.mmap(fr.fileno(), 0, prot=mmap.PROT_READ) as m:
                for page, h in zip(got["pages"], hashes, strict=True):
                    for layer in range(layout.layers):
                        offset = layout.offset(layer, page)
                        chunk = m[offset : offset + layout.chunk_bytes]
                        assert chunk == expected_chunk(h, layer, layout.chunk_bytes)
            await asyncio.to_thread(client.call, "release", export_id=got["export_id"])
            # Blocks written into the pool (as a transfer writes them) become the engine's hits.
            other = prompt(4, 2)
            theirs = HASHER.hash_prompt(other)
            grant = await asyncio.to_thread(
                client.call, "save", block_hashes=theirs, upto=4, hold_s=5.0
            )
            with open(grant["path"], "r+b") as fw, mmap.mmap(fw.fileno(), 0) as m:
                for page, h in zip(grant["pages"], theirs, strict=True):
                    for layer in range(layout.layers):
                        offset = layout.offset(layer, page)
                        m[offset : offset + layout.chunk_bytes] = expected_chunk(
                            h, layer, layout.chunk_bytes
                        )
            committed = await asyncio.to_thread(
                client.call, "commit", import_id=grant["import_id"], token_ids=other[: 4 * BS]
            )
            assert committed["stored"] == 4
        finally:
            client.close()
        answer = await eng.call("POST", "/v1/completions", {"prompt": other, "max_tokens": 1})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
        assert await eng.stop() == 0
        assert not own.exists()  # removed on a clean stop
    assert list(kv_dir.iterdir()) == []


async def test_a_killed_engines_file_is_swept_by_the_next_engine(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    async with kv_engine(kv_dir, "e-killed") as killed:
        (path,) = kv_dir.iterdir()
        assert await killed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert path.exists()  # a killed process cannot clean up
    async with kv_engine(kv_dir, "e-next") as nxt:
        (mine,) = kv_dir.iterdir()
        assert not path.exists() and mine.name.startswith(f"kvsched-kv-{nxt.proc.pid}-")
        assert await nxt.stop() == 0
    assert list(kv_dir.iterdir()) == []
