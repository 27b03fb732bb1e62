"""Batched placement streams: a `ScheduleStreamBatch` is taken item by item in order, a bad
item fails alone, an oversize batch is refused before any work; the Python client coalesces
what is queued together and sends a lone placement at once; an older client (single items
only) gets single answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from clients.python import ConductorClient
from clients.python.packed_hashes import pack_hashes
from clients.python.stream_batches import (
    BatchLimits,
    Coalescer,
    as_message,
    size_estimate,
)
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.conductor.app import Conductor
from services.conductor.backpressure import PendingPlacements, PlacementBounds
from services.conductor.metrics import ConductorMetrics
from services.conductor.stream_queues import (
    MAX_ANSWER_BYTES,
    MAX_BATCH_ITEMS,
    StreamQueues,
    answer_size_estimate,
)
from tests.conductor.conftest import chain, stub
from tests.conductor.test_conductor import IID, Start, register, sched
from tests.fixtures.poll import wait_for

INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


def _schedule(request: pb.ScheduleRequest) -> pb.ScheduleStreamRequest:
    return pb.ScheduleStreamRequest(schedule=request)


def _batch(*items: pb.ScheduleStreamRequest) -> pb.ScheduleStreamRequest:
    return pb.ScheduleStreamRequest(batch=pb.ScheduleStreamBatch(items=items))


def _counted(c: Conductor, name: str, direction: str) -> float:
    family = {"messages": c.metrics.stream_messages, "items": c.metrics.stream_items}[name]
    return float(family.labels(direction)._value.get())


async def _read_answers(call: Any, count: int) -> tuple[list[pb.ScheduleStreamResponse], int]:
    """`count` answers, batches unpacked, and how many messages carried them."""
    answers: list[pb.ScheduleStreamResponse] = []
    messages = 0
    while len(answers) < count:
        message = await asyncio.wait_for(call.read(), 10)
        assert isinstance(message, pb.ScheduleStreamResponse)
        messages += 1
        if message.WhichOneof("outcome") == "batch":
            assert not message.request_id
            assert all(a.WhichOneof("outcome") != "batch" for a in message.batch.items)
            answers.extend(message.batch.items)
        else:
            answers.append(message)
    return answers, messages


# ---- the Conductor ---------------------------------------------------------------------


async def test_a_batch_with_bad_items_fails_only_those_and_places_the_rest(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    max_blocks = c.state.scheduler.limits.max_blocks
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
        good = [
            sched(f"ok{n}", chain(n % 3 + 1, 3), session=f"s{n}" if n % 2 else "") for n in range(6)
        ]
        bad_length = pb.ScheduleRequest(
            request_id="bad-length", prompt_tokens=64, packed_block_hashes=b"\x01" * 7
        )
        both = sched("both-fields", chain(1, 2))
        both.packed_block_hashes = pack_hashes(chain(1, 2))
        oversize = pb.ScheduleRequest(
            request_id="oversize",
            prompt_tokens=64,
            packed_block_hashes=pack_hashes(range(1, max_blocks + 2)),
        )
        no_prompt = sched("no-prompt", chain(1, 2), prompt=0)
        unknown = pb.FinishRequest(request_id="ok0", instance_id="no/such-instance", ok=True)
        items = [
            _schedule(good[0]),
            _schedule(bad_length),
            _schedule(good[1]),
            _schedule(both),
            _schedule(good[2]),
            _schedule(oversize),
            _batch(_schedule(sched("nested", chain(1, 2)))),
            _schedule(good[3]),
            pb.ScheduleStreamRequest(),  # no kind
            _schedule(no_prompt),
            pb.ScheduleStreamRequest(finish=unknown),
            _schedule(good[4]),
            _schedule(good[5]),
        ]
        call = s.ScheduleStream()  # type: ignore[call-arg]  # the write/read API
        assert dict(await call.initial_metadata())["kvsched-stream-batch-items"] == str(
            MAX_BATCH_ITEMS
        )
        await call.write(_batch(*items))
        answers, _ = await _read_answers(call, len(items))
        by_id: dict[str, list[pb.ScheduleStreamResponse]] = {}
        for a in answers:
            by_id.setdefault(a.request_id, []).append(a)
        for request in good:
            (answer,) = [a for a in by_id[request.request_id] if not a.HasField("error")]
            assert answer.WhichOneof("outcome") == "decision", answer
            assert answer.decision.instance_id in IID[:2]
        for rid in ("bad-length", "both-fields", "oversize", "no-prompt"):
            (answer,) = by_id[rid]
            assert answer.WhichOneof("outcome") == "error", answer
            assert answer.error.code == INVALID and answer.error.message, answer
        assert "whole number of 8-byte" in by_id["bad-length"][0].error.message
        nameless = sorted(a.error.message for a in by_id[""])  # the nested batch, no kind
        assert [a.error.code for a in by_id[""]] == [INVALID, INVALID]
        assert "batch inside a batch" in nameless[0] and "no kind" in nameless[1]
        # ok0 was placed, and its finish naming an unknown instance failed alone.
        outcomes = sorted(a.WhichOneof("outcome") or "" for a in by_id["ok0"])
        assert outcomes == ["decision", "error"]
        assert [a.error.code for a in by_id["ok0"] if a.HasField("error")] == [NOT_FOUND]
        assert float(c.state.cluster.load.in_flight.sum()) == len(good)
        assert _counted(c, "messages", "received") == 1
        assert _counted(c, "items", "received") == len(items)
        assert _counted(c, "items", "sent") == len(items)
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]


async def test_an_oversize_batch_is_refused_before_any_work_and_the_stream_goes_on(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        await register(s, 0)
        call = s.ScheduleStream()  # type: ignore[call-arg]
        too_many = [_schedule(sched(f"r{n}", chain(1, 2))) for n in range(MAX_BATCH_ITEMS + 1)]
        await call.write(_batch(*too_many))
        answers, _ = await _read_answers(call, len(too_many))
        expected = sorted(f"r{n}" for n in range(len(too_many)))
        assert sorted(a.request_id for a in answers) == expected
        assert {a.error.code for a in answers} == {INVALID}
        assert f"over the {MAX_BATCH_ITEMS}" in answers[0].error.message
        assert c.metrics.decisions.labels("placed")._value.get() == 0  # nothing decided
        assert float(c.state.cluster.load.in_flight.sum()) == 0
        assert c.pending.depth == 0  # nothing admitted
        # A lone placement afterwards is answered alone.
        await call.write(_schedule(sched("after", chain(1, 2))))
        (after,), messages = await _read_answers(call, 1)
        assert messages == 1 and after.request_id == "after"
        assert after.WhichOneof("outcome") == "decision"
        await call.done_writing()


async def test_a_client_that_sends_single_items_gets_single_answers(start_conductor: Start) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        await register(s, 0)
        call = s.ScheduleStream()  # type: ignore[call-arg]
        for n in range(40):  # all written before any is read: answers pile up
            await call.write(_schedule(sched(f"r{n}", chain(n % 4 + 1, 2))))
        answers, messages = await _read_answers(call, 40)
        assert messages == 40 and {a.WhichOneof("outcome") for a in answers} == {"decision"}
        await call.done_writing()
    assert _counted(c, "messages", "sent") == _counted(c, "items", "sent") == 40


# ---- the stream's queues (a fake placement handler) ------------------------------------


class _Leadership:
    serving = True


class _Rpcs:
    """What a stream's queues use of `PlacementRpcs`: decisions are echoes, in order."""

    def __init__(self) -> None:
        self.pending = PendingPlacements(PlacementBounds())
        self.metrics = ConductorMetrics()
        self.leadership = _Leadership()
        self.decided: list[str] = []

    def stream_answer(self, item: pb.ScheduleStreamRequest) -> tuple[Any, bool]:
        rid = item.schedule.request_id or f"finish {item.finish.request_id}"
        self.decided.append(rid)
        return pb.ScheduleStreamResponse(request_id=rid, decision=pb.Decision()), False

    def outbox_full(self) -> bool:
        return False

    async def durable(self, context: None) -> None:
        return None


