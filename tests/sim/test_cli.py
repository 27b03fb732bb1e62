"""`kvsched replay`: the interface contract scripts rely on, and clear errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsched.sim.cli import main
from tests.conftest import SLICES

POLICY_KEYS = {
    "ttft_mean",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "tpot_p50",
    "tpot_p90",
    "tpot_p99",
    "e2e_p50",
    "e2e_p90",
    "apc",
    "apc_local",
    "apc_transfer",
    "hotspot_index",
    "hotspot_pmr",
    "hotspot_cv",
    "amplification",
    "amplification_ideal",
    "slo_attainment",
    "completed",
    "rejected",
    "migrations",
    "migrated_bytes",
}


def replay(tmp: Path, *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--out", str(tmp), "--quiet"]) == 0
    report: dict[str, Any] = json.loads((tmp / "report.json").read_text())
    return report


def test_report_contract_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = replay(
        tmp_path,
        "--trace",
        str(SLICES / "mooncake_conversation_head.jsonl"),
        "--policies",
        "least_loaded,elastic:replicate=0",
        "--instances",
        "4",
        "--seed",
        "1",
        "--load",
        "4",
        "--max-requests",
        "300",
    )
    assert set(report) >= {"trace", "config", "wall_seconds", "simulated_seconds", "policies"}
    assert {"ideal_apc_global", "ideal_apc_session"} <= set(report["trace"])
    assert list(report["policies"]) == ["least_loaded", "elastic:replicate=0"]
    for row in report["policies"].values():
        assert set(row) >= POLICY_KEYS
    assert report["config"]["slo"] == {"ttft_s": 2.0, "tpot_s": 0.1}
    assert report["config"]["instances"] == 4 and report["config"]["load"] == 4.0
    out = capsys.readouterr().out
    assert "| policy |" in out and "| least_loaded |" in out
    for name in ("headline.png", "ttft_cdf.png", "heatmaps/least_loaded.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| elastic:replicate=0 |" in (tmp_path / "table.md").read_text()


def test_without_matplotlib_the_report_is_written_and_the_figures_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "kvsched.sim.figures", None)  # its import fails
    trace = str(SLICES / "mooncake_conversation_head.jsonl")
    report = replay(tmp_path, "--trace", trace, "--policies", "round_robin", "--max-requests", "50")
    assert list(report["policies"]) == ["round_robin"]
    assert "pip install 'kvsched[figures]'" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.png"))


def test_closed_loop_weka_and_open_loop_azure(tmp_path: Path) -> None:
    weka = replay(
        tmp_path / "w",
        "--trace",
        str(SLICES / "weka_cc_agentic_sample.jsonl.xz"),
        "--policies",
        "ear",
        "--instances",
        "2",
        "--max-sessions",
        "3",
        "--max-gap",
        "60",
        "--no-figures",
    )
    assert weka["config"]["mode"] == "closed"
    assert weka["trace"]["notes"]["max_gap_s"] == 60.0
    assert weka["trace"]["notes"]["scale_tokens"][0]["factor"] == "1/4"
    assert weka["policies"]["ear"]["amplification"] > 0
    azure = replay(
        tmp_path / "a",
        "--trace",
        str(SLICES / "azure_conv_head.csv"),
        "--policies",
        "round_robin",
        "--instances",
        "2",
        "--max-requests",
        "200",
        "--no-figures",
    )
    assert azure["trace"]["ideal_apc_global"] == 0.0
    assert azure["policies"]["round_robin"]["apc"] == 0.0


def test_same_run_twice_gives_the_same_policies_section(tmp_path: Path) -> None:
    args = (
        "--trace",
        str(SLICES / "mooncake_conversation_head.jsonl"),
        "--policies",
        "mooncake,elastic",
        "--instances",
        "4",
        "--max-requests",
        "200",
        "--no-figures",
    )
    assert replay(tmp_path / "1", *args)["policies"] == replay(tmp_path / "2", *args)["policies"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "nope"], "unknown policy"),
        (["--policies", "ear:speed=3"], "no parameter"),
        (["--max-sessions", "3"], "--max-sessions applies"),
        (["--instances", "0"], "must be positive"),
        (["--mode", "closed"], "no turn dependencies"),
        (["--sweep", "2", "--sweep-scale-repeat"], "--sweep-scale-repeat applies to closed-loop"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--trace", str(SLICES / "mooncake_conversation_head.jsonl"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_or_garbled_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "--trace", str(tmp_path / "absent.jsonl")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{oops\n'
    )
    with pytest.raises(SystemExit):
        main(["replay", "--trace", str(bad)])
    err = capsys.readouterr().err
    assert "absent.jsonl" in err and "bad.jsonl:2" in err


def test_goodput_sweep(tmp_path: Path) -> None:
    report = replay(
        tmp_path,
        "--trace",
        str(SLICES / "mooncake_conversation_head.jsonl"),
        "--policies",
        "least_loaded,elastic",
        "--instances",
        "8",
        "--max-requests",
        "600",
        "--load",
        "1",
        "--sweep",
        "0.25,64",
    )
    sweep = report["goodput"]
    assert sweep["loads"] == [0.25, 1.0, 64.0]
    for name, row in report["policies"].items():
        curve = sweep["policies"][name]["slo_attainment"]
        assert curve[1] == row["slo_attainment"]
        assert curve[0] >= 0.9  # light load meets the SLOs, 64x overload does not
        assert curve[2] is None or curve[2] < 0.9  # (not run when load 1 already missed)
        assert row["goodput_load"] in (0.25, 1.0)
    assert (tmp_path / "goodput.png").exists()
