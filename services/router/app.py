"""One Router process: the OpenAI-compatible HTTP front, its gRPC admin API, and the wiring
of authentication, tokenization, placement and the upstream relay.

HTTP is aiohttp on uvloop rather than FastAPI/uvicorn: the request body is read once and
forwarded as bytes (no pydantic model re-validating and re-serialising it on the hot path),
a streaming response is written chunk by chunk as the engine produces it, and aiohttp is the
one mature client and server library the project already uses (the Conductor's admin HTTP),
so the upstream client pool and the server share an event loop and a dependency.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not), `GET
/v1/models`, `GET /health` (503 while draining), `GET /metrics` (Prometheus). A completion:
authenticate (tenant) → read and parse the body → tokenize and hash the prompt in one call
on a thread pool (HF tokenizers releases the GIL) → place (`placement`) → forward the
client's body, with the tenant's `cache_salt`, to the chosen engine and relay its answer
(`proxy`) → report the completion to the Conductor in the background. Every response carries
`x-kvsched-request-id`, and once placed `x-kvsched-instance` plus `x-kvsched-policy` (the
Conductor decided) or `x-kvsched-fallback: 1` (the local fallback did).

Errors are OpenAI error JSON: 400, 401, 429 with Retry-After, 502 (the engine failed before
answering), 503 (no instance, or draining); an engine's own error status passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, cast
from urllib.parse import quote

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clients.python import ConductorClient, Interceptor
from kvsched.api.conductor.v1 import conductor_service_pb2 as cpb
from kvsched.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from services.common.durations import duration
from services.common.http_site import start_site
from services.common.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    CompletionRequest,
    Kind,
    PromptTokenizer,
    bad_request,
    check_length,
    parse_request,
    read_json,
    unavailable,
)
from services.common.telemetry import (
    TelemetrySettings,
    client_interceptors,
    get_tracer,
    server_interceptor,
    setup_tracing,
    shutdown_tracing,
)
from services.common.tls import channel_credentials
from services.router.auth import Authenticator
from services.router.grpc_service import SERVICE_NAME, RouterServicer
from services.router.kv_moves import Forward, KvMoves
from services.router.metrics import RouterMetrics
from services.router.placement import Placement, PlacementQuery, Placer
from services.router.proxy import EngineFailed, EngineRefused, Relayed, Upstream, with_cache_salt
from services.router.settings import RouterSettings

log = logging.getLogger(__name__)

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_SESSION_SAFE: Final = "-._~:@!$&'()*+,;=/"  # kept as they are (no '%', no space)
# Prompts up to this many characters (or token ids) are tokenized and hashed on the event
# loop: at most ~80 µs of work (demo tokenizer), less than a pool thread's round trip costs.
INLINE_PROMPT_CHARS: Final = 256
COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the tokenizer thread makes of a request."""

    prompt_tokens: int
    output_tokens: int  # at most, within the context
    block_hashes: list[int]
    body: bytes  # what the engine gets


@dataclass(frozen=True, slots=True)
class _Call:
    """One completion request on its way to an engine."""

    req: CompletionRequest
    query: PlacementQuery
    body: bytes  # what the engine gets
    arrived: float  # perf_counter() when the request came in
    reply: dict[str, str]  # our headers for the client's response (filled as we go)


def bad_gateway(message: str) -> ApiError:
    return ApiError(502, message, type_="upstream_error", code="bad_gateway")


