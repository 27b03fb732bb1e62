"""The placement RPCs: Schedule, Finish, and ScheduleStream (both over one stream).

A placement is counted, its transfers start at once, and it names the transfers under way
that it must wait for. A placement that rebound a session is answered only once the binding
is in etcd, so a new leader places the session's next turn where this one did.

Under overload (see `backpressure`) a placement is refused with RESOURCE_EXHAUSTED before it
is decided: when too many wait for an answer, when one waited too long to be decided, or
when the etcd write-behind is too far behind. A stream reads its items into a queue of its
own as they come and decides them in turn, so a refusal at the door is answered without
waiting behind the decisions queued before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final, NoReturn

import grpc
from opentelemetry import trace

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.decision import Decision, TransferPlan
from kvsched.core.requests import RequestError
from services.common.store import StoreError
from services.conductor import convert
from services.conductor.backpressure import (
    OVERLOAD_RETRY_MS,
    PendingPlacements,
    overloaded_answer,
)
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics
from services.conductor.rpc_status import CODES, Context, abort, require_leader
from services.conductor.streams import OpenStreams
from services.conductor.term import CurrentTerm
from services.conductor.transfer_runner import TransferRunner

STREAM_WINDOW = 4096  # placement answers queued on one stream before the reader waits


class PlacementRpcs:
    """Handlers of the placement RPCs; only the serving leader places."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        *,
        clock: Callable[[], float],
        metrics: ConductorMetrics,
        transfers: TransferRunner,
        sync: Callable[[], Awaitable[None]],
        streams: OpenStreams,
        pending: PendingPlacements,
        time_scale: float = 1.0,
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.clock = clock  # policy seconds
        self.metrics = metrics
        self.transfers = transfers
        self.sync = sync  # waits for the term's queued writes to reach etcd
        self.streams = streams
        self.pending = pending
        self.time_scale = time_scale  # wall seconds per policy second (a request's `queued`)

    # ---- one placement, one completion ---------------------------------------------------

    def _place(self, request: pb.ScheduleRequest) -> tuple[Decision, bool, list[TransferPlan]]:
        """Place one request, count it and start its transfers; returns the decision, whether
        a session was rebound, and the transfers under way that it must wait for (see
        `TransferRunner.landing`). Raises RequestError."""
        metrics = self.metrics
        started = time.perf_counter()
        scheduler = self.current().state.scheduler
        try:
            info = convert.request_info(request, scheduler.limits.max_blocks, self.time_scale)
            decision = scheduler.place(info, self.clock())
        except RequestError:
            metrics.decisions.labels("error").inc()
            raise
        metrics.decision_seconds.observe(time.perf_counter() - started)
        if decision.rejected:
            metrics.decisions.labels("rejected").inc()
        else:
            metrics.decisions.labels("placed").inc()
            metrics.prompt_tokens.inc(request.prompt_tokens)
            metrics.cached_tokens.inc(decision.cached_tokens)
            if decision.transfers:
                self.transfers.launch(decision.transfers, prefill_s=decision.estimated_ttft_s)
            landing = self.transfers.landing(
                decision.instance, info.block_hashes, decision.transfers
            )
            return decision, decision.rebound, landing
        return decision, decision.rebound, []

    def _finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        """Record a completion; transfers it causes (an idle-gap migration) start at once."""
        state, now = self.current().state, self.clock()
        plans = list(state.scheduler.finish(convert.completion(state, request, now), now))
        self.metrics.reported_cached_tokens.inc(request.cached_tokens)
        self.transfers.launch(plans)
        return pb.FinishResponse(transfers=[convert.transfer_message(state, p) for p in plans])

    def _annotate(self, decision: Decision) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        state = self.current().state
        span.set_attribute("kvsched.policy", state.scheduler.spec)
        span.set_attribute("kvsched.rule", decision.rule)
        span.set_attribute("kvsched.rejected", decision.rejected)
        span.set_attribute("kvsched.cached_tokens", decision.cached_tokens)
        span.set_attribute("kvsched.estimated_ttft_s", decision.estimated_ttft_s)
        if decision.instance >= 0:
            span.set_attribute("kvsched.instance", state.id_of(decision.instance))
            for name, values in decision.terms.items():
                span.set_attribute(f"kvsched.cost.{name}", float(values[decision.instance]))

    async def _durable(self, context: Context | None) -> None:
        """Wait for the session binding just made to reach etcd."""
        try:
            await self.sync()
        except StoreError as exc:
            if context is None:
                raise
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"etcd did not take the session binding: {exc}"
            )

    def _outbox_full(self) -> bool:
        full = self.pending.outbox_full(self.current().outbox.bindings)
        if full:
            self.metrics.decisions.labels("overloaded").inc()
        return full

    # ---- unary ---------------------------------------------------------------------------

    async def Schedule(self, request: pb.ScheduleRequest, context: Context) -> pb.ScheduleResponse:
        await require_leader(self.leadership, context)
        if self._outbox_full():
            await _overloaded(context, "etcd writes of session bindings are behind")
        if not self.pending.admit():  # unary placements count with the streams' ones
            self.metrics.decisions.labels("overloaded").inc()
            await _overloaded(context, "too many placements pending")
        try:
            return await self._schedule(request, context)
        finally:
            self.pending.done()

    async def _schedule(self, request: pb.ScheduleRequest, context: Context) -> pb.ScheduleResponse:
        try:
            decision, rebound, landing = self._place(request)
        except RequestError as exc:
            await abort(context, exc)
        self._annotate(decision)
        if decision.rejected:
            retry_ms = round(decision.retry_after_s * 1000)
            context.set_trailing_metadata((("retry-after-ms", str(retry_ms)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rejected by {decision.rule}: no instance meets the latency objectives; "
                f"retry after {retry_ms} ms",
            )
        if rebound:
            await self._durable(context)
        return pb.ScheduleResponse(
            decision=convert.decision_message(
                self.current().state, decision, landing=landing, explain=request.explain
            )
        )

    async def Finish(self, request: pb.FinishRequest, context: Context) -> pb.FinishResponse:
        await require_leader(self.leadership, context)
        try:
            return self._finish(request)
        except RequestError as exc:
            await abort(context, exc)

    # ---- the stream ----------------------------------------------------------------------

    def _stream_answer(
        self, item: pb.ScheduleStreamRequest
    ) -> tuple[pb.ScheduleStreamResponse, bool]:
        """Answer one stream item; the flag says the answer must wait for etcd."""
        kind = item.WhichOneof("kind")
        if kind == "schedule":
            request = item.schedule
            rid = request.request_id
            try:
                decision, rebound, landing = self._place(request)
            except RequestError as exc:
                return _stream_error(rid, exc), False
            if decision.rejected:
                rejection = convert.rejection_message(decision)
                return pb.ScheduleStreamResponse(request_id=rid, rejection=rejection), False
            msg = convert.decision_message(
                self.current().state, decision, landing=landing, explain=request.explain
            )
            return pb.ScheduleStreamResponse(request_id=rid, decision=msg), rebound
        if kind == "finish":
            try:
                finished = self._finish(item.finish)
            except RequestError as exc:
                return _stream_error(item.finish.request_id, exc), False
            return pb.ScheduleStreamResponse(
                request_id=item.finish.request_id, finished=finished
            ), False
        return _stream_error("", RequestError("invalid", "stream item has no kind set")), False

    async def ScheduleStream(
        self, request_iterator: AsyncIterator[pb.ScheduleStreamRequest], context: Context
    ) -> AsyncIterator[pb.ScheduleStreamResponse]:
        await require_leader(self.leadership, context)
        stream = StreamQueues(self, asyncio.get_running_loop().time)
        reader = asyncio.create_task(stream.read(request_iterator))
        decider = asyncio.create_task(stream.decide())
        self.streams.add(stream.answers)  # a lost term ends the stream (a None) at once
        try:
            while (answer := await stream.answers.get()) is not None:
                yield answer
            await require_leader(self.leadership, context)  # ended by a lost term: who leads
        finally:
            self.streams.discard(stream.answers)
            reader.cancel()
            decider.cancel()
            for task in stream.waiting:
                task.cancel()
            stream.drop_undecided()  # also when the decider was cancelled before it ran


# Queued after a stream's last item: the decider ends there.
_END: Final = pb.ScheduleStreamRequest()


class StreamQueues:
    """One placement stream's queues: the items read and not yet decided (with when they
    were read, by `clock`, wall seconds), the answers not yet sent, and the answers waiting
    for etcd. Placements among them count in the Conductor's `PendingPlacements` until
    answered."""

    def __init__(self, rpcs: PlacementRpcs, clock: Callable[[], float]) -> None:
        self.rpcs = rpcs
        self.clock = clock
        self.pending = rpcs.pending
        self.answers: asyncio.Queue[pb.ScheduleStreamResponse | None] = asyncio.Queue(STREAM_WINDOW)
        self.queued: deque[tuple[float, pb.ScheduleStreamRequest]] = deque()
        self.arrived = asyncio.Event()
        self.waiting: set[asyncio.Task[None]] = set()

    async def read(self, request_iterator: AsyncIterator[pb.ScheduleStreamRequest]) -> None:
        """Queue the items as they come; refuse a placement at once when too many wait."""
        try:
            async for item in request_iterator:
                if not self.rpcs.leadership.serving:
                    break
                if item.WhichOneof("kind") == "schedule" and not self.pending.admit():
                    self.rpcs.metrics.decisions.labels("overloaded").inc()
                    why = "too many placements pending"
                    await self.answers.put(overloaded_answer(item.schedule.request_id, why))
                    continue
                self.queued.append((self.clock(), item))
                self.arrived.set()
        finally:
            self.queued.append((self.clock(), _END))
            self.arrived.set()

    async def decide(self) -> None:
        """Decide the queued items in turn, yielding between them so the reader can refuse
        what it must meanwhile; ends the stream after the last item's answer."""
        ended = False
        try:
            while not ended:
                await self.arrived.wait()
                self.arrived.clear()
                while self.queued and not ended:
                    read_at, item = self.queued.popleft()
                    if item is _END:
                        if self.waiting:
                            await asyncio.gather(*self.waiting)
                        await self.answers.put(None)
                        ended = True
                    else:
                        await self._decide_one(item, self.clock() - read_at)
                        await asyncio.sleep(0)
        finally:
            self.drop_undecided()
            if not ended:  # cancelled or failed: end the stream, never wait on its reader
                with contextlib.suppress(asyncio.QueueFull):
                    self.answers.put_nowait(None)

    def drop_undecided(self) -> None:
        """Forget the items read and not decided (the stream ended under them): they are no
        longer pending. Safe to call more than once."""
        for _, item in self.queued:
            if item is not _END and item.WhichOneof("kind") == "schedule":
                self.pending.done()
        self.queued.clear()

    async def _decide_one(self, item: pb.ScheduleStreamRequest, waited_s: float) -> None:
        """Decide one queued item and queue its answer (a rebound session's after etcd)."""
        rpcs = self.rpcs
        if item.WhichOneof("kind") != "schedule":
            answer, _ = rpcs._stream_answer(item)
            await self.answers.put(answer)
            return
        rid = item.schedule.request_id
        if self.pending.overdue(waited_s):
            rpcs.metrics.decisions.labels("overloaded").inc()
            await self._answer(overloaded_answer(rid, "it waited too long to be decided"))
            return
        if rpcs._outbox_full():
            await self._answer(overloaded_answer(rid, "etcd writes of session bindings are behind"))
            return
        answer, durable = rpcs._stream_answer(item)
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
            await self.rpcs._durable(None)
        except StoreError as exc:
            error = pb.StreamError(code=grpc.StatusCode.UNAVAILABLE.value[0], message=str(exc))
            answer = pb.ScheduleStreamResponse(request_id=answer.request_id, error=error)
        finally:
            self.pending.done()  # answered, or the stream ended under it
        await self.answers.put(answer)


async def _overloaded(context: Context, why: str) -> NoReturn:
    """End a unary placement as RESOURCE_EXHAUSTED, with the retry delay in the trailer."""
    context.set_trailing_metadata((("retry-after-ms", str(OVERLOAD_RETRY_MS)),))
    await context.abort(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the Conductor is overloaded ({why}); retry after {OVERLOAD_RETRY_MS} ms",
    )
    raise AssertionError("unreachable")  # abort raises


def _stream_error(request_id: str, exc: RequestError) -> pb.ScheduleStreamResponse:
    error = pb.StreamError(code=CODES[exc.kind].value[0], message=str(exc))
    return pb.ScheduleStreamResponse(request_id=request_id, error=error)
