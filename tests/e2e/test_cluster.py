"""End to end through `kvsched up`: OpenAI requests through the Routers, placement by the
Conductor, simulated engines streaming, their KV events relayed by the Messengers.

The tests share one cluster and run in file order: the last two kill an engine and then the
Conductor."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import time
from functools import partial
from typing import Any

import aiohttp
import pytest

from tests.e2e.conftest import INSTANCE_TTL_S, LocalCluster
from tests.fixtures.poll import wait_for

pytestmark = pytest.mark.slow

_VOLATILE = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')


def _events(raw: bytes) -> list[bytes]:
    """SSE data payloads with the per-request fields (`id`, `created`) masked."""
    return [_VOLATILE.sub(rb'"\1":"*"', e) for e in raw.split(b"\n\n") if e.strip()]


async def _nodes(http: aiohttp.ClientSession, cluster: LocalCluster) -> dict[str, Any]:
    url = f"{cluster.conductor_http}/api/nodes/stats"
    async with http.get(url, headers=cluster.admin_headers) as resp:
        body: dict[str, Any] = await resp.json()
    return {row["instance_id"]: row for row in body["instances"]}


async def _conductor_seen(http: aiohttp.ClientSession, router: str, state: str) -> bool:
    """Whether `router`'s /health says the Conductor is `state` ("up" or "down")."""
    async with http.get(f"{router}/health") as resp:
        body: dict[str, Any] = await resp.json()
    return bool(body["conductor"] == state)


async def test_stream_is_the_engines_own_chunk_by_chunk(cluster: LocalCluster) -> None:
    body = {"model": cluster.endpoints["model"], "prompt": "The KV cache of a long prompt",
            "max_tokens": 12, "stream": True, "some_engine_option": {"kept": True}}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{cluster.routers[0]}/v1/completions", json=body, headers=cluster.auth
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvsched-policy"].startswith("elastic")
            instance = resp.headers["x-kvsched-instance"]
            via_router = await resp.read()
        engine = cluster.engine(instance)["url"]
        async with http.post(f"{engine}/v1/completions", json=body) as resp:
            direct = await resp.read()
    assert _events(via_router) == _events(direct)
    assert _events(via_router)[-1] == b"data: [DONE]"
    assert len(_events(via_router)) == 12 + 1  # one chunk a token (the last one finishes), [DONE]


async def test_session_stays_on_one_instance_through_both_routers(cluster: LocalCluster) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 40}]
    hosts, cached = [], []
    async with aiohttp.ClientSession() as http:
        for turn in range(4):
            messages.append({"role": "user", "content": f"Turn {turn}: go on. " * 20})
            router = cluster.routers[turn % 2]
            async with http.post(
                f"{router}/v1/chat/completions",
                json={"model": cluster.endpoints["model"], "messages": messages, "max_tokens": 8},
                headers={**cluster.auth, "x-session-id": "e2e-affinity"},
            ) as resp:
                assert resp.status == 200, await resp.text()
                hosts.append(resp.headers["x-kvsched-instance"])
                answer = await resp.json()
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append(answer["choices"][0]["message"])
    assert len(set(hosts)) == 1, hosts
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached


