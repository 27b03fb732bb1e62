"""The placement RPCs: Schedule, Finish, and ScheduleStream (both over one stream).

A placement is counted, its transfers start at once, and it names the transfers under way
that it must wait for. A placement that rebound a session is answered only once the binding
is in etcd, so a new leader places the session's next turn where this one did.

Under overload (see `backpressure`) a placement is refused with RESOURCE_EXHAUSTED before it
is decided: when too many wait for an answer, when one waited too long to be decided, or
when the etcd write-behind is too far behind. A stream reads its items into a queue of its
own as they come and decides them in turn (`stream_queues`), so a refusal at the door is
answered without waiting behind the decisions queued before it; items may come coalesced in
one message, and their answers then go back coalesced too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from opentelemetry import trace

from clients.python.stream_batches import BATCH_ITEMS_METADATA
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.decision import Decision, TransferPlan
from kvsched.core.requests import RequestError
from services.common.store.interface import StoreError
from services.conductor import placement_messages
from services.conductor.backpressure import OVERLOAD_RETRY_MS, PendingPlacements
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics
from services.conductor.rpc_status import CODES, Context, abort, require_leader
from services.conductor.stream_queues import MAX_BATCH_ITEMS, StreamQueues
from services.conductor.streams import OpenStreams
from services.conductor.term import CurrentTerm
from services.conductor.transfer_runner import TransferRunner


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
            info = placement_messages.request_info(
                request, scheduler.limits.max_blocks, self.time_scale
            )
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
        plans = list(
            state.scheduler.finish(placement_messages.completion(state, request, now), now)
        )
        self.metrics.reported_cached_tokens.inc(request.cached_tokens)
        self.transfers.launch(plans)
        return pb.FinishResponse(
            transfers=[placement_messages.transfer_message(state, p) for p in plans]
        )

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

    async def durable(self, context: Context | None) -> None:
        """Wait for the session binding just made to reach etcd."""
        try:
            await self.sync()
        except StoreError as exc:
            if context is None:
                raise
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"etcd did not take the session binding: {exc}"
            )

    def outbox_full(self) -> bool:
        full = self.pending.outbox_full(self.current().outbox.bindings)
        if full:
            self.metrics.decisions.labels("overloaded").inc()
        return full

    # ---- unary ---------------------------------------------------------------------------

    async def Schedule(self, request: pb.ScheduleRequest, context: Context) -> pb.ScheduleResponse:
        await require_leader(self.leadership, context)
        if self.outbox_full():
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
                f"rejected by {decision.rule}; retry after {retry_ms} ms",
            )
        if rebound:
            await self.durable(context)
        return pb.ScheduleResponse(
            decision=placement_messages.decision_message(
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

    def stream_answer(
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
                rejection = placement_messages.rejection_message(decision)
                return pb.ScheduleStreamResponse(request_id=rid, rejection=rejection), False
            msg = placement_messages.decision_message(
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
        # Says this Conductor takes batched items (and how many a message): a client sends
        # batches only after reading it, so an older Conductor never gets one.
        await context.send_initial_metadata(((BATCH_ITEMS_METADATA, str(MAX_BATCH_ITEMS)),))
        stream = StreamQueues(self, asyncio.get_running_loop().time)
        reader = asyncio.create_task(stream.read(request_iterator))
        decider = asyncio.create_task(stream.decide())
        self.streams.add(stream.answers)  # a lost term ends the stream (a None) at once
        try:
            async for message in stream.outgoing():
                yield message
            await require_leader(self.leadership, context)  # ended by a lost term: who leads
        finally:
            self.streams.discard(stream.answers)
            reader.cancel()
            decider.cancel()
            for task in stream.waiting:
                task.cancel()
            stream.drop_undecided()  # also when the decider was cancelled before it ran


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
