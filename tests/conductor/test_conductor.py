"""The ConductorService end to end: real Conductors on a fresh real etcd, real gRPC on
loopback. Each test checks one part of the contract in
protos/kvsched/conductor/v1/conductor_service.proto, including that refused calls change
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from clients.python import ConductorClient, Rejected
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.index import Tier
from services.common.telemetry import (
    TelemetrySettings,
    inject_metadata,
    setup_tracing,
    shutdown_tracing,
)
from services.conductor import keys
from services.conductor.app import Conductor
from services.conductor.settings import parse as parse_settings
from tests.conductor.conftest import chain, instance, settings, stub
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.otlp import OtlpReceiver
from tests.fixtures.poll import wait_for

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

Start = Callable[..., Awaitable[Conductor]]
BS = 16  # the test settings' block size
LONG_LEASE = Duration(seconds=30)  # outlives any test: only the lease-expiry test lets one lapse


# ---- helpers ---------------------------------------------------------------------------


def stored(
    hashes: Sequence[int], *, tier: int = common.TIER_GPU, parent: int | None = None
) -> pb.KvEvent:
    event = pb.BlocksStored(block_hashes=hashes, tier=tier)  # type: ignore[arg-type]
    if parent is not None:
        event.parent_block_hash = parent
    return pb.KvEvent(blocks_stored=event)


def batch(iid: str, sequence: int, *events: pb.KvEvent, resync: bool = False) -> pb.KvEventBatch:
    return pb.KvEventBatch(instance_id=iid, sequence=sequence, resync=resync, events=events)


def publish(iid: str, sequence: int, *events: pb.KvEvent, resync: bool = False) -> Any:
    return pb.PublishKvEventsRequest(batch=batch(iid, sequence, *events, resync=resync))


def sched(
    rid: str, hashes: Sequence[int], *, session: str = "", prompt: int | None = None
) -> pb.ScheduleRequest:
    return pb.ScheduleRequest(
        request_id=rid,
        prompt_tokens=len(hashes) * BS + 1 if prompt is None else prompt,
        output_tokens=16,
        block_hashes=hashes,
        session_id=session,
    )


async def register(
    s: ConductorServiceAsyncStub, i: int, ttl: Duration = LONG_LEASE, role: int = common.ROLE_BOTH
) -> pb.InstanceStatus:
    reply = await s.RegisterInstance(
        pb.RegisterInstanceRequest(spec=instance(i, role), lease_ttl=ttl)
    )
    return reply.instance


async def refused(call: Awaitable[object], code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    """Await `call`, which must fail with `code`; returns the error (for its trailers)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value


def trailer(err: grpc.aio.AioRpcError, key: str) -> str | None:
    pairs: Any = err.trailing_metadata() or ()  # (key, value) pairs; the stubs say otherwise
    for k, v in pairs:
        if k == key:
            return str(v)
    return None


async def listed(s: ConductorServiceAsyncStub) -> dict[str, pb.InstanceStatus]:
    reply = await s.ListInstances(pb.ListInstancesRequest())
    return {i.spec.instance_id: i for i in reply.instances}


async def etcd_instance(c: Conductor, iid: str) -> Any:
    return await c.store.get(b"/kvsched/v1/instances/" + urllib.parse.quote(iid, safe="").encode())


IID = [instance(i).instance_id for i in range(8)]


# ---- 1. registration -------------------------------------------------------------------


