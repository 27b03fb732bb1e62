"""The Messenger as processes are deployed: Conductors as processes (one killed with SIGKILL
while events flow: the stream follows the new leader and its index catches up), and the
Messenger itself as a process (health, reflection, metrics, transfers refused for now, and
SIGTERM deregisters its instances before it exits 0)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.python import ConductorClient
from kvsched.api.messenger.v1 import messenger_service_pb2 as mpb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as mpb_grpc
from services.launcher.ports import free_port
from services.messenger.app import SERVICE_NAME
from tests.conductor.conftest import REPO, ConductorProcess, leader_of
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.poll import wait_for
from tests.messenger.conftest import (
    BLOCK,
    EngineProcess,
    cached_tokens,
    expected_hashes,
    gpu_blocks,
    instance_status,
)

Start = Callable[..., Any]
IID = "node-0/e0"


def prompt(seed: int, blocks: int) -> list[int]:
    return [1000 + seed * 97 + i for i in range(blocks * BLOCK + 3)]


@pytest.fixture
def conductors(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ConductorProcess]]:
    procs = [
        ConductorProcess(etcd, f"c{i}", tmp_path / f"c{i}.log", instance_ttl=10) for i in range(2)
    ]
    yield procs
    for p in procs:
        p.stop()


async def index_matches(
    client: ConductorClient, http: aiohttp.ClientSession, engine: EngineProcess
) -> bool:
    """The leader indexes as many blocks as the engine caches, and every cached prompt."""
    want = expected_hashes(await engine.snapshot(http))
    return await gpu_blocks(client, IID) == len(want)


@pytest.mark.slow
async def test_the_stream_follows_a_new_leader_after_a_kill(
    conductors: list[ConductorProcess],
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    client_of: Callable[[Sequence[str]], ConductorClient],
    http: aiohttp.ClientSession,
) -> None:
    addresses = [p.url for p in conductors]
    client = client_of(addresses)
    leader_url = await wait_for(lambda: leader_of(client), 15.0, message="a leader")
    engine = start_engine(IID)
    await engine.ready(http)
    messenger = await start_messenger(addresses, [engine.url])
    await wait_for(lambda: instance_status(client, IID), 10.0, message="registered")
    prompts = [prompt(i, 3) for i in range(4)]
    for tokens in prompts[:2]:
        await engine.complete(http, tokens)
    await wait_for(lambda: index_matches(client, http, engine), 10.0, message="relayed")

    leader = next(p for p in conductors if p.url == leader_url)
    leader.kill()
    for tokens in prompts[2:]:  # while no one leads, or the new leader warms up
        await engine.complete(http, tokens)
    await wait_for(lambda: index_matches(client, http, engine), 15.0, message="caught up")
    assert await client.leader() != leader_url
    for tokens in prompts:
        assert await cached_tokens(client, tokens) == 3 * BLOCK
    stream = messenger.stream
    assert stream is not None and stream.counters.failures >= 1
    assert messenger.relays[0].registered


async def test_the_messenger_process_serves_and_deregisters_on_sigterm(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    client_of: Callable[[Sequence[str]], ConductorClient],
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    conductor = await start_conductor()
    engine = start_engine(IID)
    await engine.ready(http)
    port, http_port = free_port(), free_port()
    env = dict(os.environ, KVSCHED_MESSENGER_ENGINE=engine.url)  # flags also come from env
    log = tmp_path / "messenger.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "services.messenger",
                "--listen", f"127.0.0.1:{port}",
                "--http-listen", f"127.0.0.1:{http_port}",
                "--conductor", conductor.url,
                "--node", "node-0",
                "--instance-ttl", "10",
                "--insecure",
            ],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    client = client_of([conductor.url])
    try:
        await wait_for(lambda: instance_status(client, IID), 15.0, message="registered")
        status = await instance_status(client, IID)
        assert status is not None and status.spec.messenger_url == f"127.0.0.1:{port}"
        await engine.complete(http, prompt(1, 2))
        await wait_for(lambda: cached_tokens(client, prompt(1, 2)), 10.0, message="relayed")

        async with http.get(f"http://127.0.0.1:{http_port}/health") as r:
            health = await r.json()
        assert r.status == 200 and health["engines"][0]["registered"]
        async with http.get(f"http://127.0.0.1:{http_port}/metrics") as r:
            metrics = await r.text()
        assert f'kvsched_messenger_engine_up{{engine="{engine.url}",instance="{IID}"}} 1.0' in (
            metrics
        )
        assert 'kvsched_messenger_kv_event_batches_total{instance="node-0/e0"}' in metrics

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            checked = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5.0
            )
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            async for answer in stub.ServerReflectionInfo(iter([ask])):
                assert SERVICE_NAME in {s.name for s in answer.list_services_response.service}
                break
            messenger = mpb_grpc.MessengerServiceStub(channel)
            try:  # an empty plan is refused with a reason, and the Messenger keeps serving
                await messenger.StartTransfer(mpb.StartTransferRequest(), timeout=5.0)
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "transfer_id is required" in (err.details() or "")
            else:
                raise AssertionError("StartTransfer was accepted")

        process.send_signal(signal.SIGTERM)
        # Waited for off the loop: the Conductor in this process answers its deregistration.
        assert await asyncio.to_thread(process.wait, 10) == 0
        assert await instance_status(client, IID) is None  # at once, not after its lease
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