def _s(rid: str) -> pb.ScheduleStreamRequest:
    return _schedule(pb.ScheduleRequest(request_id=rid))


async def _messages(*items: pb.ScheduleStreamRequest) -> AsyncIterator[pb.ScheduleStreamRequest]:
    for item in items:
        yield item


async def test_batched_items_are_decided_in_the_order_single_ones_would_be() -> None:
    finish = pb.ScheduleStreamRequest(finish=pb.FinishRequest(request_id="a"))
    rpcs = _Rpcs()
    queues = StreamQueues(rpcs, lambda: 0.0)  # type: ignore[arg-type]
    await queues.read(
        _messages(
            _s("a"),
            _batch(_s("b"), finish, _s("c")),
            _s("d"),
            _batch(_s("e"), _batch(_s("x")), _s("f")),
        )
    )
    await queues.decide()
    assert rpcs.decided == ["a", "b", "finish a", "c", "d", "e", "f"]
    assert queues.batched and rpcs.pending.depth == 0
    sent = [m async for m in queues.outgoing()]  # all ready: they go together
    assert len(sent) == 1 and sent[0].WhichOneof("outcome") == "batch"
    ids = [a.request_id for a in sent[0].batch.items]
    assert ids == ["", "a", "b", "finish a", "c", "d", "e", "f"]  # the nested one at the door


