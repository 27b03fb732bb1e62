"""Whole shared traces (../shared/traces): published figures reproduced. Slow; skipped when the
shared folder is absent (a user's clone)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from kvsched.sim.traces import (
    Trace,
    ideal_apc,
    read_azure,
    read_mooncake,
    read_weka,
    weka_shared_prefix,
)

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "traces"
WEKA_DIR = SHARED / "weka_cc_agentic"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs_shared() -> None:
    if not SHARED.is_dir():
        pytest.skip("../shared/traces is absent")


@cache
def weka() -> Trace:
    return read_weka(WEKA_DIR / "weka_cc_agentic_calls.jsonl.xz")


def with_partial_blocks(trace: Trace, path: Path) -> Trace:
    """The trace with every hash id of the raw rows, partial last block included (how the
    Mooncake README counts)."""
    with path.open() as f:
        hash_ids = [tuple(json.loads(line)["hash_ids"]) for line in f]
    calls = tuple(replace(c, block_ids=ids) for c, ids in zip(trace.calls, hash_ids, strict=True))
    return replace(trace, calls=calls)


@pytest.mark.parametrize(
    ("name", "rows", "readme_apc", "full_block_apc"),
    [
        ("conversation_trace.jsonl", 12_031, 0.3736, 0.3734),
        ("synthetic_trace.jsonl", 3_993, 0.6512, 0.6504),
    ],
)
def test_mooncake_readme_ceilings(
    name: str, rows: int, readme_apc: float, full_block_apc: float
) -> None:
    trace = read_mooncake(SHARED / name)
    assert len(trace.calls) == rows
    assert round(ideal_apc(trace), 4) == full_block_apc
    partial = with_partial_blocks(trace, SHARED / name)
    assert round(ideal_apc(partial), 4) == readme_apc
    assert ideal_apc(partial, scope="session") <= ideal_apc(partial)
    if name.startswith("synthetic"):  # "0.2448 over the first 1,500 synthetic requests"
        assert round(ideal_apc(partial, window=range(1500)), 4) == 0.2448


def test_mooncake_conversation_sessions() -> None:
    """README: about a third of the requests extend an earlier prefix; about 2,000 chains of up
    to 43 turns."""
    trace = read_mooncake(SHARED / "conversation_trace.jsonl")
    sizes = Counter(c.session for c in trace.calls)
    assert 1_900 <= trace.notes["multi_turn_sessions"] <= 2_100
    assert max(sizes.values()) == 43
    extending = sum(1 for c in trace.calls if c.turn > 1)
    assert 0.30 <= extending / len(trace.calls) <= 0.36


def test_weka_readme_ceilings() -> None:
    trace = weka()
    assert len(trace.calls) == 24_108
    assert trace.notes["groups"] == 360
    assert round(ideal_apc(trace), 4) == 0.9643
    assert round(ideal_apc(trace, scope="session"), 4) == 0.9642


def test_weka_structure() -> None:
    calls = weka().calls
    assert all(len(c.block_ids) == c.input_tokens // 64 for c in calls)
    assert all(-1 <= c.after < c.index for c in calls)
    subs = [c for c in calls if c.session.count("/") == 2 and c.turn == 1]
    assert len(subs) == 38
    assert all(calls[c.after].session == f"{c.group}/main" for c in subs)


def test_weka_shared_prefix() -> None:
    trace = weka()
    shared = weka_shared_prefix(trace, WEKA_DIR / "weka_cc_agentic_trace_meta.json")
    assert ideal_apc(shared, scope="session") == ideal_apc(trace, scope="session")
    assert ideal_apc(shared) > ideal_apc(trace)


@pytest.mark.parametrize(
    ("name", "rows", "span_min"),
    [
        ("AzureLLMInferenceTrace_conv.csv", 19_366, 58),
        ("AzureLLMInferenceTrace_code.csv", 8_819, 57),
    ],
)
def test_azure(name: str, rows: int, span_min: int) -> None:
    trace = read_azure(SHARED / "azure_llm_2023" / name)
    assert len(trace.calls) == rows
    assert round(trace.span_s / 60) == span_min
    assert ideal_apc(trace) == 0.0


def test_slices_regenerate_identically(tmp_path: Path) -> None:
    script = ROOT / "tools" / "make_trace_slices.py"
    subprocess.run(
        [sys.executable, str(script), str(SHARED), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    shipped = ROOT / "data" / "traces"
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name
