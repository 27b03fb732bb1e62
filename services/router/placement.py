"""Where a request goes: the Conductor's decision over one long-lived placement stream, or
the Router's local fallback when the Conductor is slow or unreachable.

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
UNAVAILABLE (connection refused, no leader), not merely no answer in time. Its candidates
are the instances that serve the request's model. A session goes to
the instance the Conductor last placed it on, as this Router saw it (`session_hosts.py`:
during a leader change the session's turns keep finding their KV), else to its
rendezvous-hash instance (highest `xxh3_64(instance_id ‖ session)`; every Router computes
the same from the same list, so a session stays together across Routers), anything else to
the instance with the fewest requests in flight from this Router. Its admission rule is a
per-instance bound (`fallback_max_in_flight`) on the requests this Router has open there: a
session whose instance is full, or a request when every instance is, gets 429. It is coarser
than the Conductor's TTFT estimate (the Router sees neither the other Routers' load nor the
engines' caches), which is why it serves only while the Conductor cannot. An instance that
refused a connection is skipped for `suspect_s` seconds.

Completions of fallback placements are not reported: the Conductor never placed them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc
import xxhash
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from clients.python import ConductorClient, ConductorError, InvalidRequest, Rejected, Unavailable
from clients.python.placement_stream import PlacementStream
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import NO_CHANGE, AdapterChange
from services.common.openai_api import bad_request, rate_limited, unavailable
from services.router.metrics import RouterMetrics
from services.router.overload import BoundedCount, fits_instance, shed
from services.router.session_hosts import SessionHosts

log = logging.getLogger(__name__)

# What says the Conductor is unreachable rather than slow: nothing listens, or no leader.
UNREACHABLE: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION})


@dataclass(frozen=True, slots=True)
class KnownInstance:
    """An instance the fallback may pick."""

    instance_id: str
    url: str
    model: str = ""  # the model it serves ("": not said)


@dataclass(frozen=True, slots=True)
class PlacementQuery:
    """What the Conductor needs to place one request."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    packed_hashes: bytes  # the prompt's block hashes, packed (`clients.python.pack_hashes`)
    session_id: str  # tenant-scoped ("tenant/session"); empty for none
    model: str = ""  # the served model asked for ("": any instance)
    adapter: str = ""  # its LoRA adapter ("": the base model)
    adapter_bytes: int = 0


@dataclass(frozen=True, slots=True)
class PlannedTransfer:
    """A KV transfer the Conductor ordered with a decision."""

    transfer_id: str
    kind: int  # kvsched.common.v1.TransferKind
    source_instance_id: str
    on_critical_path: bool


