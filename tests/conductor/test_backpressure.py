"""The Conductor's overload bounds: placements pending across streams, the wait before a
placement is decided, the etcd write-behind; each refusal is RESOURCE_EXHAUSTED before
anything is decided, and completions are never refused (a stream's queues, with a fake
placement handler: no server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from services.conductor import keys, placement_messages
from services.conductor.backpressure import PendingPlacements, PlacementBounds, overloaded_answer
from services.conductor.metrics import ConductorMetrics
from services.conductor.records import Outbox
from services.conductor.settings import parse
from services.conductor.stream_queues import StreamQueues
from tests.conductor.conftest import chain, stub
from tests.conductor.test_conductor import (
    IID,
    Start,
    publish,
    refused,
    register,
    sched,
    stored,
    trailer,
)

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


def test_pending_placements_admit_up_to_the_bound() -> None:
    pending = PendingPlacements(PlacementBounds(max_pending=2, max_wait_s=0.1, max_outbox=5))
    assert pending.admit() and pending.admit() and not pending.admit()
    assert (pending.depth, pending.refused) == (2, 1)
    pending.done()
    assert pending.admit() and pending.depth == 2
    assert pending.overdue(0.11) and not pending.overdue(0.1)
    assert pending.outbox_full(5) and not pending.outbox_full(4)
    pending.done()
    pending.done()
    with pytest.raises(RuntimeError):
        pending.done()
    for bad in ({"max_pending": 0}, {"max_wait_s": 0.0}, {"max_outbox": 0}):
        with pytest.raises(ValueError):
            PlacementBounds(**bad)


def test_an_overloaded_answer_is_resource_exhausted() -> None:
    answer = overloaded_answer("r1", "too many placements pending")
    assert answer.request_id == "r1" and answer.error.code == EXHAUSTED
    assert "overloaded" in answer.error.message


def test_the_overload_flags() -> None:
    assert parse(["--insecure"]).placement_bounds == PlacementBounds()
    s = parse(
        [
            "--insecure",
            "--max-pending-placements",
            "8",
            "--max-placement-wait",
            "0.5",
            "--max-persist-pending",
            "100",
        ]
    )
    assert s.placement_bounds == PlacementBounds(8, 0.5, 100)
    with pytest.raises(SystemExit):
        parse(["--max-pending-placements", "0"])


class _Leadership:
    serving = True


class _Rpcs:
    """What a stream's queues use of `PlacementRpcs`: decisions are echoes."""

    def __init__(self, bounds: PlacementBounds, outbox: int = 0) -> None:
        self.pending = PendingPlacements(bounds)
        self.metrics = ConductorMetrics()
        self.leadership = _Leadership()
        self.outbox = outbox
        self.decided: list[str] = []

    def stream_answer(self, item: pb.ScheduleStreamRequest) -> tuple[Any, bool]:
        if item.WhichOneof("kind") == "finish":
            rid = item.finish.request_id
            self.decided.append(f"finish {rid}")
            return pb.ScheduleStreamResponse(request_id=rid, finished=pb.FinishResponse()), False
        rid = item.schedule.request_id
        self.decided.append(rid)
        return pb.ScheduleStreamResponse(request_id=rid, decision=pb.Decision()), False

    def outbox_full(self) -> bool:
        return self.pending.outbox_full(self.outbox)


def _schedule(rid: str) -> pb.ScheduleStreamRequest:
    return pb.ScheduleStreamRequest(schedule=pb.ScheduleRequest(request_id=rid))


def _finish(rid: str) -> pb.ScheduleStreamRequest:
    return pb.ScheduleStreamRequest(finish=pb.FinishRequest(request_id=rid))


async def _items(*items: pb.ScheduleStreamRequest) -> AsyncIterator[pb.ScheduleStreamRequest]:
    for item in items:
        yield item


async def _run(
    rpcs: _Rpcs, items: list[pb.ScheduleStreamRequest], clock: Any = None
) -> list[pb.ScheduleStreamResponse]:
    queues = StreamQueues(rpcs, clock or (lambda: 0.0))  # type: ignore[arg-type]
    await queues.read(_items(*items))  # read all before any is decided
    await queues.decide()
    out = []
    while (answer := queues.answers.get_nowait()) is not None:
        out.append(answer)
    return out


def _outcomes(answers: list[pb.ScheduleStreamResponse]) -> dict[str, str]:
    return {
        a.request_id + (" finish" if a.WhichOneof("outcome") == "finished" else ""): (
            "refused" if a.error.code == EXHAUSTED else a.WhichOneof("outcome") or ""
        )
        for a in answers
    }


async def test_beyond_max_pending_a_placement_is_refused_at_once_and_a_finish_never() -> None:
    rpcs = _Rpcs(PlacementBounds(max_pending=2))
    answers = await _run(
        rpcs, [_schedule("a"), _schedule("b"), _schedule("c"), _finish("a"), _finish("b")]
    )
    assert _outcomes(answers) == {
        "a": "decision",
        "b": "decision",
        "c": "refused",
        "a finish": "finished",
        "b finish": "finished",
    }
    assert answers[0].request_id == "c"  # refused at the door, before the queued decisions
    assert rpcs.decided == ["a", "b", "finish a", "finish b"]  # c was never decided
    assert rpcs.pending.depth == 0
    assert rpcs.metrics.decisions.labels("overloaded")._value.get() == 1


