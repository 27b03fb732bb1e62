"""Parity: one trace replayed through the simulator twice, once deciding in process and once
asking a live Conductor over gRPC (same seed, the Conductor's clock injected from the
simulator's), gives identical decisions."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from kvsched.core.cluster import ClusterConfig
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferPlan
from kvsched.core.events import KvEvent
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.sim.prepare import PreparedTrace, prepare
from kvsched.sim.records import ReplayConfig
from kvsched.sim.replay import Replay
from kvsched.sim.traces import transform
from services.common.serving import durations
from services.conductor import instance_messages, placement_messages
from services.conductor.app import Conductor
from services.kv_events.messages import event_message
from tests.conductor.conftest import settings
from tests.conftest import SLICES
from tests.fixtures.etcd import EtcdServer

KINDS = {value: kind for kind, value in placement_messages.KINDS.items()}
ROLES = instance_messages.ROLE_VALUES


@dataclass
class Clock:
    """The Conductor's clock, set by the simulator before each call."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class RemoteScheduler:
    """A `SchedulerPort` that asks a live Conductor. KV events and load reports are buffered
    per instance and published (in order) before the next decision, as a Messenger would."""

    def __init__(self, stub: pb_grpc.ConductorServiceStub, clock: Clock, ids: Sequence[str]):
        self.stub = stub
        self.clock = clock
        self.ids = list(ids)
        self.slots = {iid: slot for slot, iid in enumerate(ids)}
        self.pending: dict[int, list[pb.KvEvent]] = defaultdict(list)
        self.sequence = [0] * len(ids)
        # Placements go over one long-lived stream, as a Router's do.
        self.requests: queue.Queue[pb.ScheduleStreamRequest | None] = queue.Queue()
        stream = stub.ScheduleStream(iter(self.requests.get, None))
        self.answers: Iterator[pb.ScheduleStreamResponse] = iter(stream)

    def close(self) -> None:
        self._flush()
        self.requests.put(None)
        for _ in self.answers:
            pass

    def _flush(self) -> None:
        for slot, events in self.pending.items():
            if not events:
                continue
            batch = pb.KvEventBatch(
                instance_id=self.ids[slot], sequence=self.sequence[slot], events=events
            )
            reply = self.stub.PublishKvEvents(pb.PublishKvEventsRequest(batch=batch))
            self.sequence[slot] = reply.next_sequence
        self.pending.clear()

    def _at(self, now: float) -> None:
        self._flush()
        self.clock.now = now

    def place(self, req: RequestInfo, now: float) -> Decision:
        self._at(now)
        request = pb.ScheduleRequest(
            request_id=str(req.request_id),
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
            block_hashes=req.block_hashes,
            session_id=req.session_id or "",
        )
        self.requests.put(pb.ScheduleStreamRequest(schedule=request))
        answer = next(self.answers)
        assert answer.request_id == request.request_id
        if answer.HasField("rejection"):
            r = answer.rejection
            ttft = durations.seconds(r.estimated_ttft)
            return Decision(req.request_id, -1, -1, 0, 0, ttft, r.rule, rejected=True)
        d = answer.decision
        return Decision(
            request_id=req.request_id,
            instance=self.slots[d.instance_id],
            decode_instance=self.slots[d.decode_instance_id],
            cached_tokens=d.cached_tokens,
            fetched_tokens=d.fetched_tokens,
            estimated_ttft_s=durations.seconds(d.estimated_ttft),
            rule=d.rule,
            transfers=tuple(self._plan(t) for t in d.transfers),
        )

    def _plan(self, t: common.TransferPlan) -> TransferPlan:
        return TransferPlan(
            kind=KINDS[t.kind],
            source=self.slots[t.source_instance_id],
            target=self.slots[t.target_instance_id],
            block_hashes=tuple(t.block_hashes),
            skip_blocks=t.skip_blocks,
            tokens=t.tokens,
            nbytes=t.bytes,
            est_seconds=durations.seconds(t.estimated_duration),
            on_critical_path=t.on_critical_path,
            session_id=t.session_id or None,
            request_id=int(t.request_id) if t.request_id else None,
            transfer_id=t.transfer_id,
        )

    def finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        self._at(now)
        reply = self.stub.Finish(
            pb.FinishRequest(
                request_id=str(done.request_id),
                session_id=done.session_id or "",
                instance_id=self.ids[done.instance],
                decode_instance_id=self.ids[done.decode_instance],
                prompt_tokens=done.prompt_tokens,
                output_tokens=done.output_tokens,
                cached_tokens=done.cached_tokens,
                block_hashes=done.block_hashes,
                time_to_first_token=durations.duration(done.first_token_at - done.arrival),
                end_to_end=durations.duration(done.finished_at - done.arrival),
                ok=done.ok,
            )
        )
        return [self._plan(t) for t in reply.transfers]

    def transfer_done(self, transfer_id: str, ok: bool, now: float) -> bool:
        self._at(now)
        reply = self.stub.ReportTransfer(pb.ReportTransferRequest(transfer_id=transfer_id, ok=ok))
        return reply.session_moved

    def apply(self, slot: int, events: Sequence[KvEvent]) -> None:
        pending = self.pending[slot]
        for event in events:
            if isinstance(event, LoadReport):  # only the latest load counts
                pending[:] = [e for e in pending if not e.HasField("load")]
            pending.append(event_message(event))