class Router:
    """A Router: `start()`, serve, `drain()`, `stop()`."""

    def __init__(
        self,
        settings: RouterSettings,
        *,
        tracer_provider: TracerProvider | None = None,
        authenticator: Authenticator | None = None,
    ) -> None:
        self.settings = s = settings
        self.metrics = RouterMetrics()
        self.tracer_provider = tracer_provider or setup_tracing(
            TelemetrySettings("kvsched-router", s.otlp_endpoint)
        )
        self._own_provider = tracer_provider is None
        self.tracer = get_tracer(self.tracer_provider)
        if authenticator is None:
            authenticator = (
                Authenticator.open()
                if s.no_auth
                else Authenticator.from_file(s.api_keys or "")  # settings demand one of them
            )
        self.auth = authenticator
        self.tokenizer = PromptTokenizer(s.tokenizer)
        self.hasher = s.block_hashes.hasher(s.block_size)
        self.aliases = dict(s.model_aliases)
        self._pool = ThreadPoolExecutor(s.tokenizer_threads, thread_name_prefix="kvsched-tok")
        self.client = ConductorClient(
            s.conductors,
            # Short: a placement past `placement_timeout_s` is served by the fallback anyway,
            # and a dead Conductor should be noticed within a refresh or two.
            deadline_s=1.0,
            retries=2,
            credentials=channel_credentials(s.conductor_tls),
            # (grpc-stubs types aio.ClientInterceptor as a placeholder that needs a cast)
            interceptors=cast("list[Interceptor]", client_interceptors(self.tracer)),
        )
        self.placer = Placer(
            self.client,
            self.metrics,
            timeout_s=s.placement_timeout_s,
            refresh_s=s.instances_refresh_s,
            suspect_s=s.suspect_s,
        )
        self.upstream = Upstream(
            self.metrics, timeout_s=s.upstream_timeout_s, max_connections=s.max_connections
        )
        self.kv_moves = KvMoves(
            self.client, self.upstream, self.metrics, self.tracer, wait_s=s.transfer_wait_s
        )
        self.health = health_aio.HealthServicer()
        self.draining = False
        self.streams_open = 0
        self.requests_served = 0
        self._idle: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._started_at = int(time.time())
        self.url = ""  # http://host:port once started
        self.grpc_url = ""  # host:port once started
        self.app = web.Application(client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post(COMPLETIONS, self.completions),
                web.post(CHAT, self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health_check),
                web.get("/metrics", self.prometheus),
            ]
        )

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Open the upstream pool and the placement stream, then listen (HTTP and gRPC)."""
        s = self.settings
        self._idle = asyncio.Event()
        self._idle.set()
        await self.upstream.start()
        await self.placer.start()
        self._runner, port = await start_site(
            self.app, s.listen, backlog=s.backlog, shutdown_timeout=5.0
        )
        self.url = f"http://{s.listen.rpartition(':')[0]}:{port}"
        self.grpc_url = await self._start_grpc()
        log.info(
            "Router %s listening on %s (gRPC %s); %s",
            s.router_id,
            self.url,
            self.grpc_url,
            f"{self.auth.tenants} tenants" if self.auth.enabled else "no auth",
        )

    async def _start_grpc(self) -> str:
        server = grpc.aio.server(interceptors=[server_interceptor(self.tracer)])
        rpb_grpc.add_RouterServiceServicer_to_server(RouterServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        listen = self.settings.grpc_listen
        port = server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        self._grpc = server
        await self._set_health()
        return f"{listen.rpartition(':')[0]}:{port}"

    async def _set_health(self) -> None:
        state = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self.draining
            else health_pb2.HealthCheckResponse.SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, state)

    async def set_draining(self, draining: bool) -> None:
        """Refuse (or accept again) new requests; open streams are not touched."""
        if draining != self.draining:
            log.info("Router %s %s", self.settings.router_id, "draining" if draining else "resumes")
        self.draining = draining
        await self._set_health()

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait (up to `timeout_s`) for open ones to finish; returns
        whether they all did."""
        await self.set_draining(True)
        assert self._idle is not None, "start() first"
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Close the listeners (requests still running get a few seconds), report what is
        queued to the Conductor, close the pools."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        await self.placer.stop()
        await self.upstream.close()
        await self.client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_provider:
            await asyncio.to_thread(shutdown_tracing, self.tracer_provider)

    # ---- completions -----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion", COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat", CHAT)

    async def _serve(self, request: web.Request, kind: Kind, route: str) -> web.StreamResponse:
        """One completion request inside its SERVER span; every failure becomes an OpenAI
        error response (a bug is logged, the client gets a plain 500)."""
        arrived = time.perf_counter()
        span = self.tracer.start_span(
            f"POST {route}",
            context=_PROPAGATOR.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route, "url.path": route},
        )
        reply: dict[str, str] = {}
        status = 500
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                response = await self._complete(request, kind, route, arrived, reply)
            status = response.status
            return response
        except ApiError as err:
            status = err.status
            return err.response(reply)
        except Exception:
            log.exception("request failed")
            return ApiError(500, "internal error", type_="internal_error").response(reply)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
            self.requests_served += 1
            self.metrics.requests.labels(route, str(status)).inc()

    async def _complete(
        self, request: web.Request, kind: Kind, route: str, arrived: float, reply: dict[str, str]
    ) -> web.StreamResponse:
        if self.draining:
            raise unavailable("This router is draining; send the request to another one.")
        tenant = self.auth.tenant(request.headers.get("Authorization"))
        self._opened()
        try:
            body = await read_json(request)
            raw = await request.read()  # the bytes read_json parsed (aiohttp keeps them)
            req = parse_request(kind, body)
            session = request.headers.get("x-session-id") or req.session_id
            scoped = session_key(tenant.name, session) if session else ""
            salt = tenant.cache_salt(req.cache_salt)
            with self.tracer.start_as_current_span("tokenize") as span:
                if _small(req):
                    prepared = self._prepare(req, raw, body, salt)
                else:
                    prepared = await asyncio.get_running_loop().run_in_executor(
                        self._pool, self._prepare, req, raw, body, salt
                    )
                span.set_attribute("kvsched.prompt_tokens", prepared.prompt_tokens)
                span.set_attribute("kvsched.blocks", len(prepared.block_hashes))
            rid = uuid.uuid4().hex
            reply["x-kvsched-request-id"] = rid
            query = PlacementQuery(
                rid, prepared.prompt_tokens, prepared.output_tokens, prepared.block_hashes, scoped
            )
            with self.tracer.start_as_current_span("placement") as span:
                started = time.perf_counter()
                placement = await self.placer.place(query, traced=span.is_recording())
                self.metrics.placement.observe(time.perf_counter() - started)
                if span.is_recording():
                    _annotate(span, placement)
            call = _Call(req, query, prepared.body, arrived, reply)
            return await self._forward(request, call, placement)
        finally:
            self._closed()

    def _prepare(
        self, req: CompletionRequest, raw: bytes, body: dict[str, Any], salt: str
    ) -> Prepared:
        """Tokenize, check the length, hash, and build the engine's body (thread-safe)."""
        served = self.aliases.get(req.model or "")
        if served is not None:  # the engines know the model by its served name only
            body = {**body, "model": served}
            raw = json.dumps(body).encode()
        ids = self.tokenizer.prompt_ids(req)
        if not ids:
            param = "messages" if req.kind == "chat" else "prompt"
            raise bad_request("The prompt is empty.", param)
        output = check_length(len(ids), req.max_tokens, self.settings.max_model_len)
        hashes = self.hasher.hash_prompt(ids, salt or None)
        return Prepared(len(ids), output, hashes, with_cache_salt(raw, body, salt))

    async def _forward(
        self, request: web.Request, call: _Call, placement: Placement
    ) -> web.StreamResponse:
        """Wait for the KV the placement moves (see `kv_moves`), then relay to the engine it
        settles on; when that one refuses the connection, to one other instance the fallback
        picks (the refusing one is suspect for a while)."""
        req, query, reply = call.req, call.query, call.reply
        path = request.path
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "x-request-id": query.request_id,
        }
        if query.session_id:
            headers["x-session-id"] = query.session_id
        # No usage will come when a stream was not asked for it: then count events instead.
        count_events = req.stream and not req.include_usage
        forward = Forward(placement)
        if placement.transfers or placement.landing:
            _PROPAGATOR.inject(headers)  # the prefill of a hand-off: under the request's span
            known = {i.instance_id: i.url for i in self.placer.instances}
            forward = await self.kv_moves.settle(
                placement, path=path, body=call.body, headers=headers, source_url=known
            )
        attempt = forward.placement
        with self.tracer.start_as_current_span("upstream", kind=SpanKind.CLIENT) as span:
            _PROPAGATOR.inject(headers)  # traceparent: this span
            for tries in (1, 2):
                _stamp(reply, attempt)
                span.set_attribute("kvsched.instance", attempt.instance_id)
                if tries == 1:
                    self.metrics.overhead.observe(time.perf_counter() - call.arrived)
                instance = attempt.instance_id
                self.placer.begin(instance)
                try:
                    response, relayed = await self.upstream.relay(
                        request,
                        attempt.url + path,
                        call.body,
                        headers,
                        reply,
                        count_events=count_events,
                    )
                except EngineRefused:
                    self.placer.suspect(attempt.instance_id)
                    self._report(call, attempt, None, forward.prefill_instance_id)
                    if tries == 2:
                        raise bad_gateway("The inference engine refused the connection.") from None
                    try:
                        attempt = self.placer.fallback(
                            query, "refused", exclude=(attempt.instance_id,)
                        )
                    except ApiError:
                        raise bad_gateway(
                            "The inference engine refused the connection and no other is up."
                        ) from None
                    continue
                except EngineFailed as exc:
                    self._report(call, attempt, None, forward.prefill_instance_id)
                    log.warning("engine %s failed before answering: %s", instance, exc)
                    raise bad_gateway(f"The inference engine failed ({exc.kind}).") from None
                finally:
                    self.placer.end(instance)
                span.set_attribute("http.response.status_code", relayed.status)
                self._report(call, attempt, relayed, forward.prefill_instance_id)
                if relayed.ok and req.stream and relayed.first_byte_at is not None:
                    self.metrics.ttft.observe(relayed.first_byte_at - call.arrived)
                return response
        raise AssertionError("unreachable")  # the second try returns or raises

    def _report(
        self,
        call: _Call,
        placement: Placement,
        relayed: Relayed | None,
        prefill_instance_id: str = "",
    ) -> None:
        """Tell the Conductor how a request it placed went (in the background); when another
        instance ran its prefill (a hand-off), `placement` names the one that decoded."""
        if not placement.by_conductor:
            return
        req, query, arrived = call.req, call.query, call.arrived
        now = time.perf_counter()
        usage = relayed.usage if relayed is not None else None
        # Counts come from the engine's usage when the answer carries it: always without
        # streaming, and on a stream when the client asked for include_usage. Otherwise the
        # Router estimates rather than parse every chunk: cached tokens as the Conductor
        # expected them, output tokens as the number of SSE events (one token each, less
        # `[DONE]` and the chat role chunk).
        if usage is not None:
            output, cached = usage.completion_tokens, usage.cached_tokens
        elif relayed is not None:
            extra = 1 + (1 if req.kind == "chat" else 0)
            output = max(relayed.events - extra, 0)
            cached = placement.expected_cached_tokens
        else:
            output, cached = 0, 0
        first = relayed.first_byte_at if relayed is not None else None
        # A non-streaming answer has no visible first token: its end-to-end time bounds it.
        ttft = (first if first is not None and req.stream else now) - arrived
        self.placer.finish(
            cpb.FinishRequest(
                request_id=query.request_id,
                session_id=query.session_id,
                instance_id=prefill_instance_id or placement.instance_id,
                decode_instance_id=placement.instance_id if prefill_instance_id else "",
                prompt_tokens=query.prompt_tokens,
                output_tokens=output,
                cached_tokens=min(cached, query.prompt_tokens),
                block_hashes=query.block_hashes,
                time_to_first_token=duration(ttft),
                end_to_end=duration(now - arrived),
                ok=relayed is not None and relayed.ok,
            )
        )

    def _opened(self) -> None:
        self.streams_open += 1
        self.metrics.streams_open.inc()
        assert self._idle is not None
        self._idle.clear()

    def _closed(self) -> None:
        self.streams_open -= 1
        self.metrics.streams_open.dec()
        if self.streams_open == 0:
            assert self._idle is not None
            self._idle.set()

    # ---- other routes ----------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """An engine's /v1/models when one answers, else the configured model."""
        try:
            self.auth.tenant(request.headers.get("Authorization"))
        except ApiError as err:
            self.metrics.requests.labels("/v1/models", str(err.status)).inc()
            return err.response()
        for inst in self.placer.instances[:2]:
            with contextlib.suppress(EngineFailed):
                status, data, content_type = await self.upstream.get(inst.url + "/v1/models")
                if status == 200:
                    self.metrics.requests.labels("/v1/models", "200").inc()
                    headers = {"x-kvsched-instance": inst.instance_id}
                    data = with_aliases(data, self.aliases)
                    return web.Response(body=data, content_type=content_type, headers=headers)
        self.metrics.requests.labels("/v1/models", "200").inc()
        model = {
            "id": self.settings.model,
            "object": "model",
            "created": self._started_at,
            "owned_by": "kvsched",
            "max_model_len": self.settings.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def health_check(self, request: web.Request) -> web.Response:
        body = {
            "status": "draining" if self.draining else "ok",
            "conductor": "up" if self.placer.conductor_up else "down",
            "instances": len(self.placer.instances),
        }
        return web.json_response(body, status=503 if self.draining else 200)

    async def prometheus(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _small(req: CompletionRequest) -> bool:
    """Whether tokenizing and hashing `req` costs less than handing it to a pool thread
    (0.1 ms of wake-ups and more on a busy machine): then it runs on the event loop."""
    if req.prompt_text is not None:
        return len(req.prompt_text) <= INLINE_PROMPT_CHARS
    return req.prompt_ids is not None and len(req.prompt_ids) <= INLINE_PROMPT_CHARS


def with_aliases(models: bytes, aliases: dict[str, str]) -> bytes:
    """An engine's `/v1/models` with a card for each alias of a model it lists (its `root`
    the served name); the engine's bytes themselves when there is nothing to add."""
    if not aliases:
        return models
    try:
        listing = json.loads(models)
        cards = [c for c in listing["data"] if isinstance(c, dict)]
    except (ValueError, TypeError, KeyError):
        return models
    served = {c.get("id"): c for c in cards}
    extra = [{**served[name], "id": alias, "root": name}
             for alias, name in aliases.items() if name in served]  # fmt: skip
    return json.dumps({**listing, "data": [*cards, *extra]}).encode() if extra else models


def session_key(tenant: str, session: str) -> str:
    """The session id the Conductor and the engine see: scoped by tenant (two tenants' "s1"
    are different sessions), and percent-encoded where it is not a plain token, so it is a
    valid header value (`x-session-id` to the engine) equal to what the Conductor is sent."""
    return f"{_quote(tenant)}/{_quote(session)}"


def _quote(text: str) -> str:
    return quote(text, safe=_SESSION_SAFE, errors="surrogatepass")


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
