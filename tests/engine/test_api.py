"""The simulated engine's vLLM-compatible HTTP API: response shapes, streaming, usage,
determinism, the extra routes, metrics and errors."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kvsched.core.cluster import Role
from tests.engine.conftest import MODEL, RunningEngine


def sse(raw: bytes) -> list[Any]:
    """The JSON chunks of an SSE body, which must end with `[DONE]`."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


async def stream(eng: RunningEngine, path: str, body: dict[str, Any]) -> list[Any]:
    async with await eng.post(path, {**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        return sse(await resp.read())


async def test_streamed_completion_is_vllm_shaped(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    body = {"model": MODEL, "prompt": "hello cache", "max_tokens": 5, "unknown_field": 1,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = await stream(eng, "/v1/completions", body)
    tokens, final = chunks[:-1], chunks[-1]
    assert len(tokens) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-") and chunks[0]["model"] == MODEL
    for i, c in enumerate(tokens):
        (choice,) = c["choices"]
        assert set(c) == {"id", "object", "created", "model", "choices", "usage"}
        assert c["usage"] is None and choice["index"] == 0 and choice["text"].strip()
        assert choice["logprobs"] is None and choice["stop_reason"] is None
        assert choice["finish_reason"] == ("length" if i == 4 else None)
    assert final["choices"] == []
    usage = final["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_without_include_usage_chunks_carry_no_usage(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    chunks = await stream(eng, "/v1/completions", {"prompt": "plain", "max_tokens": 3})
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_chat_stream_shapes_and_deterministic_text(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    body = {"messages": [{"role": "user", "content": "same question"}], "max_tokens": 6,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = await stream(eng, "/v1/chat/completions", body)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["id"].startswith("chatcmpl-")
    first, content, final = chunks[0], chunks[1:-1], chunks[-1]
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert len(content) == 6 and all(c["usage"] is None for c in chunks[:-1])
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * 5 + ["length"]
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in content)
    async with await eng.post("/v1/chat/completions", body) as resp:
        whole = await resp.json()
    assert whole["object"] == "chat.completion" and whole["model"] == MODEL
    (choice,) = whole["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == streamed and len(streamed.split()) == 6
    assert whole["usage"] == final["usage"]  # same request, same answer and usage


async def test_text_depends_on_the_prompt_only(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()

    async def text(prompt: str) -> str:
        answer = await eng.complete({"prompt": prompt, "max_tokens": 20})
        assert answer["object"] == "text_completion"
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        return str(choice["text"])

    a, b = await text("one prompt"), await text("another prompt")
    assert a == await text("one prompt") and a != b
    assert len(a.split()) == 20 and a.isascii()
    assert len(set(a.split())) > 5  # words vary along the answer


async def test_cached_tokens_grow_as_a_conversation_extends(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    messages = [{"role": "system", "content": "A long shared system prompt. " * 20}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"question {turn} " * 10})
        async with await eng.post(
            "/v1/chat/completions", {"messages": messages, "max_tokens": 4}
        ) as r:
            answer = await r.json()
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append(answer["choices"][0]["message"])
    assert cached[0] == 0 < cached[1] < cached[2]
    assert all(c % 16 == 0 for c in cached)  # whole blocks


async def test_output_is_capped_by_the_context_left(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(max_model_len=64)
    answer = await eng.complete({"prompt": [5] * 60, "max_tokens": 50})
    assert answer["usage"]["completion_tokens"] == 4


async def test_models_tokenize_and_health(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    models = await eng.get_json("/v1/models")
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 131_072
    async with await eng.post("/tokenize", {"prompt": "hello world"}) as resp:
        tok = await resp.json()
    assert set(tok) == {"count", "max_model_len", "tokens"}
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 131_072
    messages = [{"role": "user", "content": "hi there"}]
    async with await eng.post("/tokenize", {"messages": messages}) as resp:
        chat_tok = await resp.json()
    async with await eng.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1}) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == chat_tok["count"]
    async with await eng.post("/tokenize", {"prompt": "x", "model": "other"}) as resp:
        assert resp.status == 404
    async with eng.http.get(f"{eng.url}/health") as resp:
        assert resp.status == 200


def scrape(text: str) -> dict[str, float]:
    """Metric name (labels dropped) -> value, buckets left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:", "kvsched_")) and "_bucket{" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


async def test_metrics_have_vllms_names_and_count(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    for _ in range(2):
        await eng.complete({"prompt": [7] * 40 + [8], "max_tokens": 3})
    async with eng.http.get(f"{eng.url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    values = scrape(text)
    assert 'model_name="' + MODEL + '"' in text and 'engine="0"' in text
    assert values["vllm:request_success_total"] == 2
    assert 'finished_reason="length"' in text
    assert values["vllm:generation_tokens_total"] == 6
    assert values["vllm:prompt_tokens_total"] == 2 * 41
    assert values["vllm:prefix_cache_queries_total"] == 2 * 41
    assert values["vllm:prefix_cache_hits_total"] == 32  # the second prompt's cached blocks
    assert values["vllm:time_to_first_token_seconds_count"] == 2
    assert values["vllm:e2e_request_latency_seconds_count"] == 2
    assert values["vllm:inter_token_latency_seconds_count"] == 4  # 2 gaps per answer
    assert values["vllm:num_requests_running"] == 0
    assert values["vllm:num_requests_waiting"] == 0
    assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
    assert "vllm:inter_token_latency_seconds_bucket{" in text and 'le="+Inf"' in text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [1, 99_999]}, "prompt"),  # out of the vocabulary
        ({"prompt": ""}, "prompt"),
        ({"prompt": "word " * 80}, "messages"),  # longer than the context
        ({"prompt": [5] * 40, "max_tokens": 20}, "max_tokens"),  # more than the KV memory
    ],
)
async def test_bad_requests_get_openai_errors(
    start_engine: Any, body: dict[str, Any], param: str
) -> None:
    eng: RunningEngine = await start_engine(max_model_len=64, capacity_blocks=3)
    async with await eng.post("/v1/completions", body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] and error["code"] == 400
    assert not eng.live.requests and not eng.live.names.blocks  # nothing half-submitted


async def test_malformed_json_unknown_model_and_routes(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    async with eng.http.post(f"{eng.url}/v1/completions", data=b"{oops") as resp:
        assert resp.status == 400
        assert "not valid JSON" in (await resp.json())["error"]["message"]
    async with eng.http.post(f"{eng.url}/v1/chat/completions", json=[1, 2]) as resp:
        assert resp.status == 400
    body = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    async with await eng.post("/v1/chat/completions", body) as resp:
        assert resp.status == 404
        error = (await resp.json())["error"]
    assert error["message"] == "The model `gpt-9` does not exist." and error["code"] == 404
    async with eng.http.get(f"{eng.url}/v1/nothing") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    async with eng.http.get(f"{eng.url}/v1/completions") as resp:
        assert resp.status == 405 and "error" in await resp.json()


async def test_kvsched_info_and_load(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(
        instance_id="node-0/e0", capacity_blocks=500, role=Role.DECODE, max_model_len=4096
    )
    info = await eng.get_json("/kvsched/info")
    kv = info.pop("kv_events")
    assert info == {"instance_id": "node-0/e0", "model": MODEL, "role": "decode",
                    "block_size": 16, "capacity_blocks": 500, "max_model_len": 4096}  # fmt: skip
    # The mini-KV model: 32 layers, 1 KV head of 16 bf16 values, K and V, 16 tokens a chunk.
    layout = eng.live.memory.layout
    assert (layout.layers, layout.pages, layout.chunk_bytes) == (32, 500, 16 * 2 * 1 * 16 * 2)
    assert eng.live.memory.path.name.startswith(f"kvsched-kv-{os.getpid()}-node-0_e0")
    assert kv["endpoint"].startswith("tcp://127.0.0.1:") and kv["topic"] == "kv-events"
    assert kv["replay_endpoint"].startswith("tcp://127.0.0.1:") and kv["shape"] == "map"
    load = await eng.get_json("/kvsched/load")
    assert load == {"pending_prefill_tokens": 0, "pending_prefill_s": 0.0,
                    "queued_prefill_s": 0.0, "waiting": 0, "running": 0, "decode_tokens": 0,
                    "free_blocks": 500}  # fmt: skip


async def test_sglang_server_and_model_info(start_engine: Any) -> None:
    """What sglang-router reads when it registers a worker: the served name (else it routes
    requests naming the model nowhere), the page size and the KV capacity."""
    eng: RunningEngine = await start_engine(capacity_blocks=500, max_running=64)
    server = await eng.get_json("/server_info")
    assert server["served_model_name"] == MODEL and server["model_path"] == MODEL
    assert server["dp_size"] == 1 and server["page_size"] == 16
    assert server["max_total_num_tokens"] == 500 * 16 and server["max_running_requests"] == 64
    assert server["context_length"] == 131_072
    model = await eng.get_json("/model_info")
    assert model["model_path"] == MODEL and model["is_generation"] is True
    assert model["has_image_understanding"] is False