@pytest.fixture
def conductor_thread(etcd: EtcdServer) -> Iterator[Any]:
    """Start Conductors on an event loop of their own, so the simulator can block on gRPC."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    started: list[Conductor] = []

    def start(config: ClusterConfig, policy: str, seed: int, clock: Clock) -> Conductor:
        s = settings(
            etcd,
            policy=policy,
            seed=seed,
            max_instances=config.n_instances,
            block_size=config.block_size,
            model=config.model,
            latency_profile=config.latency_profile,
            kv_capacity_tokens=config.kv_capacity_tokens,
            ttft_slo_s=config.slo.ttft_s,
            tpot_slo_s=config.slo.tpot_s,
            instance_ttl_s=60,
            persist_blocks=False,
            execute_transfers=False,  # the simulator moves the KV and reports each transfer
            # The simulator never forgets a session; a sweep landing mid-trace (the trace's
            # clock runs far ahead of the wall's) could, and then decide otherwise.
            session_ttl_s=0,
            max_sessions=0,
        )

        async def boot() -> Conductor:
            c = Conductor(s, clock=clock)
            await c.start()
            while not c.serving:
                await asyncio.sleep(0.01)
            return c

        c = asyncio.run_coroutine_threadsafe(asyncio.wait_for(boot(), 10), loop).result()
        started.append(c)
        return c

    yield start
    for c in started:
        asyncio.run_coroutine_threadsafe(c.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def decisions(replay: Replay) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for req in replay.reqs:
        d = req.decision
        if d is None:
            rows.append((req.call, "rejected-before-placement"))
            continue
        transfers = tuple(
            (t.kind, t.source, t.target, t.block_hashes, t.skip_blocks, t.on_critical_path)
            for t in d.transfers
        )
        rows.append(
            (
                req.call,
                d.rejected,
                d.instance,
                d.decode_instance,
                d.cached_tokens,
                d.fetched_tokens,
                d.rule,
                round(d.estimated_ttft_s, 6),
                transfers,
            )
        )
    return rows


def weka() -> PreparedTrace:
    trace = transform.load(SLICES / "weka_cc_agentic_sample.jsonl.xz", max_sessions=8)
    return prepare(transform.scale_tokens(transform.cap_gaps(trace, 30.0), 0.25))


def mooncake() -> PreparedTrace:
    return prepare(transform.load(SLICES / "mooncake_conversation_head.jsonl", max_requests=60))


# (policy, trace, closed loop, load): busy enough that a session migrates (elastic) and
# requests are refused and handed off (mooncake).
CASES = {
    "elastic-weka": ("elastic", weka, True, 32.0),
    "cache_aware-mooncake": ("cache_aware", mooncake, False, 4.0),
    "mooncake-mooncake": ("mooncake", mooncake, False, 4.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_live_conductor_makes_the_simulators_decisions(case: str, conductor_thread: Any) -> None:
    spec, load_trace, closed, load = CASES[case]
    prepared = load_trace()
    config = ReplayConfig(
        # KV memory small enough that engines evict: removals are events to agree on too.
        ClusterConfig(n_instances=4, kv_capacity_tokens=65_536),
        seed=7,
        load=load,
        closed_loop=closed,
        keep_decisions=True,
    )
    local = Replay(prepared, spec, config)
    ours_result = local.run()
    cluster = local.cluster.config
    clock = Clock()
    conductor = conductor_thread(cluster, spec, config.seed, clock)
    ids = [f"parity/engine-{slot}" for slot in range(cluster.n_instances)]
    with grpc.insecure_channel(conductor.url) as channel:
        stub = pb_grpc.ConductorServiceStub(channel)
        for slot, iid in enumerate(ids):
            role = ROLES[local.cluster.roles[slot]]
            spec_msg = pb.InstanceSpec(
                instance_id=iid, url=f"http://127.0.0.1:{9000 + slot}", node="n", role=role
            )
            reply = stub.RegisterInstance(pb.RegisterInstanceRequest(spec=spec_msg))
            assert reply.instance.slot == slot
        scheduler = RemoteScheduler(stub, clock, ids)
        remote = Replay(prepared, spec, config, scheduler=scheduler)
        theirs_result = remote.run()
        scheduler.close()
    ours, theirs = decisions(local), decisions(remote)
    assert len(ours) == len(prepared.trace.calls)
    placed = sum(1 for row in ours if row[1] is False)
    assert placed > 0
    assert theirs == ours
    assert theirs_result.migrations.count == ours_result.migrations.count
    assert theirs_result.transfers == ours_result.transfers
    # The KV events built the same index in both: every block on every instance, every tier.
    index, theirs_index = local.cluster.index, conductor.state.cluster.index
    for slot in range(cluster.n_instances):
        for tier in Tier:
            assert sorted(theirs_index.blocks_of(slot, tier)) == sorted(index.blocks_of(slot, tier))
    assert sum(index.block_count(slot) for slot in range(cluster.n_instances)) > 0
    assert sum(engine.cache.evicted_total for engine in local.engines) > 0
    if spec == "elastic":
        assert ours_result.migrations.count > 0  # migrations were exercised
    if spec == "mooncake":
        assert any(row[1] for row in ours)  # rejections were exercised
        assert any(row[8] for row in ours if len(row) > 2)  # transfers were exercised
