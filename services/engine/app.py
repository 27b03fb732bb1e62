"""The engine's HTTP API: vLLM's routes (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/tokenize`, `/health`, `/metrics`) plus the JSON views a Messenger reads
(`/kvsched/info`, `/kvsched/load`, `/kvsched/kv/snapshot`, `/kvsched/stats`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Tracer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common.openai_api import (
    MAX_BODY_BYTES,
    ApiError,
    CompletionRequest,
    Kind,
    PromptTokenizer,
    check_length,
    parse_request,
    read_json,
    render_chat,
)
from services.engine.metrics import EngineMetrics
from services.engine.model import LiveEngine, Request
from services.engine.openai_stream import DONE, Shape
from services.engine.text import Words

log = logging.getLogger("kvsched.engine")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EngineApp:
    """Routes over one `LiveEngine`."""

    def __init__(
        self, live: LiveEngine, tokenizer: PromptTokenizer, words: Words, tracer: Tracer
    ) -> None:
        self.live = live
        self.settings = live.settings
        self.tokenizer = tokenizer
        self.words = words
        self.tracer = tracer
        self.metrics = EngineMetrics(live.settings.model)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
        self.app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/v1/models", self.models),
                web.post("/tokenize", self.tokenize),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.get("/kvsched/info", self.info),
                web.get("/kvsched/load", self.load),
                web.get("/kvsched/kv/snapshot", self.snapshot),
                web.get("/kvsched/stats", self.stats),
            ]
        )

    # ---- completions -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        parent = propagate.extract(dict(request.headers))
        name = f"POST {request.path}"
        with self.tracer.start_as_current_span(name, context=parent, kind=SpanKind.SERVER) as span:
            req = parse_request(kind, await read_json(request))
            if req.model is not None and req.model != self.settings.model:
                raise ApiError(404, f"The model `{req.model}` does not exist.", param="model",
                               type_="NotFoundError", code="model_not_found")  # fmt: skip
            ids = await self._prompt_ids(req)
            check_length(len(ids), req.max_tokens, self.live.max_model_len)
            live_req = self.live.submit(ids, req.max_tokens, req.cache_salt)
            span.set_attribute("kvsched.prompt_tokens", len(ids))
            span.set_attribute("kvsched.output_tokens", req.max_tokens)
            shape = Shape.new(kind, self.settings.model, req.include_usage)
            try:
                if req.stream:
                    return await self._stream(request, live_req, shape)
                return await self._whole(live_req, shape)
            except BaseException:
                self.live.abort(live_req)  # the client went away (or we failed): free it
                raise
            finally:
                span.set_attribute("kvsched.cached_tokens", live_req.job.cached_tokens)

    async def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.prompt_ids is not None:
            return self.tokenizer.prompt_ids(req)
        # Long prompts take milliseconds to tokenize: off the loop (HF tokenizers frees the GIL).
        return await asyncio.get_running_loop().run_in_executor(
            None, self.tokenizer.prompt_ids, req
        )

    async def _tokens(self, live_req: Request) -> Any:
        """Yield (first index, last index) ranges of new tokens until the output is done."""
        sent = 0
        output = live_req.job.output
        while sent < output:
            upto = await live_req.tokens.get()
            if sent == 0:
                self._first_token(live_req)
            yield sent, upto
            sent = upto
        self._finished(live_req)

    async def _stream(
        self, request: web.Request, live_req: Request, shape: Shape
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        if shape.kind == "chat":
            await resp.write(shape.role_chunk())
        words = self.words
        start = words.start(live_req.prompt_ids)
        output = live_req.job.output
        async for lo, hi in self._tokens(live_req):
            if hi - lo == 1:
                text = words.json[words.index(start, lo)]
            else:
                text = _json_join(words, start, lo, hi)
            await resp.write(shape.chunk(text, "length" if hi == output else None))
        job = live_req.job
        if shape.include_usage:
            await resp.write(shape.usage_chunk(job.prompt, job.output, job.cached_tokens))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _whole(self, live_req: Request, shape: Shape) -> web.Response:
        words = self.words
        start = words.start(live_req.prompt_ids)
        async for _ in self._tokens(live_req):
            pass
        job = live_req.job
        text = "".join(words.words[words.index(start, i)] for i in range(job.output))
        return web.json_response(shape.full(text, job.prompt, job.output, job.cached_tokens))

    def _first_token(self, live_req: Request) -> None:
        job, m = live_req.job, self.metrics
        m.ttft.observe(max(self.live.now() - job.arrival, 0.0))
        m.queries.inc(job.prompt)
        m.hits.inc(job.local_hit_tokens)
        m.prompt_tokens.inc(job.prompt)

    def _finished(self, live_req: Request) -> None:
        job, m = live_req.job, self.metrics
        elapsed = max(self.live.now() - job.arrival, 0.0)
        m.e2e.observe(elapsed)
        m.generation_tokens.inc(job.output)
        m.success.inc()
        if job.output > 1 and job.first_token_at >= 0:
            m.itl.observe(max(job.finished_at - job.first_token_at, 0.0) / (job.output - 1))

    # ---- other vLLM routes -------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        model = self.settings.model
        card = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvsched",
                "root": model, "parent": None, "max_model_len": self.live.max_model_len,
                "permission": []}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json(request)
        if "messages" in body:
            req = parse_request("completion", {"prompt": render_chat(body["messages"])})
        else:
            req = parse_request("completion", {"prompt": body.get("prompt")})
        ids = await self._prompt_ids(req)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.live.max_model_len, "tokens": ids}
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def prometheus(self, request: web.Request) -> web.Response:
        engine, m = self.live.engine, self.metrics
        m.running.set(engine.running)
        m.waiting.set(len(engine.waiting) + len(engine.handoffs))
        m.kv_usage.set(engine.cache.locked / engine.cache.total)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- kvsched views -----------------------------------------------------------------

    async def info(self, request: web.Request) -> web.Response:
        pub = self.live.publisher
        return web.json_response(
            {
                "instance_id": self.settings.instance_id,
                "model": self.settings.model,
                "role": "both",
                "block_size": self.settings.block_size,
                "capacity_blocks": self.live.capacity_blocks,
                "kv_events": {
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "topic": pub.topic.decode(),
                    "shape": pub.shape,
                },
            }
        )

    async def load(self, request: web.Request) -> web.Response:
        r = self.live.engine.report()
        return web.json_response(
            {
                "pending_prefill_tokens": r.pending_prefill_tokens,
                "pending_prefill_s": r.pending_prefill_s,
                "waiting": r.waiting,
                "running": r.running,
                "decode_tokens": r.decode_tokens,
                "free_blocks": r.free_blocks,
            }
        )

    async def snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "next_seq": self.live.publisher.next_seq,
                "block_size": self.settings.block_size,
                "blocks": self.live.snapshot(),
            }
        )

    async def stats(self, request: web.Request) -> web.Response:
        """The engine model's cumulative step counters (model seconds), as the simulator's
        report reads them from its engines."""
        e = self.live.engine
        keys = ("busy_s", "kv_area", "batch_area", "passes", "decode_passes", "mixed_passes")
        return web.json_response({k: getattr(e, k) for k in keys})


def _json_join(words: Words, start: int, lo: int, hi: int) -> bytes:
    parts = [words.json[words.index(start, i)][1:-1] for i in range(lo, hi)]
    return b'"' + b"".join(parts) + b'"'


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