async def test_register_lists_instances_with_distinct_slots_and_keys_in_etcd(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        statuses = [await register(s, i) for i in range(3)]
        assert len({st.slot for st in statuses}) == 3
        assert all(st.spec.role == common.ROLE_BOTH for st in statuses)
        shown = await listed(s)
        assert set(shown) == set(IID[:3])
        assert len({st.slot for st in shown.values()}) == 3
        for st in statuses:
            row = shown[st.spec.instance_id]
            assert row.slot == st.slot
            assert row.spec.role == common.ROLE_BOTH
            assert row.spec.url == st.spec.url
            assert row.lease_id != 0
            kv = await etcd_instance(c, st.spec.instance_id)
            assert kv is not None, f"no etcd key for {st.spec.instance_id}"
            record = keys.InstanceRecord.decode(kv.value)
            assert record.slot == st.slot
            assert record.lease_id == row.lease_id
        # Re-registering keeps the slot (and the instance count), and, the spec being the
        # same, the instance's index and event cursor.
        await s.PublishKvEvents(publish(IID[1], 0, stored(chain(1, 3))))
        again = await register(s, 1)
        assert again.slot == statuses[1].slot
        assert again.gpu_blocks == 3 and again.next_event_sequence == 1
        shown = await listed(s)
        assert len(shown) == 3
        assert shown[IID[1]].slot == statuses[1].slot
        assert shown[IID[1]].lease_id == again.lease_id
        assert c.state.instances[IID[1]].slot == statuses[1].slot


# ---- 2. lease expiry -------------------------------------------------------------------


async def test_lapsed_lease_removes_instance_blocks_and_session_binding(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    short = Duration(seconds=1)
    async with stub(c.url) as s:
        doomed = await register(s, 0, ttl=short)
        kept = await register(s, 1, ttl=short)

        async def keep_alive() -> None:
            while True:
                await s.KeepAliveInstance(pb.KeepAliveInstanceRequest(instance_id=IID[1]))
                await asyncio.sleep(0.3)

        keeper = asyncio.create_task(keep_alive())
        try:
            hashes = chain(1, 4)
            await s.PublishKvEvents(publish(IID[0], 0, stored(hashes)))
            index = c.state.cluster.index
            assert index.block_count(doomed.slot) > 0
            first = await s.Schedule(sched("r1", hashes, session="sess"))
            assert first.decision.instance_id == IID[0]  # the longest prefix match
            assert c.state.cluster.sessions.get("sess").host == doomed.slot  # type: ignore[union-attr]

            async def gone() -> bool:
                return IID[0] not in await listed(s)

            await wait_for(gone, 5.0, message="the lapsed instance leaves ListInstances")
            assert index.block_count(doomed.slot) == 0
            assert index.holders(hashes[0]) == 0
            session = c.state.cluster.sessions.get("sess")
            assert session is not None and session.host == -1
            reply = await s.GetSession(pb.GetSessionRequest(session_id="sess"))
            assert reply.session.host_instance_id == ""
            assert await etcd_instance(c, IID[0]) is None
            # The kept-alive instance stays, and the session rebinds to it on its next turn.
            assert IID[1] in await listed(s)
            assert not keeper.done()
            nxt = await s.Schedule(sched("r2", hashes, session="sess"))
            assert nxt.decision.instance_id == IID[1]
            assert c.state.cluster.sessions.get("sess").host == kept.slot  # type: ignore[union-attr]
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


# ---- 3. KV events ----------------------------------------------------------------------


async def test_kv_events_sequence_resume_and_resync(start_conductor: Start) -> None:
    c = await start_conductor()
    index = c.state.cluster.index
    async with stub(c.url) as s:
        await register(s, 0)
        target = await register(s, 1)
        iid, slot = IID[1], target.slot
        a, b = chain(1, 3), chain(2, 3)
        r0 = await s.PublishKvEvents(publish(iid, 0, stored(a)))
        assert r0.next_sequence == 1
        r1 = await s.PublishKvEvents(publish(iid, 1, stored(b)))
        assert r1.next_sequence == 2
        assert index.block_count(slot) == 6
        assert all(index.holders(h) == 1 << slot for h in a + b)

        before = (len(index), index.block_count(slot), c.state.instances[iid].next_sequence)
        # A batch from the past is refused whole, naming where to resume.
        err = await refused(
            s.PublishKvEvents(publish(iid, 1, stored(chain(3, 2)))), grpc.StatusCode.OUT_OF_RANGE
        )
        assert trailer(err, "kvsched-next-sequence") == "2"
        # So is a gap.
        err = await refused(
            s.PublishKvEvents(publish(iid, 5, stored(chain(4, 2)))), grpc.StatusCode.OUT_OF_RANGE
        )
        assert trailer(err, "kvsched-next-sequence") == "2"
        assert (len(index), index.block_count(slot), c.state.instances[iid].next_sequence) == before
        assert index.holders(chain(3, 1)[0]) == 0 and index.holders(chain(4, 1)[0]) == 0
        assert (await listed(s))[iid].next_event_sequence == 2

        # The index holds the blocks: a prompt over them hits that instance.
        placed = await s.Schedule(sched("r1", a))
        assert placed.decision.instance_id == iid
        assert placed.decision.cached_tokens == len(a) * BS

        # A stream applies in order and stops at the first batch out of sequence.
        c_hashes, d_hashes, e_hashes = chain(5, 2), chain(6, 2), chain(7, 2)

        async def batches() -> AsyncIterator[pb.StreamKvEventsRequest]:
            for seq, hashes in ((2, c_hashes), (3, d_hashes), (7, e_hashes)):
                yield pb.StreamKvEventsRequest(batch=batch(iid, seq, stored(hashes)))

        streamed = await s.StreamKvEvents(batches())
        assert streamed.batches_applied == 2
        assert streamed.HasField("resume")
        assert streamed.resume.instance_id == iid
        assert streamed.resume.next_sequence == 4
        assert streamed.resume.reason
        assert all(index.holders(h) == 1 << slot for h in c_hashes + d_hashes)
        assert index.holders(e_hashes[0]) == 0
        assert c.state.instances[iid].next_sequence == 4

        # Resync replaces the instance's whole index; the sequence restarts at the batch's.
        fresh = chain(8, 4)
        r = await s.PublishKvEvents(publish(iid, 40, stored(fresh), resync=True))
        assert r.next_sequence == 41
        assert all(index.holders(h) == 0 for h in a + b + c_hashes + d_hashes)
        assert all(index.holders(h) == 1 << slot for h in fresh)
        assert index.block_count(slot) == len(fresh)  # speculative entries went too
        assert (await listed(s))[iid].gpu_blocks == len(fresh)
        # ...and etcd follows: only the fresh blocks and the new cursor remain.
        prefix = keys.blocks_prefix(iid).encode()

        async def persisted() -> bool:
            kvs = await c.store.get_prefix(prefix)
            held = {keys.parse_block_key(kv.key.decode())[2] for kv in kvs}
            cursor = await c.store.get(keys.cursor_key(iid).encode())
            return held == set(fresh) and cursor is not None and cursor.value == b"41"

        await wait_for(persisted, 5.0, message="etcd holds exactly the resynced blocks")


# ---- 4. bad input ----------------------------------------------------------------------


Call = Callable[["ConductorServiceAsyncStub"], Awaitable[object]]


@dataclass(frozen=True)
class BadInput:
    """A call the Conductor must refuse: with `code`, saying `fragment` in its details;
    made once an instance is registered, holds blocks and has a request in flight (`served`),
    or on an empty Conductor."""

    call: Call
    code: grpc.StatusCode
    fragment: str
    served: bool = True


def spec_without_id() -> pb.InstanceSpec:
    spec = instance(0)
    spec.instance_id = ""
    return spec


SERVED = chain(1, 4)  # the served setup's blocks and its request's prompt
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
BAD_INPUTS: dict[str, BadInput] = {
    "placement before any instance registered": BadInput(
        lambda s: s.Schedule(sched("r0", chain(1, 2))),
        grpc.StatusCode.UNAVAILABLE,
        "no instance is registered",
        served=False,
    ),
    "registering with no role": BadInput(
        lambda s: s.RegisterInstance(pb.RegisterInstanceRequest(spec=instance(0, role=0))),
        INVALID,
        "role must be",
        served=False,
    ),
    "registering with no id": BadInput(
        lambda s: s.RegisterInstance(pb.RegisterInstanceRequest(spec=spec_without_id())),
        INVALID,
        "instance_id is required",
        served=False,
    ),
    "a bad tier after a good event: the whole batch": BadInput(
        lambda s: s.PublishKvEvents(
            publish(
                IID[0], 1, stored(chain(2, 2)), stored(chain(3, 2), tier=common.TIER_UNSPECIFIED)
            )
        ),
        INVALID,
        "tier must be",
    ),
    "placement with no request id": BadInput(
        lambda s: s.Schedule(sched("", SERVED, session="new")), INVALID, "request_id is required"
    ),
    "placement of an empty prompt": BadInput(
        lambda s: s.Schedule(sched("r-zero", [], prompt=0, session="new")),
        INVALID,
        "prompt_tokens must be positive",
    ),
    "placement of a prompt without its hashes": BadInput(
        lambda s: s.Schedule(sched("r-nohash", [], prompt=100, session="new")),
        INVALID,
        "block_hashes is empty",
    ),
    "placement with more hashes than the prompt has blocks": BadInput(
        lambda s: s.Schedule(sched("r-many", chain(4, 8), prompt=100, session="new")),
        INVALID,
        "at most 7",
    ),
    "placement of a prompt longer than the model's context": BadInput(
        lambda s: s.Schedule(sched("r-long", chain(5, 8), prompt=131_073, session="new")),
        INVALID,
        "exceeds the limit of 131072",
    ),
    "events of an unknown instance": BadInput(
        lambda s: s.PublishKvEvents(publish("nobody", 0, stored(chain(6, 2)))),
        NOT_FOUND,
        "unknown instance 'nobody'",
    ),
    "an unknown session": BadInput(
        lambda s: s.GetSession(pb.GetSessionRequest(session_id="nobody")),
        NOT_FOUND,
        "unknown session 'nobody'",
    ),
    "finishing on an unknown instance": BadInput(
        lambda s: s.Finish(pb.FinishRequest(request_id="ok", instance_id="nobody", ok=True)),
        NOT_FOUND,
        "unknown instance 'nobody'",
    ),
    "the outcome of an unknown transfer": BadInput(
        lambda s: s.ReportTransfer(pb.ReportTransferRequest(transfer_id="nope")),
        NOT_FOUND,
        "unknown or already reported transfer 'nope'",
    ),
    "keeping an unknown instance alive": BadInput(
        lambda s: s.KeepAliveInstance(pb.KeepAliveInstanceRequest(instance_id="nobody")),
        NOT_FOUND,
        "unknown instance 'nobody'",
    ),
    "deregistering an unknown instance": BadInput(
        lambda s: s.DeregisterInstance(pb.DeregisterInstanceRequest(instance_id="nobody")),
        NOT_FOUND,
        "unknown instance 'nobody'",
    ),
    "a policy that does not exist": BadInput(
        lambda s: s.SetPolicy(pb.SetPolicyRequest(spec="nonsense")),
        INVALID,
        "unknown policy 'nonsense'",
    ),
}


async def conductor_state(c: Conductor, s: ConductorServiceAsyncStub) -> tuple[object, ...]:
    """What a refused call must leave as it was: what the Conductor serves, holds and wrote
    to etcd."""
    state = c.state
    cluster = state.cluster
    index = cluster.index
    listing = await s.ListInstances(pb.ListInstancesRequest())
    policy = await s.GetPolicy(pb.GetPolicyRequest())
    known = cluster.sessions.get("known")
    return (
        listing.SerializeToString(deterministic=True),
        policy.spec,
        state.scheduler.spec,
        {iid: inst.next_sequence for iid, inst in state.instances.items()},
        len(index),
        tuple(index.block_count(slot) for slot in range(cluster.n)),
        index.pending_count(),
        len(cluster.sessions),
        (known.host, known.turns) if known is not None else None,
        tuple(cluster.load.in_flight),
        [(kv.key, kv.value) for kv in await c.store.get_prefix(keys.INSTANCES.encode())],
        await c.store.get(keys.POLICY.encode()),
    )


@pytest.mark.parametrize("bad", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
async def test_bad_input_is_refused_with_the_right_code_and_changes_nothing(
    start_conductor: Start, bad: BadInput
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        if bad.served:
            inst = await register(s, 0)
            await s.PublishKvEvents(publish(IID[0], 0, stored(SERVED)))
            await s.Schedule(sched("ok", SERVED, session="known"))
        before = await conductor_state(c, s)
        err = await refused(bad.call(s), bad.code)
        assert bad.fragment in (err.details() or "")
        assert await conductor_state(c, s) == before
        if bad.served:
            # The request in flight before the refusal finishes for real.
            done = pb.FinishRequest(
                request_id="ok", instance_id=IID[0], session_id="known", ok=True
            )
            await s.Finish(done)
            assert float(c.state.cluster.load.in_flight[inst.slot]) == 0


# ---- 5. standby ------------------------------------------------------------------------


async def test_standby_refuses_writes_naming_the_leader_and_serves_reads(
    start_conductor: Start,
) -> None:
    c1 = await start_conductor(conductor_id="c1")
    c2 = await start_conductor(conductor_id="c2", lead=False)
    async with stub(c1.url) as s1, stub(c2.url) as s2:

        async def knows_leader() -> bool:
            reply = await s2.GetLeader(pb.GetLeaderRequest())
            return reply.leader_id == "c1"

        await wait_for(knows_leader, 5.0, message="the standby learns who leads")
        leader = await s2.GetLeader(pb.GetLeaderRequest())
        assert leader.self_id == "c2"
        assert not leader.is_leader
        assert leader.leader_url == c1.url
        assert leader.leader_http_url == c1.http_url
        assert not c2.serving

        async def stream_one() -> Any:
            call = s2.ScheduleStream()  # type: ignore[call-arg]  # the write/read API
            await call.write(pb.ScheduleStreamRequest(schedule=sched("r", chain(1, 2))))
            return await call.read()

        writes: list[Awaitable[object]] = [
            s2.RegisterInstance(pb.RegisterInstanceRequest(spec=instance(0), lease_ttl=LONG_LEASE)),
            s2.KeepAliveInstance(pb.KeepAliveInstanceRequest(instance_id=IID[0])),
            s2.DeregisterInstance(pb.DeregisterInstanceRequest(instance_id=IID[0])),
            s2.PublishKvEvents(publish(IID[0], 0, stored(chain(1, 2)))),
            s2.Schedule(sched("r", chain(1, 2))),
            s2.Finish(pb.FinishRequest(request_id="r", instance_id=IID[0])),
            s2.ReportTransfer(pb.ReportTransferRequest(transfer_id="t")),
            s2.SetPolicy(pb.SetPolicyRequest(spec="least_loaded")),
            stream_one(),
        ]
        for write in writes:
            err = await refused(write, grpc.StatusCode.FAILED_PRECONDITION)
            assert trailer(err, "kvsched-leader") == c1.url
        assert c2.state.instances == {}
        assert await listed(s1) == {}

        # Reads work on the standby, and it learns what the leader does.
        assert await listed(s2) == {}
        inst = await register(s1, 0)
        hashes = chain(2, 3)
        await s1.PublishKvEvents(publish(IID[0], 0, stored(hashes)))

        async def learned() -> bool:
            shown = await listed(s2)
            return IID[0] in shown and shown[IID[0]].slot == inst.slot

        await wait_for(learned, 5.0, message="the standby learns the registration")
        await wait_for(
            lambda: (
                all(c2.state.cluster.index.holders(h) == 1 << inst.slot for h in hashes)
                and c2.state.instances[IID[0]].next_sequence == 1
            ),
            5.0,
            message="the standby learns the blocks and the cursor",
        )
        explained = await s2.Explain(pb.ExplainRequest(block_hashes=hashes))
        assert explained.decision.instance_id == IID[0]
        await s1.Schedule(sched("r1", hashes, session="sess"))

        async def session_seen() -> bool:
            try:
                reply = await s2.GetSession(pb.GetSessionRequest(session_id="sess"))
            except grpc.aio.AioRpcError:
                return False
            return reply.session.host_instance_id == IID[0] and reply.session.turns == 1

        await wait_for(session_seen, 5.0, message="the standby learns the session binding")
        assert (await s2.GetPolicy(pb.GetPolicyRequest())).spec == "cache_aware"


# ---- 6. runtime policy change ----------------------------------------------------------


async def test_set_policy_is_recorded_followed_and_used(start_conductor: Start) -> None:
    c1 = await start_conductor(conductor_id="c1")
    c2 = await start_conductor(conductor_id="c2", lead=False)
    async with stub(c1.url) as s:
        await register(s, 0)
        await register(s, 1)
        before = await s.Schedule(sched("r0", chain(1, 2)))
        assert before.decision.policy == "cache_aware"
        reply = await s.SetPolicy(pb.SetPolicyRequest(spec="least_loaded"))
        assert reply.previous_spec == "cache_aware"
        assert reply.spec == "least_loaded"
        policy = await s.GetPolicy(pb.GetPolicyRequest())
        assert policy.spec == "least_loaded"
        assert "least_loaded" in policy.available and "cache_aware" in policy.available
        recorded = await c1.store.get(keys.POLICY.encode())
        assert recorded is not None and recorded.value == b"least_loaded"
        await wait_for(
            lambda: c2.state.scheduler.spec == "least_loaded",
            5.0,
            message="the standby follows the policy",
        )
        for i in range(3):
            placed = await s.Schedule(sched(f"r{i + 1}", chain(i + 2, 2)))
            assert placed.decision.policy == "least_loaded"
            assert placed.decision.rule == "fewest pending prefill tokens"
    async with stub(c2.url) as s2:
        assert (await s2.GetPolicy(pb.GetPolicyRequest())).spec == "least_loaded"


# ---- 7. idempotency --------------------------------------------------------------------


async def test_schedule_retry_gets_the_same_decision_and_charges_once(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        for i in range(3):
            await register(s, i)
        request = sched("same", chain(1, 4), session="sess")
        first = await s.Schedule(request)
        second = await s.Schedule(request)
        assert first.decision.instance_id
        assert first.SerializeToString(deterministic=True) == second.SerializeToString(
            deterministic=True
        )
        call = s.ScheduleStream()  # type: ignore[call-arg]  # the write/read API
        await call.write(pb.ScheduleStreamRequest(schedule=request))
        third = await call.read()
        await call.done_writing()
        assert isinstance(third, pb.ScheduleStreamResponse)
        assert third.decision == first.decision
        shown = await listed(s)
        flights = {iid: st.in_flight for iid, st in shown.items()}
        assert flights[first.decision.instance_id] == 1
        assert sum(flights.values()) == 1
        session = await s.GetSession(pb.GetSessionRequest(session_id="sess"))
        assert session.session.turns == 1
        assert session.session.host_instance_id == first.decision.instance_id


# ---- 8. warm restart -------------------------------------------------------------------


async def test_new_leader_warm_starts_from_etcd(start_conductor: Start) -> None:
    c1 = await start_conductor(conductor_id="c1")
    async with stub(c1.url) as s:
        slots = {IID[i]: (await register(s, i)).slot for i in range(3)}
        sequences = {}
        for n, iid in enumerate(IID[:3]):
            # Two batches each, the second continuing the first's chain.
            hashes = chain(n + 1, 6)
            await s.PublishKvEvents(publish(iid, 0, stored(hashes[:3])))
            reply = await s.PublishKvEvents(publish(iid, 1, stored(hashes[3:], parent=hashes[2])))
            sequences[iid] = reply.next_sequence
        # A CPU-tier chain too.
        await s.PublishKvEvents(publish(IID[0], 2, stored(chain(9, 2), tier=common.TIER_CPU)))
        sequences[IID[0]] = 3
        index = c1.state.cluster.index
        reported = {
            iid: {tier: len(index.blocks_of(slot, tier)) for tier in Tier}
            for iid, slot in slots.items()
        }
        assert reported[IID[0]][Tier.GPU] == 6 and reported[IID[0]][Tier.CPU] == 2
        hosts = {}
        for n in range(3):
            sid = f"sess-{n}"
            placed = await s.Schedule(sched(f"r{n}", chain(n + 1, 6), session=sid))
            hosts[sid] = placed.decision.instance_id
        assert set(hosts.values()) == set(IID[:3])  # each session follows its prefix
        await s.SetPolicy(pb.SetPolicyRequest(spec="least_loaded"))
        turns = {sid: c1.state.cluster.sessions.get(sid).turns for sid in hosts}  # type: ignore[union-attr]
    await c1.stop()

    c2 = await start_conductor(conductor_id="c2")
    assert c2.serving
    state = c2.state
    async with stub(c2.url) as s:
        leader = await s.GetLeader(pb.GetLeaderRequest())
        assert leader.is_leader and leader.leader_id == "c2"
        shown = await listed(s)
        assert {iid: st.slot for iid, st in shown.items()} == slots
        for iid, slot in slots.items():
            counts = {tier: len(state.cluster.index.blocks_of(slot, tier)) for tier in Tier}
            assert counts == reported[iid], iid
            assert state.cluster.index.block_count(slot) == reported[iid][Tier.GPU]
            assert shown[iid].next_event_sequence == sequences[iid]
        for sid, host in hosts.items():
            session = (await s.GetSession(pb.GetSessionRequest(session_id=sid))).session
            assert session.host_instance_id == host, sid
            assert session.turns == turns[sid]
        assert (await s.GetPolicy(pb.GetPolicyRequest())).spec == "least_loaded"
        # The engines go on where they were, without re-sending anything.
        for iid, seq in sequences.items():
            reply = await s.PublishKvEvents(publish(iid, seq, stored(chain(20, 1))))
            assert reply.next_sequence == seq + 1
        placed = await s.Schedule(sched("again", chain(2, 6), session="sess-1"))
        assert placed.decision.policy == "least_loaded"


async def test_an_idle_session_is_forgotten_after_its_ttl_by_leader_etcd_and_standby(
    start_conductor: Start,
) -> None:
    now = [1000.0]  # policy time, driven here; the sweep runs every 60 × 0.01 / 10 wall s
    c1 = await start_conductor(
        conductor_id="c1", clock=lambda: now[0], session_ttl_s=60, time_scale=0.01
    )
    c2 = await start_conductor(conductor_id="c2", lead=False)
    async with stub(c1.url) as s:
        await register(s, 0)
        for sid, finished_at in (("idle", 1000.0), ("kept", 1050.0)):
            await s.Schedule(sched(f"r-{sid}", chain(1, 4), session=sid))
            now[0] = finished_at
            done = pb.FinishRequest(request_id=f"r-{sid}", instance_id=IID[0], session_id=sid)
            await s.Finish(done)
        now[0] = 1050.0

        def standby_has(*sids: str) -> bool:
            held = c2.state.cluster.sessions
            return all(held.get(sid) is not None for sid in sids) and len(held) == len(sids)

        await wait_for(lambda: standby_has("idle", "kept"), 5.0, message="the standby follows")
        assert c1.forget_idle_sessions() == 0  # 50 s idle of 60: nothing yet
        now[0] = 1060.0  # "idle" has been idle exactly its TTL, "kept" 10 s

        def leader_forgot() -> bool:
            return c1.state.cluster.sessions.get("idle") is None

        await wait_for(leader_forgot, 5.0, message="the sweep forgets the idle session")
        assert c1.state.cluster.sessions.get("kept") is not None

        async def etcd_sessions() -> list[str]:
            kvs = await c1.store.get_prefix(keys.SESSIONS.encode())
            return [keys.tail(kv.key.decode(), keys.SESSIONS) for kv in kvs]

        async def etcd_forgot() -> bool:
            return await etcd_sessions() == ["kept"]

        await wait_for(etcd_forgot, 5.0, message="its etcd binding is deleted")
        await wait_for(lambda: standby_has("kept"), 5.0, message="the standby forgets it too")
        forgotten = c1.metrics.registry.get_sample_value(
            "kvsched_conductor_sessions_forgotten_total"
        )
        assert forgotten == 1.0
        await refused(
            s.GetSession(pb.GetSessionRequest(session_id="idle")), grpc.StatusCode.NOT_FOUND
        )
        # Its next turn starts it afresh.
        await s.Schedule(sched("r-again", chain(1, 4), session="idle"))
        assert c1.state.cluster.sessions.get("idle").turns == 1  # type: ignore[union-attr]


async def test_a_tenants_new_session_past_its_cap_forgets_its_idle_one_in_etcd_too(
    start_conductor: Start,
) -> None:
    c1 = await start_conductor(conductor_id="c1", max_sessions_per_tenant=2)
    async with stub(c1.url) as s:
        await register(s, 0)
        for i, sid in enumerate(["acme/a", "acme/b", "globex/a", "acme/c"]):
            await s.Schedule(sched(f"r-{i}", chain(1, 4), session=sid))
            done = pb.FinishRequest(request_id=f"r-{i}", instance_id=IID[0], session_id=sid)
            await s.Finish(done)

        async def etcd_sessions() -> list[str]:
            kvs = await c1.store.get_prefix(keys.SESSIONS.encode())
            return sorted(keys.tail(kv.key.decode(), keys.SESSIONS) for kv in kvs)

        async def etcd_evicted() -> bool:
            return await etcd_sessions() == ["acme/b", "acme/c", "globex/a"]

        await wait_for(etcd_evicted, 5.0, message="acme's oldest binding is deleted")
        assert c1.state.cluster.sessions.get("acme/a") is None
        evicted = c1.metrics.registry.get_sample_value("kvsched_conductor_sessions_evicted")
        assert evicted == 1.0


def test_the_cap_per_tenant_is_a_flag() -> None:
    assert parse_settings(["--insecure"]).max_sessions_per_tenant == 100_000
    assert (
        parse_settings(["--insecure", "--max-sessions-per-tenant", "5"]).max_sessions_per_tenant
        == 5
    )
    with pytest.raises(SystemExit):
        parse_settings(["--insecure", "--max-sessions-per-tenant", "-1"])


# ---- 9. placement stream ---------------------------------------------------------------


async def test_schedule_stream_answers_every_item_and_survives_an_error(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
        call = s.ScheduleStream()  # type: ignore[call-arg]  # the write/read API
        requests = {}
        for n in range(50):
            rid = f"r{n}"
            sid = f"sess-{n % 5}" if n % 2 else ""  # some answers wait for etcd
            requests[rid] = sched(rid, chain(n % 7 + 1, 3), session=sid)
            await call.write(pb.ScheduleStreamRequest(schedule=requests[rid]))
        bad = pb.ScheduleRequest(request_id="bad", prompt_tokens=0)
        await call.write(pb.ScheduleStreamRequest(schedule=bad))
        answers: dict[str, pb.ScheduleStreamResponse] = {}
        for _ in range(51):
            answer = await call.read()
            assert isinstance(answer, pb.ScheduleStreamResponse)
            assert answer.request_id not in answers
            answers[answer.request_id] = answer
        assert set(answers) == {*requests, "bad"}
        assert answers["bad"].WhichOneof("outcome") == "error"
        assert answers["bad"].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
        assert answers["bad"].error.message
        for rid in requests:
            assert answers[rid].WhichOneof("outcome") == "decision", answers[rid]
            assert answers[rid].decision.request_id == rid
            assert answers[rid].decision.instance_id in IID[:2]
        load = c.state.cluster.load
        assert float(load.in_flight.sum()) == 50

        # A completion on the same stream.
        first = answers["r0"].decision
        finish = pb.FinishRequest(
            request_id="r0",
            instance_id=first.instance_id,
            prompt_tokens=requests["r0"].prompt_tokens,
            output_tokens=10,
            ok=True,
        )
        await call.write(pb.ScheduleStreamRequest(finish=finish))
        done = await call.read()
        assert isinstance(done, pb.ScheduleStreamResponse)
        assert done.request_id == "r0" and done.WhichOneof("outcome") == "finished"
        assert float(load.in_flight.sum()) == 49  # (a fresh array: the property copies)

        # The stream is still usable after the error.
        await call.write(pb.ScheduleStreamRequest(schedule=sched("after", chain(1, 3))))
        after = await call.read()
        assert isinstance(after, pb.ScheduleStreamResponse)
        assert after.request_id == "after" and after.WhichOneof("outcome") == "decision"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
        assert await call.code() == grpc.StatusCode.OK
        for n in range(1, 50, 2):
            session = c.state.cluster.sessions.get(f"sess-{n % 5}")
            assert session is not None and session.host >= 0


# ---- 10. explain -----------------------------------------------------------------------


async def test_explain_shows_every_candidate_and_changes_nothing(start_conductor: Start) -> None:
    c = await start_conductor()
    state = c.state
    async with stub(c.url) as s:
        for i in range(3):
            await register(s, i)
        hashes = chain(1, 6)
        await s.PublishKvEvents(publish(IID[2], 0, stored(hashes)))
        index_before = (len(state.cluster.index), state.cluster.index.pending_count())
        reply = await s.Explain(
            pb.ExplainRequest(block_hashes=hashes, output_tokens=8, session_id="peek")
        )
        assert not reply.rejected
        d = reply.decision
        assert d.instance_id == IID[2]
        assert d.cached_tokens == len(hashes) * BS
        assert d.rule and d.policy == "cache_aware"
        assert {cand.instance_id for cand in d.candidates} == set(IID[:3])
        assert len(d.candidates) == 3
        assert [cand.instance_id for cand in d.candidates if cand.chosen] == [IID[2]]
        for cand in d.candidates:
            assert "ttft_s" in cand.terms and "hit_tokens" in cand.terms
            expected_hit = len(hashes) * BS if cand.instance_id == IID[2] else 0
            assert cand.terms["hit_tokens"] == expected_hit
        ttfts = [cand.terms["ttft_s"] for cand in d.candidates]
        assert ttfts == sorted(ttfts)  # best first

        # Nothing changed.
        assert all(st.in_flight == 0 for st in (await listed(s)).values())
        assert (len(state.cluster.index), state.cluster.index.pending_count()) == index_before
        assert len(state.cluster.sessions) == 0
        await refused(
            s.GetSession(pb.GetSessionRequest(session_id="peek")), grpc.StatusCode.NOT_FOUND
        )
        placed = await s.Schedule(sched("real", hashes, session="peek"))
        assert placed.decision.instance_id == d.instance_id
        assert placed.decision.rule == d.rule

        # Token ids are hashed by the Conductor: the same prompt as hashes or tokens agrees.
        tokens = list(range(3 * BS + 5))
        by_tokens = await s.Explain(pb.ExplainRequest(token_ids=tokens))
        assert len(by_tokens.decision.candidates) == 3
        # Neither hashes nor tokens, or both: invalid.
        await refused(s.Explain(pb.ExplainRequest()), grpc.StatusCode.INVALID_ARGUMENT)
        await refused(
            s.Explain(pb.ExplainRequest(block_hashes=hashes, token_ids=tokens)),
            grpc.StatusCode.INVALID_ARGUMENT,
        )


# ---- 11. tracing -----------------------------------------------------------------------

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7


async def test_schedule_span_reaches_the_collector_with_decision_attributes(
    etcd: EtcdServer, otlp_receiver: OtlpReceiver
) -> None:
    provider = setup_tracing(TelemetrySettings("kvsched-conductor", otlp_receiver.endpoint))
    c = Conductor(settings(etcd), tracer_provider=provider)
    try:
        await c.start()
        await wait_for(lambda: c.serving, 5.0, message="conductor leads")
        async with stub(c.url) as s:
            await register(s, 0)
            await register(s, 1)
            hashes = chain(1, 4)
            await s.PublishKvEvents(publish(IID[1], 0, stored(hashes)))
            parent = NonRecordingSpan(
                SpanContext(
                    trace_id=TRACE_ID,
                    span_id=PARENT_SPAN_ID,
                    is_remote=False,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
            )
            metadata = inject_metadata(context=trace.set_span_in_context(parent))
            assert any(k == "traceparent" for k, _ in metadata)
            placed = await s.Schedule(sched("traced", hashes), metadata=metadata)
        assert await asyncio.to_thread(provider.force_flush)
        span = await otlp_receiver.wait_for_span(
            "kvsched.conductor.v1.ConductorService/Schedule",
            kind="SERVER",
            where=lambda sp: sp.trace_id == f"{TRACE_ID:032x}",
        )
        assert span.parent_span_id == f"{PARENT_SPAN_ID:016x}"
        assert span.service_name == "kvsched-conductor"
        assert span.status_code != "ERROR"
        attrs = span.attributes
        assert attrs["kvsched.instance"] == placed.decision.instance_id == IID[1]
        assert attrs["kvsched.policy"] == "cache_aware"
        assert attrs["kvsched.cached_tokens"] == placed.decision.cached_tokens == len(hashes) * BS
        assert isinstance(attrs["kvsched.cost.ttft_s"], float)
        assert attrs["kvsched.cost.ttft_s"] > 0
        assert attrs["rpc.grpc.status_code"] == 0
    finally:
        await c.stop(0)
        await asyncio.to_thread(shutdown_tracing, provider)


# ---- leases and terms ------------------------------------------------------------------


async def test_reregistering_keeps_the_instances_blocks_and_cursor(start_conductor: Start) -> None:
    c1 = await start_conductor(conductor_id="c1")
    c2 = await start_conductor(conductor_id="c2", lead=False)
    async with stub(c1.url) as s:
        first = await register(s, 0, ttl=Duration(seconds=1))
        hashes = chain(1, 3)
        await s.PublishKvEvents(publish(IID[0], 0, stored(hashes)))
        # The engine re-registers under its id (e.g. after a restart of its agent).
        again = await register(s, 0)
        assert again.slot == first.slot
        slot = first.slot
        await wait_for(
            lambda: all(c2.state.cluster.index.holders(h) == 1 << slot for h in hashes),
            5.0,
            message="the standby learns the blocks",
        )

        async def first_lease_gone() -> bool:
            return again.lease_id == first.lease_id or await c1.store.lease_ttl(first.lease_id) < 0

        await wait_for(first_lease_gone, 5.0, message="the first lease is gone")
        assert await etcd_instance(c1, IID[0]) is not None
        kvs = await c1.store.get_prefix(keys.blocks_prefix(IID[0]).encode())
        assert {keys.parse_block_key(kv.key.decode())[2] for kv in kvs} == set(hashes)
        cursor = await c1.store.get(keys.cursor_key(IID[0]).encode())
        assert cursor is not None and cursor.value == b"1"
        assert all(c2.state.cluster.index.holders(h) == 1 << slot for h in hashes)
        assert c2.state.instances[IID[0]].next_sequence == 1


async def test_leader_that_lost_its_lease_serves_from_the_rebuilt_state(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        await register(s, 0)
        old_state = c.state
        leader = await c.store.get(keys.LEADER.encode())
        assert leader is not None
        await c.store.revoke_lease(leader.lease)  # as if the leader's lease lapsed
        await wait_for(lambda: c.state is not old_state, 5.0, message="it steps down, rebuilt")
        await wait_for(lambda: c.serving, 5.0, message="it leads again")
        assert IID[0] in c.state.instances  # rebuilt from etcd
        inst = await register(s, 1)
        hashes = chain(1, 2)
        await s.PublishKvEvents(publish(IID[1], 0, stored(hashes)))
        assert set(await listed(s)) == set(c.state.instances) == set(IID[:2])
        assert c.state.cluster.index.holders(hashes[0]) == 1 << inst.slot

        async def persisted() -> bool:
            kvs = await c.store.get_prefix(keys.blocks_prefix(IID[1]).encode())
            return len(kvs) == len(hashes)

        await wait_for(persisted, 2.0, message="the new blocks reach etcd")


async def test_losing_etcd_gives_clear_errors_and_the_conductor_keeps_answering(
    start_conductor: Start, etcd: EtcdServer
) -> None:
    c = await start_conductor(policy="sticky")
    async with stub(c.url) as s:
        await register(s, 0)
        await register(s, 1)
        etcd.kill()
        # Writes that need etcd fail with a status a person can act on; depending on how soon
        # the leader notices its lease cannot be kept alive, the answer is UNAVAILABLE (etcd
        # did not take the binding) or FAILED_PRECONDITION (it stepped down).
        expected = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.Schedule(sched("needs-etcd", chain(7, 2), session="new-session"))
        assert info.value.code() in expected, info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.RegisterInstance(pb.RegisterInstanceRequest(spec=instance(2)))
        assert info.value.code() in expected, info.value.details()
        # It steps down (its lease cannot be renewed) and keeps answering reads.
        await wait_for(lambda: not c.serving, 5.0, message="the leader steps down")
        leader = await s.GetLeader(pb.GetLeaderRequest())
        assert not leader.is_leader
        assert set(await listed(s)) == {IID[0], IID[1]}


async def test_an_overloaded_cluster_rejects_with_a_retry_delay(start_conductor: Start) -> None:
    c = await start_conductor(policy="elastic")
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
            busy = common.LoadReport(
                pending_prefill_tokens=200_000, pending_prefill=Duration(seconds=10), waiting=40
            )
            await s.PublishKvEvents(publish(IID[i], 0, pb.KvEvent(load=busy)))
        before = dict(await listed(s))
        err = await refused(
            s.Schedule(sched("late", chain(3, 4))), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        retry_ms = int(trailer(err, "retry-after-ms") or 0)
        assert 7_000 <= retry_ms <= 10_000  # about the excess over the 2 s objective
        assert "SLO" in (err.details() or "")
        assert dict(await listed(s)) == before  # nothing charged
    async with ConductorClient([c.url], deadline_s=2.0) as py:
        with pytest.raises(Rejected) as rejected:
            await py.schedule(sched("late-again", chain(3, 4)))
        assert rejected.value.retry_after_s == pytest.approx(retry_ms / 1000, rel=0.05)
        async with py.placement_stream() as stream:
            with pytest.raises(Rejected) as on_stream:
                await stream.schedule(sched("late-on-stream", chain(3, 4)))
        assert on_stream.value.retry_after_s == pytest.approx(retry_ms / 1000, rel=0.05)
