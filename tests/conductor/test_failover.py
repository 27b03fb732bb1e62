"""Leader failover with Conductors in separate processes: kill -9 the leader while a client
streams placements and keeps 2 s instance leases alive; a standby serves within 2 s, no
session binding is lost, no instance lease lapses, and the client recovers on its own. A
leader that stalls (SIGSTOP) is not taken for dead, and the instance leases live on through
the standby meanwhile. (The whole cluster under streaming load: tests/e2e/test_failover.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from clients.python import ConductorClient, Unavailable
from clients.python.kv_stream import KvEventStream
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from tests.conductor.conftest import ConductorProcess, instance, leader_of
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.poll import wait_for

SESSIONS = 16
BLOCK = 16
INSTANCES = 4
INSTANCE_TTL_S = 2  # as short as `kvsched up`'s: it must outlive the takeover


async def keep_alive(client: ConductorClient, renewals: list[float]) -> None:
    """Renew every instance's lease each third of its TTL, as a Messenger does (at any
    Conductor that answers); `renewals` records when each round of renewals completed."""

    async def renew(i: int) -> None:
        with contextlib.suppress(Unavailable):
            await client.renew_lease(instance(i).instance_id, deadline_s=INSTANCE_TTL_S / 4)

    while True:
        await asyncio.gather(*(renew(i) for i in range(INSTANCES)))  # a Messenger's are apart
        renewals.append(time.monotonic())
        await asyncio.sleep(INSTANCE_TTL_S / 3)


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
        for i in range(INSTANCES):
            await client.register_instance(instance(i), lease_ttl_s=INSTANCE_TTL_S)
        renewals: list[float] = []
        renewing = asyncio.create_task(keep_alive(client, renewals))
        standby_url = next(p.url for p in conductors if p.url != leader_url)
        async with ConductorClient([standby_url], deadline_s=1.0, retries=0) as one:

            async def standby_follows() -> bool:
                try:
                    answer = await one.get_leader()
                except Unavailable:  # not listening yet
                    return False
                return not answer.is_leader and answer.leader_id != ""

            await wait_for(standby_follows, 30.0, message="the standby follows the leader")
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
        # Past a whole TTL after the kill, renewed all along: no instance's lease lapsed.
        await wait_for(
            lambda: renewals and renewals[-1] > killed_at + INSTANCE_TTL_S,
            10.0,
            message="renewals go on past a TTL after the kill",
        )
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        listed = await client.list_instances()
        assert sorted(i.spec.instance_id for i in listed) == sorted(
            instance(i).instance_id for i in range(INSTANCES)
        )


async def test_a_stalled_leader_keeps_its_term_and_instance_leases_live_on(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    # A 5 s leader lease: the 2.5 s stall below must not end the term by itself.
    procs = [
        ConductorProcess(etcd, f"c{i}", tmp_path / f"c{i}.log", policy="sticky", leader_ttl=5)
        for i in range(2)
    ]
    try:
        async with ConductorClient([p.url for p in procs], deadline_s=1.0, retries=40) as client:
            leader_url = await wait_for(lambda: leader_of(client), 15.0, message="a leader")
            for i in range(INSTANCES):
                await client.register_instance(instance(i), lease_ttl_s=INSTANCE_TTL_S)
            leader = next(p for p in procs if p.url == leader_url)
            standby = next(p for p in procs if p is not leader)
            async with ConductorClient([standby.url], deadline_s=1.0, retries=0) as one:

                async def follows() -> bool:
                    try:
                        answer = await one.get_leader()
                    except Unavailable:
                        return False
                    return not answer.is_leader and answer.leader_id != ""

                await wait_for(follows, 30.0, message="the standby follows the leader")
                renewals: list[float] = []
                renewing = asyncio.create_task(keep_alive(client, renewals))
                os.kill(leader.process.pid, signal.SIGSTOP)  # alive, listening, silent
                try:
                    # The stall lasts longer than an instance lease: only the standby's
                    # renewals keep the instances (a scenario's length, not a wait).
                    await asyncio.sleep(INSTANCE_TTL_S * 1.25)
                    answer = await one.get_leader()
                    assert not answer.is_leader, "the stalled leader was taken for dead"
                finally:
                    os.kill(leader.process.pid, signal.SIGCONT)
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
            assert len(renewals) >= 3
            assert await client.leader() == leader.url  # it kept its term
            listed = await client.list_instances()
            assert len(listed) == INSTANCES, "an instance lease lapsed during the stall"
    finally:
        for p in procs:
            p.stop()


async def _metric(http_port: int, name: str) -> float:
    """A counter's value on a Conductor's /metrics (0 when absent or not answering)."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{http_port}/metrics") as r,
        ):
            text = await r.text()
    except aiohttp.ClientError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_a_standby_applies_the_mirrored_batches_the_dead_leader_had_not_flushed(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    # A write-behind that never flushes in the test's time: everything the leader applies
    # after the registration dies with it, and only the mirror can save it.
    procs = [
        ConductorProcess(etcd, f"c{i}", tmp_path / f"c{i}.log", persist_interval=60)
        for i in range(2)
    ]
    batches = 12
    try:
        addresses = [p.url for p in procs]
        async with ConductorClient(addresses, deadline_s=1.0, retries=40) as client:
            leader_url = await wait_for(lambda: leader_of(client), 15.0, message="a leader")
            leader = next(p for p in procs if p.url == leader_url)
            standby = next(p for p in procs if p is not leader)
            spec = instance(0)
            await client.register_instance(spec, lease_ttl_s=30)
            async with ConductorClient([standby.url], deadline_s=1.0, retries=0) as one:

                async def standby_knows() -> bool:
                    try:
                        listed = await one.list_instances()
                    except Unavailable:  # not listening yet
                        return False
                    return [i.spec.instance_id for i in listed] == [spec.instance_id]

                await wait_for(standby_knows, 15.0, message="the standby knows the instance")
            stream = KvEventStream(client, on_resync=lambda _: None, on_unregistered=lambda _: None)
            stream.start()
            try:
                first = (await client.keep_alive(spec.instance_id)).next_event_sequence
                stream.open(spec.instance_id, first)
                for b in range(batches):
                    events = [
                        pb.KvEvent(
                            blocks_stored=pb.BlocksStored(
                                block_hashes=[1000 + b], tier=common.TIER_GPU
                            )
                        )
                    ]
                    stream.send(spec.instance_id, events, resync=b == 0)
                end = first + batches

                async def applied_by_leader() -> bool:
                    return (await client.keep_alive(spec.instance_id)).next_event_sequence == end

                await wait_for(applied_by_leader, 15.0, message="the leader applied every batch")
                kept = 'kvsched_conductor_mirrored_kv_event_batches_total{outcome="kept"}'

                async def kept_by_standby() -> bool:
                    return await _metric(standby.http_port, kept) >= batches

                await wait_for(kept_by_standby, 15.0, message="the standby kept every batch")
                leader.kill()

                async def standby_leads() -> bool:
                    return await leader_of(client) == standby.url

                await wait_for(standby_leads, 15.0, message="the standby takes over")
                answer = await client.keep_alive(spec.instance_id)
                assert answer.next_event_sequence == end  # the mirror advanced the cursor
                applied = 'kvsched_conductor_mirrored_kv_event_batches_total{outcome="applied"}'
                assert await _metric(standby.http_port, applied) == batches
                # One more batch: the stream resumes at the new leader, sending nothing again.
                more = [
                    pb.KvEvent(
                        blocks_stored=pb.BlocksStored(block_hashes=[7], tier=common.TIER_GPU)
                    )
                ]
                stream.send(spec.instance_id, more)

                async def took_the_next() -> bool:
                    return (
                        await client.keep_alive(spec.instance_id)
                    ).next_event_sequence == end + 1

                await wait_for(took_the_next, 15.0, message="the new leader took the next batch")
                assert stream.counters.resent == 0
                assert stream.counters.resyncs_asked == 0
            finally:
                await stream.close()
    finally:
        for p in procs:
            p.stop()
