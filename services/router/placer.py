"""Where a request goes: the Conductor's decision over one long-lived placement stream, or
the Router's own (`local_placement`) when the Conductor is unreachable.

Conductor path. Every placement and completion rides one `PlacementStream` per Router (one
HTTP/2 stream, answers matched by request id; those queued together share one message and
a lone placement or completion goes at once: `stream_batches`). The
exception is a request whose trace is sampled: a stream's gRPC metadata (and so its
`traceparent`) is fixed when the stream opens, so a placement on it cannot be the parent of
the Conductor's work. A sampled request is
placed with the unary `Schedule` call instead, inside the caller's `placement` span, so the
Conductor's server span is its child. Sampling (`OTEL_TRACES_SAMPLER_ARG`) thus also bounds
how many placements leave the stream; with no trace export nothing is sampled.

Overload. A placement the Conductor does not answer within `timeout_s` is shed: the client
gets 429 + Retry-After, and the late decision is released (Finish with ok=False on its
instance) so the Conductor does not count it in flight forever. A busy Conductor is not a
down one: deciding alone there would admit without the SLO estimate, and the queues it was
protecting would fill at the engines instead (see `overload`). At most `max_placing`
requests wait for an answer at once; more are shed without asking.

Fallback. The Router keeps the last instance list (`ListInstances` every `refresh_s` seconds)
and decides locally only when the Conductor is unreachable: the refresh or a placement got
UNAVAILABLE (connection refused, no leader), not merely no answer in time. Completions of
fallback placements are not reported: the Conductor never placed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from clients.python import ConductorClient, ConductorError, InvalidRequest, Rejected, Unavailable
from clients.python.placement_stream import PlacementStream
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import AdapterChange
from services.common.inference_api.openai_api import bad_request, rate_limited
from services.router.local_placement import LocalPlacer
from services.router.metrics import RouterMetrics
from services.router.overload import BoundedCount, shed
from services.router.placement import KnownInstance, Placement, PlacementQuery, PlannedTransfer

log = logging.getLogger(__name__)

# What says the Conductor is unreachable rather than slow: nothing listens, or no leader.
UNREACHABLE: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION})


class Placer(LocalPlacer):
    """Placement for one Router: the Conductor's, over its placement stream, and the instance
    list it keeps for the Router's own placement (`LocalPlacer`: the fallback, pass-through
    requests)."""

    def __init__(
        self,
        client: ConductorClient,
        metrics: RouterMetrics,
        *,
        timeout_s: float,
        refresh_s: float,
        suspect_s: float = 5.0,
        max_placing: int = 256,
        fallback_max_in_flight: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            metrics, suspect_s=suspect_s, fallback_max_in_flight=fallback_max_in_flight, clock=clock
        )
        self._client = client
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._stream: PlacementStream | None = None
        # Each model's context as its engines said it (vLLM's max_model_len), kept in place:
        # the Preparer reads this dict.
        self.contexts: dict[str, int] = {}
        self._placing = BoundedCount(max_placing, metrics.placing, metrics.placing_limit)
        self._up = True  # optimistic until the first refresh says otherwise
        self._refresher: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        metrics.conductor_up.set(1)

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the placement stream and start refreshing the instance list; waits (briefly)
        for a first list so the first requests can fall back if they must."""
        # Opened outside any request and unsampled: a span as long as the stream would hang
        # off the first request's trace, or make a day-long trace of its own; the placements
        # worth tracing take the unary path anyway.
        loop = asyncio.get_running_loop()
        stream = self._client.placement_stream()
        self._stream = await loop.create_task(stream.__aenter__(), context=_unsampled_context())
        first = loop.create_task(self.refresh(), context=_unsampled_context())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, 4 * self._timeout_s)):
                await first
        self._refresher = loop.create_task(
            self._refresh_loop(), name="kvsched-router-instances", context=_unsampled_context()
        )

    async def stop(self) -> None:
        """Stop refreshing, send the completions still queued, close the stream."""
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._client.deadline_s)
        if self._stream is not None:
            await self._stream.close()

    # ---- state -----------------------------------------------------------------------

    @property
    def conductor_up(self) -> bool:
        return self._up

    @property
    def conductor_leader(self) -> str:
        return self._client.current_leader or ""

    def _set_up(self, up: bool) -> None:
        if up != self._up:
            log.warning("Conductor %s", "reachable again" if up else "unreachable: fallback on")
        self._up = up
        self._metrics.conductor_up.set(1 if up else 0)

    async def refresh(self) -> None:
        """Fetch the instance list once; marks the Conductor up or down."""
        try:
            statuses = await self._client.list_instances()
        except ConductorError as exc:
            log.debug("instance list refresh failed: %s", exc.code.name)
            if exc.code in UNREACHABLE:
                self._set_up(False)
            return  # slow, not gone: placements keep going to it (and are shed when late)
        self._instances = tuple(
            KnownInstance(s.spec.instance_id, s.spec.url.rstrip("/"), s.spec.model)
            for s in statuses
            # The fallback sends whole requests: decode-only instances cannot take them.
            if s.spec.role != common.ROLE_DECODE and s.spec.url
        )
        learned: dict[str, int] = {}
        for s in statuses:  # a model's context: the least its engines said
            if s.spec.max_model_len:
                model, n = s.spec.model, s.spec.max_model_len
                learned[model] = min(learned.get(model, n), n)
        if learned != self.contexts:
            self.contexts.clear()
            self.contexts.update(learned)
        self._metrics.instances_known.set(len(self._instances))
        self._set_up(True)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            with contextlib.suppress(TimeoutError):  # slow: the next round asks again
                async with asyncio.timeout(max(2.0, 2 * self._refresh_s)):
                    await self.refresh()

    # ---- placement -------------------------------------------------------------------

    async def place(
        self, query: PlacementQuery, *, traced: bool = False, arrived: float | None = None
    ) -> Placement:
        """The Conductor's decision, or the fallback's while the Conductor is unreachable.
        `arrived` (a `time.perf_counter()` reading) is when the request reached the Router:
        the Conductor's admission counts the time since against the TTFT objective.
        Raises `ApiError`: 429 (rejected by admission with the Conductor's retry delay, or
        shed: too many waiting, no answer in time, or the fallback's bound), 400 (the
        Conductor refuses the request as malformed), 503 (no instance is known)."""
        if not self._up:
            return self.fallback(query, "conductor_down")
        assert self._stream is not None, "start() first"
        if not self._placing.enter():
            self._metrics.shed.labels("placing").inc()
            raise shed("too many requests are waiting for a placement")
        try:
            return await self._ask(query, self._stream, traced=traced, arrived=arrived)
        finally:
            self._placing.leave()

    async def _ask(
        self, query: PlacementQuery, stream: PlacementStream, *, traced: bool, arrived: float | None
    ) -> Placement:
        message = pb.ScheduleRequest(
            request_id=query.request_id,
            prompt_tokens=query.prompt_tokens,
            output_tokens=query.output_tokens,
            packed_block_hashes=query.packed_hashes,
            session_id=query.session_id,
            model=query.model,
            adapter=query.adapter,
            adapter_bytes=query.adapter_bytes,
        )
        if arrived is not None:
            message.queued.FromNanoseconds(max(0, round((time.perf_counter() - arrived) * 1e9)))
        loop = asyncio.get_running_loop()
        task: asyncio.Task[pb.Decision]
        if traced:  # in this context: the gRPC client span nests under the caller's span
            task = loop.create_task(self._client.schedule(message))
        else:
            task = loop.create_task(stream.schedule(message), context=contextvars.Context())
        done, _ = await asyncio.wait((task,), timeout=self._timeout_s)
        if not done:
            task.add_done_callback(lambda t: self._release_late(t, query))
            self._metrics.shed.labels("timeout").inc()
            raise shed("the scheduler did not answer in time")
        try:
            decision = task.result()
        except Rejected as exc:
            raise rate_limited(
                f"No instance can serve this request now: {exc.message}",
                exc.retry_after_s if exc.retry_after_s is not None else 1.0,
            ) from None
        except InvalidRequest as exc:
            raise bad_request(f"The request cannot be placed: {exc.message}") from None
        except Unavailable as exc:
            if exc.code not in UNREACHABLE:  # the stream gave up waiting: slow, not gone
                self._metrics.shed.labels("deadline").inc()
                raise shed("the scheduler did not answer in time") from None
            return self.fallback(query, "unavailable")
        except ConductorError as exc:  # cancelled at shutdown, internal errors
            log.debug("placement failed (%s); falling back", exc.code.name)
            return self.fallback(query, "error")
        self._session_hosts.placed(query.session_id, decision.instance_id)
        decode = decision.decode_instance_id
        return Placement(
            request_id=query.request_id,
            instance_id=decision.instance_id,
            url=decision.instance_url.rstrip("/"),
            policy=decision.policy,
            rule=decision.rule,
            expected_cached_tokens=decision.cached_tokens,
            decode_instance_id=decode if decode != decision.instance_id else "",
            decode_url=decision.decode_instance_url.rstrip("/")
            if decode != decision.instance_id
            else "",
            transfers=tuple(map(planned, decision.transfers)),
            landing=tuple(map(planned, decision.landing)),
            adapter_change=_change(decision.adapter_change),
            decode_adapter_change=_change(decision.decode_adapter_change),
        )

    # ---- completions -----------------------------------------------------------------

    def finish(self, request: pb.FinishRequest) -> None:
        """Report a completion on the stream, in the background (errors are only logged)."""
        if self._stream is None or not self._up:
            return  # a Conductor that is down will not take it; it is not worth queueing
        self._spawn(self._finish(self._stream, request))

    async def _finish(self, stream: PlacementStream, request: pb.FinishRequest) -> None:
        try:
            await stream.finish(request)
        except ConductorError as exc:
            log.debug("finish of %s not recorded: %s", request.request_id, exc.code.name)

    def _release_late(self, task: asyncio.Task[pb.Decision], query: PlacementQuery) -> None:
        if task.cancelled() or task.exception() is not None:
            return  # retrieved: nothing to release
        decision = task.result()
        self.finish(
            pb.FinishRequest(
                request_id=query.request_id,
                session_id=query.session_id,
                instance_id=decision.instance_id,
                prompt_tokens=query.prompt_tokens,
                packed_block_hashes=query.packed_hashes,
                ok=False,
            )
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def planned(plan: common.TransferPlan) -> PlannedTransfer:
    """A transfer of a Conductor's decision, as the Router follows it (`kv_moves`)."""
    return PlannedTransfer(
        plan.transfer_id, plan.kind, plan.source_instance_id, plan.on_critical_path
    )


def _unsampled_context() -> contextvars.Context:
    """A context whose current span is a non-sampled one: the gRPC calls made in it (the
    placement stream, the instance refresh once a second) make no traces of their own."""
    span = NonRecordingSpan(
        SpanContext(
            trace_id=random.getrandbits(128) or 1,
            span_id=random.getrandbits(64) or 1,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.DEFAULT),
        )
    )
    ctx = contextvars.Context()
    ctx.run(otel_context.attach, trace.set_span_in_context(span))
    return ctx


def _change(msg: pb.AdapterChange) -> AdapterChange:
    return AdapterChange(msg.load, msg.unload)