async def test_answers_ready_together_are_coalesced_within_a_byte_bound() -> None:
    rpcs = _Rpcs()
    queues = StreamQueues(rpcs, lambda: 0.0)  # type: ignore[arg-type]
    queues.batched = True
    candidates = [pb.CandidateCost(instance_id=f"i{n}", terms={"ttft_s": 1.0}) for n in range(64)]
    explained = pb.Decision(candidates=candidates)
    per_answer = answer_size_estimate(pb.ScheduleStreamResponse(decision=explained))
    assert per_answer > pb.ScheduleStreamResponse(decision=explained).ByteSize()  # a bound
    count = 3 * MAX_ANSWER_BYTES // per_answer
    for n in range(count):
        queues.answers.put_nowait(pb.ScheduleStreamResponse(request_id=f"r{n}", decision=explained))
    queues.answers.put_nowait(None)
    sent = [m async for m in queues.outgoing()]
    assert 3 <= len(sent) <= 4  # about MAX_ANSWER_BYTES each
    ids = [a.request_id for m in sent for a in (m.batch.items if m.HasField("batch") else [m])]
    assert ids == [f"r{n}" for n in range(count)]  # all, in order
    assert all(m.ByteSize() <= 2 * MAX_ANSWER_BYTES for m in sent)


# ---- the client's coalescer ------------------------------------------------------------


def _taker(stale: set[str] | None = None) -> Any:
    def take(key: str) -> pb.ScheduleStreamRequest | None:
        if stale and key in stale:
            return None
        if key.startswith("f"):
            return pb.ScheduleStreamRequest(finish=pb.FinishRequest(request_id=key))
        return _s(key)

    return take


def _ids(items: list[pb.ScheduleStreamRequest]) -> list[str]:
    return [i.schedule.request_id or i.finish.request_id for i in items]


async def test_the_coalescer_sends_what_is_queued_together_and_a_lone_item_at_once() -> None:
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    coalescer = Coalescer(queue, _taker({"stale"}), BatchLimits(max_items=3))
    for key in ("b", "stale", "c", "d", "e"):
        queue.put_nowait(key)
    assert _ids(await coalescer.next_items("a", limit=1024)) == ["a", "b", "c"]  # max_items
    first = queue.get_nowait()
    assert first is not None
    assert _ids(await coalescer.next_items(first, limit=2)) == ["d", "e"]  # the server's limit
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert _ids(await coalescer.next_items("lone", limit=1024)) == ["lone"]
    assert loop.time() - started < 0.5  # not the window: no wait at all for a placement
    queue.put_nowait("b")
    assert _ids(await coalescer.next_items("a", limit=0)) == ["a"]  # no batches: one a message
    assert queue.get_nowait() == "b" and not coalescer.ended
    # The stream's end flushes what was taken.
    queue.put_nowait("b")
    queue.put_nowait(None)
    assert _ids(await coalescer.next_items("a", limit=1024)) == ["a", "b"] and coalescer.ended


