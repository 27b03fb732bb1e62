"""Trace readers on tiny hand-made files: fields, sessions, dependencies, clear errors."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

import pytest

from kvsched.sim.traces import (
    detect_format,
    ideal_apc,
    load,
    read_azure,
    read_mooncake,
    read_weka,
    weka_shared_prefix,
)


def write_jsonl(path: Path, rows: list[dict[str, Any]], *, xz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if xz:
        path.write_bytes(lzma.compress(text.encode()))
    else:
        path.write_text(text)
    return path


# ---- Mooncake ---------------------------------------------------------------------------


def mc(ts: int, inp: int, ids: list[int], out: int = 10) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


MOONCAKE_ROWS = [
    mc(0, 1536, [0, 1, 2]),  # 0  A1: 3 full blocks
    mc(0, 1100, [0, 3, 4]),  # 1  B1: full [0, 3]
    mc(3000, 2100, [0, 1, 2, 5, 6]),  # 2  A2 extends A1's whole prompt
    mc(3000, 700, [0, 7]),  # 3  C: full [0], a strict prefix of A1 (shared content)
    mc(6000, 1030, [0, 8, 9]),  # 4  D: full [0, 8]; must not chain onto C
    mc(6000, 2000, [0, 3, 10, 11]),  # 5  B2 extends B1
    mc(9000, 2600, [0, 1, 2, 5, 12, 13]),  # 6  A3 extends A2 (longest) not A1
    mc(9500, 2100, [0, 1, 2, 5, 14]),  # 7  A2 retried: same full blocks as A2
]


def test_mooncake_fields_and_prefix_chaining(tmp_path: Path) -> None:
    trace = read_mooncake(write_jsonl(tmp_path / "tiny.jsonl", MOONCAKE_ROWS))
    assert trace.format == "mooncake"
    assert trace.block_tokens == 512
    assert not trace.closed_loop
    assert [c.block_ids for c in trace.calls] == [
        (0, 1, 2),
        (0, 3),
        (0, 1, 2, 5),
        (0,),
        (0, 8),
        (0, 3, 10),
        (0, 1, 2, 5, 12),
        (0, 1, 2, 5),
    ]
    assert [c.session for c in trace.calls] == [
        "mc-0",
        "mc-1",
        "mc-0",
        "mc-3",
        "mc-4",
        "mc-1",
        "mc-0",
        "mc-0",
    ]
    assert [c.turn for c in trace.calls] == [1, 1, 2, 1, 1, 2, 3, 4]
    assert all(c.group == c.session for c in trace.calls)
    assert all(c.after == -1 for c in trace.calls)
    assert [c.timestamp_s for c in trace.calls][-2:] == [9.0, 9.5]
    assert [c.index for c in trace.calls] == list(range(8))
    assert trace.notes["sessions"] == 4
    assert trace.notes["multi_turn_sessions"] == 2


def test_mooncake_max_requests(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tiny.jsonl", MOONCAKE_ROWS)
    assert len(read_mooncake(path, max_requests=3).calls) == 3
    assert len(read_mooncake(path, max_requests=0).calls) == 0
    with pytest.raises(ValueError, match="max_requests"):
        read_mooncake(path, max_requests=-1)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        (
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}',
            "2 hash_ids",
        ),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [0]}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE_ROWS[0]) + "\n\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: ") as info:
        read_mooncake(path)
    assert message in str(info.value)


# ---- WEKA -------------------------------------------------------------------------------


def wk(  # noqa: PLR0917 (a row is clearer positionally in the tables below)
    session: str,
    chat: int,
    parent: int,
    t: float,
    inp: int,
    prefix: int,
    new: list[int],
    *,
    turn: int = 1,
    api: float | None = 1.0,
    think: float | None = 0.0,
) -> dict[str, Any]:
    return {
        "session_id": session,
        "chat_id": chat,
        "parent_chat_id": parent,
        "turn": turn,
        "depth": session.count("/") - 1,
        "t_in_trace": t,
        "input_length": inp,
        "output_length": 7,
        "api_time": api,
        "think_time": think,
        "stop": "tool_use",
        "type": "agent",
        "model": "m",
        "block_size": 64,
        "prefix_blocks": prefix,
        "new_hash_ids": new,
    }


M1, SUB1 = "trace_0001/main", "trace_0001/main/agent_001"
M3, SUB3 = "trace_0003/main", "trace_0003/main/agent_001"
WEKA_ROWS = [
    wk(M1, 1, -1, 0.0, 202, 0, [100, 101, 102], api=2.0),  # 0
    wk(M1, 2, 1, 10.0, 256, 2, [103, 104], turn=2, api=None, think=5.0),  # 1 finish unknown
    wk(SUB1, 3, -1, 0.0, 128, 0, [200, 201]),  # 2 own clock: starts when call 0 finishes
    wk(SUB1, 4, 3, 3.0, 192, 2, [202], turn=2, think=None),  # 3
    wk(M1, 5, 2, 30.0, 320, 4, [105], turn=3, think=12.5),  # 4
    wk(M3, 6, -1, 0.0, 64, 0, [300], api=4.0),  # 5 finishes at 4
    wk(SUB3, 7, -1, 50.0, 64, 0, [400]),  # 6 on the trace clock: 46 s after call 5
    wk("trace_0005/main/agent_001", 8, -1, 7.0, 100, 0, [500]),  # 7 no main call before it
    wk("trace_0005/main", 9, -1, 2.0, 63, 0, []),  # 8
]


def test_weka_hash_reconstruction_and_dependencies(tmp_path: Path) -> None:
    trace = read_weka(write_jsonl(tmp_path / "calls.jsonl.xz", WEKA_ROWS, xz=True))
    assert trace.format == "weka"
    assert trace.closed_loop
    assert trace.block_tokens == 64
    calls = trace.calls
    assert [c.block_ids for c in calls] == [
        (100, 101, 102),
        (100, 101, 103, 104),
        (200, 201),
        (200, 201, 202),
        (100, 101, 103, 104, 105),
        (300,),
        (400,),
        (500,),
        (),
    ]
    assert [c.group for c in calls] == ["trace_0001"] * 5 + ["trace_0003"] * 2 + ["trace_0005"] * 2
    assert calls[2].session == SUB1
    # Think times run from the agent's latest call with a known api_time (call 1 has none).
    assert [(c.after, c.gap_s, c.start_offset_s) for c in calls] == [
        (-1, 0.0, 0.0),
        (0, 5.0, 0.0),
        (0, 0.0, 0.0),
        (2, 0.0, 0.0),
        (0, 12.5, 0.0),
        (-1, 0.0, 0.0),
        (5, 46.0, 0.0),
        (-1, 0.0, 7.0),
        (-1, 0.0, 2.0),
    ]
    assert [c.timestamp_s for c in calls] == [0.0, 10.0, 2.0, 5.0, 30.0, 0.0, 50.0, 7.0, 2.0]
    assert [c.recorded_service_s for c in calls][:3] == [2.0, 0.0, 1.0]
    assert [c.turn for c in calls][:5] == [1, 2, 1, 2, 3]
    assert all(c.after < c.index for c in calls)
    assert trace.notes["groups"] == 3
    assert trace.notes["sessions"] == 6


def test_weka_plain_file_and_max_sessions(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "calls.jsonl", WEKA_ROWS)
    assert len(read_weka(path).calls) == 9
    capped = read_weka(path, max_sessions=2)
    assert [c.group for c in capped.calls] == ["trace_0001"] * 5 + ["trace_0003"] * 2
    assert capped.notes["groups"] == 2
    assert read_weka(path, max_sessions=0).calls == ()


def _weka_error(tmp_path: Path, rows: list[dict[str, Any]]) -> str:
    path = write_jsonl(tmp_path / "w.jsonl", rows)
    with pytest.raises(ValueError) as info:
        read_weka(path)
    return str(info.value)


def test_weka_errors_name_file_and_line(tmp_path: Path) -> None:
    orphan = wk(M1, 9, 77, 1.0, 128, 0, [1, 2], turn=2)
    assert "w.jsonl:2: parent_chat_id 77" in _weka_error(tmp_path, [WEKA_ROWS[0], orphan])
    too_long = wk(M1, 2, 1, 10.0, 640, 5, [1, 2, 3, 4, 5], turn=2)
    assert "w.jsonl:2: prefix_blocks 5" in _weka_error(tmp_path, [WEKA_ROWS[0], too_long])
    wrong_count = wk(M1, 2, 1, 10.0, 1000, 3, [103], turn=2)
    assert "w.jsonl:2: 4 rebuilt hash ids" in _weka_error(tmp_path, [WEKA_ROWS[0], wrong_count])
    split = [WEKA_ROWS[0], WEKA_ROWS[5], wk(M1, 10, 1, 9.0, 202, 3, [], turn=2)]
    assert "w.jsonl:3: calls of trace_0001 are not contiguous" in _weka_error(tmp_path, split)
    assert "block_size" in _weka_error(tmp_path, [{**WEKA_ROWS[0], "block_size": 16}])
    other_session = wk(SUB1, 2, 1, 1.0, 202, 3, [])
    assert "another session" in _weka_error(tmp_path, [WEKA_ROWS[0], other_session])
    assert "duplicate chat_id" in _weka_error(tmp_path, [WEKA_ROWS[0], WEKA_ROWS[0]])


def test_truncated_xz_is_a_value_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "calls.jsonl.xz", MOONCAKE_ROWS * 50, xz=True)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"calls\.jsonl\.xz:\d+: unreadable"):
        read_mooncake(path)


def test_weka_shared_prefix_remaps_only_the_traces_own_prefix(tmp_path: Path) -> None:
    trace = read_weka(write_jsonl(tmp_path / "calls.jsonl", WEKA_ROWS))
    meta = tmp_path / "meta.json"
    entries = [("trace_0001", 100, 30), ("trace_0003", 64, 64), ("trace_0005", 10, 10)]
    meta.write_text(
        json.dumps([{"trace_id": t, "tool_tokens": a, "system_tokens": b} for t, a, b in entries])
    )
    shared = weka_shared_prefix(trace, meta)
    base = 501  # 1 + the largest id
    assert [c.block_ids for c in shared.calls] == [
        (base, base + 1, 102),
        (base, base + 1, 103, 104),
        (200, 201),  # the sub-agent never had the trace's prefix
        (200, 201, 202),
        (base, base + 1, 103, 104, 105),
        (base,),
        (400,),
        (500,),  # S = 0 for trace_0005
        (),
    ]
    assert shared.notes["shared_prefix"]["blocks_per_trace"] == {
        "trace_0001": 2,
        "trace_0003": 2,
        "trace_0005": 0,
    }
    assert shared.notes["shared_prefix"]["first_shared_id"] == base
    assert ideal_apc(shared, scope="session") == ideal_apc(trace, scope="session")
    assert ideal_apc(shared) > ideal_apc(trace)
    meta.write_text(json.dumps([{"trace_id": "trace_0001", "tool_tokens": 1, "system_tokens": 1}]))
    with pytest.raises(ValueError, match="no entry for trace 'trace_0003'"):
        weka_shared_prefix(trace, meta)


# ---- Azure ------------------------------------------------------------------------------

AZURE_CSV = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
    "2023-11-16 18:15:46.6805900,374,44\r\n"
    "2023-11-16 18:15:46.6805901,64,9\r\n"
    "2023-11-16 18:16:00.0000000,130,1\r\n"
)


def test_azure_fresh_ids_and_relative_times(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_bytes(AZURE_CSV.encode())
    trace = read_azure(path)
    assert trace.format == "azure"
    assert trace.block_tokens == 64
    assert not trace.closed_loop
    assert [c.timestamp_s for c in trace.calls] == [0.0, 1e-7, 13.31941]
    assert [c.block_ids for c in trace.calls] == [(0, 1, 2, 3, 4), (5,), (6, 7)]
    assert (trace.calls[0].input_tokens, trace.calls[0].output_tokens) == (374, 44)
    assert {c.session for c in trace.calls} == {""}
    assert ideal_apc(trace) == 0.0
    assert len(read_azure(path, max_requests=2).calls) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("TIMESTAMP,Context\r\n", r"az\.csv:1: missing column\(s\) ContextTokens"),
        (AZURE_CSV + "2023-11-16 18:16:01.5,12x,3\r\n", r"az\.csv:5: ContextTokens '12x'"),
        (AZURE_CSV + "yesterday,12,3\r\n", r"az\.csv:5: bad TIMESTAMP"),
        (AZURE_CSV + "2023-11-16 18:16:01.5,12\r\n", r"az\.csv:5: expected 3 columns"),
        (AZURE_CSV + "2023-11-16 18:16:01.5,0,3\r\n", r"az\.csv:5: ContextTokens 0 < 1"),
    ],
)
def test_azure_malformed_rows(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "az.csv"
    path.write_bytes(text.encode())
    with pytest.raises(ValueError, match=message):
        read_azure(path)


# ---- load -------------------------------------------------------------------------------


def test_load_detects_format_from_content(tmp_path: Path) -> None:
    mooncake = write_jsonl(tmp_path / "a.jsonl", MOONCAKE_ROWS)
    weka = write_jsonl(tmp_path / "b.bin", WEKA_ROWS, xz=True)
    azure = tmp_path / "c.txt"
    azure.write_bytes(AZURE_CSV.encode())
    assert detect_format(mooncake) == "mooncake"
    assert detect_format(weka) == "weka"
    assert detect_format(azure) == "azure"
    assert load(mooncake, max_requests=2).format == "mooncake"
    assert len(load(mooncake, max_requests=2).calls) == 2
    assert len(load(weka, max_sessions=1).calls) == 5
    assert len(load(weka, max_requests=3).calls) == 3
    assert len(load(azure).calls) == 3
    with pytest.raises(ValueError, match="not \\['max_sessions'\\]"):
        load(mooncake, max_sessions=1)
    with pytest.raises(ValueError, match="unknown trace format 'csv'"):
        load(azure, fmt="csv")
    other = tmp_path / "d.jsonl"
    other.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="cannot tell the trace format"):
        load(other)
