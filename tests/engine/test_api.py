"""The simulated engine's vLLM-compatible HTTP API."""

from __future__ import annotations

import json
from typing import Any

from tests.engine.conftest import RunningEngine
from tests.fixtures.poll import wait_for

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _chunks(raw: bytes) -> list[Any]:
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


async def test_streamed_completion_is_vllm_shaped(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    body = {"model": MODEL, "prompt": "hello cache", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "unknown_field": 1}  # fmt: skip
    async with await eng.post("/v1/completions", body) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        chunks = _chunks(await resp.read())
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 5 and all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 4 + ["length"]
    assert all(c["usage"] is None and c["choices"][0]["text"] for c in tokens)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens"] == usage["usage"]["total_tokens"] - 5
    assert len({c["id"] for c in chunks}) == 1


async def test_chat_stream_opens_with_the_role_and_text_is_deterministic(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    body = {"messages": [{"role": "user", "content": "same question"}], "max_tokens": 6}
    async with await eng.post("/v1/chat/completions", {**body, "stream": True}) as resp:
        chunks = _chunks(await resp.read())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    async with await eng.post("/v1/chat/completions", body) as resp:
        whole = await resp.json()
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["content"] == streamed != ""
    assert whole["usage"]["completion_tokens"] == 6


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


async def test_models_tokenize_health_and_metrics(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine()
    models = await eng.get_json("/v1/models")
    assert models["data"][0]["id"] == MODEL
    async with await eng.post("/tokenize", {"prompt": "hello"}) as resp:
        tok = await resp.json()
    assert tok["count"] == len(tok["tokens"]) > 0
    async with eng.http.get(f"{eng.url}/health") as resp:
        assert resp.status == 200
    async with await eng.post("/v1/completions", {"prompt": "x " * 40, "max_tokens": 2}) as resp:
        assert resp.status == 200
    async with await eng.post("/v1/completions", {"prompt": "x " * 40, "max_tokens": 2}) as resp:
        assert resp.status == 200
    async with eng.http.get(f"{eng.url}/metrics") as resp:
        text = await resp.text()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:") and "_created" not in line
    }
    assert values["vllm:request_success_total"] == 2
    assert values["vllm:prefix_cache_hits_total"] > 0
    assert values["vllm:prefix_cache_queries_total"] >= values["vllm:prefix_cache_hits_total"]
    expected = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:generation_tokens_total",
    }
    assert expected <= set(values)


async def test_bad_requests_get_openai_errors(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(max_model_len=64)
    cases: list[tuple[Any, int, str | None]] = [
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1, 99_999]}, 400, "prompt"),
        ({"prompt": "word " * 80}, 400, "messages"),
        ({"prompt": "x", "model": "other"}, 404, "model"),
    ]
    for body, status, param in cases:
        async with await eng.post("/v1/completions", body) as resp:
            assert resp.status == status
            assert (await resp.json())["error"]["param"] == param
    async with eng.http.post(f"{eng.url}/v1/completions", data=b"{oops") as resp:
        assert resp.status == 400
        assert "not valid JSON" in (await resp.json())["error"]["message"]
    async with eng.http.get(f"{eng.url}/v1/nothing") as resp:
        assert resp.status == 404 and "error" in await resp.json()
    assert not eng.live.requests  # nothing half-submitted


async def test_a_client_that_leaves_mid_stream_frees_its_request(start_engine: Any) -> None:
    eng: RunningEngine = await start_engine(time_scale=0.2)
    resp = await eng.post(
        "/v1/completions", {"prompt": "long answer", "max_tokens": 5000, "stream": True}
    )
    await resp.content.readline()  # the first chunk: the request runs
    assert eng.live.engine.running == 1
    resp.close()
    await wait_for(lambda: not eng.live.requests and eng.live.engine.running == 0, 5.0)
    assert eng.live.engine.cache.private == 0  # its reserved pages went back