async def test_completions_wait_a_bounded_window_and_a_placement_ends_it() -> None:
    queue: asyncio.Queue[str | None] = asyncio.Queue()
    coalescer = Coalescer(queue, _taker(), BatchLimits(finish_window_s=0.05))
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, queue.put_nowait, "f2")
    loop.call_later(0.02, queue.put_nowait, "p1")
    loop.call_later(0.03, queue.put_nowait, "f3")
    assert _ids(await coalescer.next_items("f1", limit=1024)) == ["f1", "f2", "p1"]
    assert await asyncio.wait_for(queue.get(), 5) == "f3"  # left for the next message
    started = loop.time()
    assert _ids(await coalescer.next_items("f4", limit=1024)) == ["f4"]
    assert 0.04 <= loop.time() - started < 1.0  # waited for the window, then gave up
    loop.call_later(0.01, queue.put_nowait, None)  # the stream ends: flushed at once
    assert _ids(await coalescer.next_items("f5", limit=1024)) == ["f5"] and coalescer.ended


def test_a_message_for_one_item_is_the_item_and_sizes_count_the_hashes() -> None:
    one = _s("a")
    assert as_message([one]) is one
    both = as_message([one, _s("b")])
    assert both.WhichOneof("kind") == "batch" and len(both.batch.items) == 2
    packed = _schedule(pb.ScheduleRequest(packed_block_hashes=b"\0" * 16384))
    assert 16384 < size_estimate(packed) < 16384 + 1024
    with pytest.raises(ValueError):
        BatchLimits(max_items=0)


# ---- the Python client against a Conductor ---------------------------------------------


async def test_the_client_coalesces_concurrent_placements_and_sends_a_lone_one_alone(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
    async with ConductorClient([c.url], deadline_s=5.0) as client:
        async with client.placement_stream() as stream:
            # A lone placement goes alone (and the stream learns that batches are taken).
            lone = await stream.schedule(sched("lone", chain(1, 3)))
            assert lone.instance_id in IID[:2]
            assert _counted(c, "messages", "received") == _counted(c, "items", "received") == 1
            decisions = await asyncio.gather(
                *(stream.schedule(sched(f"r{n}", chain(n % 5 + 1, 3))) for n in range(40))
            )
            assert {d.instance_id for d in decisions} <= set(IID[:2])
            assert _counted(c, "items", "received") == 41
            assert _counted(c, "messages", "received") < 1 + 40  # coalesced
            assert _counted(c, "messages", "sent") < 1 + 40
            finishes = [
                pb.FinishRequest(request_id=f"r{n}", instance_id=d.instance_id, ok=True)
                for n, d in enumerate(decisions)
            ]
            finished = await asyncio.gather(*map(stream.finish, finishes))
            assert len(finished) == 40 and float(c.state.cluster.load.in_flight.sum()) == 1
        # A burst before the stream has connected (as after a reconnect, every item still
        # unanswered) waits to learn that the Conductor takes batches, then goes batched.
        async with client.placement_stream() as fresh:
            before_m = _counted(c, "messages", "received")
            await asyncio.gather(*(fresh.schedule(sched(f"b{n}", chain(1, 3))) for n in range(20)))
            assert _counted(c, "messages", "received") - before_m < 20
        async with client.placement_stream(batching=None) as singles:
            before_m, before_i = (_counted(c, n, "received") for n in ("messages", "items"))
            await asyncio.gather(
                *(singles.schedule(sched(f"u{n}", chain(1, 3))) for n in range(10))
            )
            assert _counted(c, "messages", "received") - before_m == 10
            assert _counted(c, "items", "received") - before_i == 10


async def test_completions_held_for_company_are_sent_when_the_stream_closes(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        await register(s, 0)
    window_s = 15.0
    async with ConductorClient([c.url], deadline_s=4 * window_s) as client:
        with pytest.raises(ValueError):  # the stall watchdog would count the window
            client.placement_stream(batching=BatchLimits(finish_window_s=window_s + 1))
        stream = client.placement_stream(batching=BatchLimits(finish_window_s=window_s))
        loop = asyncio.get_running_loop()
        async with stream:
            placed = await stream.schedule(sched("r1", chain(1, 3)))
            report = pb.FinishRequest(request_id="r1", instance_id=placed.instance_id, ok=True)
            finishing = asyncio.create_task(stream.finish(report))
            await wait_for(lambda: stream.in_flight == 1, 5.0, message="the finish is queued")
            assert not finishing.done()  # held: no placement comes to end the window
            closing = loop.time()
        # Closing sent it at once, without waiting out the window: answered, not cancelled.
        assert isinstance(await asyncio.wait_for(finishing, 10), pb.FinishResponse)
        assert loop.time() - closing < window_s / 2
    assert float(c.state.cluster.load.in_flight.sum()) == 0
