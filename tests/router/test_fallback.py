"""The Router keeps serving when the Conductor is gone: the local fallback decides (sessions
by rendezvous hash, the same on every Router), under its per-instance bound, says so, and hands
placement back when the Conductor answers again. A Conductor that is slow, not gone, gets no
fallback: a placement it does not answer in time is shed with 429 + Retry-After."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from clients.python import ConductorClient
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from tests.conductor.conftest import ConductorProcess, leader_of
from tests.fixtures.etcd import EtcdServer
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, chat, completion


async def test_with_the_conductor_gone_requests_are_still_served(stack: Stack) -> None:
    c, engines, first = await stack.up(3, policy="sticky", placement_timeout_s=0.2)
    second = await stack.start_router(c.url, router_id="r2", placement_timeout_s=0.2)
    await wait_for(lambda: len(second.placer.instances) == 3, 5.0, message="all known")
    await c.stop(0)
    # The refresh finds it gone (connection refused); until then placements are shed.
    await wait_for(
        lambda: not (first.placer.conductor_up or second.placer.conductor_up),
        5.0,
        message="both Routers see it down",
    )
    routers = (first, second)
    for session in ("s-a", "s-b", "s-c", "s-d"):
        hosts = set()
        for turn in range(4):
            status, headers, data = await stack.post(
                routers[turn % 2].url + "/v1/chat/completions",
                chat(f"turn {turn}"),
                **{"x-session-id": session},
            )
            assert status == 200, data
            assert headers["x-kvsched-fallback"] == "1" and "x-kvsched-policy" not in headers
            hosts.add(headers["x-kvsched-instance"])
        assert len(hosts) == 1, (session, hosts)  # the same on both Routers
    spread = set()
    for _ in range(6):  # no session: the least loaded, which spreads an idle cluster
        status, headers, _ = await stack.post(first.url + "/v1/completions", completion())
        assert status == 200
        spread.add(headers["x-kvsched-instance"])
    assert spread == {e.instance_id for e in engines}
    text = await stack.metrics(first)
    assert "kvsched_router_conductor_up 0.0" in text
    assert 'kvsched_router_fallback_total{reason="conductor_down"}' in text
    async with stack.http.get(first.url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["conductor"] == "down"
    # A Conductor back on the same address (warm from etcd) takes placement back.
    await stack.start_conductor(listen=c.url, policy="sticky")
    await wait_for(lambda: first.placer.conductor_up, 10.0, message="the Conductor is back")
    status, headers, _ = await stack.post(first.url + "/v1/completions", completion())
    assert status == 200 and headers["x-kvsched-policy"] == "sticky"
    assert "x-kvsched-fallback" not in headers


async def test_a_conductor_that_does_not_answer_in_time_gets_the_request_shed(
    stack: Stack, etcd: EtcdServer, tmp_path: Path
) -> None:
    conductor = ConductorProcess(etcd, "c0", tmp_path / "c0.log", policy="sticky")
    try:
        async with ConductorClient([conductor.url], deadline_s=1.0) as client:
            await wait_for(lambda: leader_of(client), 15.0, message="the Conductor leads")
        (engine,) = await stack.start_engines(1)
        await stack.registry(conductor.url).add(engine.instance_id, engine.url)
        router = await stack.start_router(conductor.url, placement_timeout_s=0.2)
        await wait_for(lambda: router.placer.instances, 5.0, message="the Router knows it")
        reported: list[pb.FinishRequest] = []
        finish = router.placer.finish

        def spy(request: pb.FinishRequest) -> None:
            reported.append(request)
            finish(request)

        router.placer.finish = spy  # type: ignore[method-assign]
        status, headers, _ = await stack.post(router.url + "/v1/completions", completion())
        assert status == 200 and headers["x-kvsched-policy"] == "sticky"
        os.kill(conductor.process.pid, signal.SIGSTOP)  # alive, connected, silent
        try:
            started = time.monotonic()
            status, headers, data = await stack.post(router.url + "/v1/completions", completion())
            took = time.monotonic() - started
            # Slow is not gone: the Router keeps counting it up and sheds, never decides alone.
            up_while_stopped = router.placer.conductor_up
        finally:
            os.kill(conductor.process.pid, signal.SIGCONT)
        assert status == 429, data
        assert headers["Retry-After"] == "1"
        assert json.loads(data)["error"]["code"] == "server_overloaded"
        # Placed nowhere: no instance named, nothing relayed, no fallback decision.
        assert "x-kvsched-instance" not in headers and "x-kvsched-fallback" not in headers
        assert router.placer.fallback_decisions == 0 and up_while_stopped
        # Answered at its placement deadline (0.2 s), not after the stream's retry budget
        # (3 × 1 s): the bound leaves room for a loaded machine.
        assert took < 2.0, took
        text = await stack.metrics(router)
        assert 'kvsched_router_shed_total{reason="timeout"} 1.0' in text
        assert "kvsched_router_fallback_total{" not in text
        # Its late decision is released at once, so the Conductor does not count it in flight.
        late = headers["x-kvsched-request-id"]
        await wait_for(
            lambda: any(r.request_id == late and not r.ok for r in reported),
            10.0,
            message="the late decision released",
        )
    finally:
        conductor.stop()
