"""What a request may cost the Router before it is refused: a body over the limit is refused
unread, a prompt too long for the context by its bytes alone untokenized, and an over-long
session id before it is placed (so nothing is bound to it); a long prompt is tokenized to the
same ids without the GIL."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from services.common.inference_api.openai_api import (
    MAX_BODY_BYTES,
    CompletionRequest,
    PromptTokenizer,
    parse_request,
)
from services.router.app import Router
from services.router.bodies import body_limit
from services.router.settings import parse
from services.router.tokenizer import RouterTokenizer, body_bytes_bound, max_token_bytes
from tests.fixtures.poll import wait_for
from tests.router.conftest import MODEL, Stack, chat, completion

JSON = {"Content-Type": "application/json"}


def error_of(data: bytes) -> dict[str, Any]:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def count_tokenizing(router: Router, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the Router's calls for a prompt's token ids (in its one-element list)."""
    calls = [0]
    tokenizer = router.preparer.tokenizer
    real: Callable[..., list[int]] = tokenizer.prompt_ids

    def counted(*args: Any) -> list[int]:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(tokenizer, "prompt_ids", counted)
    return calls


def test_a_token_stands_for_at_most_its_longest_pieces_bytes() -> None:
    demo = RouterTokenizer()
    assert demo.max_token_bytes == max(len(p) for p in demo.model.hf.get_vocab())  # byte-level
    sentencepiece = {
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            ],
        },
        "model": {"type": "BPE", "vocab": {"▁héllo": 0, "<0x41>": 1}},
        "added_tokens": [{"content": "<|a-long-special-token|>"}],
    }
    assert max_token_bytes(sentencepiece) == len("<|a-long-special-token|>")
    # Where one token may stand for more text than its piece spells, there is no bound.
    assert max_token_bytes({**sentencepiece, "normalizer": {"type": "NFC"}}) is None
    fused = {**sentencepiece, "model": {"type": "BPE", "vocab": {"a": 0}, "fuse_unk": True}}
    assert max_token_bytes(fused) is None
    assert max_token_bytes({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}}) is None


def test_the_bound_never_exceeds_the_tokens_a_prompt_has() -> None:
    demo = RouterTokenizer()
    plain = PromptTokenizer()
    for text in ("-" * 5000, " " + "-" * 73, "héllo wörld ✓ " * 300, "\U0001f600" * 100):
        req = completion_request(text)
        assert 0 < demo.least_tokens(req) <= len(plain.encode(text))


def completion_request(text: str) -> CompletionRequest:
    return parse_request("completion", completion(text))


async def test_a_prompt_too_long_by_its_bytes_is_refused_untokenized(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, router = await stack.up(1, max_model_len=64)
    calls = count_tokenizing(router, monkeypatch)
    longest = router.preparer.tokenizer.max_token_bytes
    assert longest is not None
    text = "x" * (64 * longest)  # at least 64 tokens, whatever they are
    for path, body in [
        ("/v1/completions", completion(text)),
        ("/v1/chat/completions", chat(text)),
        ("/v1/completions", completion(list(range(64)))),
    ]:
        status, _, data = await stack.post(router.url + path, body)
        assert status == 400, data
        error = error_of(data)
        assert error["param"] == "input_tokens"
        assert "maximum context length is 64 tokens" in error["message"]
    assert calls == [0]
    # A token's worth less could be 63 tokens: it is tokenized, then refused by its count.
    status, _, data = await stack.post(router.url + "/v1/completions", completion(text[longest:]))
    assert status == 400 and error_of(data)["param"] == "input_tokens"
    assert calls == [1]
    status, _, data = await stack.post(router.url + "/v1/completions", completion())
    assert status == 200, data


async def test_a_10_mb_prompt_is_refused_while_a_small_one_is_served(stack: Stack) -> None:
    _, _, router = await stack.up(1)  # the default context: 131,072 tokens
    url = router.url + "/v1/completions"

    async def post_huge() -> tuple[int, bytes]:
        # A stream, not bytes: aiohttp warns that a large body of bytes blocks its loop.
        body = io.BytesIO(json.dumps(completion("a" * (10 << 20))).encode())
        async with stack.http.post(url, data=body, headers=JSON) as resp:
            return resp.status, await resp.read()

    (status, data), small = await asyncio.gather(post_huge(), stack.post(url, completion("hi")))
    assert status == 400 and "at least" in error_of(data)["message"]
    assert small[0] == 200, small[2]


async def test_an_over_long_session_id_is_refused_and_binds_nothing(stack: Stack) -> None:
    conductor, _, router = await stack.up(1, policy="sticky")
    url = router.url + "/v1/completions"
    long_id = "é" * 2000
    refused = [
        (completion(user=long_id), {}, "user"),
        (completion(metadata={"session_id": long_id}), {}, "metadata.session_id"),
        (completion(), {"x-session-id": "x" * 257}, "x-session-id"),
    ]
    for body, headers, param in refused:
        status, reply, data = await stack.post(url, body, **headers)
        assert status == 400 and reply["Content-Type"].startswith("application/json"), data
        error = error_of(data)
        assert error["param"] == param and "at most 256" in error["message"]
    sessions = conductor.state.cluster.sessions
    assert len(sessions) == 0
    # At the limit it is served, and bound.
    status, _, data = await stack.post(url, completion(user="é" * 128))
    assert status == 200, data
    assert len(sessions) == 1 and sessions.get("anonymous/" + "%C3%A9" * 128) is not None


def test_the_session_id_limit_is_a_flag() -> None:
    assert parse(["--no-auth", "--insecure"]).max_session_id_bytes == 256
    assert (
        parse(["--no-auth", "--insecure", "--max-session-id-bytes", "64"]).max_session_id_bytes
        == 64
    )
    with pytest.raises(SystemExit):
        parse(["--no-auth", "--insecure", "--max-session-id-bytes", "0"])


async def test_a_body_over_the_limit_is_refused_unread(stack: Stack) -> None:
    # The limit follows the context: a 64-token prompt needs a body of about a megabyte.
    _, _, router = await stack.up(0, max_model_len=64)
    limit = router.preparer.max_body_bytes
    bound = body_bytes_bound(64, router.preparer.tokenizer.max_token_bytes)
    assert bound is not None and limit == bound < 2 << 20
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\n"
    )
    # Announced over the limit: refused from the header, before a byte of the body is sent.
    announced = head + b"Content-Length: %d\r\n\r\n" % (limit + 1)
    over = {
        "message": f"request body over {limit} bytes",
        "type": "invalid_request_error",
        "param": None,
        "code": 413,
    }
    assert await error_from(router, announced, b"") == over
    # Sent in chunks, no length announced: refused once the limit is crossed.
    chunk = b"x" * (64 << 10)
    chunks = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    count = limit // len(chunk) + 1
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n"
    assert await error_from(router, chunked, chunks, count) == over


