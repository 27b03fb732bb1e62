"""The engine model in real time: time scale, no drift, streaming every few passes, arrivals
cutting a long step short, and aborts freeing what a request held."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from tests.dataplane.test_pool_link import prompt, served_pool
from tests.engine.conftest import FAST, RunningEngine
from tests.engine.test_api import sse
from tests.fixtures.poll import wait_for

BS = FAST.block_size


async def test_wall_time_follows_the_model_scaled_without_drift(start_engine: Any) -> None:
    walls = {}
    for scale in (0.2, 0.02):
        eng: RunningEngine = await start_engine(time_scale=scale)
        request = eng.live.submit([3] * 100, 150)  # one prefill, then 149 one-pass steps
        t0 = time.monotonic()
        while not request.done:
            await request.wait(request.generated)
        walls[scale] = time.monotonic() - t0
        job = request.job
        model_s = job.finished_at - job.arrival
        # Each step starts where the previous one ended in model time, so timer latency never
        # adds up over the 150 steps: the wall time is the scaled model time.
        assert 0.9 * scale * model_s <= walls[scale] <= 1.25 * scale * model_s + 0.02
        assert eng.live.engine.passes == 150
    assert walls[0.02] < walls[0.2] / 4  # ten times faster, less the fixed overheads


async def test_decode_streams_one_chunk_per_step_of_stream_interval_passes(
    start_engine: Any,
) -> None:
    eng: RunningEngine = await start_engine(stream_interval=4)
    async with await eng.post(
        "/v1/completions", {"prompt": "tick", "max_tokens": 13, "stream": True}
    ) as resp:
        chunks = sse(await resp.read())
    words = [len(c["choices"][0]["text"].split()) for c in chunks]
    assert sum(words) == 13 and len(chunks) <= 4  # 1 from the prefill, then 4 + 4 + 4
    assert eng.live.engine.passes == 13 and len(chunks) >= 2


async def test_an_arrival_cuts_a_long_decode_step_short(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(stream_interval=100_000, time_scale=0.05)
    long = eng.live.submit([3] * 100, 3000)  # one macro-step of 2999 passes: ~1 s of wall
    await long.wait(0)
    short = eng.live.submit([4] * 100, 1)
    await short.wait(0)
    job = short.job
    # Served within a couple of passes of arriving, not after the long step.
    assert job.first_token_at - job.arrival < 0.1
    assert not long.done
    eng.live.abort(long)


async def test_an_abort_frees_a_queued_request_at_once(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(max_running=1, time_scale=1.0)
    running = eng.live.submit([3] * 100, 100_000)
    queued = eng.live.submit([4] * 100, 10)
    await running.wait(0)
    assert len(eng.live.engine.waiting) == 1 and eng.live.engine.report().waiting == 1
    # What `/kvsched/load` says is queued (the hotspot index's measure): the waiting prompt.
    load = await eng.get_json("/kvsched/load")
    assert load["queued_prefill_s"] == queued.job.est_prefill_s > 0
    eng.live.abort(queued)
    await wait_for(lambda: not eng.live.engine.waiting and queued.job.rid not in eng.live.requests)
    assert eng.live.engine.pending_tokens == 0 and eng.live.engine.running == 1
    assert eng.live.engine.queued_s == 0.0
    eng.live.abort(running)
    await wait_for(lambda: eng.live.engine.running == 0)
    eng.live.engine.check_integrity()
    assert eng.live.cache.locked == 0 and not eng.live.requests


async def test_a_client_that_leaves_mid_stream_frees_its_request(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(time_scale=0.2)
    resp = await eng.post(
        "/v1/completions", {"prompt": "long answer", "max_tokens": 5000, "stream": True}
    )
    await resp.content.readline()  # the first chunk: the request runs
    assert eng.live.engine.running == 1
    resp.close()
    await wait_for(lambda: not eng.live.requests and eng.live.engine.running == 0)
    assert eng.live.cache.private == 0 and eng.live.cache.locked == 0
    eng.live.engine.check_integrity()


async def test_a_client_that_leaves_a_plain_request_frees_it(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(time_scale=0.2)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=0.3)
    body = {"prompt": "long answer", "max_tokens": 5000}
    post = asyncio.ensure_future(eng.post("/v1/completions", body, timeout=timeout))
    await wait_for(lambda: eng.live.engine.running == 1)
    post.cancel()  # the client gives up: its connection closes
    await wait_for(lambda: not eng.live.requests and eng.live.engine.running == 0)
    assert eng.live.cache.private == 0


async def test_a_stopped_engine_ends_its_streams_with_an_error(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(time_scale=0.2)
    async with await eng.post(
        "/v1/completions", {"prompt": "long", "max_tokens": 5000, "stream": True}
    ) as resp:
        await resp.content.readline()
        await eng.live.stop()
        chunks = sse(b"data: " + (await resp.read()).split(b"data: ", 1)[1])
    assert chunks[-1]["error"]["type"] == "service_unavailable"
    async with eng.http.get(f"{eng.url}/health") as health:
        assert (health.status, health.headers["Retry-After"]) == (503, "1")
    async with await eng.post("/v1/completions", {"prompt": "x"}) as late:
        assert (late.status, late.headers["Retry-After"]) == (503, "1")


async def test_a_load_from_the_pool_costs_its_model_time_overlapped_with_the_prefill(
    start_engine: Any,
) -> None:
    eng: RunningEngine = await start_engine(time_scale=1.0)
    live = eng.live
    load_s = 0.3  # model seconds, longer than the prefill below: the TTFT follows the load
    # An idle engine wakes for the request once the first layer is in (no other arrival).
    loading = live.submit([6] * 2000, 1, load_s=load_s)
    async with asyncio.timeout(30):
        await loading.wait(0)
    job, layers = loading.job, live.model.spec.layers
    # Admitted once the first layer is in, while the rest still loads (the prefill overlaps
    # the load), and its first token only after the last layer's KV and compute.
    assert job.arrival + load_s / layers <= job.admitted_at < job.kv_done_at
    assert job.kv_done_at == pytest.approx(job.arrival + load_s)
    assert job.first_token_at > job.kv_done_at


async def test_a_requests_last_token_comes_once_its_prompt_is_saved_in_the_pool(
    start_engine: Any,
) -> None:
    """As with vLLM's connector, whose step copies its blocks into the pool: a session's KV
    read from the pool right after its turn ends is whole, not cut at what was saved yet."""
    async with served_pool() as pool:
        engine = await start_engine(instance_id="e-0", kv_pool_socket=str(pool.socket))
        link = engine.live.pool
        assert link is not None
        await wait_for(lambda: link.attached, 5.0, message="attached to the pool")
        request = engine.live.submit(prompt(6, 40 * BS + 5), 1)
        async with asyncio.timeout(30):
            assert await request.wait(0) == 1
        assert not request.saving and pool.pool.usage().blocks == 40


async def test_blocks_loaded_from_the_pool_are_charged_their_host_link_time(
    start_engine: Any,
) -> None:
    async with served_pool() as pool:
        socket = str(pool.socket)
        first = await start_engine(instance_id="e-0", kv_pool_socket=socket)
        # A slow host link, so the load is seen against the prefill of the rest.
        second = await start_engine(instance_id="e-1", kv_pool_socket=socket, pool_setup_s=0.5)
        link = first.live.pool
        assert link is not None
        await wait_for(lambda: link.attached, 5.0, message="attached to the pool")
        ids = prompt(5, 20 * BS + 3)
        await first.live.submit(ids, 1).wait(0)
        await wait_for(lambda: pool.pool.usage().blocks >= 20, 5.0, message="the prompt saved")
        request = await second.live.admit(ids, 1)
        async with asyncio.timeout(30):
            await request.wait(0)
        job = request.job
        load_s = second.live.model.pool_load_s(20 * BS)
        assert request.loaded_tokens == job.cached_tokens == 20 * BS
        assert load_s > 0.5 and job.kv_done_at == pytest.approx(job.arrival + load_s)
        assert job.first_token_at > job.kv_done_at