def planned(plan: common.TransferPlan) -> PlannedTransfer:
    return PlannedTransfer(
        plan.transfer_id, plan.kind, plan.source_instance_id, plan.on_critical_path
    )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes, and who decided."""

    request_id: str
    instance_id: str
    url: str  # the engine's base URL
    policy: str  # the Conductor's policy; empty when the fallback decided
    rule: str
    expected_cached_tokens: int
    fallback: str | None = None  # why the local fallback decided; None: the Conductor did
    decode_instance_id: str = ""  # another instance decodes (disaggregated); "" for none
    decode_url: str = ""
    transfers: tuple[PlannedTransfer, ...] = ()
    # Transfers under way for earlier requests that bring KV this one counts on.
    landing: tuple[PlannedTransfer, ...] = ()
    # What the instance, and the decode instance, load and unload first (LoRA adapters).
    adapter_change: AdapterChange = NO_CHANGE
    decode_adapter_change: AdapterChange = NO_CHANGE

    @property
    def by_conductor(self) -> bool:
        return self.fallback is None


class Placer:
    """Placement for one Router: the Conductor stream, the instance list and the fallback."""

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
        self._client = client
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._suspect_s = suspect_s
        self._clock = clock
        self._stream: PlacementStream | None = None
        self._instances: tuple[KnownInstance, ...] = ()
        # Each model's context as its engines said it (vLLM's max_model_len), kept in place:
        # the Preparer reads this dict.
        self.contexts: dict[str, int] = {}
        self._suspects: dict[str, float] = {}  # instance id -> skipped until (clock)
        self._in_flight: dict[str, int] = {}
        self._rr = 0
        self._placing = BoundedCount(max_placing, metrics.placing, metrics.placing_limit)
        self._per_instance = fallback_max_in_flight
        metrics.fallback_instance_limit.set(fallback_max_in_flight)
        self._session_hosts = SessionHosts()
        self._up = True  # optimistic until the first refresh says otherwise
        self.fallback_decisions = 0
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

    @property
    def instances(self) -> tuple[KnownInstance, ...]:
        return self._instances

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

    # ---- in-flight and suspects (fed by the relay) -----------------------------------

    def begin(self, instance_id: str) -> None:
        self._in_flight[instance_id] = self._in_flight.get(instance_id, 0) + 1

    def end(self, instance_id: str) -> None:
        left = self._in_flight.get(instance_id, 0) - 1
        if left > 0:
            self._in_flight[instance_id] = left
        else:
            self._in_flight.pop(instance_id, None)

    def suspect(self, instance_id: str) -> None:
        """`instance_id` refused a connection: the fallback skips it for a while."""
        if instance_id not in self._suspects:
            log.warning(
                "instance %s refused a connection; skipped for %.0f s", instance_id, self._suspect_s
            )
        self._suspects[instance_id] = self._clock() + self._suspect_s

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

    def fallback(
        self, query: PlacementQuery, reason: str, exclude: Collection[str] = ()
    ) -> Placement:
        """Decide locally (see the module docstring); raises `ApiError` 503 with no candidate,
        429 when the chosen instance is at the per-instance bound."""
        now = self._clock()
        if self._suspects:
            for iid in [i for i, until in self._suspects.items() if until <= now]:
                del self._suspects[iid]
        candidates = [
            i
            for i in self._instances
            if i.instance_id not in self._suspects
            and i.instance_id not in exclude
            and (not query.model or i.model in ("", query.model))
        ]
        if not candidates:
            raise unavailable("No inference instance is available; try again shortly.")
        last = self._session_hosts.host(query.session_id) if query.session_id else None
        remembered = [i for i in candidates if i.instance_id == last]
        if remembered:
            chosen, rule = remembered[0], "fallback_session_last_host"
        elif query.session_id:
            chosen = rendezvous(candidates, query.session_id)
            rule = "fallback_session_hash"
        else:
            chosen = self._least_in_flight(candidates)
            rule = "fallback_least_in_flight"
        if not fits_instance(self._in_flight.get(chosen.instance_id, 0), self._per_instance):
            self._metrics.shed.labels("fallback_bound").inc()
            raise shed("the scheduler is unreachable and the instance is at its local bound")
        self.fallback_decisions += 1
        self._metrics.fallback.labels(reason).inc()
        return Placement(
            request_id=query.request_id,
            instance_id=chosen.instance_id,
            url=chosen.url,
            policy="",
            rule=rule,
            expected_cached_tokens=0,
            fallback=reason,
            # Nobody knows what the instance holds: load the adapter (a no-op where held).
            adapter_change=AdapterChange(load=query.adapter),
        )

    def any_instance(self, model: str, exclude: Collection[str] = ()) -> KnownInstance:
        """An instance serving `model` for a request no prefix places (`passthrough`): the
        one with the fewest requests in flight from this Router, suspects and `exclude`
        skipped; raises `ApiError` 503 when none is up."""
        now = self._clock()
        candidates = [
            i
            for i in self._instances
            if self._suspects.get(i.instance_id, 0.0) <= now
            and i.instance_id not in exclude
            and i.model in ("", model)
        ]
        if not candidates:
            raise unavailable("No inference instance is available; try again shortly.")
        return self._least_in_flight(candidates)

    def _least_in_flight(self, candidates: Sequence[KnownInstance]) -> KnownInstance:
        # Start the scan at a rotating position so ties (an idle cluster) spread round-robin.
        n = len(candidates)
        start = self._rr % n
        self._rr += 1
        best = candidates[start]
        best_load = self._in_flight.get(best.instance_id, 0)
        for k in range(1, n):
            inst = candidates[(start + k) % n]
            load = self._in_flight.get(inst.instance_id, 0)
            if load < best_load:
                best, best_load = inst, load
        return best

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


def rendezvous(candidates: Sequence[KnownInstance], session_id: str) -> KnownInstance:
    """Highest-random-weight choice: deterministic for a session and an instance set, and
    removing an instance moves only the sessions it had."""
    key = b"\x00" + session_id.encode()
    return max(
        candidates, key=lambda i: (xxhash.xxh3_64_intdigest(i.instance_id.encode() + key), i.url)
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
