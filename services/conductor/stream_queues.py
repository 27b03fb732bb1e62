"""One placement stream's queues on the Conductor: the items read and not yet decided, the
answers not yet sent, and the answers waiting for etcd.

A stream message is one item (a placement or a completion) or a batch of them
(`ScheduleStreamBatch`). A batch is unpacked at the door into the same queue, in its order,
so the decisions are those the same items would get one message each. What is wrong with one
item of a batch (a batch inside a batch, no kind) is answered for that item alone; what is
wrong inside a placement (bad hashes, unknown fields' values) is found when it is decided and
answered the same way. A batch over `MAX_BATCH_ITEMS` is refused before any work: each of its
items is answered INVALID_ARGUMENT, none is admitted or decided.

Once a stream has carried a batch its answers may be coalesced too (`coalesce_answers`):
those ready together go out in one `ScheduleStreamResponseBatch`. A stream that never sent a
batch (an older client) gets single answers only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final, Protocol

import grpc

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.store.interface import StoreError
from services.conductor.backpressure import PendingPlacements, overloaded_answer
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics

STREAM_WINDOW: Final = 4096  # answers queued on one stream before the reader waits
MAX_BATCH_ITEMS: Final = 1024  # items one ScheduleStreamBatch may carry
MAX_ANSWER_BATCH: Final = 256  # answers coalesced into one message at most
# About the most bytes of answers coalesced into one message: far below a client's default
# 4 MiB receive limit, even with explained decisions (each candidate's terms) among them.
MAX_ANSWER_BYTES: Final = 1 << 20
# Items of one batch decided before the decider lets the loop run others (other streams,
# KV events and load reports, refusals at the door): a few ms of decisions at most.
DECIDE_SLICE: Final = 16

_INVALID: Final = grpc.StatusCode.INVALID_ARGUMENT.value[0]

# Queued after a stream's last item: the decider ends there.
_END: Final = pb.ScheduleStreamRequest()


class StreamDecider(Protocol):
    """What a stream's queues use of the placement handlers (`PlacementRpcs`)."""

    leadership: Leadership
    metrics: ConductorMetrics
    pending: PendingPlacements

    def stream_answer(
        self, item: pb.ScheduleStreamRequest
    ) -> tuple[pb.ScheduleStreamResponse, bool]:
        """Decide one item (a placement is counted and its transfers started); the flag says
        the answer must wait for etcd. Changes the Conductor's state as the item asks."""
        ...

    def outbox_full(self) -> bool:
        """Whether the etcd write-behind is too far behind to take a new placement (counts
        the refusal when it is). Changes nothing else."""
        ...

    async def durable(self, context: None) -> None:
        """Wait until the writes queued so far reach etcd; raises StoreError."""
        ...


def request_id_of(item: pb.ScheduleStreamRequest) -> str:
    """The request an item is about ("" when it has none)."""
    kind = item.WhichOneof("kind")
    if kind == "schedule":
        return item.schedule.request_id
    if kind == "finish":
        return item.finish.request_id
    return ""


def invalid_answer(item: pb.ScheduleStreamRequest, why: str) -> pb.ScheduleStreamResponse:
    """An INVALID_ARGUMENT answer for one item, refused at the door."""
    error = pb.StreamError(code=_INVALID, message=why)
    return pb.ScheduleStreamResponse(request_id=request_id_of(item), error=error)


def answer_size_estimate(answer: pb.ScheduleStreamResponse) -> int:
    """A generous bound of `answer`'s size on the wire, without serializing it: an explained
    decision's candidates (a cost-term map each) dominate; the rest is small."""
    return 512 + 2048 * len(answer.decision.candidates)


