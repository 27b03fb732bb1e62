"""The KV event stream client against a real Conductor (on a real etcd): batches of several
instances on one call, a resume point the log holds is resent from it, one it does not hold
asks for a resync, an instance the Conductor forgot asks for a registration, and the stream
follows a restarted Conductor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from clients.python import ConductorClient
from clients.python.kv_stream import KvEventStream, SentBatch
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.events import BlocksRemoved
from services.conductor.app import Conductor
from tests.conductor.conftest import chain, instance
from tests.fixtures.poll import wait_for
from tests.messenger.conftest import gpu_blocks

Start = Callable[..., Any]


def stored(hashes: list[int], parent: int | None = None) -> pb.KvEvent:
    event = pb.BlocksStored(block_hashes=hashes, tier=common.TIER_GPU)
    if parent is not None:
        event.parent_block_hash = parent
    return pb.KvEvent(blocks_stored=event)


class Sender:
    """A stream with its callbacks recorded."""

    def __init__(self, client: ConductorClient) -> None:
        self.resyncs: list[str] = []
        self.unregistered: list[str] = []
        self.sent: list[SentBatch] = []
        self.stream = KvEventStream(
            client,
            on_resync=self.resyncs.append,
            on_unregistered=self.unregistered.append,
            on_sent=self.sent.append,
            log_batches=16,
            seed=1,
        )


@pytest.fixture
async def conductor(start_conductor: Start) -> Conductor:
    c: Conductor = await start_conductor(instance_ttl_s=30)
    return c


@pytest.fixture
async def client(conductor: Conductor) -> AsyncIterator[ConductorClient]:
    async with ConductorClient([conductor.url], deadline_s=1.0, retries=20) as c:
        yield c


@pytest.fixture
async def sender(client: ConductorClient) -> AsyncIterator[Sender]:
    s = Sender(client)
    s.stream.start()
    yield s
    await s.stream.close()


async def registered(client: ConductorClient, sender: Sender, i: int) -> str:
    spec = instance(i)
    answer = await client.register_instance(spec)
    sender.stream.open(spec.instance_id, answer.instance.next_event_sequence)
    return spec.instance_id


async def test_batches_of_two_instances_share_the_call_in_order(
    client: ConductorClient, sender: Sender
) -> None:
    a, b = await registered(client, sender, 0), await registered(client, sender, 1)
    stream = sender.stream
    assert stream.send(a, [stored(chain(1, 2))]) is None  # the first batch must be a resync
    assert stream.send(a, [stored(chain(1, 2))], resync=True) == 0
    assert stream.send(b, [stored(chain(2, 3))], resync=True) == 0
    for i in range(5):
        stream.send(a, [stored(chain(10 + i, 1))])
    await wait_for(lambda: gpu_blocks(client, a), 5.0, message="a's blocks")
    await wait_for(lambda: stream.unsent(a) == stream.unsent(b) == 0, 5.0)
    assert await wait_for(lambda: _count(client, a, 7), 5.0)
    assert await gpu_blocks(client, b) == 3
    assert stream.counters.connects == 1 and stream.counters.failures == 0
    assert [s.sequence for s in sender.sent if s.instance_id == a] == list(range(6))


async def _count(client: ConductorClient, iid: str, n: int) -> bool:
    return await gpu_blocks(client, iid) == n


async def test_a_resume_point_in_the_log_is_resent_and_one_beyond_asks_for_a_resync(
    conductor: Conductor, client: ConductorClient, sender: Sender
) -> None:
    iid = await registered(client, sender, 0)
    stream = sender.stream
    stream.send(iid, [stored(chain(1, 1))], resync=True)
    for i in range(4):
        stream.send(iid, [stored(chain(2 + i, 1))])  # batches 1..4
    await wait_for(lambda: _count(client, iid, 5), 5.0, message="all five applied")
    # The Conductor loses batches 3 and 4 (as a leader that did not persist them would).
    inst = conductor.state.instances[iid]
    inst.next_sequence = 3
    conductor.state.scheduler.apply(inst.slot, [BlocksRemoved((*chain(4, 1), *chain(5, 1)))])
    stream.send(iid, [stored(chain(6, 1))])  # batch 5: ahead, so the call ends at 3
    await wait_for(lambda: _count(client, iid, 6), 5.0, message="3..5 resent and applied")
    assert stream.counters.resume_points == 1
    assert stream.counters.resent == 3  # 3 and 4, and 5 (refused once)
    assert sender.resyncs == []

    # Ahead of anything cut (another sender?), while the resync batch that began the log
    # is still held: sending everything again from it is enough.
    inst.next_sequence = 50
    stream.send(iid, [stored(chain(7, 1))])
    await wait_for(lambda: _count(client, iid, 7), 5.0, message="all resent from the resync")
    assert sender.resyncs == [] and stream.counters.resume_points == 2
    # Once the log no longer holds it, only a new resync can help.
    for _ in range(20):
        stream.send(iid, [])
    await wait_for(lambda: stream.unsent(iid) == 0, 5.0)
    inst.next_sequence = 500
    stream.send(iid, [stored(chain(8, 1))])
    await wait_for(lambda: sender.resyncs == [iid], 5.0, message="asked for a resync")
    assert stream.instance_state(iid) == "resync"
    assert stream.send(iid, [stored(chain(8, 1))]) is None
    stream.send(iid, [stored(chain(9, 2))], resync=True)
    await wait_for(lambda: _count(client, iid, 2), 5.0, message="the resync replaced it all")


async def test_an_instance_the_conductor_forgot_asks_for_a_registration(
    client: ConductorClient, sender: Sender
) -> None:
    iid = await registered(client, sender, 0)
    stream = sender.stream
    stream.send(iid, [stored(chain(1, 1))], resync=True)
    await wait_for(lambda: _count(client, iid, 1), 5.0)
    await client.deregister(iid)
    stream.send(iid, [stored(chain(2, 1))])  # refused: the stream breaks, then syncs
    await wait_for(lambda: sender.unregistered == [iid], 5.0, message="asked to register")
    assert stream.instance_state(iid) == "unregistered"
    iid = await registered(client, sender, 0)
    stream.send(iid, [stored(chain(3, 2))], resync=True)
    await wait_for(lambda: _count(client, iid, 2), 5.0, message="back after registering")


async def test_the_stream_follows_a_restarted_conductor(
    start_conductor: Start, conductor: Conductor, client: ConductorClient, sender: Sender
) -> None:
    iid = await registered(client, sender, 0)
    stream = sender.stream
    stream.send(iid, [stored(chain(1, 1))], resync=True)
    for i in range(3):
        stream.send(iid, [stored(chain(2 + i, 1))])
    await wait_for(lambda: _count(client, iid, 4), 5.0)
    await conductor.stop(0)
    stream.send(iid, [stored(chain(9, 1))])  # waits in the log while no one leads
    again: Conductor = await start_conductor(instance_ttl_s=30, listen=conductor.url)
    await wait_for(lambda: _count(client, iid, 5), 10.0, message="the new leader has it all")
    assert stream.counters.connects >= 2 and again.serving
