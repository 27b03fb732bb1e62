"""Routers against real services: a Conductor on a real etcd (in this process, real gRPC on
loopback), simulated engines as processes (`python -m services.engine`), registered with the
Conductor directly (as a node's Messenger would) and kept alive, and Routers serving real
HTTP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from clients.python import ConductorClient, ConductorError
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.inference_api.openai_api import DEFAULT_MODEL
from services.conductor.app import Conductor
from services.launcher.ports import free_port
from services.router.api_keys import new_key
from services.router.app import Router
from services.router.settings import RouterSettings
from tests.conductor.conftest import etcd, start_conductor
from tests.fixtures.poll import wait_for

__all__ = ["etcd", "start_conductor"]  # fixtures re-exported for the tests here

REPO = Path(__file__).resolve().parents[2]
MODEL = DEFAULT_MODEL


class EngineProcess:
    """A simulated engine in its own process."""

    def __init__(
        self, instance_id: str, log: Path, env: dict[str, str] | None = None, **flags: Any
    ) -> None:
        self.instance_id = instance_id
        self.port = free_port()
        args = [
            sys.executable, "-m", "services.engine",
            "--listen", f"127.0.0.1:{self.port}",
            "--instance-id", instance_id,
            "--time-scale", "0.02",  # fifty times faster than the GPU it models
        ]  # fmt: skip
        for key, value in flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        self.log = log
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCHED_", "OTEL_"))}
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                args, cwd=REPO, env={**base, **(env or {})}, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self, session: aiohttp.ClientSession, timeout: float = 20.0) -> None:
        async def up() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"engine exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url + "/health") as resp:
                    return resp.status == 200
            return False

        await wait_for(up, timeout, message=f"engine {self.instance_id} answers /health")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


StartEngines = Callable[..., Awaitable[list[EngineProcess]]]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def start_engines(tmp_path: Path, http: aiohttp.ClientSession) -> AsyncIterator[StartEngines]:
    """`await start_engines(n, env=..., **flags)`: n engines, ready."""
    started: list[EngineProcess] = []

    async def start(
        n: int, *, env: dict[str, str] | None = None, **flags: Any
    ) -> list[EngineProcess]:
        batch = []
        for _ in range(n):
            i = len(started)
            log = tmp_path / f"engine-{i}.log"
            engine = EngineProcess(f"node-{i}/engine-0", log, env, **flags)
            started.append(engine)
            batch.append(engine)
        for engine in batch:
            await engine.ready(http)
        return batch

    yield start
    for engine in started:
        engine.stop()


def spec(instance_id: str, url: str, model: str = MODEL, max_model_len: int = 0) -> pb.InstanceSpec:
    return pb.InstanceSpec(
        instance_id=instance_id,
        url=url,
        node=instance_id.partition("/")[0],
        role=common.ROLE_BOTH,
        model=model,
        max_model_len=max_model_len,
    )


class Registry:
    """Registers instances with a Conductor and keeps their leases alive, as a Messenger."""

    def __init__(self, client: ConductorClient) -> None:
        self.client = client
        self._tasks: list[asyncio.Task[None]] = []

    async def add(
        self, instance_id: str, url: str, model: str = MODEL, max_model_len: int = 0
    ) -> None:
        registered = spec(instance_id, url, model, max_model_len)
        await self.client.register_instance(registered, lease_ttl_s=3)
        self._tasks.append(asyncio.create_task(self._keep(instance_id)))

    async def _keep(self, instance_id: str) -> None:
        while True:
            await asyncio.sleep(0.5)  # a heartbeat, well inside the 3 s lease
            with contextlib.suppress(ConductorError):
                await self.client.keep_alive(instance_id)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()


@pytest.fixture
async def registry() -> AsyncIterator[Callable[[str], Registry]]:
    made: list[Registry] = []

    def make(conductor_url: str) -> Registry:
        r = Registry(ConductorClient([conductor_url], deadline_s=1.0, retries=1))
        made.append(r)
        return r

    yield make
    for r in made:
        await r.close()


def router_settings(conductor_url: str, **overrides: Any) -> RouterSettings:
    base = RouterSettings(
        router_id="r1",
        listen="127.0.0.1:0",
        grpc_listen="127.0.0.1:0",
        conductors=(conductor_url,),
        no_auth=True,
        instances_refresh_s=0.2,
        placement_timeout_s=1.0,  # loaded CI machines: the fallback has its own tests
    )
    return replace(base, **overrides)


StartRouter = Callable[..., Awaitable[Router]]


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    """`await start_router(conductor_url, **settings)`: a started Router (stopped after)."""
    started: list[Router] = []

    async def start(conductor_url: str, **overrides: Any) -> Router:
        provider = overrides.pop("tracer_provider", None)
        router = Router(router_settings(conductor_url, **overrides), tracer_provider=provider)
        await router.start()
        started.append(router)
        return router

    yield start
    for router in started:
        with contextlib.suppress(Exception):
            await router.stop()


@pytest.fixture
def keys_file(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A keys file with tenants `acme` and `globex`: (path, {tenant: key})."""
    path = tmp_path / "api-keys.json"
    yield path, {name: new_key(path, name) for name in ("acme", "globex")}


def completion(
    prompt: str | list[int] = "Hello there, how are you doing today?", **extra: Any
) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}


def chat(content: str = "Tell me a story about a fox.", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        **extra,
    }


@dataclass
class Stack:
    """The fixtures a Router test composes, with `up()` for the usual arrangement."""

    start_conductor: Callable[..., Awaitable[Conductor]]
    start_engines: StartEngines
    registry: Callable[[str], Registry]
    start_router: StartRouter
    http: aiohttp.ClientSession

    async def up(
        self,
        engines: int = 1,
        *,
        policy: str = "cache_aware",
        engine_flags: dict[str, Any] | None = None,
        **router: Any,
    ) -> tuple[Conductor, list[EngineProcess], Router]:
        """A Conductor, `engines` engines (started with `engine_flags`) registered with it,
        and a Router (with settings `router`) that already knows them."""
        conductor = await self.start_conductor(policy=policy)
        started = await self.start_engines(engines, **(engine_flags or {})) if engines else []
        reg = self.registry(conductor.url)
        for engine in started:
            await reg.add(engine.instance_id, engine.url)
        r = await self.start_router(conductor.url, **router)
        await wait_for(
            lambda: len(r.placer.instances) == engines, 5.0, message="the Router knows them all"
        )
        return conductor, started, r

    async def post(self, url: str, body: Any, **headers: str) -> tuple[int, dict[str, str], bytes]:
        """POST JSON (or raw bytes); returns status, headers, body."""
        kwargs: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with self.http.post(url, headers=headers, **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    async def metrics(self, router: Router) -> str:
        async with self.http.get(router.url + "/metrics") as resp:
            return await resp.text()


@pytest.fixture
def stack(
    start_conductor: Callable[..., Awaitable[Conductor]],
    start_engines: StartEngines,
    registry: Callable[[str], Registry],
    start_router: StartRouter,
    http: aiohttp.ClientSession,
) -> Stack:
    return Stack(start_conductor, start_engines, registry, start_router, http)
