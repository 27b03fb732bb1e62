"""The connector's scheduler side (in vLLM's environment: it imports vLLM) asking a real node
pool for a prompt whose third block was written over after its save: the pool answers the
two blocks before it, so the connector reports only their tokens as matched (vLLM computes
the rest) and plans a load of those two pages only; the pool drops the bad block and the
one after it. Marked `vllm` (run by the test command)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.kv_pool import NodePool
from services.dataplane.pool_server import PoolServer
from services.kv_events.vllm_wire import BlockRemoved, Event
from services.launcher.vllm import DEFAULT_PYTHON, REPO
from tests.dataplane.test_kv_pool import BLOCK_BYTES, BS, FMT, chain, put, tokens

pytestmark = pytest.mark.vllm
HOLD_S = 30.0

ASK = """
import json, sys
from types import SimpleNamespace
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.vllm_connector.pool_client import PoolClient
from services.vllm_connector.scheduler_side import SchedulerSide

socket, bs, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
client = PoolClient(socket, timeout_s=10.0)
side = SchedulerSide(client, bs, lambda rid: list(range(10, 20)), hold_s=30.0)
request = SimpleNamespace(
    request_id="r-1", block_hashes=VllmBlockHasher(bs).digests(ids), num_tokens=len(ids) + 1,
    all_token_ids=[*ids, 7], cache_salt=None, lora_request=None, mm_features=[],
)
matched = side.matched_tokens(request, 0)
blocks = SimpleNamespace(get_block_ids=lambda: (list(range(10, 20)),))
side.allocated(request, blocks, matched)
cached = SimpleNamespace(req_ids=[], num_computed_tokens=[])
out = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})
loads = side.step_jobs(out).loads
for job in loads:  # what the worker does once it copied them
    client.call("release", export_id=job.export_id)
print(json.dumps({"matched": matched,
                  "loads": [{"pages": job.pages, "block_ids": job.block_ids} for job in loads]}))
"""


@pytest.fixture
async def pool() -> AsyncIterator[tuple[NodePool, Path, list[Event]]]:
    directory = Path(tempfile.mkdtemp(prefix="kp"))  # a socket path must fit in 108 bytes
    events: list[Event] = []
    kv_pool = NodePool(
        8 * BLOCK_BYTES,
        node="node-0",
        hasher_for=VllmBlockHasher,
        on_events=events.extend,
        directory=directory,
    )
    kv_pool.attach(FMT)
    server = PoolServer(kv_pool, directory / "pool.sock")
    await server.start()
    try:
        yield kv_pool, directory / "pool.sock", events
    finally:
        await server.stop()
        kv_pool.close()
        shutil.rmtree(directory, ignore_errors=True)


async def test_a_shortened_load_answer_is_what_the_connector_loads(
    pool: tuple[NodePool, Path, list[Event]],
) -> None:
    if not DEFAULT_PYTHON.exists():
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    kv_pool, socket, events = pool
    ids = tokens(4, 21)
    hashes = await put(kv_pool, ids)
    assert hashes == chain(ids)
    pages = [kv_pool.memory.page_of[h] for h in hashes]
    kv_pool.memory.chunks[0, pages[2], 5] ^= 0x10  # written over after the save
    events.clear()

    asked = await asyncio.create_subprocess_exec(
        str(DEFAULT_PYTHON), "-c", ASK, str(socket), str(BS), json.dumps(ids),
        cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(asked.communicate(), 300)
    assert asked.returncode == 0, err.decode()[-3000:]
    answer = json.loads(out.decode().strip().splitlines()[-1])

    assert answer["matched"] == 2 * BS
    assert answer["loads"] == [{"pages": pages[:2], "block_ids": [10, 11]}]
    assert [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes] == (
        hashes[2:]
    )
    assert (kv_pool.checks.corrupt, kv_pool.checks.dropped) == (1, 2)
    usage = kv_pool.usage()
    assert (usage.blocks, usage.pinned, usage.exports) == (2, 0, 0)
    kv_pool.check_integrity()
