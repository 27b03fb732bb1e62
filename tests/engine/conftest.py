"""A simulated engine served in process on a free loopback port, its KV events on real ZMQ."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.trace import NoOpTracer

from services.common.openai_api import PromptTokenizer
from services.engine.app import EngineApp
from services.engine.kv_publisher import KvEventPublisher
from services.engine.model import LiveEngine
from services.engine.settings import KV_TOPIC, EngineSettings
from services.engine.text import Words

FAST = EngineSettings(instance_id="e-test", time_scale=0.01, engine_hash_seed=7)


@dataclass
class RunningEngine:
    live: LiveEngine
    url: str
    http: aiohttp.ClientSession

    async def post(self, path: str, body: Any, **kw: Any) -> aiohttp.ClientResponse:
        return await self.http.post(f"{self.url}{path}", json=body, **kw)

    async def get_json(self, path: str) -> Any:
        async with self.http.get(f"{self.url}{path}") as resp:
            assert resp.status == 200
            return await resp.json()


EngineFactory = Callable[..., "AsyncIterator[RunningEngine]"]


@pytest.fixture
async def start_engine() -> AsyncIterator[Callable[..., Any]]:
    """`await start_engine(**settings_overrides)` → a `RunningEngine`; all stopped after."""
    stops: list[Callable[[], Any]] = []
    tokenizer = PromptTokenizer()

    async def start(**overrides: Any) -> RunningEngine:
        settings = replace(FAST, **overrides)
        publisher = KvEventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=KV_TOPIC.encode(),
            shape=settings.event_shape,
        )  # fmt: skip
        publisher.start()
        live = LiveEngine(settings, publisher)
        api = EngineApp(live, tokenizer, Words(tokenizer, settings.seed), NoOpTracer())
        server = TestServer(api.app, host="127.0.0.1")
        await server.start_server()
        live.start()
        http = aiohttp.ClientSession()

        async def stop() -> None:
            await http.close()
            await server.close()
            await live.stop()
            await publisher.close()

        stops.append(stop)
        return RunningEngine(live, str(server.make_url("")).rstrip("/"), http)

    yield start
    for stop in reversed(stops):
        await stop()