async def test_conductor_index_matches_the_engines_caches(cluster: LocalCluster) -> None:
    async with aiohttp.ClientSession() as http:

        async def agree() -> bool:
            nodes = await _nodes(http, cluster)
            for engine in cluster.endpoints["engines"]:
                async with http.get(f"{engine['url']}/kvsched/kv/snapshot") as resp:
                    blocks = len((await resp.json())["blocks"])
                if nodes[engine["id"]]["reported_gpu_blocks"] != blocks:
                    return False
            return True

        await wait_for(agree, 10.0, message="Conductor index equal to the engines' caches")
        nodes = await _nodes(http, cluster)
    assert sum(row["reported_gpu_blocks"] for row in nodes.values()) > 0


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", {}, 400),
        (json.dumps({"model": "m"}).encode(), {}, 400),
        (json.dumps({"prompt": "x", "max_tokens": -1}).encode(), {}, 400),
        (json.dumps({"prompt": "x"}).encode(), {"Authorization": "Bearer wrong"}, 401),
    ],
)
async def test_bad_requests_get_openai_errors(
    cluster: LocalCluster, body: bytes, headers: dict[str, str], status: int
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{cluster.routers[1]}/v1/completions",
            data=body,
            headers={**cluster.auth, "Content-Type": "application/json", **headers},
        ) as resp,
    ):
        assert resp.status == status
        error = (await resp.json())["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]


async def test_one_trace_spans_router_conductor_and_engine(cluster: LocalCluster) -> None:
    traceparent = "00-" + os.urandom(16).hex() + "-" + os.urandom(8).hex() + "-01"
    trace_id = traceparent.split("-")[1]
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{cluster.routers[0]}/v1/completions",
            json={"model": cluster.endpoints["model"], "prompt": "trace me", "max_tokens": 2},
            headers={**cluster.auth, "traceparent": traceparent},
        ) as resp,
    ):
        assert resp.status == 200

    def in_trace(kind: str, service: str) -> Any:
        return [
            s
            for s in cluster.otlp.spans
            if s.trace_id == trace_id and s.kind == kind and s.service_name == service
        ]

    # Each process exports its spans on its own schedule: wait for all three.
    for service in ("kvsched-router", "kvsched-conductor", "kvsched-engine"):
        await wait_for(partial(in_trace, "SERVER", service), 10.0, message=f"{service} span")
    spans = {s.span_id: s for s in cluster.otlp.spans if s.trace_id == trace_id}
    (router,) = in_trace("SERVER", "kvsched-router")
    assert router.parent_span_id == traceparent.split("-")[2]  # the caller's span

    def chain(span: Any) -> list[str]:
        names = []
        while span is not None:
            names.append(span.span_id)
            span = spans.get(span.parent_span_id or "")
        return names

    for service in ("kvsched-conductor", "kvsched-engine"):
        (server,) = in_trace("SERVER", service)
        assert router.span_id in chain(server), f"{service} span not under the Router's"


async def test_killed_engine_leaves_routing_within_its_lease(cluster: LocalCluster) -> None:
    session = {**cluster.auth, "x-session-id": "e2e-failover"}
    body = {"model": cluster.endpoints["model"], "prompt": "Survive a crash. " * 30,
            "max_tokens": 4}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{cluster.routers[0]}/v1/completions", json=body, headers=session
        ) as resp:
            assert resp.status == 200
            victim = resp.headers["x-kvsched-instance"]
        os.kill(cluster.engine(victim)["pid"], signal.SIGKILL)
        killed = time.monotonic()

        async def gone() -> bool:
            return victim not in await _nodes(http, cluster)

        await wait_for(gone, INSTANCE_TTL_S + 5.0, message=f"{victim} out of the Conductor")
        assert time.monotonic() - killed <= INSTANCE_TTL_S
        async with http.post(
            f"{cluster.routers[1]}/v1/completions", json=body, headers=session
        ) as resp:
            assert resp.status == 200
            assert resp.headers["x-kvsched-instance"] != victim


async def test_routers_keep_serving_with_the_conductor_down(cluster: LocalCluster) -> None:
    for conductor in cluster.endpoints["conductors"]:
        os.kill(conductor["pid"], signal.SIGKILL)
    body = {"model": cluster.endpoints["model"], "prompt": "Still here?", "max_tokens": 3}
    async with aiohttp.ClientSession() as http:
        for router in cluster.routers:  # each sees it unreachable (until then it sheds)
            seen_down = partial(_conductor_seen, http, router, "down")
            await wait_for(seen_down, 10.0, message="the Conductor seen down")
        for router in cluster.routers:
            for i in range(3):
                async with http.post(
                    f"{router}/v1/completions",
                    json=body,
                    headers={**cluster.auth, "x-session-id": f"e2e-down-{i}"},
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers.get("x-kvsched-fallback") == "1"
                    assert (await resp.json())["choices"][0]["text"]
            async with http.get(f"{router}/metrics") as resp:
                metrics = await resp.text()
            fallbacks = [
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("kvsched_router_fallback_total")
            ]
            assert sum(fallbacks) >= 3
