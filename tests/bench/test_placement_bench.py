"""`bench.placement`: a tiny run of the whole bench, so it cannot rot, and its three builds
deciding alike."""

from __future__ import annotations

import random
import re

import pytest

import bench.placement
from kvsched.core.request_view import request_view


@pytest.mark.slow
def test_a_tiny_run_prints_every_build_and_ratio(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.placement, "TOTAL_BLOCKS", 20_000)
    bench.placement.main(["--decisions", "30", "--policies", "cache_aware,elastic"])
    out = capsys.readouterr().out
    assert "reference" in out and "compiled index" in out and "both compiled" in out
    # 3 × (p50, p99) and two ratios, the scoring's left out of the bare match.
    for name, figures in (("index.match", 7), ("cache_aware", 8), ("elastic", 8)):
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert len(re.findall(r"\d+\.\d+", row)) == figures, row


@pytest.mark.slow
def test_a_tiny_pooled_run_decides_alike_in_every_build(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The builds must decide alike (the bench raises otherwise) with pool-only blocks priced.
    monkeypatch.setattr(bench.placement, "TOTAL_BLOCKS", 20_000)
    args = ["--decisions", "30", "--policies", "mooncake:colocated=1,elastic", "--pooled"]
    bench.placement.main(args)
    out = capsys.readouterr().out
    assert "also in their node's pool" in out
    for name in ("mooncake:colocated=1", "elastic"):
        row = next(line for line in out.splitlines() if line.startswith(name))
        assert len(re.findall(r"\d+\.\d+", row)) == 8, row
    cluster, _, chains = bench.placement.build(
        "elastic", random.Random(0), bench.placement.BUILDS[-1], True
    )
    req = bench.placement.requests(chains, 1, random.Random(1))[0]
    assert request_view(cluster, req, 0.0).pool_tokens is not None  # the tier is really in play
