"""Fencing and takeover: a term's writes are guarded by its leader key, a standby ends the
term of a leader whose process refuses connections without waiting for its lease, a standby
renews instance leases, and what a standby's outbox collected is never written."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from clients.python import ConductorClient
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.cluster import Role
from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from services.common.store.interface import Fenced, Guard, Put, StoreUnavailable
from services.common.store.memory import MemoryStore
from services.conductor import keys
from services.conductor.election import Election, LeaderInfo
from services.conductor.fencing import TermWriter
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.takeover import DeadLeaderProbe, refuses_connections
from services.conductor.term import Term
from services.launcher.ports import free_port
from tests.conductor.conftest import instance, stub
from tests.fixtures.poll import wait_for

Start = Callable[..., Any]


async def test_a_stale_terms_write_is_refused_and_applies_nothing(start_conductor: Start) -> None:
    c1 = await start_conductor(conductor_id="c1", leader_ttl_s=30)
    c2 = await start_conductor(conductor_id="c2", lead=False, leader_ttl_s=30)
    await wait_for(lambda: c2.election.leader is not None, 5.0, message="c2 sees the leader")
    await c1.writer.commit([Put(b"/kvsched/v1/test/before", b"1")])
    leader = c1.election.leader
    assert leader is not None and await c2.probe.take_over(leader)
    # c1 has not noticed yet: it still believes it leads, and etcd refuses its write.
    with pytest.raises(Fenced):
        await c1.writer.commit([Put(b"/kvsched/v1/test/after", b"1")])
    assert await c1.store.get(b"/kvsched/v1/test/after") is None
    assert await c1.store.get(b"/kvsched/v1/test/before") is not None
    assert c1.writer.fenced == 1
    assert c1.metrics.registry.get_sample_value("kvsched_conductor_fenced_writes_total") == 1
    await wait_for(lambda: c2.serving, 5.0, message="the standby leads, long before 30 s")
    await wait_for(lambda: not c1.serving, 5.0, message="the fenced leader steps down")
    assert c1.election.deposed_at is not None  # it lived: its probe pauses
    # A second standby taking over the same (ended) term changes nothing.
    assert not await c1.probe.take_over(leader)
    assert c2.serving


async def test_a_conductor_that_does_not_lead_writes_nothing() -> None:
    store = MemoryStore()
    told: list[str] = []
    writer = TermWriter(store, lambda: None, lambda: told.append("fenced"))
    before = await store.revision()
    with pytest.raises(Fenced, match="does not lead"):
        await writer.commit([Put(b"/kvsched/v1/x", b"1")])
    assert await store.revision() == before and writer.fenced == 1
    assert told == []  # nothing to step down from
    lease = await store.grant_lease(30)
    assert await store.create(keys.LEADER.encode(), b"other", lease.id)
    stale = TermWriter(
        store, lambda: Guard(keys.LEADER.encode(), lease.id + 1), lambda: told.append("fenced")
    )
    with pytest.raises(Fenced):
        await stale.commit([Put(b"/kvsched/v1/x", b"1")])
    assert told == ["fenced"] and await store.get(b"/kvsched/v1/x") is None


async def test_a_leader_whose_port_refuses_is_replaced_before_its_lease_lapses(
    start_conductor: Start,
) -> None:
    c1 = await start_conductor(conductor_id="c1", leader_ttl_s=30)
    c2 = await start_conductor(conductor_id="c2", lead=False, leader_ttl_s=30)
    await wait_for(lambda: c2.election.leader is not None, 5.0, message="c2 sees the leader")
    async with stub(c1.url) as s:
        await s.RegisterInstance(pb.RegisterInstanceRequest(spec=instance(0)))
    assert c1.server is not None
    await c1.server.stop(None)  # its gRPC port refuses now, as a dead process's would
    started = time.monotonic()
    await wait_for(lambda: c2.serving, 5.0, message="the standby takes over")
    assert time.monotonic() - started < 2.0
    assert c2.probe.takeovers == 1
    assert c2.metrics.registry.get_sample_value("kvsched_conductor_takeovers_total") == 1
    await wait_for(lambda: not c1.serving, 5.0, message="the old leader steps down")
    assert "node-0/engine-0" in c2.state.instances  # adopted, not re-registered


async def test_a_stalled_but_listening_leader_is_not_taken_for_dead() -> None:
    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()  # a stalled server accepts (its kernel does) and answers nothing

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        assert not await refuses_connections(f"127.0.0.1:{port}")
        assert not await refuses_connections(f"http://127.0.0.1:{port}")
    assert await refuses_connections(f"127.0.0.1:{port}")
    assert not await refuses_connections("127.0.0.1")  # no port: proves nothing


async def test_a_probe_ends_the_term_only_after_refusals_in_a_row() -> None:
    store = MemoryStore()
    dead = LeaderInfo("c1", "127.0.0.1:1", "http://127.0.0.1:2")
    lease = await store.grant_lease(30)
    assert await store.create(keys.LEADER.encode(), dead.encode(), lease.id)
    standby = Election(store, LeaderInfo("c2", "a:1", "http://a:2"), 30)
    standby.observe(dead.encode())
    answers = itertools.chain([True, False, True, True], itertools.repeat(True))
    probed: list[str] = []

    async def refuses(url: str) -> bool:
        if not probe.takeovers:  # count the probes up to the takeover
            probed.append(url)
        return next(answers)

    probe = DeadLeaderProbe(store, lambda: standby, interval_s=0.001, refuses=refuses)
    task = asyncio.create_task(probe.run())
    try:
        await wait_for(lambda: probe.takeovers, 5.0, message="the term is ended")
    finally:
        task.cancel()
    # Refused, answered (the count starts over), refused, refused: ended once.
    assert probed == ["127.0.0.1:1"] * 4
    assert probe.takeovers == 1
    assert await store.get(keys.LEADER.encode()) is None
    assert await store.lease_ttl(lease.id) < 0  # revoked


async def test_a_conductor_deposed_while_alive_pauses_its_probe() -> None:
    """Its address refused connections from another Conductor while it lived: probing that
    one back at once would take the lead from each other in turn."""
    store = MemoryStore()
    now = [100.0]
    standby = Election(store, LeaderInfo("c1", "a:1", "http://a:2"), 30)
    standby.observe(LeaderInfo("c2", "127.0.0.1:1", "http://b:2").encode())
    standby.deposed_at = now[0] - 1.0
    probed: list[str] = []

    async def refuses(url: str) -> bool:
        probed.append(url)
        return False

    probe = DeadLeaderProbe(
        store, lambda: standby, interval_s=0.001, pause_s=30.0, refuses=refuses,
        clock=lambda: now[0],
    )  # fmt: skip
    task = asyncio.create_task(probe.run())
    try:
        for _ in range(20):
            await asyncio.sleep(0.002)
        assert probed == []  # paused
        now[0] += 30.0
        await wait_for(lambda: probed, 5.0, message="probing again after the pause")
    finally:
        task.cancel()


def _run(election: Election) -> tuple[list[str], asyncio.Task[None]]:
    """Run `election`; the list records "elected" and "lost" as its terms begin and end."""
    events: list[str] = []

    async def elected() -> None:
        events.append("elected")

    async def lost() -> None:
        events.append("lost")

    return events, asyncio.create_task(election.run(elected, lost))


async def test_a_leader_ignores_old_news_of_the_key_and_steps_down_on_new() -> None:
    store = MemoryStore()
    me = LeaderInfo("c1", "a:1", "http://a:2")
    election = Election(store, me, 30)
    events, task = _run(election)
    try:
        await wait_for(lambda: election.is_leader, 5.0, message="elected")
        mine = await store.get(keys.LEADER.encode())
        assert mine is not None
        election.observe(None, mine.mod_revision - 1)  # the previous leader's key going
        election.observe(mine.value, mine.mod_revision)
        await asyncio.sleep(0)
        assert election.is_leader and events == ["elected"]
        assert election.guard() is not None
        other = LeaderInfo("c2", "b:1", "http://b:2").encode()
        election.observe(other, mine.mod_revision + 1)
        await wait_for(lambda: events[:2] == ["elected", "lost"], 5.0, message="steps down")
        # It gave its lease up: the key it held is gone (it may campaign again, anew).
        assert await store.lease_ttl(mine.lease) < 0
    finally:
        task.cancel()


class _SlowEtcd(MemoryStore):
    """A store whose lease renewals fail while `failing` (etcd busy applying a burst)."""

    failing = False
    renewals = 0
    failures = 0

    async def keep_alive(self, lease_id: int) -> int:
        if self.failing:
            self.failures += 1
            raise StoreUnavailable("etcd did not answer in time")
        self.renewals += 1
        return await super().keep_alive(lease_id)


async def test_a_leader_rides_out_failed_renewals_and_steps_down_once_its_lease_lapses() -> None:
    store = _SlowEtcd()
    election = Election(store, LeaderInfo("c1", "a:1", "http://a:2"), 2)
    events, task = _run(election)
    try:
        await wait_for(lambda: store.renewals >= 1, 5.0, message="a first renewal")
        store.failing = True  # two failures, well inside the 2 s lease
        await wait_for(lambda: store.failures >= 2, 5.0, message="renewals tried again")
        store.failing = False
        renewed = store.renewals
        await wait_for(lambda: store.renewals > renewed, 5.0, message="renewing again")
        assert events == ["elected"] and election.is_leader
        store.failing = True  # for good: the lease lapses, and the leader knows it
        # (It campaigns again at once, and wins once etcd expired the lease too.)
        await wait_for(lambda: events[:2] == ["elected", "lost"], 5.0, message="steps down")
    finally:
        task.cancel()


async def test_a_standby_renews_instance_leases_and_drops_its_outbox(
    start_conductor: Start,
) -> None:
    # Leader leases far longer than the instance's: a stall of the machine must not hand the
    # term to c2, which this test needs as the standby.
    c1 = await start_conductor(conductor_id="c1", leader_ttl_s=10)
    c2 = await start_conductor(conductor_id="c2", lead=False, leader_ttl_s=10)
    iid = "node-0/engine-0"
    async with stub(c1.url) as s:
        ttl = pb.RegisterInstanceRequest(spec=instance(0))
        ttl.lease_ttl.FromSeconds(1)
        await s.RegisterInstance(ttl)
    await wait_for(lambda: iid in c2.state.instances, 5.0, message="the standby follows")
    dead = f"127.0.0.1:{free_port()}"
    async with ConductorClient([dead, c2.url], deadline_s=1.0, retries=0) as client:
        # Only the standby is asked (the first address is dead): 3 s of a 1 s lease.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            answer = await client.renew_lease(iid)
            assert answer.lease_ttl.seconds >= 1
            await asyncio.sleep(0.3)
    record = await c1.store.get(keys.instance_key(iid).encode())
    assert record is not None, "the instance's lease lapsed though the standby renewed it"
    async with stub(c2.url) as s:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await s.KeepAliveInstance(pb.KeepAliveInstanceRequest(instance_id="nobody"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # not NOT_FOUND
    # What the standby's observers queued is etcd's already: never written by it.
    c2.terms.current().outbox.put("/kvsched/v1/test/standby", b"x")
    await c2.persister.flush()
    assert c2.persister.dropped == 1
    assert await c2.store.get(b"/kvsched/v1/test/standby") is None


def test_a_cursor_is_queued_after_the_blocks_it_counts() -> None:
    term = Term.build(ConductorSettings(max_instances=2), "test")
    term.state.add_instance(InstanceRecord(InstanceSpec("a", "http://a", "n", Role.BOTH), 0, 7))
    term.cursors.apply("a", 0, False, [BlocksStored((11,), None, Tier.GPU)])
    term.cursors.apply("a", 1, False, [BlocksStored((12,), 11, Tier.GPU)])
    written = [key for key, _, _ in term.outbox.take()]
    assert written[-1] == keys.cursor_key("a")  # a flush cut short never counts lost blocks
    assert written.index(keys.block_key("a", Tier.GPU, 12)) < len(written) - 1
