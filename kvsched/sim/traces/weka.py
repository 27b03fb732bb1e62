"""Reader for the WEKA / kv-cache-tester Claude Code agentic calls (JSONL, plain or xz).

Hash ids are stored as deltas against the previous call of the same (sub)agent; the reader
rebuilds them and turns the recorded times into closed-loop dependencies."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsched.sim.traces._io import (
    check_cap,
    get_float,
    get_ids,
    get_int,
    get_str,
    json_lines,
)
from kvsched.sim.traces.model import Trace, TraceCall

WEKA_BLOCK_TOKENS = 64


@dataclass
class _Group:
    """Per-trace state: the latest main-agent call in file order and each sub-agent's clock
    origin (trace time at which its `t_in_trace` is 0)."""

    name: str
    last_main: int = -1
    last_main_finish: float = 0.0  # its t_in_trace + api_time
    origins: dict[str, float] = field(default_factory=dict)
    # Per (sub)agent, its latest call whose api_time is known: `think_time` is measured from
    # that call's finish (calls with no api_time never set the clock).
    anchors: dict[str, int] = field(default_factory=dict)

    def spawn(self, session: str, t: float) -> tuple[int, float, float]:
        """(after, gap_s, start_offset_s) of a sub-agent's first call at `t_in_trace` t, and
        records the sub-agent's clock origin.

        It depends on the main-agent call that spawned it, the latest one before it in the file.
        When t ≥ that call's recorded finish, t is on the trace clock: gap = t − finish. In the
        published file a sub-agent's `t_in_trace` restarts at 0 (its own clock): then it fires
        `t` after that finish, and its calls' trace times are shifted by the finish. With no
        main-agent call before it, it fires at `start_offset_s = t`."""
        if self.last_main < 0:
            self.origins[session] = 0.0
            return -1, 0.0, t
        finish = self.last_main_finish
        if t >= finish:
            self.origins[session] = 0.0
            return self.last_main, t - finish, 0.0
        self.origins[session] = finish
        return self.last_main, t, 0.0


def _group_of(session: str, where: str) -> str:
    group = session.split("/", 1)[0]
    if not group or "/" not in session:
        raise ValueError(f"{where}: session_id {session!r} is not 'trace_XXXX/main[/<agent>]'")
    return group


@dataclass
class _Calls:
    """Calls read so far and chat_id → index."""

    calls: list[TraceCall] = field(default_factory=list)
    index_of: dict[int, int] = field(default_factory=dict)

    def add(self, obj: dict[str, Any], where: str, group: _Group) -> None:
        """Append the call of one row (see `_build_call`)."""
        chat = get_int(obj, "chat_id", where)
        if chat in self.index_of:
            raise ValueError(f"{where}: duplicate chat_id {chat}")
        self.calls.append(_build_call(obj, where, self, group))
        self.index_of[chat] = len(self.calls) - 1

    def parent(self, obj: dict[str, Any], where: str, session: str) -> int:
        """Index of the row's `parent_chat_id` (-1 for a first call), checked to precede it in
        the same (sub)agent."""
        chat = get_int(obj, "parent_chat_id", where, minimum=-1)
        if chat == -1:
            return -1
        index = self.index_of.get(chat)
        if index is None:
            raise ValueError(f"{where}: parent_chat_id {chat} does not precede this call")
        if self.calls[index].session != session:
            raise ValueError(f"{where}: parent_chat_id {chat} is in another session")
        return index


def _rebuild_ids(obj: dict[str, Any], where: str, parent_ids: tuple[int, ...]) -> tuple[int, ...]:
    """hash ids = `parent_ids[:prefix_blocks]` + `new_hash_ids`, with the block count checked."""
    prefix = get_int(obj, "prefix_blocks", where)
    if prefix > len(parent_ids):
        raise ValueError(f"{where}: prefix_blocks {prefix} > the parent's {len(parent_ids)} blocks")
    ids = parent_ids[:prefix] + get_ids(obj, "new_hash_ids", where)
    inp = get_int(obj, "input_length", where, minimum=1)
    if len(ids) != inp // WEKA_BLOCK_TOKENS:
        raise ValueError(
            f"{where}: {len(ids)} rebuilt hash ids for input_length {inp} "
            f"(expected {inp // WEKA_BLOCK_TOKENS})"
        )
    return ids


def _build_call(obj: dict[str, Any], where: str, done: _Calls, group: _Group) -> TraceCall:
    """The next call from one row: hash ids rebuilt from the parent, dependency and gap set."""
    index = len(done.calls)
    session = get_str(obj, "session_id", where)
    depth = get_int(obj, "depth", where)
    t = get_float(obj, "t_in_trace", where)
    api_known = obj.get("api_time") is not None
    api = get_float(obj, "api_time", where, optional=True)
    block_size = get_int(obj, "block_size", where)
    if block_size != WEKA_BLOCK_TOKENS:
        raise ValueError(f"{where}: block_size {block_size}, expected {WEKA_BLOCK_TOKENS}")
    parent = done.parent(obj, where, session)
    ids = _rebuild_ids(obj, where, done.calls[parent].block_ids if parent >= 0 else ())
    if parent >= 0:
        after = group.anchors.get(session, parent)
        gap, start = get_float(obj, "think_time", where, optional=True), 0.0
    elif depth > 0:
        after, gap, start = group.spawn(session, t)
    else:
        after, gap, start = -1, 0.0, t
    if api_known:
        group.anchors[session] = index
    if depth == 0 and api_known:
        group.last_main, group.last_main_finish = index, t + api
    return TraceCall(
        index=index,
        session=session,
        group=group.name,
        timestamp_s=group.origins.get(session, 0.0) + t,
        input_tokens=get_int(obj, "input_length", where, minimum=1),
        output_tokens=get_int(obj, "output_length", where),
        block_ids=ids,
        turn=get_int(obj, "turn", where, minimum=1),
        after=after,
        gap_s=gap,
        start_offset_s=start,
        recorded_service_s=api,
        tool_call=obj.get("stop") == "tool_use",
    )


def read_weka(path: str | os.PathLike[str], *, max_sessions: int | None = None) -> Trace:
    """Read the WEKA calls JSONL (`.jsonl.xz` or plain) into a closed-loop `Trace` (64-token
    blocks), streaming.

    hash ids = parent's `[:prefix_blocks]` + `new_hash_ids`; `session` = `session_id` (the
    (sub)agent), `group` = the trace id; `recorded_service_s` = `api_time` (None → 0).
    Dependencies: a call with a previous call in its own (sub)agent fires `think_time` (None →
    0) after the finish of that agent's latest earlier call whose `api_time` is known (the
    recorded think times are measured from it: calls without an api_time overlap their
    successors instead of gating them); a main agent's first call fires at
    `start_offset_s = t_in_trace`; a sub-agent's first call fires after the main-agent call that
    spawned it (the latest one before it in the file), see `_Group.spawn`. `timestamp_s` =
    `t_in_trace` on the trace clock (open-loop offsets within the group): a sub-agent's own
    clock, which restarts at 0 in the published file, is shifted by the recorded finish of its
    spawning call. `max_sessions` keeps the first that many whole traces (groups) in file order.

    Raises ValueError naming file and line for malformed rows, a parent that does not precede
    its child, a block count ≠ floor(input_length / 64), or a trace whose calls are not
    contiguous in the file."""
    check_cap("max_sessions", max_sessions)
    p = Path(path)
    read = _Calls()
    done: set[str] = set()
    group: _Group | None = None
    for lineno, obj in json_lines(p):
        where = f"{p}:{lineno}"
        name = _group_of(get_str(obj, "session_id", where), where)
        if group is None or name != group.name:
            if name in done:
                raise ValueError(f"{where}: calls of {name} are not contiguous in the file")
            if group is not None:
                done.add(group.name)
            if max_sessions is not None and len(done) >= max_sessions:
                break
            group = _Group(name)
        read.add(obj, where, group)
    calls = read.calls
    n_groups = len(done) + (group is not None and group.name not in done)
    return Trace(
        name=p.name.split(".")[0],
        format="weka",
        block_tokens=WEKA_BLOCK_TOKENS,
        calls=tuple(calls),
        closed_loop=True,
        notes={
            "source": p.name,
            "groups": n_groups,
            "sessions": len({c.session for c in calls}),
        },
    )


def _shared_prefix_blocks(meta_path: Path) -> dict[str, int]:
    """trace id → floor((tool_tokens + system_tokens) / 64) from the trace-meta JSON."""
    try:
        with meta_path.open(encoding="utf-8") as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(meta, list):
        raise ValueError(f"{meta_path}: expected a JSON list of per-trace objects")
    out: dict[str, int] = {}
    for i, entry in enumerate(meta):
        where = f"{meta_path}: entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object")
        tokens = get_int(entry, "tool_tokens", where) + get_int(entry, "system_tokens", where)
        out[get_str(entry, "trace_id", where)] = tokens // WEKA_BLOCK_TOKENS
    return out


def weka_shared_prefix(trace: Trace, meta_path: str | os.PathLike[str]) -> Trace:
    """Model a warm Claude Code system + tools prefix shared by every trace.

    For each trace (group), its shared prefix is the first S = floor((tool_tokens +
    system_tokens) / 64) block ids of its first call (from `meta_path`, the trace-meta JSON).
    Wherever a call of that trace starts with those ids, its leading ids (up to S) are replaced
    by one global sequence of shared ids, the same for every trace and distinct from every other
    id (they start at 1 + the largest id in the trace). A call that diverges from its trace's
    prefix keeps its own ids from the divergence on (sub-agents, which have their own system
    prompt, usually keep all of theirs), so no prefix equality is invented. Returns a new trace;
    S per trace and the first shared id are recorded in `notes`.

    Raises ValueError when a group has no entry in the meta file."""
    if trace.block_tokens != WEKA_BLOCK_TOKENS:
        raise ValueError(f"expects {WEKA_BLOCK_TOKENS}-token blocks, got {trace.block_tokens}")
    mp = Path(meta_path)
    blocks = _shared_prefix_blocks(mp)
    base = 1 + max((max(c.block_ids) for c in trace.calls if c.block_ids), default=-1)
    longest = max((blocks.get(c.group, 0) for c in trace.calls), default=0)
    shared = tuple(range(base, base + longest))
    refs: dict[str, tuple[int, ...]] = {}
    calls: list[TraceCall] = []
    remapped = 0
    for c in trace.calls:
        if c.group not in blocks:
            raise ValueError(f"{mp}: no entry for trace {c.group!r}")
        ref = refs.setdefault(c.group, c.block_ids[: blocks[c.group]])
        m = _common_prefix(c.block_ids, ref)
        remapped += m
        calls.append(replace(c, block_ids=shared[:m] + c.block_ids[m:]) if m else c)
    notes = dict(trace.notes)
    notes["shared_prefix"] = {
        "meta": mp.name,
        "first_shared_id": base,
        "blocks_per_trace": {g: blocks[g] for g in refs},
        "remapped_blocks": remapped,
    }
    return replace(trace, name=f"{trace.name}+shared_prefix", calls=tuple(calls), notes=notes)


def _common_prefix(ids: tuple[int, ...], ref: tuple[int, ...]) -> int:
    """Leading positions where `ids` equals `ref` (prefix ids: equal at k ⇒ equal before k)."""
    n = min(len(ids), len(ref))
    if n and ids[n - 1] == ref[n - 1]:
        return n
    m = 0
    while m < n and ids[m] == ref[m]:
        m += 1
    return m
