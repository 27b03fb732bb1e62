"""One completion request's way through a Router, in five stages:

    prepare  check, tokenize and hash it                              (`prepare`)
    place    ask the Conductor (or the local fallback) where it runs  (`placer`)
    settle   wait for the KV the placement moves: where it runs then  (`kv_moves`)
    relay    forward the client's body to that engine, relay its answer (`proxy`); when the
             engine refuses the connection, once more to one other instance the fallback
             picks (the refusing one is suspect for a while)
    report   tell the Conductor how it went, in the background        (`finish`)

The server (`server`) runs it inside the request's SERVER span, once the client is known and
counted, and turns what it raises (`ApiError`) into the client's error response.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.inference_api.openai_api import ApiError
from services.common.telemetry.spans import child_span
from services.router.auth import Tenant
from services.router.finish import RequestOutcome, finish_report
from services.router.kv_moves import Forward, KvMoves
from services.router.lora import AdapterLoader
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, PlacementQuery
from services.router.placer import Placer
from services.router.prepare import Api, Call, Preparer
from services.router.proxy import EngineFailed, EngineRefused, Relayed, Upstream

log = logging.getLogger(__name__)

_PROPAGATOR: Final = TraceContextTextMapPropagator()


def bad_gateway(message: str) -> ApiError:
    return ApiError(502, message, type_="upstream_error", code="bad_gateway")


class Pipeline:
    """The stages of a completion (see the module docstring); holds no state of its own
    between requests."""

    def __init__(
        self,
        preparer: Preparer,
        placer: Placer,
        kv_moves: KvMoves,
        upstream: Upstream,
        *,
        adapters: AdapterLoader,
        metrics: RouterMetrics,
        tracer: Tracer,
    ) -> None:
        self._adapters = adapters
        self._preparer = preparer
        self._placer = placer
        self._kv_moves = kv_moves
        self._upstream = upstream
        self._metrics = metrics
        self._tracer = tracer

    async def run(
        self,
        request: web.Request,
        api: Api,
        tenant: Tenant,
        arrived: float,
        reply: dict[str, str],
    ) -> web.StreamResponse:
        """Serve one completion request of `tenant` that came by `api`; fills `reply` with our
        headers for the client's response as it goes. Raises `ApiError` for what the client
        gets as one."""
        call = await self._preparer.prepare(request, api, tenant, arrived, reply)
        placement = await self.place(call.query, call.arrived)
        await self.adapt(call, placement)
        headers = engine_headers(call.query, call.client_request_id)
        forward = await self.settle(request.path, call, placement, headers)
        return await self.relay(request, call, forward, headers)

    async def place(self, query: PlacementQuery, arrived: float | None = None) -> Placement:
        """Where the request goes; `arrived` (perf_counter) lets admission count the time it
        already spent here against its TTFT objective."""
        with child_span(self._tracer, "placement") as span:
            started = time.perf_counter()
            placement = await self._placer.place(query, traced=span.is_recording(), arrived=arrived)
            self._metrics.placement.observe(time.perf_counter() - started)
            if span.is_recording():
                _annotate(span, placement)
        return placement

    async def adapt(self, call: Call, placement: Placement) -> None:
        """Load (after unloading what makes room) the LoRA adapter the placement needs on its
        instance and decode instance. One that cannot be loaded fails the request (503),
        reported to the Conductor as such."""
        for url, change in (
            (placement.url, placement.adapter_change),
            (placement.decode_url, placement.decode_adapter_change),
        ):
            if url and (change.load or change.unload):
                try:
                    with child_span(self._tracer, "adapter_load") as span:
                        span.set_attribute("kvsched.adapter", change.load)
                        await self._adapters.change(self._upstream.session, url, change)
                except ApiError:
                    self.report(call, placement, None)
                    raise

    async def settle(
        self, path: str, call: Call, placement: Placement, headers: dict[str, str]
    ) -> Forward:
        """Wait for the KV the placement moves (see `kv_moves`); returns where the request
        goes. Stamps `headers` with the request's trace context when a prefill goes first."""
        if not (placement.transfers or placement.landing):
            return Forward(placement)
        _PROPAGATOR.inject(headers)  # the prefill of a hand-off: under the request's span
        known = {i.instance_id: i.url for i in self._placer.instances}
        return await self._kv_moves.settle(
            placement, path=path, body=call.body, headers=headers, source_url=known
        )

    async def relay(
        self, request: web.Request, call: Call, forward: Forward, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Relay to the engine `forward` names; when that one refuses the connection, to one
        other instance the fallback picks. Reports every attempt that was placed."""
        req, query, reply = call.req, call.query, call.reply
        path = request.path
        # No usage will come when a stream was not asked for it: then count events instead.
        count_events = req.stream and not req.include_usage
        attempt = forward.placement
        with child_span(self._tracer, "upstream", SpanKind.CLIENT) as span:
            _PROPAGATOR.inject(headers)  # traceparent: this span (unsampled: the request's)
            for tries in (1, 2):
                _stamp(reply, attempt)
                span.set_attribute("kvsched.instance", attempt.instance_id)
                if tries == 1:
                    self._metrics.overhead.observe(time.perf_counter() - call.arrived)
                instance = attempt.instance_id
                self._placer.begin(instance)
                try:
                    response, relayed = await self._upstream.relay(
                        request,
                        attempt.url + path,
                        call.body,
                        headers,
                        reply,
                        count_events=count_events,
                    )
                except EngineRefused:
                    self._placer.suspect(attempt.instance_id)
                    self.report(call, attempt, None, forward.prefill_instance_id)
                    if tries == 2:
                        raise bad_gateway("The inference engine refused the connection.") from None
                    try:
                        attempt = self._placer.fallback(
                            query, "refused", exclude=(attempt.instance_id,)
                        )
                    except ApiError as err:
                        if err.status == 429:  # the others are at the fallback's bound
                            raise
                        raise bad_gateway(
                            "The inference engine refused the connection and no other is up."
                        ) from None
                    await self.adapt(call, attempt)
                    continue
                except EngineFailed as exc:
                    self.report(call, attempt, None, forward.prefill_instance_id)
                    log.warning("engine %s failed before answering: %s", instance, exc)
                    raise bad_gateway(f"The inference engine failed ({exc.kind}).") from None
                finally:
                    self._placer.end(instance)
                span.set_attribute("http.response.status_code", relayed.status)
                self.report(call, attempt, relayed, forward.prefill_instance_id)
                if relayed.ok and req.stream and relayed.first_byte_at is not None:
                    self._metrics.ttft.observe(relayed.first_byte_at - call.arrived)
                return response
        raise AssertionError("unreachable")  # the second try returns or raises

    def report(
        self,
        call: Call,
        placement: Placement,
        relayed: Relayed | None,
        prefill_instance_id: str = "",
    ) -> None:
        """Tell the Conductor how a request it placed went (in the background); when another
        instance ran its prefill (a hand-off), `placement` names the one that decoded."""
        outcome = RequestOutcome(
            req=call.req,
            query=call.query,
            placement=placement,
            relayed=relayed,
            arrived=call.arrived,
            ended=time.perf_counter(),
            prefill_instance_id=prefill_instance_id,
        )
        report = finish_report(outcome)
        if report is not None:
            self._placer.finish(report)


def engine_headers(query: PlacementQuery, client_request_id: str | None = None) -> dict[str, str]:
    """The headers an engine gets with the client's body (the trace context comes later):
    the request id is the client's own where it sent one (vLLM names the request by it),
    else ours."""
    headers = {
        "Content-Type": "application/json",
        "Accept-Encoding": "identity",
        "x-request-id": client_request_id or query.request_id,
    }
    if query.session_id:
        headers["x-session-id"] = query.session_id
    return headers


def _stamp(reply: dict[str, str], placement: Placement) -> None:
    reply["x-kvsched-instance"] = placement.instance_id
    if placement.by_conductor:
        reply.pop("x-kvsched-fallback", None)
        if placement.policy:
            reply["x-kvsched-policy"] = placement.policy
    else:
        reply.pop("x-kvsched-policy", None)
        reply["x-kvsched-fallback"] = "1"


def _annotate(span: trace.Span, placement: Placement) -> None:
    span.set_attribute("kvsched.instance", placement.instance_id)
    span.set_attribute("kvsched.rule", placement.rule)
    span.set_attribute("kvsched.expected_cached_tokens", placement.expected_cached_tokens)
    if placement.policy:
        span.set_attribute("kvsched.policy", placement.policy)
    if placement.fallback is not None:
        span.set_attribute("kvsched.fallback", placement.fallback)
