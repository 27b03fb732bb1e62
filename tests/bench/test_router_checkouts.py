"""`bench.router_checkouts`: its summary arithmetic, and a tiny run of two stacks from this
checkout (as base and as this) so the bench cannot rot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.common import REPO
from bench.router_checkouts import parse_args, report, run, running_from, summarize


def test_each_checkout_is_measured_against_its_own_engines() -> None:
    probes = {
        "base direct stream": [0.001] * 5, "base router stream": [0.004] * 5,
        "base direct whole": [0.001] * 5, "base router whole": [0.003] * 5,
        "this direct stream": [0.002] * 5, "this router stream": [0.003] * 5,
        "this direct whole": [0.002] * 5, "this router whole": [0.0025] * 5,
    }  # fmt: skip
    burst = {"refused": 0, "seconds": 1.0}
    behind = {"conductor": 0.2, "messenger": 0.04, "etcd": 0.02}
    bursts = {
        "base direct": [{**burst, "requests": 1000, "cpu_s": {}}],
        "base router": [{**burst, "requests": 200, "cpu_s": {**behind, "router": 0.4}}],
        "this direct": [{**burst, "requests": 800, "cpu_s": {}}],
        "this router": [
            {**burst, "requests": 400, "refused": 3, "cpu_s": {**behind, "router": 0.6}}
        ],
    }
    out = summarize(probes, bursts)
    assert out["base"]["stream_added_p50_ms"] == pytest.approx(3.0)
    assert out["this"]["whole_added_p50_ms"] == pytest.approx(0.5)
    assert out["base"]["rps_over_direct"] == pytest.approx(0.2)
    assert out["this"]["rps_over_direct"] == pytest.approx(0.5)
    assert out["base"]["router_cpu_ms_per_request"] == pytest.approx(2.0)
    assert out["this"]["router_cpu_ms_per_request"] == pytest.approx(1.5)
    assert out["base"]["conductor_cpu_ms_per_request"] == pytest.approx(1.0)
    assert out["this"]["etcd_cpu_ms_per_request"] == pytest.approx(0.05)
    assert out["this"]["refused"] == 3
    text = report(out)
    assert "1.500 + 0.500 + 0.100 + 0.050 ms  (3 refused)" in text
    assert "CPU a request router 0.750x, conductor 0.500x" in text
    assert "requests/s over direct 2.500x" in text


def test_processes_started_inside_run_the_checkouts_code(tmp_path: Path) -> None:
    before, path = Path.cwd(), os.environ.get("PYTHONPATH")
    name = "KVSCHED_TEST_ROUTER_CHECKOUTS"
    assert name not in os.environ
    with running_from(tmp_path, {name: "asyncio"}):
        assert Path.cwd() == tmp_path
        assert os.environ["PYTHONPATH"] == str(tmp_path)
        assert os.environ[name] == "asyncio"
    assert Path.cwd() == before
    assert os.environ.get("PYTHONPATH") == path
    assert name not in os.environ


def test_the_base_stack_takes_environment_settings() -> None:
    args = parse_args([".", "--base-env", "KVSCHED_EVENT_LOOP=asyncio", "--base-env", "A=b=c"])
    assert args.base_env == {"KVSCHED_EVENT_LOOP": "asyncio", "A": "b=c"}
    assert parse_args(["."]).base_env == {}
    with pytest.raises(SystemExit):
        parse_args([".", "--base-env", "no-equals-sign"])


@pytest.mark.slow
async def test_a_tiny_run_of_this_checkout_against_itself(tmp_path: Path) -> None:
    args = parse_args([str(REPO), "--rounds", "1", "--requests", "2", "--seconds", "0.5"])
    out = await run(args)
    for name in ("base", "this"):
        assert out[name]["router_rps"] > 0 and out[name]["direct_rps"] > 0
        assert out[name]["router_cpu_ms_per_request"] > 0
        assert out[name]["conductor_cpu_ms_per_request"] > 0
        assert out[name]["stream_p50_ms"] > 0
