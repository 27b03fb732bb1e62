"""Operating a Router: RouterService status and draining over gRPC, gRPC health and
reflection, and the process itself (SIGTERM drains, then exit 0; no keys, no start)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvsched.api.router.v1 import router_service_pb2 as pb
from kvsched.api.router.v1 import router_service_pb2_grpc as pb_grpc
from services.launcher.ports import free_port
from tests.fixtures.poll import wait_for
from tests.router.conftest import REPO, Stack, chat, completion

SLOW = {"time_scale": 1.0}  # engines at GPU speed: a long answer stays open for a while


async def health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(answer.status)


async def test_draining_refuses_new_requests_while_open_streams_finish(stack: Stack) -> None:
    c, _, router = await stack.up(1, engine_flags=SLOW)
    async with grpc.aio.insecure_channel(router.grpc_url) as channel:
        admin = pb_grpc.RouterServiceStub(channel)
        status = await admin.GetRouterStatus(pb.GetRouterStatusRequest())
        assert (status.router_id, status.conductor_leader) == ("r1", c.url)
        assert not status.draining and not status.fallback_active and status.streams_open == 0
        assert await health(channel) == health_pb2.HealthCheckResponse.SERVING
        body = chat(max_tokens=64, stream=True)
        async with stack.http.post(router.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            drained = await admin.SetDraining(pb.SetDrainingRequest(draining=True))
            assert drained.draining and drained.streams_open == 1
            status_code, headers, data = await stack.post(
                router.url + "/v1/completions", completion()
            )
            assert status_code == 503 and json.loads(data)["error"]["code"] == "service_unavailable"
            assert headers["Retry-After"] == "1"
            async with stack.http.get(router.url + "/health") as h:
                assert (h.status, h.headers["Retry-After"]) == (503, "1")
            assert await health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            rest = await resp.read()
        assert (first + rest).rstrip().endswith(b"data: [DONE]")  # the open stream finished
        status = await admin.GetRouterStatus(pb.GetRouterStatusRequest())
        assert status.draining and status.streams_open == 0 and status.requests_served == 2
        await admin.SetDraining(pb.SetDrainingRequest(draining=False))
        status_code, _, _ = await stack.post(router.url + "/v1/completions", completion())
        assert status_code == 200
        assert await health(channel, "kvsched.router.v1.RouterService") == 1  # SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        services: list[str] = []
        async for answer in reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        ):
            services += [s.name for s in answer.list_services_response.service]
        assert "kvsched.router.v1.RouterService" in services


async def test_the_router_process_drains_on_sigterm_and_exits_0(
    stack: Stack, tmp_path: Path
) -> None:
    c = await stack.start_conductor()
    (engine,) = await stack.start_engines(1, **SLOW)
    await stack.registry(c.url).add(engine.instance_id, engine.url)
    port = free_port()
    log = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSCHED_", "OTEL_"))}
    args = [
        sys.executable, "-m", "services.router", "--no-auth", "--insecure",
        "--listen", f"127.0.0.1:{port}", "--grpc-listen", f"127.0.0.1:{free_port()}",
        "--conductor", c.url, "--instances-refresh", "0.2",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                async with stack.http.get(url + "/health") as resp:
                    return resp.status == 200 and (await resp.json())["instances"] == 1
            except aiohttp.ClientError:
                return False

        await wait_for(ready, 20.0, message="the Router process is up")
        body = completion(max_tokens=64, stream=True)
        async with stack.http.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            first = await resp.content.readany()
            process.send_signal(signal.SIGTERM)

            async def refusing() -> bool:
                status, _, _ = await stack.post(url + "/v1/completions", completion())
                return status == 503

            await wait_for(refusing, 5.0, message="new requests refused while draining")
            rest = await resp.read()
        assert (first + rest).rstrip().endswith(b"data: [DONE]")
        assert await asyncio.to_thread(process.wait, 20) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_router_without_keys_or_no_auth_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCHED_")}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "router", "--listen", "127.0.0.1:0", "--insecure"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--no-auth" in done.stderr
    missing = tmp_path / "missing.json"
    done = subprocess.run(
        [sys.executable, "-m", "services.router", "--api-keys", str(missing), "--insecure",
         "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and "cannot read the API keys file" in done.stderr
