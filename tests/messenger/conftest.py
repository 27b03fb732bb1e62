"""Fixtures of the Messenger tests: the Conductor's (a real etcd of its own per test,
Conductors in this process or as processes), simulated engines as processes, Messengers in
this process, and what the Conductor's index should hold given an engine's snapshot."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from clients.python import ConductorClient, unpack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.index import Tier
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.conductor.app import Conductor
from services.launcher.ports import free_port
from services.messenger.app import Messenger
from services.messenger.engine_api import parse_snapshot
from services.messenger.engines import parse_engines
from services.messenger.relay import EngineRelay
from services.messenger.settings import MessengerSettings
from services.messenger.translate import EventTranslator
from tests.conductor.conftest import etcd, start_conductor
from tests.fixtures.poll import wait_for
from tests.fixtures.process import ServiceProcess

__all__ = ["etcd", "start_conductor"]

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
MODEL = "kvsched-test"


class EngineProcess(ServiceProcess):
    """A simulated engine (`python -m services.engine`) on free loopback ports, running ten
    times faster than a GPU would; its ports stay the same across `start` after a `kill`."""

    def __init__(
        self,
        log: Path,
        instance_id: str,
        *,
        replay: bool = True,
        capacity_blocks: int = 64,
        flags: Sequence[str] = (),
    ) -> None:
        self.instance_id = instance_id
        self.port = free_port()
        argv = [
            sys.executable, "-m", "services.engine",
            "--listen", f"127.0.0.1:{self.port}",
            "--instance-id", instance_id,
            "--kv-events", f"tcp://127.0.0.1:{free_port()}",
            "--block-size", str(BLOCK),
            "--capacity-blocks", str(capacity_blocks),
            "--time-scale", "0.1",
            "--model", MODEL,
            *flags,
        ]  # fmt: skip
        if replay:
            argv += ["--kv-replay", f"tcp://127.0.0.1:{free_port()}"]
        super().__init__(argv, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def ready(self, http: aiohttp.ClientSession, timeout: float = 20.0) -> None:
        async def answers() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"engine exited; log: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(self.url + "/health") as r:
                    return r.status == 200
            return False

        await wait_for(answers, timeout, interval=0.05, message="the engine serves")

    async def complete(
        self, http: aiohttp.ClientSession, tokens: Sequence[int], salt: str | None = None
    ) -> dict[str, Any]:
        """One completion of a token-id prompt (its full blocks get cached)."""
        body: dict[str, Any] = {"model": MODEL, "prompt": list(tokens), "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        async with http.post(self.url + "/v1/completions", json=body) as r:
            answer: dict[str, Any] = await r.json()
            assert r.status == 200, answer
            return answer

    async def snapshot(self, http: aiohttp.ClientSession) -> Any:
        async with http.get(self.url + "/kvsched/kv/snapshot") as r:
            assert r.status == 200
            return await r.json()


class MessengerProcess(ServiceProcess):
    """A Messenger (`python -m services.messenger`) on free loopback ports."""

    def __init__(
        self, log: Path, conductor: str, node: str, engines: Sequence[str], flags: Sequence[str]
    ) -> None:
        self.port, self.http_port = free_port(), free_port()
        argv = [
            sys.executable, "-m", "services.messenger",
            "--listen", f"127.0.0.1:{self.port}",
            "--http-listen", f"127.0.0.1:{self.http_port}",
            "--conductor", conductor,
            "--node", node,
            "--engine", ",".join(engines),
            "--instance-ttl", "10",
            *flags,
        ]  # fmt: skip
        if not any(flag.startswith(("--tls-", "--serve-tls-")) for flag in flags):
            argv.append("--insecure")  # plaintext unless TLS is asked
        super().__init__(argv, log)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    async def metrics(self, http: aiohttp.ClientSession) -> str:
        async with http.get(self.http_url + "/metrics") as r:
            return await r.text()


@pytest.fixture
def start_messenger_process(tmp_path: Path) -> Iterator[Callable[..., MessengerProcess]]:
    started: list[MessengerProcess] = []

    def start(conductor: str, node: str, engines: Sequence[str], *flags: str) -> MessengerProcess:
        m = MessengerProcess(tmp_path / f"messenger-{node}.log", conductor, node, engines, flags)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
def start_engine(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def start(instance_id: str = "node-0/e0", **kwargs: Any) -> EngineProcess:
        name = instance_id.replace("/", "-")
        engine = EngineProcess(tmp_path / f"engine-{name}.log", instance_id, **kwargs)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


def messenger_settings(
    conductors: Sequence[str], engines: Sequence[str], **overrides: Any
) -> MessengerSettings:
    base = MessengerSettings(
        listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        conductors=tuple(conductors),
        engines=parse_engines(engines),
        node="node-0",
        instance_ttl_s=10.0,  # engine death must be noticed long before a lease lapses
        load_interval_s=0.02,
        engine_dead_after_s=0.5,
        probe_interval_s=0.05,
    )
    return replace(base, **overrides)


@pytest.fixture
async def start_messenger() -> AsyncIterator[Callable[..., Any]]:
    started: list[Messenger] = []

    async def start(conductors: Sequence[str], engines: Sequence[str], **kw: Any) -> Messenger:
        m = Messenger(messenger_settings(conductors, engines, **kw))
        await m.start()
        started.append(m)
        return m

    yield start
    for m in started:
        with contextlib.suppress(Exception):
            await m.stop(0)


@pytest.fixture
async def client_of() -> AsyncIterator[Callable[[Sequence[str]], ConductorClient]]:
    clients: list[ConductorClient] = []

    def make(addresses: Sequence[str]) -> ConductorClient:
        c = ConductorClient(list(addresses), deadline_s=1.0, retries=30, max_backoff_s=0.2)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


# ---- what the index should hold --------------------------------------------------------------


def expected_hashes(snapshot: Any) -> set[int]:
    """The hashes of every block in an engine snapshot (its JSON), as the index holds them."""
    snap = parse_snapshot(snapshot)
    events = EventTranslator(snap.block_size).translate(snap.events)
    return {h for e in events for h in unpack_hashes(e.blocks_stored.packed_block_hashes)}


def indexed(conductor: Conductor, instance_id: str) -> set[int] | None:
    """The GPU blocks an in-process Conductor's index holds for the instance."""
    slot = conductor.state.slot_of(instance_id)
    if slot is None:
        return None
    return set(conductor.state.cluster.index.blocks_of(slot, Tier.GPU))


