"""A simulated engine served in process on a free loopback port, its KV events on real ZMQ,
and a subscriber that misses none of them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from opentelemetry.trace import NoOpTracer, Tracer

from services.common.inference_api.openai_api import PromptTokenizer
from services.engine.app import EngineApp, build
from services.engine.runner import LiveEngine
from services.engine.settings import EngineSettings
from services.engine.text import Words
from services.kv_events.vllm_wire import Event, EventBatch
from services.launcher.ports import free_port
from services.messenger.kv_subscriber import KvEventSubscriber
from tests.conftest import REPO
from tests.fixtures.poll import wait_for

# A hundred times faster than the modelled GPU: a few-token answer takes milliseconds.
FAST = EngineSettings(
    instance_id="e-test",
    time_scale=0.01,
    kv_events="tcp://127.0.0.1:*",
    kv_replay="tcp://127.0.0.1:*",
)
MODEL = FAST.model
_TOKENIZER = PromptTokenizer()
_WORDS = Words(_TOKENIZER, FAST.seed)
_probe = itertools.count()


@dataclass
class RunningEngine:
    api: EngineApp
    url: str
    http: aiohttp.ClientSession

    @property
    def live(self) -> LiveEngine:
        return self.api.live

    async def post(self, path: str, body: Any, **kw: Any) -> aiohttp.ClientResponse:
        return await self.http.post(f"{self.url}{path}", json=body, **kw)

    async def complete(self, body: dict[str, Any], **kw: Any) -> Any:
        """A non-streamed completion that must succeed; its JSON."""
        async with await self.post("/v1/completions", body, **kw) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def get_json(self, path: str) -> Any:
        async with self.http.get(f"{self.url}{path}") as resp:
            assert resp.status == 200
            return await resp.json()

    async def subscribe(self) -> Events:
        """A subscriber that has joined and will see every batch from sequence 0 on (the
        missed ones come from the replay socket)."""
        info = await self.get_json("/kvsched/info")
        kv = info["kv_events"]
        sub = KvEventSubscriber(kv["endpoint"], kv["replay_endpoint"], topic=kv["topic"].encode())
        sub.last_seq = -1  # so a first live batch after 0 is a gap, filled from replay
        events = Events(sub)
        # ZMQ's slow joiner: a SUB socket misses what is sent before it has joined. Send
        # probes (each stores one new block) until one gets through.
        for _ in range(200):
            await self.complete({"prompt": [1000 + next(_probe)] * 16 + [1], "max_tokens": 1})
            if await events.poll(0.02):
                return events
        raise AssertionError("the subscriber never joined")


class Events:
    """Everything an engine published, in order, as a subscriber received it."""

    def __init__(self, sub: KvEventSubscriber) -> None:
        self.sub = sub
        self.batches: list[EventBatch] = []
        self._items = sub.batches()
        # One pending read, kept across polls: cancelling it would end the generator.
        self._next: asyncio.Future[Any] | None = None

    @property
    def events(self) -> list[Event]:
        return [e for b in self.batches for e in b.events]

    async def poll(self, timeout: float) -> bool:
        """Take one batch if it comes within `timeout` seconds."""
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self._items))
        done, _ = await asyncio.wait({self._next}, timeout=timeout)
        if not done:
            return False
        item, self._next = self._next.result(), None
        assert isinstance(item, EventBatch), item
        self.batches.append(item)
        return True

    async def upto(self, seq: int, timeout: float = 5.0) -> list[Event]:
        """Every event up to batch `seq` (exclusive), e.g. an engine's `next_seq`."""
        async with asyncio.timeout(timeout):
            while not self.batches or self.batches[-1].seq < seq - 1:
                await self.poll(0.1)
        assert [b.seq for b in self.batches] == list(range(len(self.batches)))
        return self.events

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
        self.sub.close()


@pytest.fixture
async def start_engine() -> AsyncIterator[Callable[..., Any]]:
    """`await start_engine(tracer=None, **settings_overrides)` → a `RunningEngine`; all are
    stopped (and their subscribers closed) after the test."""
    stops: list[Callable[[], Any]] = []

    async def start(tracer: Tracer | None = None, **overrides: Any) -> RunningEngine:
        settings = replace(FAST, **overrides)
        api = build(settings, tracer or NoOpTracer(), tokenizer=_TOKENIZER, words=_WORDS)
        server = TestServer(api.app, host="127.0.0.1")  # cancels handlers on disconnect
        await server.start_server()
        await api.start()
        http = aiohttp.ClientSession()
        running = RunningEngine(api, str(server.make_url("")).rstrip("/"), http)

        async def stop() -> None:
            await http.close()
            await server.close()
            await api.close()

        stops.append(stop)
        return running

    yield start
    for stop in reversed(stops):
        await stop()


@pytest.fixture
async def events_of() -> AsyncIterator[Callable[[RunningEngine], Any]]:
    """`await events_of(engine)` → a joined `Events`; closed after the test."""
    opened: list[Events] = []

    async def subscribe(engine: RunningEngine) -> Events:
        events = await engine.subscribe()
        opened.append(events)
        return events

    yield subscribe
    for events in opened:
        events.close()


@dataclass
class EngineProcess:
    """An engine started as its own process (`python -m services.engine`)."""

    proc: subprocess.Popen[bytes]
    url: str
    http: aiohttp.ClientSession
    log: Path

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        async with self.http.request(method, f"{self.url}{path}", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return await asyncio.to_thread(self.proc.wait, 10)


@contextlib.asynccontextmanager
async def engine_process(
    log: Path, *flags: str, env: Mapping[str, str] | None = None
) -> AsyncIterator[EngineProcess]:
    """An engine process on a free port with `flags` and, over an environment without our
    settings, `env`; yielded once it answers /health, killed after if still running."""
    port = free_port()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCHED_", "OTEL_"))}
    environ.update(env or {})
    argv = [sys.executable, "-m", "services.engine", "--listen", f"127.0.0.1:{port}", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=environ, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                assert proc.poll() is None, log.read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/health") as resp:
                        return resp.status == 200
                return False

            await wait_for(healthy, 20.0, message=f"the engine of {log.name} answers /health")
            yield EngineProcess(proc, url, http, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
