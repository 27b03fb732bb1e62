"""`bench.router`: its summary arithmetic, the peer routers in front of a simulated engine
(only where their environments are already installed: the tests never pip-install), and a tiny
run of the whole bench with kvsched's Router and direct calls so the bench cannot rot."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench.common import cpu_seconds
from bench.peer_routers import PEERS, PeerProcess, Worker, ensure_installed
from bench.router import parse_args, run
from bench.router_report import summarize
from bench.router_stack import DIRECT, KVSCHED
from services.launcher.ports import free_port
from tests.engine.conftest import MODEL
from tests.fixtures.poll import wait_for


def test_summary_adds_over_direct_and_ratios_to_the_faster_peer() -> None:
    probes = {
        DIRECT: {"stream": [0.002] * 10, "whole": [0.001] * 10},
        KVSCHED: {"stream": [0.005] * 10, "whole": [0.004] * 10},
        "vllm-router": {"stream": [0.003] * 10, "whole": [0.002] * 10},
    }
    rounds = {
        DIRECT: [{"requests": 1000, "refused": 0, "seconds": 1.0, "cpu_s": {}}],
        KVSCHED: [{"requests": 300, "refused": 2, "seconds": 1.0, "cpu_s": {"router": 0.6}}],
        "vllm-router": [{"requests": 500, "refused": 0, "seconds": 1.0, "cpu_s": {"router": 0.2}}],
    }
    s = summarize(probes, rounds)
    assert s[KVSCHED]["stream_added_p50_ms"] == pytest.approx(3.0)
    assert s["vllm-router"]["whole_added_p99_ms"] == pytest.approx(1.0)
    assert s[KVSCHED]["rps_over_direct"] == pytest.approx(0.3)
    assert s[KVSCHED]["rps_over_faster_peer"] == pytest.approx(0.6)
    assert s[KVSCHED]["cpu_ms_per_request"] == {"router": pytest.approx(2.0)}
    assert s[KVSCHED]["refused"] == 2


def test_cpu_seconds_grow_with_work() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # bounded: 50 ms of CPU
        pass
    assert cpu_seconds(os.getpid()) >= before + 0.03


def test_unknown_peer_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--peers", "nginx"])


@pytest.mark.parametrize("name", sorted(PEERS))
async def test_peer_routes_to_the_simulated_engine(
    name: str, start_engine: Any, tmp_path: Path
) -> None:
    """The peer, started as the bench starts it, serves a completion that names the model
    (sglang-router finds the model through the engine's /server_info) and streams."""
    peer = PEERS[name]
    if not peer.installed():
        pytest.skip(f"{peer.venv} not installed (`python -m bench.router` installs it)")
    ensure_installed(peer)  # present: returns without pip
    eng = await start_engine()
    info = await eng.get_json("/kvsched/info")
    kv = info["kv_events"]
    worker = Worker(eng.url, info["model"], kv["endpoint"], kv["replay_endpoint"])
    proc = PeerProcess(peer, free_port(), free_port(), [worker], tmp_path / "peer.log")
    try:
        async with aiohttp.ClientSession() as http:

            async def answered() -> Any:
                assert proc.exited() is None, proc.exited()
                body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3}
                try:
                    async with http.post(f"{proc.url}/v1/completions", json=body) as resp:
                        return await resp.json() if resp.status == 200 else None
                except aiohttp.ClientError:
                    return None

            answer = await wait_for(answered, 30.0, interval=0.1, message=f"{name} serves")
            assert answer["usage"]["completion_tokens"] == 3 and answer["model"] == MODEL
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}
            async with http.post(f"{proc.url}/v1/completions", json=body) as resp:
                lines = [line async for line in resp.content if line.strip()]
            assert lines[-1].strip() == b"data: [DONE]" and len(lines) >= 4
    finally:
        proc.stop()
    assert proc.exited() is not None


@pytest.mark.slow
async def test_a_tiny_bench_run_with_kvsched_and_direct(tmp_path: Path) -> None:
    args = parse_args(
        [
            "--quick",
            "--peers",
            "",
            "--streams",
            "20",
            "--seconds",
            "1",
            "--requests",
            "5",
            "--json",
            str(tmp_path / "router.json"),
        ]
    )
    out = await run(args)
    s = out["summary"]
    assert set(s) == {DIRECT, KVSCHED, "kvsched x2"}
    assert all(row["rps"] > 0 for row in s.values())
    assert s[KVSCHED]["stream_p50_ms"] > 0 and "whole_added_p99_ms" in s[KVSCHED]
    assert set(s[KVSCHED]["cpu_ms_per_request"]) == {"router", "conductor", "messenger", "etcd"}
    assert s[KVSCHED]["cpu_ms_per_request"]["router"] > 0
    for workload in ("roomy", "shared_prefix_short_memory"):
        rows = out["cache_share"][workload]
        assert set(rows) == {DIRECT, KVSCHED}
        assert all(r["errors"] == 0 and r["cached_share"] > 0 for r in rows.values())
    assert out["streams_direct"]["errors"] == 0