def test_the_body_limit_is_a_flag_bounded_by_default() -> None:
    # 0: derived (at most MAX_BODY_BYTES)
    assert parse(["--no-auth", "--insecure"]).max_body_bytes == 0
    assert parse(["--no-auth", "--insecure", "--max-body-bytes", "4096"]).max_body_bytes == 4096
    assert parse(["--no-auth", "--insecure", "--body-worker-bytes", "0"]).body_worker_bytes == 0
    for flag in ("--max-body-bytes", "--body-worker-bytes"):
        with pytest.raises(SystemExit):
            parse(["--no-auth", "--insecure", flag, "-1"])
    # The default context's bound (tens of MB) is over the ceiling: the ceiling holds; with
    # no bound known, too. A given limit is taken as it is.
    assert (body_bytes_bound(131_072, 74) or 0) > MAX_BODY_BYTES
    assert body_limit(0, 131_072, 74) == body_limit(0, 64, None) == MAX_BODY_BYTES
    assert body_limit(0, 64, 74) == 64 * 74 * 6 + (1 << 20)
    assert body_limit(4096, 131_072, 74) == 4096


async def error_from(router: Router, head: bytes, chunk: bytes, count: int = 0) -> dict[str, Any]:
    """Send `head` then `chunk` `count` times (or until the Router stops reading); returns the
    error of the Router's JSON answer."""
    host, _, port = router.url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def send() -> None:
        writer.write(head)
        with contextlib.suppress(ConnectionError):
            for _ in range(count):
                writer.write(chunk)
                await writer.drain()

    sending = asyncio.create_task(send())
    answer = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    length = int(answer.partition("content-length:")[2].split()[0])
    error = error_of(await reader.readexactly(length))
    sending.cancel()
    writer.close()
    assert "application/json" in answer
    return error


async def test_a_models_context_is_what_its_engines_said(stack: Stack) -> None:
    """An engine that registered a context of 64 tokens (vLLM's max_model_len, from its
    /v1/models) bounds its model's prompts, whatever the Router's --max-model-len."""
    (engine,) = await stack.start_engines(1)
    c = await stack.start_conductor()
    await stack.registry(c.url).add(engine.instance_id, engine.url, max_model_len=64)
    router = await stack.start_router(c.url)
    await wait_for(lambda: router.preparer.context(MODEL) == 64, 5.0, message="learned")
    status, _, data = await stack.post(router.url + "/v1/completions", completion(list(range(70))))
    assert status == 400 and "maximum context length is 64 tokens" in error_of(data)["message"]
    status, _, data = await stack.post(router.url + "/v1/completions", completion(list(range(9))))
    assert status == 200, data
