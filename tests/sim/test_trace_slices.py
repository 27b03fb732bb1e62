"""The shipped slices in data/traces/: counts, block lengths, sessions, ceilings, README."""

from __future__ import annotations

import hashlib
import json
import lzma
import re
from functools import cache
from pathlib import Path

import pytest

from kvsched.sim.traces import (
    Trace,
    ideal_apc,
    load,
    read_azure,
    read_mooncake,
    read_weka,
    scale_tokens,
    weka_shared_prefix,
)

SLICES = Path(__file__).resolve().parents[2] / "data" / "traces"
MOONCAKE = SLICES / "mooncake_conversation_head.jsonl"
WEKA = SLICES / "weka_cc_agentic_sample.jsonl.xz"
WEKA_META = SLICES / "weka_cc_agentic_sample_trace_meta.json"
AZURE = SLICES / "azure_conv_head.csv"


@cache
def mooncake() -> Trace:
    return read_mooncake(MOONCAKE)


@cache
def weka() -> Trace:
    return read_weka(WEKA)


@cache
def azure() -> Trace:
    return read_azure(AZURE)


def all_slices() -> list[Trace]:
    return [mooncake(), weka(), azure()]


def test_counts() -> None:
    assert len(mooncake().calls) == 3000
    assert len(weka().calls) == 1660
    assert weka().notes["groups"] == 24
    assert len(azure().calls) == 3000


@pytest.mark.parametrize("trace", all_slices(), ids=lambda t: t.format)
def test_every_call_lists_its_full_blocks(trace: Trace) -> None:
    for c in trace.calls:
        assert len(c.block_ids) == c.input_tokens // trace.block_tokens
    assert [c.index for c in trace.calls] == list(range(len(trace.calls)))
    assert all(-1 <= c.after < c.index for c in trace.calls)


def test_mooncake_sessions_are_prefix_chains() -> None:
    trace = mooncake()
    assert trace.notes["sessions"] == 2178
    assert trace.notes["multi_turn_sessions"] == 496
    earlier: dict[str, list[tuple[int, ...]]] = {}
    for c in trace.calls:
        prompts = earlier.setdefault(c.session, [])
        if c.turn == 1:
            assert not prompts
            assert c.session == f"mc-{c.index}"
        else:
            assert len(prompts) == c.turn - 1
            assert any(c.block_ids[: len(p)] == p for p in prompts)
        prompts.append(c.block_ids)


def test_weka_calls_match_the_raw_rows() -> None:
    with lzma.open(WEKA, "rt") as f:
        rows = [json.loads(line) for line in f]
    by_chat: dict[int, list[int]] = {}
    for row, c in zip(rows, weka().calls, strict=True):
        parent = by_chat.get(row["parent_chat_id"], [])
        ids = parent[: row["prefix_blocks"]] + row["new_hash_ids"]
        by_chat[row["chat_id"]] = ids
        assert c.block_ids == tuple(ids)
        assert c.session == row["session_id"]
        assert c.group == row["session_id"].split("/")[0]
        assert c.recorded_service_s == (row["api_time"] or 0.0)


def test_weka_dependencies() -> None:
    calls = weka().calls
    subs = [c for c in calls if c.session.count("/") == 2 and c.turn == 1]
    assert len(subs) == 8
    for c in calls:
        if c.after < 0:
            assert c.turn == 1
            continue
        dep = calls[c.after]
        assert dep.group == c.group
        if c.turn > 1:
            # The latest earlier call of the agent whose finish is known sets its clock.
            assert dep.session == c.session
            assert dep.turn < c.turn
            assert dep.recorded_service_s > 0 or dep.turn == 1
            between = [x for x in calls if x.session == c.session and dep.turn < x.turn < c.turn]
            assert all(x.recorded_service_s == 0 for x in between)
        else:  # a sub-agent's first call waits for the main-agent call that spawned it
            assert dep.session == f"{c.group}/main"
            assert c.timestamp_s == pytest.approx(dep.timestamp_s + dep.recorded_service_s)


def test_azure_has_no_reuse() -> None:
    trace = azure()
    ids = [x for c in trace.calls for x in c.block_ids]
    assert len(ids) == len(set(ids))
    times = [c.timestamp_s for c in trace.calls]
    assert times[0] == 0.0
    assert times == sorted(times)
    assert trace.span_s == pytest.approx(628.703398)


CEILINGS = {  # global, session
    MOONCAKE.name: (0.3196, 0.2715),
    WEKA.name: (0.9519, 0.9516),
    AZURE.name: (0.0, 0.0),
}


@pytest.mark.parametrize("path", [MOONCAKE, WEKA, AZURE], ids=lambda p: p.name)
def test_ceilings(path: Path) -> None:
    trace = load(path)
    g, s = ideal_apc(trace), ideal_apc(trace, scope="session")
    assert s <= g
    assert (round(g, 4), round(s, 4)) == CEILINGS[path.name]


def test_shared_prefix_on_the_sample() -> None:
    trace = weka()
    shared = weka_shared_prefix(trace, WEKA_META)
    assert ideal_apc(shared, scope="session") == ideal_apc(trace, scope="session")
    assert ideal_apc(shared) > ideal_apc(trace)
    assert shared.notes["shared_prefix"]["remapped_blocks"] > 0


def test_scale_identity_on_the_slices() -> None:
    for trace in all_slices():
        assert scale_tokens(trace, 1).calls == trace.calls


def test_readme_matches_the_files() -> None:
    readme = (SLICES / "README.md").read_text()
    for path in (MOONCAKE, WEKA, WEKA_META, AZURE):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{path.name}`"))
        size = path.stat().st_size
        assert f"| {size:,} |" in row
        assert hashlib.sha256(path.read_bytes()).hexdigest() in row
    for name, (g, s) in CEILINGS.items():
        assert re.search(rf"\| `{re.escape(name)}` \| \d+ \| {g:.4f} \| {s:.4f} \|", readme)
    for licence in ("LICENSE-Apache-2.0.txt", "LICENSE-CC-BY-4.0.txt"):
        assert (SLICES / licence).stat().st_size > 10_000
