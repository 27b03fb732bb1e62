"""One Router process: the OpenAI-compatible HTTP front and its gRPC admin API
(`admin_server`), from start to drain and stop, with the routes; each completion goes through
the request pipeline (`pipeline`).

HTTP is aiohttp on uvloop rather than FastAPI/uvicorn: the request body is read once and
forwarded as bytes (no pydantic model re-validating and re-serialising it on the hot path),
a streaming response is written chunk by chunk as the engine produces it, and aiohttp is the
one mature client and server library the project already uses (the Conductor's admin HTTP),
so the upstream client pool and the server share an event loop and a dependency.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not), `GET
/v1/models` and `/v1/models/{id}` (every served model: `model_cards`), `GET /health` (503
while draining), `GET /metrics` (Prometheus). A completion: refused while draining →
authenticate (tenant) → counted as open until it ends → the pipeline: prepare (read, check,
tokenize, hash) → place → settle (the KV it waits for) → relay to the engine → report to the
Conductor in the background. Every response carries `x-kvsched-request-id`, and once placed
`x-kvsched-instance` plus `x-kvsched-policy` (the Conductor decided) or
`x-kvsched-fallback: 1` (the local fallback did).

Errors are OpenAI error JSON: 400, 401, 429 with Retry-After (refused by admission, or shed
under overload: see `overload`), 502 (the engine failed before
answering), 503 with Retry-After (no instance, or draining), and aiohttp's own (404, 405, a
request it cannot parse: `http_errors`); an engine's own error status passes through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, cast

from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clients.python import ConductorClient, Interceptor
from services.common.inference_api.openai_api import ApiError, unavailable
from services.common.security.tls import channel_credentials
from services.common.serving.api_errors import unavailable_headers
from services.common.serving.client_errors import ClientErrorLog
from services.common.serving.http_errors import CLIENT_ERRORS, JsonErrorRunner, json_errors
from services.common.serving.http_site import start_site
from services.common.telemetry import (
    TelemetrySettings,
    client_interceptors,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
)
from services.router.admin_server import AdminServer
from services.router.auth import Authenticator, Tenant
from services.router.client_ids import client_request_id
from services.router.kv_moves import KvMoves
from services.router.lora import AdapterLoader
from services.router.metrics import RouterMetrics
from services.router.model_cards import ModelCards
from services.router.overload import BoundedCount, shed
from services.router.passthrough import ROUTES as PASS_THROUGH
from services.router.passthrough import PassThrough
from services.router.pipeline import Pipeline
from services.router.placer import Placer
from services.router.prepare import Preparer
from services.router.proxy import Upstream
from services.router.settings import RouterSettings

log = logging.getLogger(__name__)

_PROPAGATOR: Final = TraceContextTextMapPropagator()
COMPLETIONS: Final = "/v1/completions"
CHAT: Final = "/v1/chat/completions"
MESSAGES: Final = "/v1/messages"  # Anthropic's Messages API, as vLLM serves it
RESPONSES: Final = "/v1/responses"
# A request's work once admitted: (tenant, arrived, our reply headers) -> the response.
Serve = Callable[[Tenant, float, dict[str, str]], Awaitable[web.StreamResponse]]


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
        self.client_errors = ClientErrorLog(log)  # a client's mistakes: a few warnings, no flood
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
        self.preparer = Preparer(s, self.tracer)
        self.client = ConductorClient(
            s.conductors,
            # Short: a placement past `placement_timeout_s` is shed anyway, and a dead
            # Conductor should be noticed within a refresh or two.
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
            max_placing=s.max_placing,
            fallback_max_in_flight=s.fallback_max_in_flight,
        )
        self.in_flight = BoundedCount(
            s.max_in_flight, self.metrics.in_flight, self.metrics.in_flight_limit
        )
        self.upstream = Upstream(
            self.metrics, timeout_s=s.upstream_timeout_s, max_connections=s.max_connections
        )
        kv_moves = KvMoves(
            self.client, self.upstream, self.metrics, self.tracer, wait_s=s.transfer_wait_s
        )
        adapters = AdapterLoader(s.lora_modules)
        self.pipeline = Pipeline(
            self.preparer,
            self.placer,
            kv_moves,
            self.upstream,
            adapters=adapters,
            metrics=self.metrics,
            tracer=self.tracer,
        )
        self.preparer.contexts = self.placer.contexts
        self.passthrough = PassThrough(self.preparer, self.placer, self.upstream, adapters)
        self.model_cards = ModelCards(
            self.preparer, self.placer, self.upstream, auth=self.auth, metrics=self.metrics
        )
        self.admin = AdminServer(s, self.tracer)
        self.draining = False
        self.streams_open = 0
        self.requests_served = 0
        self._idle: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""  # http://host:port once started
        self.grpc_url = ""  # host:port once started
        # Every error as OpenAI error JSON, aiohttp's own (404, 405, unparsable) included.
        self.app = web.Application(
            client_max_size=self.preparer.max_body_bytes, middlewares=[json_errors]
        )
        self.app[CLIENT_ERRORS] = self.client_errors  # one budget for all its client errors
        self.app.add_routes(
            [
                web.post(COMPLETIONS, self.completions),
                web.post(CHAT, self.chat_completions),
                web.post(MESSAGES, self.messages),
                web.post(RESPONSES, self.responses),
                web.get("/v1/models", self.model_cards.models),
                web.get("/v1/models/{model}", self.model_cards.model),
                *(web.post(route, self.pass_through) for route in PASS_THROUGH),
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
        await self.preparer.start()
        await self.upstream.start()
        await self.placer.start()
        self._runner, port = await start_site(
            self.app,
            s.listen,
            backlog=s.backlog,
            runner_class=JsonErrorRunner,
            shutdown_timeout=5.0,
        )
        self.url = f"http://{s.listen.rpartition(':')[0]}:{port}"
        self.grpc_url = await self.admin.start(self, serving=not self.draining)
        log.info(
            "Router %s listening on %s (gRPC %s); %s",
            s.router_id,
            self.url,
            self.grpc_url,
            f"{self.auth.tenants} tenants" if self.auth.enabled else "no auth",
        )

    async def set_draining(self, draining: bool) -> None:
        """Refuse (or accept again) new requests; open streams are not touched."""
        if draining != self.draining:
            log.info("Router %s %s", self.settings.router_id, "draining" if draining else "resumes")
        self.draining = draining
        await self.admin.set_serving(not draining)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait (up to `timeout_s`) for open ones to finish; returns
        whether they all did."""
        await self.set_draining(True)
        assert self._idle is not None, "start() first"
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Close the listeners (requests still running get a few seconds), report what is
        queued to the Conductor, close the pools."""
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()
        await self.admin.stop(1.0)
        await self.placer.stop()
        await self.upstream.close()
        await self.client.close()
        await self.preparer.close()
        if self._own_provider:
            await asyncio.to_thread(shutdown_tracing, self.tracer_provider)

    # ---- completions -----------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(
            request, COMPLETIONS, partial(self.pipeline.run, request, "completion")
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT, partial(self.pipeline.run, request, "chat"))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        run = partial(self.pipeline.run, request, "messages")
        return await self._serve(request, MESSAGES, run, anthropic=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(
            request, RESPONSES, partial(self.pipeline.run, request, "responses")
        )

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, request.path, partial(self.passthrough.serve, request))

    async def _serve(
        self, request: web.Request, route: str, run: Serve, *, anthropic: bool = False
    ) -> web.StreamResponse:
        """One request inside its SERVER span; every failure becomes an error response,
        OpenAI's JSON or, with `anthropic`, Anthropic's (a bug is logged, the client gets a
        plain 500)."""
        arrived = time.perf_counter()
        span = self.tracer.start_span(
            f"POST {route}",
            context=_PROPAGATOR.extract(request.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "http.route": route, "url.path": route},
        )
        if (rid := client_request_id(request)) is not None:
            span.set_attribute("http.request.header.x-request-id", rid)
        reply: dict[str, str] = {}
        status = 500
        try:
            with trace.use_span(span, record_exception=False, set_status_on_exception=False):
                response = await self._admitted(request, run, arrived, reply)
            status = response.status
            return response
        except ApiError as err:
            status = err.status
            if _is_mistake(status):
                self.client_errors.warning("POST %s: %d %s", route, status, err.message)
            return err.response(reply, anthropic=anthropic)
        except Exception:
            log.exception("request failed")
            failed = ApiError(500, "internal error", type_="internal_error")
            return failed.response(reply, anthropic=anthropic)
        finally:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
            self.requests_served += 1
            self.metrics.requests.labels(route, str(status)).inc()

    async def _admitted(
        self, request: web.Request, run: Serve, arrived: float, reply: dict[str, str]
    ) -> web.StreamResponse:
        if self.draining:
            raise unavailable("This router is draining; send the request to another one.")
        tenant = self.auth.tenant_of(request.headers)
        # Before the body is read: a Router over its bound spends nothing more on a request.
        if not self.in_flight.enter():
            self.metrics.shed.labels("in_flight").inc()
            raise shed("too many requests in flight at this router")
        self._opened()
        try:
            return await run(tenant, arrived, reply)
        finally:
            self._closed()
            self.in_flight.leave()

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

    async def health_check(self, request: web.Request) -> web.Response:
        body = {
            "status": "draining" if self.draining else "ok",
            "conductor": "up" if self.placer.conductor_up else "down",
            "instances": len(self.placer.instances),
        }
        if self.draining:
            return web.json_response(body, status=503, headers=unavailable_headers())
        return web.json_response(body)

    async def prometheus(self, request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _is_mistake(status: int) -> bool:
    """Whether a status says the client sent what it should not have (not a 429: that one
    says the cluster is busy)."""
    return 400 <= status < 500 and status != 429