class StreamQueues:
    """One placement stream's queues: the items read and not yet decided (with when they
    were read, by `clock`, wall seconds, and whether each is the last of its message), the
    answers not yet sent, and the answers waiting for etcd. Placements among them count in
    the Conductor's `PendingPlacements` until answered."""

    def __init__(self, rpcs: StreamDecider, clock: Callable[[], float]) -> None:
        self.rpcs = rpcs
        self.clock = clock
        self.pending = rpcs.pending
        self.answers: asyncio.Queue[pb.ScheduleStreamResponse | None] = asyncio.Queue(STREAM_WINDOW)
        self.queued: deque[tuple[float, pb.ScheduleStreamRequest, bool]] = deque()
        self.arrived = asyncio.Event()
        self.waiting: set[asyncio.Task[None]] = set()
        self.batched = False  # the client sent a batch: it takes batched answers

    async def read(self, request_iterator: AsyncIterator[pb.ScheduleStreamRequest]) -> None:
        """Queue the items as they come; refuse a placement at once when too many wait, and
        an item (or a whole oversize batch) that cannot be taken at all."""
        metrics = self.rpcs.metrics
        try:
            async for message in request_iterator:
                if not self.rpcs.leadership.serving:
                    break
                if message.WhichOneof("kind") != "batch":
                    metrics.stream_messages.labels("received").inc()
                    metrics.stream_items.labels("received").inc()
                    await self._take(message, last_of_message=True)
                    continue
                self.batched = True
                items = message.batch.items
                metrics.stream_messages.labels("received").inc()
                metrics.stream_items.labels("received").inc(len(items))
                await self._take_batch(items)
        finally:
            self.queued.append((self.clock(), _END, True))
            self.arrived.set()

    async def _take_batch(self, items: Sequence[pb.ScheduleStreamRequest]) -> None:
        if len(items) > MAX_BATCH_ITEMS:
            why = f"a batch of {len(items)} items is over the {MAX_BATCH_ITEMS} one may carry"
            for item in items:
                await self.answers.put(invalid_answer(item, why))
            return
        takeable = []
        for item in items:
            kind = item.WhichOneof("kind")
            if kind in ("schedule", "finish"):
                takeable.append(item)
            else:
                why = "a batch inside a batch" if kind == "batch" else "stream item has no kind set"
                await self.answers.put(invalid_answer(item, why))
        for i, item in enumerate(takeable):
            await self._take(item, last_of_message=i == len(takeable) - 1)

    async def _take(self, item: pb.ScheduleStreamRequest, *, last_of_message: bool) -> None:
        if item.WhichOneof("kind") == "schedule" and not self.pending.admit():
            self.rpcs.metrics.decisions.labels("overloaded").inc()
            why = "too many placements pending"
            await self.answers.put(overloaded_answer(item.schedule.request_id, why))
            if last_of_message and self.queued:  # the decider yields after the message
                read_at, previous, _ = self.queued[-1]
                self.queued[-1] = (read_at, previous, True)
            return
        self.queued.append((self.clock(), item, last_of_message))
        self.arrived.set()

    async def decide(self) -> None:
        """Decide the queued items in turn, yielding after each message's last item (and
        every `DECIDE_SLICE` items of a batch) so the reader can refuse what it must
        meanwhile and other streams go on; ends the stream after the last item's answer."""
        ended = False
        unyielded = 0
        try:
            while not ended:
                await self.arrived.wait()
                self.arrived.clear()
                while self.queued and not ended:
                    read_at, item, last_of_message = self.queued.popleft()
                    if item is _END:
                        if self.waiting:
                            await asyncio.gather(*self.waiting)
                        await self.answers.put(None)
                        ended = True
                    else:
                        await self._decide_one(item, self.clock() - read_at)
                        unyielded += 1
                        if last_of_message or unyielded >= DECIDE_SLICE:
                            unyielded = 0
                            await asyncio.sleep(0)
        finally:
            self.drop_undecided()
            if not ended:  # cancelled or failed: end the stream, never wait on its reader
                with contextlib.suppress(asyncio.QueueFull):
                    self.answers.put_nowait(None)

    def drop_undecided(self) -> None:
        """Forget the items read and not decided (the stream ended under them): they are no
        longer pending. Safe to call more than once."""
        for _, item, _ in self.queued:
            if item is not _END and item.WhichOneof("kind") == "schedule":
                self.pending.done()
        self.queued.clear()

    async def _decide_one(self, item: pb.ScheduleStreamRequest, waited_s: float) -> None:
        """Decide one queued item and queue its answer (a rebound session's after etcd)."""
        rpcs = self.rpcs
        if item.WhichOneof("kind") != "schedule":
            answer, _ = rpcs.stream_answer(item)
            await self.answers.put(answer)
            return
        rid = item.schedule.request_id
        if self.pending.overdue(waited_s):
            rpcs.metrics.decisions.labels("overloaded").inc()
            await self._answer(overloaded_answer(rid, "it waited too long to be decided"))
            return
        if rpcs.outbox_full():
            await self._answer(overloaded_answer(rid, "etcd writes of session bindings are behind"))
            return
        answer, durable = rpcs.stream_answer(item)
        if durable:
            task = asyncio.create_task(self._after_sync(answer))
            self.waiting.add(task)
            task.add_done_callback(self.waiting.discard)
        else:
            await self._answer(answer)

    async def _answer(self, answer: pb.ScheduleStreamResponse) -> None:
        self.pending.done()
        await self.answers.put(answer)

    async def _after_sync(self, answer: pb.ScheduleStreamResponse) -> None:
        try:
            await self.rpcs.durable(None)
        except StoreError as exc:
            error = pb.StreamError(code=grpc.StatusCode.UNAVAILABLE.value[0], message=str(exc))
            answer = pb.ScheduleStreamResponse(request_id=answer.request_id, error=error)
        finally:
            self.pending.done()  # answered, or the stream ended under it
        await self.answers.put(answer)

    async def outgoing(self) -> AsyncIterator[pb.ScheduleStreamResponse]:
        """The stream's messages, until its end: each answer alone, or, once the client has
        sent a batch, the answers ready together in one batch (at most `MAX_ANSWER_BATCH`,
        and about `MAX_ANSWER_BYTES`)."""
        metrics = self.rpcs.metrics
        answers = self.answers
        while (answer := await answers.get()) is not None:
            if not self.batched or answers.empty():
                metrics.stream_messages.labels("sent").inc()
                metrics.stream_items.labels("sent").inc()
                yield answer
                continue
            ready, ended = [answer], False
            size = answer_size_estimate(answer)
            while len(ready) < MAX_ANSWER_BATCH and not answers.empty():
                following = answers.get_nowait()
                if following is None:
                    ended = True
                    break
                ready.append(following)
                size += answer_size_estimate(following)
                if size >= MAX_ANSWER_BYTES:
                    break
            metrics.stream_messages.labels("sent").inc()
            metrics.stream_items.labels("sent").inc(len(ready))
            if len(ready) == 1:
                yield answer
            else:
                yield pb.ScheduleStreamResponse(batch=pb.ScheduleStreamResponseBatch(items=ready))
            if ended:
                return