async def test_a_placement_that_waited_past_its_bound_is_refused_undecided() -> None:
    rpcs = _Rpcs(PlacementBounds(max_wait_s=0.25))
    times = iter([0.0, 0.1, 0.2, 0.3, 0.4, 0.5])  # read a, b, end; then decide a, b
    answers = await _run(rpcs, [_schedule("a"), _schedule("b")], clock=lambda: next(times))
    # a: read at 0.0, decided at 0.3 (waited 0.3 > 0.25); b: read at 0.1, at 0.4 (0.3 too).
    assert _outcomes(answers) == {"a": "refused", "b": "refused"}
    assert rpcs.decided == [] and rpcs.pending.depth == 0
    rpcs = _Rpcs(PlacementBounds(max_wait_s=0.25))
    answers = await _run(rpcs, [_schedule("a")])
    assert _outcomes(answers) == {"a": "decision"}


async def test_a_full_write_behind_refuses_placements_but_not_completions() -> None:
    rpcs = _Rpcs(PlacementBounds(max_outbox=10), outbox=10)
    answers = await _run(rpcs, [_schedule("a"), _finish("z")])
    assert _outcomes(answers) == {"a": "refused", "z finish": "finished"}
    assert "etcd" in answers[0].error.message and rpcs.decided == ["finish z"]
    assert rpcs.pending.depth == 0


def test_the_time_a_request_queued_at_the_router_reaches_admission_in_policy_seconds() -> None:
    request = pb.ScheduleRequest(request_id="r1", prompt_tokens=32, output_tokens=4)
    assert placement_messages.request_info(request, 64).waited_s == 0.0  # unset: none
    request.queued.FromMilliseconds(300)
    assert placement_messages.request_info(request, 64, time_scale=2.0).waited_s == pytest.approx(
        0.15
    )
    request.queued.FromSeconds(-1)
    with pytest.raises(RequestError):
        placement_messages.request_info(request, 64)


async def test_a_stream_ended_under_its_queue_leaves_nothing_pending() -> None:
    rpcs = _Rpcs(PlacementBounds(max_pending=8))
    queues = StreamQueues(rpcs, lambda: 0.0)  # type: ignore[arg-type]
    await queues.read(_items(_schedule("a"), _schedule("b"), _finish("c")))
    assert rpcs.pending.depth == 2
    decider = asyncio.create_task(queues.decide())
    await asyncio.sleep(0)  # it decides "a", then yields: the stream ends there (a lost term)
    decider.cancel()
    with pytest.raises(asyncio.CancelledError):
        await decider
    first, last = queues.answers.get_nowait(), queues.answers.get_nowait()
    assert first is not None and first.request_id == "a"
    assert last is None  # the stream ends instead of hanging
    assert rpcs.pending.depth == 0 and rpcs.decided == ["a"]
    # Cancelled before it ever ran: ScheduleStream drops what is left itself.
    queues = StreamQueues(rpcs, lambda: 0.0)  # type: ignore[arg-type]
    await queues.read(_items(_schedule("d")))
    decider = asyncio.create_task(queues.decide())
    decider.cancel()
    with pytest.raises(asyncio.CancelledError):
        await decider
    assert rpcs.pending.depth == 1
    queues.drop_undecided()
    queues.drop_undecided()  # safe twice
    assert rpcs.pending.depth == 0


async def test_a_conductor_behind_on_etcd_refuses_placements_not_completions(
    start_conductor: Start,
) -> None:
    # Flushes far apart: what placements and KV events write stays queued for etcd.
    c = await start_conductor(
        persist_interval_s=60.0, placement_bounds=PlacementBounds(max_outbox=4)
    )
    async with stub(c.url) as s:
        await register(s, 0)
        await s.PublishKvEvents(publish(IID[0], 0, stored(chain(2, 8))))  # 8 block records
        for i in range(4):  # block records do not count; each new session's binding does
            placed = await s.Schedule(sched(f"r{i}", chain(1, 2), session=f"s{i}"))
            assert placed.decision.instance_id == IID[0]
        err = await refused(
            s.Schedule(sched("r9", chain(1, 2))), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "etcd writes of session bindings are behind" in (err.details() or "")
        assert trailer(err, "retry-after-ms") == "1000"
        done = pb.FinishRequest(
            request_id="r0", instance_id=IID[0], prompt_tokens=33, block_hashes=chain(1, 2), ok=True
        )
        items = _items(_schedule("r10"), pb.ScheduleStreamRequest(finish=done))
        answers = [a async for a in s.ScheduleStream(items)]
        assert _outcomes(list(answers)) == {"r10": "refused", "r0 finish": "finished"}
        assert c.pending.depth == 0
        await c.persister.flush()  # etcd caught up: placements are taken again
        assert (await s.Schedule(sched("r11", chain(1, 2)))).decision.instance_id == IID[0]
    text = generate_latest(c.metrics.registry).decode()
    assert 'kvsched_conductor_decisions_total{outcome="overloaded"} 2.0' in text
    assert "kvsched_conductor_persist_pending_bindings_limit 4.0" in text


def test_the_outbox_counts_the_session_bindings_it_holds_once_each() -> None:
    outbox = Outbox()
    outbox.put(keys.block_key("i0", Tier.GPU, 7), b"b")
    outbox.put(keys.session_key("s1"), b"a")
    outbox.put(keys.session_key("s1"), b"b")  # coalesced: still one
    outbox.delete(keys.session_key("s2"))
    assert (len(outbox), outbox.bindings) == (3, 2)
    batch = outbox.take()
    assert (len(outbox), outbox.bindings) == (0, 0)
    outbox.put(keys.session_key("s1"), b"newer")
    outbox.restore(batch)  # etcd refused the batch: queued again, the newer write kept
    assert (len(outbox), outbox.bindings) == (3, 2)
    assert outbox.writes[keys.session_key("s1")] == (b"newer", 0)
