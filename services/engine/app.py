"""The engine's HTTP API: vLLM's routes (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/tokenize`, `/health`, `/metrics`), SGLang's `/server_info` and `/model_info`
(what sglang-router reads to learn a worker's model), plus the JSON views a Messenger reads
(`/kvsched/info`, `/kvsched/load`, `/kvsched/kv/snapshot`) and the step counters the load
generator reads (`/kvsched/stats`). KV leaves and enters the engine only through its node's
KV pool (`services.engine.pool_link`), as a vLLM engine's does through kvsched's connector.

`build` assembles one engine (model, KV memory, KV-event publisher, metrics, step loop,
routes); the caller serves `EngineApp.app` and calls `start`/`close` around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvsched.core.models import model_config
from kvsched.core.vllm_hashing import AdapterKey
from services.common.api_errors import unavailable_headers
from services.common.kv_layout import KvLayout
from services.common.kv_memory import KvMemory
from services.common.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    CompletionRequest,
    Kind,
    PromptTokenizer,
    bad_request,
    parse_request,
    read_json,
    unavailable,
)
from services.engine.kv_publisher import KvEventPublisher
from services.engine.lora import Adapters, runtime_updates_allowed
from services.engine.metrics import EngineMetrics
from services.engine.model import build_model
from services.engine.openai_stream import DONE, Shape, error_chunk
from services.engine.pool_link import PoolLink
from services.engine.runner import LiveEngine, Request
from services.engine.settings import KV_TOPIC, EngineSettings
from services.engine.text import Words

log = logging.getLogger("kvsched.engine")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SESSION_HEADER = "x-session-id"
_W3C = TraceContextTextMapPropagator()
_INLINE_TOKENIZE_CHARS = 4096  # shorter prompts tokenize faster than a thread hand-off


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
        self.tokenizer = tokenizer
        self.words = words
        self.tracer = tracer
        self.draining = False
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.get("/load", self.server_load),
                web.get("/kv_event_sources", self.kv_event_sources),
                web.get("/server_info", self.server_info),
                web.get("/model_info", self.model_info),
                web.get("/kvsched/info", self.info),
                web.get("/kvsched/load", self.load),
                web.get("/kvsched/kv/snapshot", self.snapshot),
                web.get("/kvsched/stats", self.stats),
            ]
        )
        self.adapters: Adapters | None = None
        if settings.enable_lora:
            self.adapters = Adapters(
                settings.model, settings.max_loras, dict(settings.lora_modules)
            )
            if runtime_updates_allowed():
                self.app.add_routes(
                    [
                        web.post("/v1/load_lora_adapter", self.load_lora_adapter),
                        web.post("/v1/unload_lora_adapter", self.unload_lora_adapter),
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
            adapter = self._check_model(req.model)
            ids = await self._prompt_ids(req)
            output = self.live.model.output_tokens(len(ids), req.max_tokens)
            session = request.headers.get(SESSION_HEADER) or None
            live_req = await self.live.admit(ids, output, req.cache_salt, session, adapter)
            span.set_attribute("gen_ai.usage.prompt_tokens", len(ids))
            span.set_attribute("gen_ai.request.max_tokens", output)
            served = self.settings.model if adapter is None else adapter[0]
            shape = Shape.new(kind, served, req.include_usage)
            try:
                if req.stream:
                    return await self._stream(request, live_req, shape)
                return await self._whole(live_req, shape)
            except BaseException:
                # The client went away (a failed write, or aiohttp cancelling the handler on
                # a lost connection), or we failed: free its place in the engine.
                self.live.abort(live_req)
                raise
            finally:
                span.set_attribute("gen_ai.usage.cached_tokens", live_req.job.cached_tokens)
                span.set_attribute("gen_ai.usage.completion_tokens", live_req.generated)

    def _check_model(self, model: str | None) -> AdapterKey | None:
        """The LoRA adapter `model` names (None: the base model, or no model); raises
        vLLM's 404 for a model the engine does not serve."""
        if self.adapters is not None and model is not None:
            return self.adapters.key(model)
        if model is not None and model != self.settings.model:
            raise ApiError(404, f"The model `{model}` does not exist.", type_="NotFoundError",
                           param="model")  # fmt: skip
        return None

    async def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        text = req.prompt_text
        if req.chat is None and (text is None or len(text) <= _INLINE_TOKENIZE_CHARS):
            return self.tokenizer.prompt_ids(req)
        # Long prompts and chats (their template renders too) take milliseconds: off the loop.
        return await asyncio.get_running_loop().run_in_executor(
            None, self.tokenizer.prompt_ids, req
        )

    async def _stream(
        self, request: web.Request, live_req: Request, shape: Shape
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        if shape.kind == "chat":
            await resp.write(shape.role_chunk())
        words, job = self.words, live_req.job
        start, output, sent = words.start(live_req.prompt_ids), job.output, 0
        try:
            while sent < output:
                # Every token the engine made since the last write goes in one chunk: one per
                # step at `--stream-interval` passes, more when this client reads slowly.
                upto = await live_req.wait(sent)
                text = words.json_text(start, sent, upto)
                await resp.write(shape.chunk(text, upto == output))
                sent = upto
        except ApiError as exc:  # the engine stopped: say so in the stream, as vLLM does
            await resp.write(error_chunk(exc))
        else:
            if shape.include_usage:
                await resp.write(shape.usage_chunk(job.prompt, output, job.cached_tokens))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _whole(self, live_req: Request, shape: Shape) -> web.Response:
        job, seen = live_req.job, 0
        while seen < job.output:
            seen = await live_req.wait(seen)
        text = self.words.text(self.words.start(live_req.prompt_ids), 0, job.output)
        return web.json_response(shape.full(text, job.prompt, job.output, job.cached_tokens))

    # ---- other vLLM routes -------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        model = self.settings.model
        now = int(time.time())
        card = {"id": model, "object": "model", "created": now, "owned_by": "vllm",
                "root": model, "parent": None, "max_model_len": self.live.model.max_model_len,
                "permission": []}  # fmt: skip
        cards = [card]
        for name, path in (self.adapters.paths if self.adapters else {}).items():
            cards.append({"id": name, "object": "model", "created": now, "owned_by": "vllm",
                          "root": path, "parent": model, "max_model_len": None,
                          "permission": []})  # fmt: skip
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime `POST /v1/load_lora_adapter` (plain-text success)."""
        assert self.adapters is not None  # (the route exists only then)
        return web.Response(text=self.adapters.load(await read_json(request)))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's runtime `POST /v1/unload_lora_adapter`."""
        assert self.adapters is not None
        return web.Response(text=self.adapters.unload(await read_json(request)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: a `prompt` (text or ids) or chat `messages`."""
        body = await read_json(request)
        model = body.get("model")
        self._check_model(model if isinstance(model, str) else None)
        req = parse_request("chat" if "messages" in body else "completion", body)
        ids = await self._prompt_ids(req)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.live.model.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/detokenize`: the text of `tokens`."""
        body = await read_json(request)
        model = body.get("model")
        self._check_model(model if isinstance(model, str) else None)
        tokens = body.get("tokens")
        vocab = self.tokenizer.vocab_size
        if not (isinstance(tokens, list) and all(_is_token(t, vocab) for t in tokens)):
            raise bad_request(f"'tokens' must be a list of token ids below {vocab}", "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining or self.live.failed:
            return web.Response(status=503, headers=unavailable_headers())
        return web.Response(status=200)

    async def prometheus(self, request: web.Request) -> web.Response:
        engine, m = self.live.engine, self.live.metrics
        m.running.set(engine.running)
        m.waiting.set(len(engine.waiting) + len(engine.handoffs))
        m.kv_usage.set(engine.cache.locked / engine.cache.total)
        if self.adapters is not None:
            m.lora_requests(self.adapters.capacity, self._busy_adapters(), [])
        body = generate_latest(m.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- kvsched views -----------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        pub = self.live.publisher
        return web.json_response(
            {
                "instance_id": self.settings.instance_id,
                "model": self.settings.model,
                "role": self.settings.role.value,
                "block_size": self.live.model.block_size,
                "capacity_blocks": self.live.model.capacity_blocks,
                "max_model_len": self.live.model.max_model_len,
                "kv_events": {
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "topic": pub.topic.decode(),
                    "shape": pub.shape,
                },
            }
        )

    async def server_load(self, request: web.Request) -> web.Response:
        """vLLM's `/load`: requests the server holds now."""
        return web.json_response({"server_load": len(self.live.requests)})

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM's `/kv_event_sources`: the KV-event publisher's settings by DP rank."""
        pub = self.live.publisher
        source = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
                  "replay_endpoint": pub.replay_endpoint, "topic": pub.topic.decode()}  # fmt: skip
        return web.json_response({"0": source})

    async def server_info(self, request: web.Request) -> web.Response:
        """SGLang's `/server_info`: the server's settings. sglang-router names a worker's model
        after `served_model_name` (else `model_path`); without it, requests that name the model
        find no worker."""
        s, model = self.settings, self.live.model
        return web.json_response(
            {
                "model_path": s.model,
                "tokenizer_path": s.tokenizer,
                "served_model_name": s.model,
                "dp_size": 1,
                "page_size": model.block_size,
                "context_length": model.max_model_len,
                "max_total_num_tokens": model.capacity_blocks * model.block_size,
                "max_running_requests": s.max_running,
                "chunked_prefill_size": s.chunk_tokens,
                "version": "kvsched-sim",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's `/model_info`: what the served model is (a text generator)."""
        s = self.settings
        return web.json_response(
            {
                "model_path": s.model,
                "tokenizer_path": s.tokenizer,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        """`Engine.report()`: the load a scheduler reads (seconds are model seconds), and the
        part of the pending prefill still queued, not admitted (for the hotspot index)."""
        r = self.live.engine.report()
        body: dict[str, object] = {
            "pending_prefill_tokens": r.pending_prefill_tokens,
            "pending_prefill_s": r.pending_prefill_s,
            "queued_prefill_s": self.live.engine.queued_s,
            "waiting": r.waiting,
            "running": r.running,
            "decode_tokens": r.decode_tokens,
            "free_blocks": r.free_blocks,
        }
        if self.adapters is not None:  # the adapters held, and those its requests run with
            held = sorted(self.adapters.paths)
            body["adapters"] = {"capacity": self.adapters.capacity, "held": held,
                                "busy": self._busy_adapters()}  # fmt: skip
        return web.json_response(body)

    def _busy_adapters(self) -> list[str]:
        """The adapters of the requests in the engine."""
        return sorted({r.adapter[0] for r in self.live.requests.values() if r.adapter})

    async def snapshot(self, request: web.Request) -> web.Response:
        """Every cached block; events from `next_seq` on apply on top of it."""
        return web.json_response(
            {
                "next_seq": self.live.publisher.next_seq,
                "block_size": self.live.model.block_size,
                "blocks": self.live.snapshot(),
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        """The engine model's cumulative step counters (model seconds), as the simulator's
        report reads them from its engines."""
        e = self.live.engine
        keys = ("busy_s", "kv_area", "batch_area", "passes", "decode_passes", "mixed_passes")
        return web.json_response({k: getattr(e, k) for k in keys})


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


def _is_token(value: object, vocab: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab
