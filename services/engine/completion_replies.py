"""A completion's tokens written back to its client as the engine makes them: streamed as
server-sent events, or as one JSON body once the last is out."""

from __future__ import annotations

from aiohttp import web

from services.common.inference_api.openai_api import ApiError
from services.engine.openai_stream import DONE, Shape, error_chunk
from services.engine.request import Request
from services.engine.text import Words

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


async def stream_reply(
    request: web.Request, live_req: Request, shape: Shape, words: Words
) -> web.StreamResponse:
    """`live_req`'s tokens as SSE chunks, each as soon as the engine has it, then `[DONE]`;
    an engine that stops meanwhile ends the stream with an error chunk, as vLLM's does."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    if shape.kind == "chat":
        await resp.write(shape.role_chunk())
    job = live_req.job
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


async def whole_reply(live_req: Request, shape: Shape, words: Words) -> web.Response:
    """`live_req`'s whole answer as one JSON body, once its last token is out."""
    job, seen = live_req.job, 0
    while seen < job.output:
        seen = await live_req.wait(seen)
    text = words.text(words.start(live_req.prompt_ids), 0, job.output)
    return web.json_response(shape.full(text, job.prompt, job.output, job.cached_tokens))
