"""The load generator's load sampler: what live engines say is queued feeds the hotspot index."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvsched.sim.meters import HotspotMeter
from services.loadgen.observe import sample_loads
from tests.fixtures.poll import wait_for


class FakeEngines:
    """Loopback engines answering `/kvsched/load` with fixed bodies, counting the requests."""

    def __init__(self, bodies: list[Mapping[str, Any]]) -> None:
        self.bodies = bodies
        self.served = 0
        self.urls: list[str] = []
        self.runners: list[web.AppRunner] = []

    async def start(self) -> None:
        for body in self.bodies:
            app = web.Application(middlewares=[self._count])
            app.router.add_get("/kvsched/load", self._handler(body))
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.runners.append(runner)
            self.urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")

    @web.middleware
    async def _count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.served += 1  # every request, those answered 404 included
        response: web.StreamResponse = await handler(request)
        return response

    def _handler(self, body: Mapping[str, Any]) -> Any:
        async def load(_: web.Request) -> web.Response:
            return web.json_response(dict(body))

        return load

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def engines_of() -> AsyncIterator[Any]:
    started: list[FakeEngines] = []

    async def make(bodies: list[Mapping[str, Any]]) -> FakeEngines:
        fake = FakeEngines(bodies)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


async def _sample(fake: FakeEngines, rounds: int) -> tuple[HotspotMeter, float]:
    """Sample until every engine answered `rounds` times; the clock advances 1 s a read."""
    meter = HotspotMeter(len(fake.urls), chunk_tokens=512)
    clock = iter(range(1, 10_000))
    last = 0.0

    def now() -> float:
        nonlocal last
        last = float(next(clock))
        return last

    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        task = asyncio.ensure_future(sample_loads(http, fake.urls, meter, now, stop))
        await wait_for(lambda: fake.served >= rounds * len(fake.urls), timeout=10.0)
        stop.set()
        await task
    return meter, last


async def test_queued_seconds_reach_the_index(engines_of: Any) -> None:
    fake = await engines_of(
        [
            {"pending_prefill_tokens": 3000, "queued_prefill_s": 2.0},
            {"pending_prefill_tokens": 0, "queued_prefill_s": 0.0},
        ]
    )
    meter, end = await _sample(fake, rounds=3)
    assert meter.queued == [2.0, 0.0] and meter.queued_known
    # From the first sample (t = 1) on, 2 s wait on one instance of two: max − mean = 1 s.
    assert meter.hotspot_index(1.0, end) == pytest.approx(1.0)
    assert meter.summary(1.0, end)["hotspot_pmr"] == pytest.approx(2.0)


async def test_an_engine_that_does_not_say_leaves_the_index_unknown(engines_of: Any) -> None:
    fake = await engines_of(
        [
            {"pending_prefill_tokens": 3000, "queued_prefill_s": 2.0},
            {"pending_prefill_tokens": 0},  # an engine that does not know the field
        ]
    )
    meter, end = await _sample(fake, rounds=2)
    assert not meter.queued_known
    assert math.isnan(meter.hotspot_index(1.0, end))


async def test_engines_without_a_load_endpoint_leave_the_index_unknown(engines_of: Any) -> None:
    fake = await engines_of([{"pending_prefill_tokens": 0}, {"pending_prefill_tokens": 0}])
    fake.urls = [url + "/vllm" for url in fake.urls]  # every load read answers 404, as vLLM's
    meter, end = await _sample(fake, rounds=2)
    assert not meter.queued_known and math.isnan(meter.hotspot_index(1.0, end))
