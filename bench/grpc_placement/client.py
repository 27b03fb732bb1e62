"""The benchmark's gRPC client: loads the index, then runs the unary and streamed phases,
logging every placement, finish and load report it sends."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING

import grpc
from google.protobuf.duration_pb2 import Duration

from bench.grpc_placement.processes import ConductorProcess, cpu_seconds
from bench.grpc_placement.results import ModeResult, Op
from bench.grpc_placement.workload import Reports, Workload, finish_message, instance_spec
from clients.python.stream_batches import as_message
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

LEASE_S = 3600
MAX_BATCH = 64  # items a batched phase sends in one message at most (the Router's client's)
_MESSAGES = 'kvsched_conductor_placement_stream_messages_total{{direction="{}"}}'


class Bench:
    def __init__(self, stub: ConductorServiceAsyncStub, cond: ConductorProcess, etcd: int):
        self.stub = stub
        self.cond = cond
        self.etcd_pid = etcd
        self.log: list[Op] = []
        self.reports: Reports

    async def wait_leader(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cond.process.poll() is not None:
                raise RuntimeError(f"conductor exited:\n{self.cond.log.read_text()[-3000:]}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                leader = await self.stub.GetLeader(pb.GetLeaderRequest(), timeout=1)
                if leader.is_leader:
                    return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"conductor did not lead:\n{self.cond.log.read_text()[-3000:]}")

    async def load(self, work: Workload) -> float:
        for slot in range(work.n):
            await self.stub.RegisterInstance(
                pb.RegisterInstanceRequest(
                    spec=instance_spec(slot), lease_ttl=Duration(seconds=LEASE_S)
                )
            )
        started = time.perf_counter()
        per_instance: dict[str, list[pb.KvEventBatch]] = {}
        for batch in work.batches:
            per_instance.setdefault(batch.instance_id, []).append(batch)
        gate = asyncio.Semaphore(4)

        async def publish(batches: list[pb.KvEventBatch]) -> None:
            async with gate:
                for b in batches:
                    await self.stub.PublishKvEvents(pb.PublishKvEventsRequest(batch=b))

        await asyncio.gather(*(publish(bs) for bs in per_instance.values()))
        elapsed = time.perf_counter() - started
        self.reports = Reports(work)
        return elapsed

    def _measure_start(self) -> tuple[float, ...]:
        return (
            time.process_time(),
            cpu_seconds(self.cond.process.pid),
            cpu_seconds(self.etcd_pid),
            self.cond.metric("kvsched_conductor_decision_seconds_sum"),
            self.cond.metric(_MESSAGES.format("received")),
            self.cond.metric(_MESSAGES.format("sent")),
        )

    def _measure_end(self, res: ModeResult, start: tuple[float, ...]) -> None:
        res.client_cpu_s = time.process_time() - start[0]
        res.server_cpu_s = cpu_seconds(self.cond.process.pid) - start[1]
        res.etcd_cpu_s = cpu_seconds(self.etcd_pid) - start[2]
        res.server_place_s = self.cond.metric("kvsched_conductor_decision_seconds_sum") - start[3]
        res.messages_in = self.cond.metric(_MESSAGES.format("received")) - start[4]
        res.messages_out = self.cond.metric(_MESSAGES.format("sent")) - start[5]

    async def unary(self, name: str, reqs: list[pb.ScheduleRequest]) -> ModeResult:
        res = ModeResult(name, len(reqs))
        start = self._measure_start()
        started = time.perf_counter()
        stub, log = self.stub, self.log
        for req in reqs:
            log.append(Op(name, time.time(), req))
            t = time.perf_counter()
            try:
                resp = await stub.Schedule(req)
            except grpc.aio.AioRpcError as exc:
                res.latencies.append(time.perf_counter() - t)
                res.by_id[req.request_id] = res.latencies[-1]
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    res.rejected += 1
                    res.answers[req.request_id] = "rejected"
                else:
                    res.errors += 1
                continue
            res.latencies.append(time.perf_counter() - t)
            res.by_id[req.request_id] = res.latencies[-1]
            d = resp.decision
            res.answers[req.request_id] = d.instance_id
            fin = finish_message(req, d)
            report = self.reports.batch(d.instance_id)
            log.append(Op(name, time.time(), req, fin, report))
            await stub.Finish(fin)
            await stub.PublishKvEvents(pb.PublishKvEventsRequest(batch=report))
        res.wall_s = time.perf_counter() - started
        self._measure_end(res, start)
        res.rate = len(res.latencies) / sum(res.latencies)
        return res

    async def streams(
        self,
        name: str,
        reqs: list[pb.ScheduleRequest],
        k: int,
        n_streams: int,
        *,
        batched: bool = False,
    ) -> ModeResult:
        """Placements on `n_streams` ScheduleStreams, `k` in flight on each; `batched`: the
        items queued together (placements and finishes) go out as one ScheduleStreamBatch,
        as the Python client sends them."""
        res = ModeResult(name, len(reqs), batched=batched)
        by_id = {r.request_id: r for r in reqs}
        events: asyncio.Queue[pb.StreamKvEventsRequest | None] = asyncio.Queue()

        async def event_items() -> AsyncIterator[pb.StreamKvEventsRequest]:
            while (item := await events.get()) is not None:
                yield item

        event_call = self.stub.StreamKvEvents(event_items())
        items = [pb.ScheduleStreamRequest(schedule=r) for r in reqs]  # built before the clock
        start = self._measure_start()
        started = time.perf_counter()
        await asyncio.gather(
            *(self._one_stream(res, items[s::n_streams], k=k, by_id=by_id, events=events)
              for s in range(n_streams))
        )  # fmt: skip
        res.wall_s = time.perf_counter() - started
        await events.put(None)
        ended = await event_call
        if ended.HasField("resume"):
            raise RuntimeError(f"load reports refused: {ended.resume}")
        self._measure_end(res, start)
        res.rate = len(res.latencies) / res.wall_s
        return res

    async def _one_stream(
        self,
        res: ModeResult,
        items: list[pb.ScheduleStreamRequest],
        *,
        k: int,
        by_id: dict[str, pb.ScheduleRequest],
        events: asyncio.Queue[pb.StreamKvEventsRequest | None],
    ) -> None:
        name = res.name
        queue: asyncio.Queue[pb.ScheduleStreamRequest | None] = asyncio.Queue()
        slots = asyncio.Semaphore(k)
        sent: dict[str, float] = {}
        log = self.log

        def logged(item: pb.ScheduleStreamRequest) -> pb.ScheduleStreamRequest:
            if item.HasField("schedule"):
                log.append(Op(name, time.time(), item.schedule))
                sent[item.schedule.request_id] = time.perf_counter()
            else:
                op = pending_finish.pop(item.finish.request_id)
                op.now = time.time()
                log.append(op)
            return item

        async def outgoing() -> AsyncIterator[pb.ScheduleStreamRequest]:
            while (item := await queue.get()) is not None:
                if not res.batched or queue.empty():
                    yield logged(item)
                    continue
                items, ended = [logged(item)], False
                while len(items) < MAX_BATCH and not queue.empty():
                    if (following := queue.get_nowait()) is None:
                        ended = True
                        break
                    items.append(logged(following))
                yield as_message(items)
                if ended:
                    return

        pending_finish: dict[str, Op] = {}

        async def feed() -> None:
            for item in items:
                await slots.acquire()
                await queue.put(item)

        feeder = asyncio.create_task(feed())
        call = self.stub.ScheduleStream(outgoing())
        answered = finished = finishes = 0
        async for resp in _answers(call):
            kind = resp.WhichOneof("outcome")
            rid = resp.request_id
            if kind == "finished":
                finished += 1
            else:
                res.latencies.append(time.perf_counter() - sent.pop(rid))
                res.by_id[rid] = res.latencies[-1]
                answered += 1
                slots.release()
                if kind == "decision":
                    d = resp.decision
                    res.answers[rid] = d.instance_id
                    req = by_id[rid]
                    fin = finish_message(req, d)
                    report = self.reports.batch(d.instance_id)
                    pending_finish[rid] = Op(name, 0.0, req, fin, report)
                    await queue.put(pb.ScheduleStreamRequest(finish=fin))
                    await events.put(pb.StreamKvEventsRequest(batch=report))
                    finishes += 1
                elif kind == "rejection":
                    res.rejected += 1
                    res.answers[rid] = "rejected"
                else:
                    res.errors += 1
            if answered == len(items) and finished == finishes:
                await queue.put(None)
        await feeder


async def _answers(
    call: AsyncIterable[pb.ScheduleStreamResponse],
) -> AsyncIterator[pb.ScheduleStreamResponse]:
    """A stream's answers, those that came in one batch one by one."""
    async for message in call:
        if message.WhichOneof("outcome") == "batch":
            for answer in message.batch.items:
                yield answer
        else:
            yield message
