"""Acceptance runs on the whole public traces (slow; need ../shared beside the repository)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsched.core.policies import ALL_POLICIES
from kvsched.sim.cli import main
from tests.conftest import SHARED

pytestmark = pytest.mark.slow

TRACES = {
    "mooncake": ["--trace", "traces/conversation_trace.jsonl", "--load", "2"],
    "weka": [
        "--trace",
        "traces/weka_cc_agentic/weka_cc_agentic_calls.jsonl.xz",
        "--load",
        "32",
        "--max-gap",
        "300",
    ],
    "azure": ["--trace", "traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv"],
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_all_policies_on_each_shared_trace(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not (SHARED / "traces").is_dir():
        pytest.skip("../shared is not beside the repository")
    args = TRACES[name]
    args = [args[0], str(SHARED / args[1]), *args[2:]]
    assert (
        main(
            [
                "replay",
                *args,
                "--policies",
                "all",
                "--instances",
                "8",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["policies"]) == list(ALL_POLICIES)
    for row in report["policies"].values():
        assert row["completed"] > 0
        assert 1.0 <= row["hotspot_pmr"] <= 8.0 + 1e-9
        assert row["hotspot_index"] >= 0.0
    assert (tmp_path / "headline.png").exists() and (tmp_path / "ttft_cdf.png").exists()
    assert len(list((tmp_path / "heatmaps").glob("*.png"))) == len(ALL_POLICIES)
    assert "| elastic |" in capsys.readouterr().out
