"""The engine process: `EngineApp` serves one `LiveEngine` over HTTP, vLLM's completion
routes (`/v1/completions`, `/v1/chat/completions`) and `/health` here, the routes about the
served model in `services.engine.model_routes`, and what the engine tells about itself
(`/metrics`, vLLM's `/load`, SGLang's `/server_info`, the `/kvsched/*` views) in
`services.engine.status_routes`. KV leaves and enters the engine only through its node's KV
pool (`services.dataplane.pool_link`), as a vLLM engine's does through kvsched's connector.

`build` assembles one engine (model, KV memory, KV-event publisher, metrics, step loop,
routes); the caller serves `EngineApp.app` and calls `start`/`close` around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvsched.core.models import model_config
from services.common.inference_api.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    Kind,
    PromptTokenizer,
    bad_request,
    parse_request,
    read_json,
    unavailable,
)
from services.common.serving.api_errors import unavailable_headers
from services.dataplane import KvLayout, KvMemory, PoolLink
from services.engine.completion_replies import stream_reply, whole_reply
from services.engine.kv_publisher import KvEventPublisher
from services.engine.lora import Adapters, runtime_updates_allowed
from services.engine.metrics import EngineMetrics
from services.engine.model import build_model
from services.engine.model_routes import ModelRoutes
from services.engine.openai_stream import Shape
from services.engine.runner import LiveEngine
from services.engine.served_model import ServedModel
from services.engine.settings import KV_TOPIC, EngineSettings
from services.engine.status_routes import StatusRoutes
from services.engine.text import Words

log = logging.getLogger("kvsched.engine")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SESSION_HEADER = "x-session-id"
_W3C = TraceContextTextMapPropagator()


class EngineApp:
    """Routes over one `LiveEngine`. `draining` (set on SIGTERM) refuses new work."""

    def __init__(
        self,
        settings: EngineSettings,
        live: LiveEngine,
        tokenizer: PromptTokenizer,
        words: Words,
        tracer: Tracer,
    ) -> None:
        self.settings = settings
        self.live = live
        self.words = words
        self.tracer = tracer
        self.draining = False
        adapters = None
        if settings.enable_lora:
            adapters = Adapters(settings.model, settings.max_loras, dict(settings.lora_modules))
        self.served = ServedModel(settings.model, adapters, tokenizer)
        models = ModelRoutes(self.served, live.model.max_model_len)
        status = StatusRoutes(settings, live, adapters)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", models.models),
                web.post("/tokenize", models.tokenize),
                web.post("/detokenize", models.detokenize),
                web.get("/health", self.health),
                web.get("/metrics", status.prometheus),
                web.get("/load", status.server_load),
                web.get("/kv_event_sources", status.kv_event_sources),
                web.get("/server_info", status.server_info),
                web.get("/model_info", status.model_info),
                web.get("/kvsched/info", status.info),
                web.get("/kvsched/load", status.load),
                web.get("/kvsched/kv/snapshot", status.snapshot),
                web.get("/kvsched/stats", status.stats),
            ]
        )
        if adapters is not None and runtime_updates_allowed():
            self.app.add_routes(
                [
                    web.post("/v1/load_lora_adapter", models.load_lora_adapter),
                    web.post("/v1/unload_lora_adapter", models.unload_lora_adapter),
                ]
            )

    async def start(self) -> None:
        """Start the replay socket and the step loop (on the running event loop)."""
        self.live.publisher.start()
        self.live.start()

    async def close(self) -> None:
        """Stop the step loop (requests still in it end with an error, transfers end), close
        the sockets, remove the KV memory file."""
        await self.live.stop()
        await self.live.publisher.close()
        self.live.memory.close()

    async def health(self, request: web.Request) -> web.Response:
        if self.draining or self.live.failed:
            return web.Response(status=503, headers=unavailable_headers())
        return web.Response(status=200)

    # ---- completions -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        parent = _W3C.extract(request.headers)
        name = f"POST {request.path}"
        with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
            if self.draining:
                raise unavailable("the engine is shutting down")
            req = parse_request(kind, await read_json(request))
            if req.n != 1 or req.more_prompts:
                raise bad_request(
                    "the simulated engine serves n=1 and one prompt a request",
                    "n" if req.n != 1 else "prompt",
                )
            adapter = self.served.adapter(req.model)
            ids = await self.served.prompt_ids(req)
            output = self.live.model.output_tokens(len(ids), req.max_tokens)
            session = request.headers.get(SESSION_HEADER) or None
            live_req = await self.live.admit(ids, output, req.cache_salt, session, adapter)
            span.set_attribute("gen_ai.usage.prompt_tokens", len(ids))
            span.set_attribute("gen_ai.request.max_tokens", output)
            served = self.settings.model if adapter is None else adapter[0]
            shape = Shape.new(kind, served, req.include_usage)
            try:
                if req.stream:
                    return await stream_reply(request, live_req, shape, self.words)
                return await whole_reply(live_req, shape, self.words)
            except BaseException:
                # The client went away (a failed write, or aiohttp cancelling the handler on
                # a lost connection), or we failed: free its place in the engine.
                self.live.abort(live_req)
                raise
            finally:
                span.set_attribute("gen_ai.usage.cached_tokens", live_req.job.cached_tokens)
                span.set_attribute("gen_ai.usage.completion_tokens", live_req.generated)


def build(
    settings: EngineSettings,
    tracer: Tracer,
    *,
    tokenizer: PromptTokenizer | None = None,
    words: Words | None = None,
) -> EngineApp:
    """One engine for `settings` (creates its KV memory file, binds its ZMQ sockets; `start`
    runs it). A tokenizer and its word list may be shared by engines in one process (tests).
    Raises `ValueError` (unknown model or profile), `OSError` (no KV memory file) or
    `zmq.ZMQError` (endpoint taken)."""
    model = build_model(settings)
    layout = KvLayout.for_model(
        model_config(settings.model_config), model.block_size, model.capacity_blocks
    )
    memory = KvMemory(layout, settings.instance_id, settings.kv_memory_dir)
    try:
        publisher = KvEventPublisher(
            settings.kv_events,
            settings.kv_replay,
            topic=KV_TOPIC.encode(),
            shape=settings.event_shape,
        )
    except BaseException:
        memory.close()
        raise
    metrics = EngineMetrics(settings.model)
    metrics.cache_config(
        {
            "block_size": str(model.block_size),
            "num_gpu_blocks": str(model.capacity_blocks),
            "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": settings.block_hashes.algo,
        }
    )
    live = LiveEngine(
        model,
        publisher,
        metrics,
        memory,
        time_scale=settings.time_scale,
        stream_interval=settings.stream_interval,
        hasher=settings.block_hashes.hasher(settings.block_size),
    )
    if settings.kv_pool_socket:
        live.pool = PoolLink(settings.kv_pool_socket, memory, live.transfers)
    tokenizer = tokenizer or PromptTokenizer(
        settings.tokenizer, chat_template=settings.chat_template
    )
    words = words or Words(tokenizer, settings.seed)
    return EngineApp(settings, live, tokenizer, words, tracer)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as OpenAI's error JSON; never a stack trace to the client."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.status, exc.reason, type_="invalid_request_error").response()
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("request failed: %s %s", request.method, request.path)
        return ApiError(500, "internal error", type_="internal_error").response()
