"""The KV memory of an engine running as its own process (`python -m services.engine`): another
process (the test, in a Messenger's place) reads the bytes of blocks it computed and writes
blocks it then serves from cache; the file goes when the engine stops cleanly, and a killed
engine's file is swept by the next engine in the same directory."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

from kvsched.core.models import MINI_MODEL
from services.common.kv_layout import KvLayout, expected_chunk
from tests.engine.conftest import EngineProcess, engine_process
from tests.engine.test_kv_transfer import BS, chain, prompt, write_blocks


@contextlib.asynccontextmanager
async def kv_engine(kv_dir: Path, name: str) -> AsyncIterator[EngineProcess]:
    async with engine_process(
        kv_dir.parent / f"{name.replace('/', '_')}.log",
        "--instance-id", name, "--model-config", MINI_MODEL, "--capacity-blocks", "64",
        "--time-scale", "0.01",
        env={"KVSCHED_ENGINE_KV_MEMORY_DIR": str(kv_dir)},  # the flag from the environment
    ) as engine:  # fmt: skip
        yield engine


def read(path: Path, offset: int, size: int) -> bytes:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read(size)


async def test_another_process_reads_and_writes_the_engines_kv_bytes(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    async with kv_engine(kv_dir, "node-0/e0") as eng:
        mem = (await eng.call("GET", "/kvsched/info"))["kv_memory"]
        path = Path(mem["path"])
        assert path.parent == kv_dir and path.name.startswith(f"kvsched-kv-{eng.proc.pid}-")
        layout = KvLayout(mem["layers"], mem["pages"], mem["chunk_bytes"], mem["block_size"])
        assert layout == KvLayout(32, 64, BS * 64, BS) and path.stat().st_size == layout.size
        # Blocks the engine computed: every layer as the layout says.
        ids = prompt(3, 1)
        await eng.call("POST", "/v1/completions", {"prompt": ids, "max_tokens": 1})
        hashes = chain(ids)
        got = await eng.call("POST", "/kvsched/kv/export", {"block_hashes": hashes})
        assert got["blocks"] == 3
        for page, h in zip(got["pages"], hashes, strict=True):
            for layer in range(layout.layers):
                chunk = read(path, layout.offset(layer, page), layout.chunk_bytes)
                assert chunk == expected_chunk(h, layer, layout.chunk_bytes), (page, layer)
        await eng.call("DELETE", f"/kvsched/kv/export/{got['export_id']}")
        # Blocks written from here become the engine's cache hits.
        other = prompt(4, 2)
        theirs = chain(other)
        grant = await eng.call("POST", "/kvsched/kv/import", {"block_hashes": theirs})
        write_blocks(path, layout, grant["pages"], theirs)
        commit = f"/kvsched/kv/import/{grant['import_id']}/commit"
        assert await eng.call("POST", commit, {"token_ids": other[: 4 * BS]}) == {
            "stored": 4, "blocks": 4,
        }  # fmt: skip
        answer = await eng.call("POST", "/v1/completions", {"prompt": other, "max_tokens": 1})
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS
        assert await eng.stop() == 0
        assert not path.exists()  # removed on a clean stop
    assert list(kv_dir.iterdir()) == []


async def test_a_killed_engines_file_is_swept_by_the_next_engine(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    async with kv_engine(kv_dir, "e-killed") as killed:
        path = Path((await killed.call("GET", "/kvsched/info"))["kv_memory"]["path"])
        assert await killed.stop(signal.SIGKILL) == -signal.SIGKILL
    assert path.exists()  # a killed process cannot clean up
    async with kv_engine(kv_dir, "e-next") as nxt:
        mine = Path((await nxt.call("GET", "/kvsched/info"))["kv_memory"]["path"])
        assert not path.exists() and mine.exists()
        assert [p.name for p in kv_dir.iterdir()] == [mine.name]
        assert await nxt.stop() == 0
    assert list(kv_dir.iterdir()) == []
