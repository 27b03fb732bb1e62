"""`bench.placement`: a tiny run of the whole bench, so it cannot rot, and its three builds
deciding alike."""

from __future__ import annotations

import re

import pytest

import bench.placement
from kvsched.core import scoring


@pytest.mark.slow
def test_a_tiny_run_prints_every_build_and_ratio(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.placement, "TOTAL_BLOCKS", 20_000)
    before = scoring.compiled()
    bench.placement.main(["--decisions", "30", "--policies", "cache_aware,elastic"])
    assert scoring.compiled() == before  # the bench leaves the process's choice as it was
    out = capsys.readouterr().out
    assert "reference" in out and "compiled index" in out and "both compiled" in out
    # 3 × (p50, p99) and two ratios, the scoring's left out of the bare match.
    for name, figures in (("index.match", 7), ("cache_aware", 8), ("elastic", 8)):
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert len(re.findall(r"\d+\.\d+", row)) == figures, row
