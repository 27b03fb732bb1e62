"""Conductors on a real etcd of their own (the keyspace is fixed, so each test gets a fresh
server), in this process (real gRPC on loopback) or as separate processes."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from clients.python import ConductorClient, Unavailable
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from services.conductor.app import Conductor
from services.conductor.settings import ConductorSettings
from services.launcher.ports import free_port
from tests.fixtures.etcd import EtcdServer, start_etcd
from tests.fixtures.poll import wait_for
from tests.fixtures.process import ServiceProcess

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with start_etcd(tmp_path / "etcd") as server:
        yield server


def settings(etcd: EtcdServer, **overrides: Any) -> ConductorSettings:
    base = ConductorSettings(
        conductor_id="c1",
        listen="127.0.0.1:0",
        http_listen="127.0.0.1:0",
        policy="cache_aware",
        max_instances=8,
        leader_ttl_s=1,
        instance_ttl_s=1,
        persist_interval_s=0.02,
        etcd=etcd.settings(),
    )
    return replace(base, **overrides)


@pytest.fixture
async def start_conductor(
    etcd: EtcdServer,
) -> AsyncIterator[Callable[..., Any]]:
    started: list[Conductor] = []

    async def start(
        *, lead: bool = True, clock: Callable[[], float] | None = None, **overrides: Any
    ) -> Conductor:
        c = Conductor(settings(etcd, **overrides), clock=clock)
        await c.start()
        started.append(c)
        if lead:
            await wait_for(lambda: c.serving, 5.0, message="conductor leads")
        return c

    yield start
    for c in started:
        with contextlib.suppress(Exception):
            await c.stop(0)


@contextlib.asynccontextmanager
async def stub(url: str) -> AsyncIterator[ConductorServiceAsyncStub]:
    """A Conductor stub on a real loopback channel (typed as the asyncio stub it is)."""
    async with grpc.aio.insecure_channel(url) as channel:
        yield pb_grpc.ConductorServiceStub(channel)


def chain(prefix: int, n: int) -> list[int]:
    """`n` distinct block hashes sharing nothing with other prefixes."""
    return [prefix * 1_000_000 + i + 1 for i in range(n)]


def instance(i: int, role: int = 1) -> pb.InstanceSpec:
    return pb.InstanceSpec(
        instance_id=f"node-{i // 2}/engine-{i % 2}",
        url=f"http://127.0.0.1:{9000 + i}",
        node=f"node-{i // 2}",
        role=role,  # type: ignore[arg-type]
    )


async def leader_of(client: ConductorClient) -> str | None:
    """The leader's address, or None while there is none (a process still starting, an
    election running): for polling."""
    try:
        return await client.leader()
    except Unavailable:
        return None


class ConductorProcess(ServiceProcess):
    """A Conductor in its own process (for kill -9)."""

    def __init__(self, etcd: EtcdServer, conductor_id: str, log: Path, **flags: Any) -> None:
        self.port = free_port()
        self.http_port = free_port()
        args = [
            sys.executable, "-m", "services.conductor",
            "--id", conductor_id,
            "--listen", f"127.0.0.1:{self.port}",
            "--http-listen", f"127.0.0.1:{self.http_port}",
            "--leader-ttl", "1",
            "--max-instances", "8",
            "--policy", "cache_aware",
        ]  # fmt: skip
        for key, value in flags.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        if not any(key.startswith("tls_") for key in flags):  # plaintext unless TLS is asked
            args.append("--insecure")
        super().__init__(args, log, dict(os.environ, KVSCHED_ETCD_ENDPOINTS=etcd.url))

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"
