"""Leader failover with Conductors in separate processes: kill -9 the leader while a client
streams placements; a standby serves within 2 s, no session binding is lost, and the client
recovers on its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.python import ConductorClient
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from tests.conductor.conftest import ConductorProcess, instance, leader_of
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.poll import wait_for

SESSIONS = 16
BLOCK = 16


@pytest.fixture
def conductors(etcd: EtcdServer, tmp_path: Path) -> Iterator[list[ConductorProcess]]:
    procs = [
        ConductorProcess(etcd, f"c{i}", tmp_path / f"c{i}.log", policy="sticky") for i in range(2)
    ]
    yield procs
    for p in procs:
        p.stop()


def request(session: int, turn: int) -> pb.ScheduleRequest:
    prompt = (turn + 2) * BLOCK + 3
    hashes = [hash((session, b)) & (2**64 - 1) for b in range(turn + 2)]
    return pb.ScheduleRequest(
        request_id=f"s{session}-t{turn}",
        prompt_tokens=prompt,
        output_tokens=8,
        block_hashes=hashes,
        session_id=f"session-{session}",
    )


async def test_standby_takes_over_within_two_seconds_and_keeps_bindings(
    conductors: list[ConductorProcess],
) -> None:
    addresses = [p.url for p in conductors]
    async with ConductorClient(addresses, deadline_s=1.0, retries=40, max_backoff_s=0.1) as client:
        leader_url = await wait_for(lambda: leader_of(client), 15.0, message="a leader is elected")
        for i in range(4):
            spec = instance(i)
            await client.register_instance(spec, lease_ttl_s=60)
        hosts: dict[int, str] = {}
        async with client.placement_stream() as stream:
            for turn in range(2):
                for s in range(SESSIONS):
                    d = await stream.schedule(request(s, turn))
                    assert hosts.setdefault(s, d.instance_id) == d.instance_id

            leader = next(p for p in conductors if p.url == leader_url)
            standby = next(p for p in conductors if p is not leader)
            # Keep placing while the leader dies: the stream must carry on by itself.
            turn = 2
            leader.kill()
            killed_at = time.monotonic()
            first = await stream.schedule(request(0, turn))
            recovered_s = time.monotonic() - killed_at
            assert first.instance_id == hosts[0]
            for s in range(1, SESSIONS):
                d = await stream.schedule(request(s, turn))
                assert d.instance_id == hosts[s], f"session {s} lost its binding"
        assert await client.leader() == standby.url
        assert recovered_s < 2.0, f"a standby served {recovered_s:.2f} s after the kill"
        for s in range(SESSIONS):
            session = await client.get_session(f"session-{s}")
            assert session.host_instance_id == hosts[s]