async def instance_status(client: ConductorClient, instance_id: str) -> pb.InstanceStatus | None:
    for status in await client.list_instances():
        if status.spec.instance_id == instance_id:
            return status
    return None


async def gpu_blocks(client: ConductorClient, instance_id: str) -> int | None:
    """Blocks the Conductor indexes for the instance on GPU (None: not registered)."""
    status = await instance_status(client, instance_id)
    return None if status is None else int(status.gpu_blocks)


async def cached_tokens(
    client: ConductorClient, tokens: Sequence[int], salt: str | None = None
) -> int:
    """Prompt tokens the Conductor would find cached for `tokens` (hashed as a Router does)."""
    hashes = VllmBlockHasher(BLOCK).hash_prompt(tokens, salt)
    answer = await client.explain(pb.ExplainRequest(block_hashes=hashes))
    return int(answer.decision.cached_tokens)


def relay_of(messenger: Messenger, engine: EngineProcess) -> EngineRelay:
    return next(r for r in messenger.relays if r.engine_url == engine.url)


def lose_next_batches(relay: EngineRelay, n: int) -> list[int]:
    """Make the relay's subscriber lose the next `n` KV-event messages off the SUB socket
    (as a network would); a replay of them still gets through. Returns the sequence numbers
    lost, as they are."""
    sub = relay._sub
    assert sub is not None
    decode = sub._decode
    lost: list[int] = []

    def lossy(frames: list[bytes]) -> Any:
        seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else -1
        if len(lost) < n and seq not in lost and frames[0] != b"":  # replays carry b"" topics
            lost.append(seq)
            return None
        return decode(frames)

    sub._decode = lossy  # type: ignore[method-assign]
    return lost
