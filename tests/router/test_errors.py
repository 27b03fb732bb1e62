"""Every way a request can fail at the Router, each an OpenAI-shaped error: 400, 401, 429 and 503
with Retry-After, 502; an engine's own error passes through unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf.duration_pb2 import Duration
from opentelemetry.sdk.trace import TracerProvider

from clients.python import ConductorClient
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.data_files import data_path
from services.launcher.ports import free_port
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, chat, completion


def openai_error(data: bytes) -> dict[str, Any]:
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    return dict(error)


async def test_bad_requests_are_400_and_bad_keys_401(
    stack: Stack, keys_file: tuple[Path, dict[str, str]]
) -> None:
    path, keys = keys_file
    _, _, router = await stack.up(1, no_auth=False, api_keys=str(path), max_model_len=64)
    url = router.url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer kvs-wrong"}, {"Authorization": keys["acme"]}):
        status, _, data = await stack.post(url, chat(), **headers)
        assert status == 401
        assert openai_error(data)["code"] == "invalid_api_key"
    async with stack.http.get(router.url + "/v1/models") as resp:
        assert resp.status == 401
    good = {"Authorization": f"Bearer {keys['globex']}"}
    cases: list[tuple[Any, str | None]] = [
        (b"{not json", None),
        (b"[1, 2]", None),
        ({"model": "m"}, "messages"),
        (chat(n=2), "n"),
        (chat(max_tokens=-1), "max_tokens"),
        (chat("word " * 200), "input_tokens"),  # over --max-model-len
        (chat(max_tokens=65), "max_tokens"),
        (chat(stream="yes"), "stream"),
    ]
    for body, param in cases:
        status, _, data = await stack.post(url, body, **good)
        assert status == 400, (body, data)
        error = openai_error(data)
        if param is not None:
            assert error["param"] == param, (body, error)
    status, _, data = await stack.post(
        router.url + "/v1/completions", completion(prompt=[1, 2, 10**9]), **good
    )
    assert status == 400 and "vocabulary" in openai_error(data)["message"]
    status, _, _ = await stack.post(url, chat(), **good)
    assert status == 200
    text = await stack.metrics(router)
    assert 'kvsched_router_requests_total{route="/v1/chat/completions",status="401"} 3.0' in text


async def test_an_engines_own_error_passes_through_unchanged(stack: Stack) -> None:
    # A request only the engine knows it cannot take: more KV than its memory holds.
    _, (engine,), router = await stack.up(1, engine_flags={"capacity_blocks": 4})
    body = chat(max_tokens=500)
    direct_status, _, direct = await stack.post(engine.url + "/v1/chat/completions", body)
    assert 400 <= direct_status < 500
    status, headers, data = await stack.post(router.url + "/v1/chat/completions", body)
    assert (status, data) == (direct_status, direct)
    assert headers["x-kvsched-instance"] == engine.instance_id


async def test_a_model_with_no_instance_serving_it_is_503(stack: Stack) -> None:
    known = (("other-model", str(data_path("tokenizer"))),)  # known, but no engine serves it
    _, _, router = await stack.up(1, model_tokenizers=known)
    status, headers, data = await stack.post(
        router.url + "/v1/chat/completions", chat(model="other-model")
    )
    assert status == 503 and "Retry-After" in headers, data
    assert "x-kvsched-instance" not in headers
    status, _, _ = await stack.post(router.url + "/v1/chat/completions", chat())
    assert status == 200


async def test_a_model_no_router_knows_is_404_before_any_placement(stack: Stack) -> None:
    _, (engine,), router = await stack.up(1)
    body = chat(model="no-such-model")
    direct_status, _, direct = await stack.post(engine.url + "/v1/chat/completions", body)
    status, headers, data = await stack.post(router.url + "/v1/chat/completions", body)
    assert (status, json.loads(data)) == (direct_status, json.loads(direct)) == (404, {
        "error": {"message": "The model `no-such-model` does not exist.",
                  "type": "NotFoundError", "param": "model", "code": 404}})  # fmt: skip
    assert "x-kvsched-instance" not in headers


async def test_a_rejection_by_the_conductor_is_429_with_retry_after(stack: Stack) -> None:
    c = await stack.start_conductor(policy="elastic")
    (engine,) = await stack.start_engines(1)
    reg = stack.registry(c.url)
    await reg.add(engine.instance_id, engine.url)
    # The engine reports a long queue (as its Messenger would): no placement meets the SLO.
    busy = common.LoadReport(
        pending_prefill_tokens=200_000, pending_prefill=Duration(seconds=10), waiting=40
    )
    await reg.client.publish_events(
        pb.KvEventBatch(instance_id=engine.instance_id, sequence=0, events=[pb.KvEvent(load=busy)])
    )
    # Placed over the stream (nothing sampled), then unary (every request sampled).
    for provider in (None, TracerProvider()):
        router = await stack.start_router(c.url, tracer_provider=provider)
        status, headers, data = await stack.post(router.url + "/v1/chat/completions", chat())
        assert status == 429, data
        assert openai_error(data)["type"] == "rate_limit_error"
        assert 7 <= int(headers["Retry-After"]) <= 11  # the estimated excess over the 2 s SLO
        assert "x-kvsched-instance" not in headers


async def test_no_instance_is_503(stack: Stack) -> None:
    _, _, router = await stack.up(0)
    status, headers, data = await stack.post(router.url + "/v1/completions", completion())
    assert status == 503
    assert openai_error(data)["type"] == "service_unavailable"
    assert headers["Retry-After"] == "1"


async def test_an_instance_that_refuses_connections_is_skipped_then_502(stack: Stack) -> None:
    c = await stack.start_conductor(policy="round_robin")
    (engine,) = await stack.start_engines(1)
    reg = stack.registry(c.url)
    await reg.add("node-9/engine-0", f"http://127.0.0.1:{free_port()}")  # nothing listens
    await reg.add(engine.instance_id, engine.url)
    router = await stack.start_router(c.url)
    await wait_for(lambda: len(router.placer.instances) == 2, 5.0, message="both known")
    served = []
    for _ in range(4):  # round robin: the dead one is chosen at least once
        status, headers, data = await stack.post(router.url + "/v1/completions", completion())
        assert status == 200, data
        served.append((headers["x-kvsched-instance"], headers.get("x-kvsched-fallback")))
    assert set(served) >= {(engine.instance_id, "1"), (engine.instance_id, None)}
    text = await stack.metrics(router)
    assert 'kvsched_router_fallback_total{reason="refused"}' in text
    assert 'kvsched_router_upstream_errors_total{kind="refused"}' in text
    # Only the dead one left: 502 once the fallback finds nothing else.
    await reg.client.deregister(engine.instance_id)
    await wait_for(lambda: len(router.placer.instances) == 1, 5.0, message="one left")
    router.placer._suspects.clear()
    status, _, data = await stack.post(router.url + "/v1/completions", completion())
    assert status == 502
    assert openai_error(data)["type"] == "upstream_error"
    async with ConductorClient([c.url]) as client:

        async def nothing_in_flight() -> bool:
            (left,) = await client.list_instances()
            return left.in_flight == 0

        # The failed placements were reported finished (in the background).
        await wait_for(nothing_in_flight, 5.0, message="the failed placements finished")
