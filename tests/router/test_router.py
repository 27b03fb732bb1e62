"""A Router in front of a real Conductor (on a real etcd) and simulated engine processes:
what clients get, what engines get, what the Conductor hears."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from clients.python import ConductorClient, unpack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import PromptTokenizer, parse_request
from services.router.placement import Placement, PlacementQuery
from tests.conftest import REPO
from tests.fixtures.poll import wait_for
from tests.router.conftest import MODEL, Stack, chat, completion
from tests.router.tap import HttpMessage, Tap, parse_http


async def nothing_in_flight(url: str) -> bool:
    async with ConductorClient([url]) as client:
        return all(i.in_flight == 0 for i in await client.list_instances())


async def test_a_stream_reaches_the_client_byte_for_byte_as_the_engine_sent_it(
    stack: Stack,
) -> None:
    # At the modelled GPU's own speed the engine's tokens come tens of milliseconds apart, so
    # whether the first reached the client before the last left the engine does not hang on
    # how busy the machine is (at the suite's 50x a whole answer can leave in a millisecond).
    (engine,) = await stack.start_engines(1, time_scale=1.0)
    tap = Tap(engine.port)
    await tap.start()
    try:
        c = await stack.start_conductor()
        await stack.registry(c.url).add(engine.instance_id, tap.url)
        router = await stack.start_router(c.url)
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        arrivals: list[float] = []
        received = bytearray()
        body = chat(max_tokens=24, stream=True)
        async with stack.http.post(router.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvsched-instance"] == engine.instance_id
            assert resp.headers["x-kvsched-policy"] == "cache_aware"
            assert "x-kvsched-fallback" not in resp.headers
            assert resp.content_type == "text/event-stream"
            async for chunk in resp.content.iter_any():
                arrivals.append(time.perf_counter())
                received += chunk
        (exchange,) = tap.exchanges
        (answer,) = parse_http(bytes(exchange.from_engine))
        assert answer.start_line.startswith("HTTP/1.1 200")
        assert bytes(received) == answer.body  # not one byte changed
        assert received.rstrip().endswith(b"data: [DONE]")
        assert len([e for e in received.split(b"\n\n") if e.startswith(b"data: {")]) >= 24
        # Relayed as produced: the client had its first bytes before the engine sent its last.
        assert arrivals[0] < exchange.from_engine_at[-1]
        await wait_for(lambda: nothing_in_flight(c.url), 5.0, message="the Finish reported")
    finally:
        await tap.stop()


async def test_the_engine_gets_the_clients_body_with_the_tenant_salt_and_our_headers(
    stack: Stack, keys_file: tuple[Path, dict[str, str]]
) -> None:
    path, keys = keys_file
    (engine,) = await stack.start_engines(1)
    tap = Tap(engine.port)
    await tap.start()
    try:
        c = await stack.start_conductor()
        await stack.registry(c.url).add(engine.instance_id, tap.url)
        router = await stack.start_router(c.url, no_auth=False, api_keys=str(path))
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        raw = (
            b'{"model": "' + MODEL.encode() + b'", "prompt": "The quick brown fox",'
            b' "max_tokens": 4, "x_vendor": {"keep": [1, 2.50, "\\u00e9"]}, "logprobs": null}'
        )
        status, _, data = await stack.post(
            router.url + "/v1/completions",
            raw,
            **{
                "Authorization": f"Bearer {keys['acme']}",
                "Content-Type": "application/json",
                "x-session-id": "chat-7",
            },
        )
        assert status == 200, data
        (exchange,) = tap.exchanges
        (sent,) = parse_http(bytes(exchange.to_engine))
        assert sent.start_line == "POST /v1/completions HTTP/1.1"
        salt = json.loads(path.read_text())["tenants"]["acme"]["salt"]
        # Every byte the client sent, then the tenant's salt.
        assert sent.body.startswith(raw[:-1]) and json.loads(sent.body)["cache_salt"] == salt
        assert sent.headers["x-session-id"] == "acme/chat-7"
        assert sent.headers["traceparent"].startswith("00-")
        assert "authorization" not in sent.headers  # the client's key stays with the Router
        (engine_answer,) = parse_http(bytes(exchange.from_engine))
        assert engine_answer.body == data  # non-streaming: unchanged too
        # The Conductor knows the session under the tenant's scope.
        async with ConductorClient([c.url]) as client:
            session = await client.get_session("acme/chat-7")
        assert session.host_instance_id == engine.instance_id
        # A client's own salt joins the tenant's, never replaces it.
        status, _, _ = await stack.post(
            router.url + "/v1/completions",
            completion(cache_salt="mine"),
            Authorization=f"Bearer {keys['globex']}",
        )
        assert status == 200
        (_, resent) = parse_http(bytes(tap.exchanges[-1].to_engine))[-2:]
        globex = json.loads(path.read_text())["tenants"]["globex"]["salt"]
        assert json.loads(resent.body)["cache_salt"] == f"{globex}:mine"
    finally:
        await tap.stop()


async def test_a_long_text_completion_reaches_the_engine_as_its_token_ids(
    stack: Stack,
) -> None:
    """vLLM's completions take token ids: a long text prompt is sent as the ids the Router
    computed (the engine does not tokenize it again), its other fields unchanged in value;
    a short one, or one echoed back, goes as the client wrote it."""
    (engine,) = await stack.start_engines(1)
    tap = Tap(engine.port)
    await tap.start()
    try:
        c = await stack.start_conductor()
        await stack.registry(c.url).add(engine.instance_id, tap.url)
        router = await stack.start_router(c.url)
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        text = " ".join(f"word{i % 97}" for i in range(1200))
        for prompt, echo, as_ids in (
            (text, False, True),
            (text, True, False),
            ("hi", False, False),
        ):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "echo": echo,
                    "x_vendor": {"keep": [1, 2.5]}}  # fmt: skip
            status, _, data = await stack.post(router.url + "/v1/completions", body)
            assert status == 200, data
            sent = json.loads(parse_http(bytes(tap.exchanges[-1].to_engine))[-1].body)
            ids = PromptTokenizer().prompt_ids(parse_request("completion", body))
            assert sent["prompt"] == (ids if as_ids else prompt)
            assert {k: v for k, v in sent.items() if k != "prompt"} == {
                k: v for k, v in body.items() if k != "prompt"
            }
    finally:
        await tap.stop()


async def test_non_streaming_chat_usage_in_streams_models_and_metrics(stack: Stack) -> None:
    c, engines, router = await stack.up(2)
    status, headers, data = await stack.post(router.url + "/v1/completions", completion())
    assert status == 200, data
    assert headers["x-kvsched-instance"] in {e.instance_id for e in engines}
    assert json.loads(data)["usage"]["completion_tokens"] == 8
    status, _, data = await stack.post(router.url + "/v1/chat/completions", chat())
    assert status == 200 and json.loads(data)["object"] == "chat.completion"
    body = chat(stream=True, stream_options={"include_usage": True})
    status, _, data = await stack.post(router.url + "/v1/chat/completions", body)
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
    events = [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 8
    status, _, data = await stack.post(router.url + "/v1/completions", completion(stream=True))
    assert status == 200 and data.rstrip().endswith(b"data: [DONE]")
    await wait_for(lambda: nothing_in_flight(c.url), 5.0, message="the Finishes reported")
    async with stack.http.get(router.url + "/v1/models") as resp:
        models = await resp.json()
    assert MODEL in [m["id"] for m in models["data"]]
    async with stack.http.get(router.url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["conductor"] == "up"
    text = await stack.metrics(router)
    assert 'kvsched_router_requests_total{route="/v1/completions",status="200"} 2.0' in text
    assert "kvsched_router_ttft_seconds_count 2.0" in text  # the two streams
    assert "kvsched_router_overhead_seconds_count 4.0" in text
    assert "kvsched_router_conductor_up 1.0" in text
    assert "kvsched_router_streams_open 0.0" in text


async def test_a_session_stays_on_one_instance_through_two_routers(stack: Stack) -> None:
    c, _, first = await stack.up(3, policy="sticky")
    second = await stack.start_router(c.url, router_id="r2")
    await wait_for(lambda: len(second.placer.instances) == 3, 5.0, message="all known")
    routers = (first, second)
    for session in ("s-a", "s-b", "s-c"):
        hosts = set()
        for turn in range(4):
            status, headers, data = await stack.post(
                routers[turn % 2].url + "/v1/chat/completions",
                chat(f"turn {turn}"),
                **{"x-session-id": session},
            )
            assert status == 200, data
            hosts.add(headers["x-kvsched-instance"])
        assert len(hosts) == 1, (session, hosts)
    # The body's `user` names a session too.
    hosts = set()
    for router in routers:
        status, headers, _ = await stack.post(router.url + "/v1/completions", completion(user="u9"))
        hosts.add(headers["x-kvsched-instance"])
    assert len(hosts) == 1
    async with ConductorClient([c.url]) as client:
        assert (await client.get_session("anonymous/u9")).host_instance_id in hosts


@pytest.mark.parametrize(
    ("headers", "fields", "session"),
    [
        ({"X-Claude-Code-Session-Id": "cc-1"}, {}, "cc-1"),
        ({"session_id": "codex-1", "conversation_id": "other"}, {}, "codex-1"),
        ({"conversation_id": "codex-2"}, {}, "codex-2"),
        ({}, {"prompt_cache_key": "pck-1", "user": "u1"}, "pck-1"),
        ({"x-session-id": "ours"}, {"prompt_cache_key": "pck-2"}, "ours"),
    ],
)
async def test_agent_session_headers_and_prompt_cache_key_name_the_session(
    stack: Stack, headers: dict[str, str], fields: dict[str, str], session: str
) -> None:
    c, _, router = await stack.up(2, policy="sticky")
    hosts = set()
    for turn in range(3):
        status, reply, data = await stack.post(
            router.url + "/v1/chat/completions", chat(f"turn {turn}", **fields), **headers
        )
        assert status == 200, data
        hosts.add(reply["x-kvsched-instance"])
    assert len(hosts) == 1
    async with ConductorClient([c.url]) as client:
        assert (await client.get_session(f"anonymous/{session}")).host_instance_id in hosts


@pytest.mark.parametrize("include_usage", [False, True])
async def test_finish_reports_what_the_engine_counted(stack: Stack, include_usage: bool) -> None:
    _, _, router = await stack.up(1, policy="sticky")
    reported = spy_on_finish(router.placer)
    prompt = "Count to ten, slowly. " * 8
    body = completion(prompt, max_tokens=12, stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    status, _, _ = await stack.post(router.url + "/v1/completions", body, **{"x-session-id": "s"})
    assert status == 200
    (done,) = reported
    assert done.ok and done.output_tokens == 12 and done.session_id == "anonymous/s"
    ids = PromptTokenizer().encode(prompt, add_special_tokens=True)  # a completion: BOS first
    assert done.prompt_tokens == len(ids)
    hashes = unpack_hashes(done.packed_block_hashes)  # the Router sends the packed form
    assert hashes == VllmBlockHasher(16).hash_prompt(ids)  # anonymous: no salt
    assert 0 < done.time_to_first_token.ToNanoseconds() <= done.end_to_end.ToNanoseconds()


def spy_on_finish(placer: object) -> list[pb.FinishRequest]:
    """Record every FinishRequest the Router sends (they are still sent)."""
    reported: list[pb.FinishRequest] = []
    finish = placer.finish  # type: ignore[attr-defined]

    def spy(request: pb.FinishRequest) -> None:
        reported.append(request)
        finish(request)

    placer.finish = spy  # type: ignore[attr-defined]
    return reported


async def test_a_client_that_leaves_mid_stream_ends_the_engines_work(stack: Stack) -> None:
    _, (engine,), router = await stack.up(1, engine_flags={"time_scale": 1.0})
    reported = spy_on_finish(router.placer)
    body = completion(max_tokens=400, stream=True)  # several seconds at GPU speed
    async with stack.http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readany()
        resp.close()  # the client hangs up
    await wait_for(lambda: router.streams_open == 0, 5.0, message="the stream closed")
    await wait_for(lambda: reported, 5.0, message="the Finish reported")
    assert not reported[0].ok

    async def engine_idle() -> bool:
        async with stack.http.get(engine.url + "/metrics") as resp:
            text = await resp.text()
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        return bool(running) and float(running[0].split()[-1]) == 0.0

    await wait_for(engine_idle, 3.0, message="the engine stopped generating")


async def test_an_engine_dying_mid_stream_ends_it_with_an_error_event(stack: Stack) -> None:
    _, (engine,), router = await stack.up(1, engine_flags={"time_scale": 1.0})
    reported = spy_on_finish(router.placer)
    body = completion(max_tokens=400, stream=True)
    async with stack.http.post(router.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        first = await resp.content.readany()
        engine.process.kill()
        rest = await resp.read()
    events = (first + rest).rstrip().split(b"\n\n")
    assert json.loads(events[-1][6:])["error"]["code"] == 502
    assert b"data: [DONE]" not in events
    await wait_for(lambda: reported, 5.0, message="the Finish reported")
    assert not reported[0].ok
    assert 'kvsched_router_upstream_errors_total{kind="broken"} 1.0' in await stack.metrics(router)


async def test_odd_session_ids_stay_one_session(stack: Stack) -> None:
    _, _, router = await stack.up(2, policy="sticky")
    hosts = set()
    for turn in range(3):
        status, headers, data = await stack.post(
            router.url + "/v1/completions", completion(f"turn {turn}", user="a b\r\nx: é")
        )
        assert status == 200, data
        hosts.add(headers["x-kvsched-instance"])
    assert len(hosts) == 1


async def test_an_alias_is_served_as_the_model_the_engines_know(stack: Stack) -> None:
    _, _, router = await stack.up(1, model_aliases=(("fast", MODEL),))
    status, _, data = await stack.post(router.url + "/v1/chat/completions", chat(model="fast"))
    assert status == 200, data  # the engine refuses names it does not serve
    assert json.loads(data)["model"] == MODEL
    status, _, data = await stack.post(router.url + "/v1/chat/completions", chat(model="slow"))
    assert status == 404 and json.loads(data)["error"]["code"] == 404  # the engine's answer
    async with stack.http.get(router.url + "/v1/models") as resp:
        cards = {m["id"]: m for m in (await resp.json())["data"]}
    assert cards["fast"]["root"] == MODEL and MODEL in cards


async def test_two_models_behind_one_router_each_served_by_its_own_engines(stack: Stack) -> None:
    conductor = await stack.start_conductor(policy="cache_aware")
    qwen2 = str(REPO / "tests" / "data" / "tokenizers" / "qwen2")
    ours = await stack.start_engines(2)
    other = await stack.start_engines(2, model="tiny-qwen2", tokenizer=qwen2)  # another model
    reg = stack.registry(conductor.url)
    for engine in ours:
        await reg.add(engine.instance_id, engine.url)
    for engine in other:
        await reg.add(engine.instance_id, engine.url, model="tiny-qwen2")
    router = await stack.start_router(conductor.url, model_tokenizers=(("tiny-qwen2", qwen2),))
    await wait_for(lambda: len(router.placer.instances) == 4, 5.0, message="all four known")
    by_model = {MODEL: {e.instance_id for e in ours}, "tiny-qwen2": {e.instance_id for e in other}}
    words = " ".join(f"w{i}" for i in range(200))  # one prompt for both models
    for turn in range(6):
        model = (MODEL, "tiny-qwen2")[turn % 2]
        body = chat(model=model, content=words, user=f"s-{model}")
        status, headers, data = await stack.post(router.url + "/v1/chat/completions", body)
        assert status == 200, data
        assert headers["x-kvsched-instance"] in by_model[model], (model, headers)
        assert json.loads(data)["model"] == model
    async with stack.http.get(router.url + "/v1/models") as resp:
        assert {m["id"] for m in (await resp.json())["data"]} == {MODEL, "tiny-qwen2"}
    async with stack.http.get(router.url + "/v1/models/tiny-qwen2") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == "tiny-qwen2"
    async with stack.http.get(router.url + "/v1/models/none-such") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"


async def test_concurrent_requests_share_placement_stream_messages(stack: Stack) -> None:
    c, _, router = await stack.up(1)
    n = 32
    url = router.url + "/v1/completions"
    statuses = await asyncio.gather(
        *(stack.post(url, completion(f"request {i} of a burst", max_tokens=2)) for i in range(n))
    )
    assert [s for s, _, _ in statuses] == [200] * n
    items = c.metrics.stream_items.labels("received")
    # Every placement and every completion reached the Conductor on the stream ...
    await wait_for(lambda: items._value.get() == 2 * n, 5.0, message="all finishes arrived")
    await wait_for(lambda: nothing_in_flight(c.url), 5.0, message="the Finish reported")
    # ... in fewer messages than items: those queued together went together.
    messages = c.metrics.stream_messages.labels("received")._value.get()
    assert messages < 2 * n, messages


async def test_tokenize_detokenize_and_embeddings_pass_to_an_engine_of_the_model(
    stack: Stack,
) -> None:
    _, engines, router = await stack.up(2)
    ids = {e.instance_id for e in engines}
    body = {"model": MODEL, "prompt": "The KV cache"}
    status, headers, data = await stack.post(router.url + "/tokenize", body)
    assert status == 200 and headers["x-kvsched-instance"] in ids, data
    tokens = json.loads(data)["tokens"]
    assert tokens == PromptTokenizer().encode("The KV cache", add_special_tokens=True)
    status, _, data = await stack.post(
        router.url + "/detokenize", {"model": MODEL, "tokens": tokens}
    )
    assert status == 200 and json.loads(data)["prompt"].endswith("The KV cache"), data
    status, _, data = await stack.post(router.url + "/tokenize", {**body, "model": "none-such"})
    assert status == 404 and json.loads(data)["error"]["param"] == "model"
    # The simulated engine has no pooling runner: its answer passes through as vLLM's would.
    status, headers, _ = await stack.post(
        router.url + "/v1/embeddings", {"model": MODEL, "input": "x"}
    )
    assert status == 404 and headers["x-kvsched-instance"] in ids


async def test_the_clients_request_id_reaches_the_engine_and_comes_back(stack: Stack) -> None:
    (engine,) = await stack.start_engines(1)
    tap = Tap(engine.port)
    await tap.start()
    try:
        c = await stack.start_conductor()
        await stack.registry(c.url).add(engine.instance_id, tap.url)
        router = await stack.start_router(c.url)
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        for route, body in (("/v1/chat/completions", chat()), ("/tokenize", {"prompt": "x"})):
            status, headers, _ = await stack.post(
                router.url + route, body, **{"X-Request-Id": "abc-123"}
            )
            named = {k.lower(): v for k, v in headers.items()}
            assert status == 200 and named["x-request-id"] == "abc-123", (route, headers)
            assert last_sent(tap, route).headers["x-request-id"] == "abc-123"
        status, headers, _ = await stack.post(
            router.url + "/v1/chat/completions", chat(), **{"X-Request-Id": "x" * 200}
        )
        sent = last_sent(tap, "/v1/chat/completions")
        assert status == 200 and sent.headers["x-request-id"] == headers["x-kvsched-request-id"]
    finally:
        await tap.stop()


def last_sent(tap: Tap, route: str) -> HttpMessage:
    """The last request for `route` that reached the engine through `tap`."""
    sent = [m for e in tap.exchanges for m in parse_http(bytes(e.to_engine))]
    return [m for m in sent if m.start_line.startswith(f"POST {route} ")][-1]


async def test_messages_and_responses_are_placed_by_the_prompt_vllm_would_render(
    stack: Stack, keys_file: tuple[Path, dict[str, str]]
) -> None:
    c, _, router = await stack.up(2, no_auth=False, api_keys=str(keys_file[0]))
    key = keys_file[1]["acme"]
    say = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    body = {**say, "metadata": {"user_id": "user_x_account_y_session_z"}}
    # Anthropic's SDKs send the key as x-api-key; the simulated engine has no /v1/messages,
    # so its 404 is the answer, but the request was placed, in the session the body names.
    status, headers, data = await stack.post(
        router.url + "/v1/messages", body, **{"x-api-key": key}
    )
    assert status == 404 and "x-kvsched-instance" in headers, data
    async with ConductorClient([c.url]) as client:
        session = await client.get_session("acme/user_x_account_y_session_z")
    assert session.host_instance_id == headers["x-kvsched-instance"]
    status, headers, data = await stack.post(
        router.url + "/v1/responses", {"model": MODEL, "input": "Hi"},
        Authorization=f"Bearer {key}",
    )  # fmt: skip
    assert status == 404 and "x-kvsched-instance" in headers, data
    # What the Router refuses itself it refuses in the API's own error shape.
    status, _, data = await stack.post(
        router.url + "/v1/messages", {**say, "max_tokens": "4"}, **{"x-api-key": key}
    )
    error = json.loads(data)
    assert status == 400 and error["type"] == "error" and error["error"]["message"], error
    status, _, data = await stack.post(router.url + "/v1/messages", say)
    assert status == 401 and json.loads(data)["type"] == "error"
    status, _, data = await stack.post(
        router.url + "/v1/responses",
        {"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"},
        Authorization=f"Bearer {key}",
    )
    assert status == 400 and json.loads(data)["error"]["param"] == "previous_response_id"


async def test_a_sessions_later_turns_tokenize_what_is_new_with_the_same_ids(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, router = await stack.up(1)
    queries: list[PlacementQuery] = []
    place = router.placer.place

    async def recorded(query: PlacementQuery, **kw: Any) -> Placement:
        queries.append(query)
        return await place(query, **kw)

    monkeypatch.setattr(router.placer, "place", recorded)
    hasher = VllmBlockHasher(router.settings.block_size)
    tokenizer = PromptTokenizer()
    messages: list[dict[str, str]] = [{"role": "system", "content": "Be brief. " * 200}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: " + "words " * 100})
        body = chat(messages=list(messages))
        status, _, data = await stack.post(
            router.url + "/v1/chat/completions", body, **{"x-session-id": "long"}
        )
        assert status == 200, data
        ids = tokenizer.prompt_ids(parse_request("chat", body))
        assert unpack_hashes(queries[-1].packed_hashes) == hasher.hash_prompt(ids)
        assert queries[-1].prompt_tokens == len(ids)
        messages.append(
            {"role": "assistant", "content": json.loads(data)["choices"][0]["message"]["content"]}
        )
    stats = router.preparer.session_prompts[MODEL].stats()
    assert stats.reused_tokens > stats.tokenized_tokens > 0  # most of each later turn reused
