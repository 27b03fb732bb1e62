"""Reader for Mooncake FAST'25 request traces (JSONL, 512-token prefix-block hash ids).

Rows carry no session id, so sessions are rebuilt by prefix chaining (see `read_mooncake`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvsched.sim.traces._io import check_cap, get_float, get_ids, get_int, json_lines
from kvsched.sim.traces.model import Trace, TraceCall

MOONCAKE_BLOCK_TOKENS = 512

SESSION_RULE = (
    "a request continues the session of the longest earlier prompt (most recent on ties) whose "
    "full blocks are a prefix of its own full blocks; a prompt whose last full block lies "
    "inside an earlier, longer prompt (shared content such as a system prompt) is never "
    "continued"
)


@dataclass
class _Chainer:
    """Prefix-chaining state, O(1) per block id.

    `owner[x]` is the most recent request whose whole full-block list ends with id `x` (ids are
    prefix ids, so `x` identifies that whole list); `interior` holds every id seen at a
    non-final position, so prompts that are strict prefixes of earlier prompts never own one."""

    owner: dict[int, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    interior: set[int] = field(default_factory=set)

    def parent(self, ids: tuple[int, ...]) -> int:
        """Index of the request this prompt continues, or -1. Changes nothing."""
        best = -1
        owner, lengths = self.owner, self.lengths
        for k, x in enumerate(ids):
            j = owner.get(x)
            if j is not None and lengths[j] == k + 1:
                best = j
        return best

    def add(self, index: int, ids: tuple[int, ...]) -> None:
        """Record request `index` (which must be the next index) with full blocks `ids`."""
        self.lengths.append(len(ids))
        if len(ids) > 1:
            self.interior.update(ids[:-1])
        if ids and ids[-1] not in self.interior:
            self.owner[ids[-1]] = index


def read_mooncake(path: str | os.PathLike[str], *, max_requests: int | None = None) -> Trace:
    """Read a Mooncake JSONL trace into an open-loop `Trace` (512-token blocks).

    Per row: `timestamp` ms → `timestamp_s` = ms / 1000; `block_ids` = the full blocks only
    (the last hash id is dropped when `input_length % 512 != 0`). Sessions `mc-<index of first
    request>` are rebuilt by prefix chaining (`SESSION_RULE`); `group` = session, `turn` = the
    request's rank within its session. Reads at most `max_requests` rows (None: all).

    Raises ValueError naming file and line for malformed rows, including
    `len(hash_ids) != ceil(input_length / 512)`."""
    check_cap("max_requests", max_requests)
    p = Path(path)
    chainer = _Chainer()
    calls: list[TraceCall] = []
    sessions: list[str] = []
    turns: dict[str, int] = {}
    for lineno, obj in json_lines(p):
        if max_requests is not None and len(calls) >= max_requests:
            break
        where = f"{p}:{lineno}"
        ts_ms = get_float(obj, "timestamp", where)
        inp = get_int(obj, "input_length", where, minimum=1)
        out = get_int(obj, "output_length", where)
        hash_ids = get_ids(obj, "hash_ids", where)
        if len(hash_ids) != math.ceil(inp / MOONCAKE_BLOCK_TOKENS):
            raise ValueError(
                f"{where}: {len(hash_ids)} hash_ids for input_length {inp} "
                f"(expected ceil({inp}/{MOONCAKE_BLOCK_TOKENS}))"
            )
        ids = hash_ids[: inp // MOONCAKE_BLOCK_TOKENS]
        index = len(calls)
        parent = chainer.parent(ids)
        session = sessions[parent] if parent >= 0 else f"mc-{index}"
        chainer.add(index, ids)
        sessions.append(session)
        turns[session] = turn = turns.get(session, 0) + 1
        calls.append(
            TraceCall(
                index=index,
                session=session,
                group=session,
                timestamp_s=ts_ms / 1000.0,
                input_tokens=inp,
                output_tokens=out,
                block_ids=ids,
                turn=turn,
            )
        )
    return Trace(
        name=p.name.split(".")[0],
        format="mooncake",
        block_tokens=MOONCAKE_BLOCK_TOKENS,
        calls=tuple(calls),
        closed_loop=False,
        notes={
            "source": p.name,
            "sessions": len(turns),
            "multi_turn_sessions": sum(1 for n in turns.values() if n > 1),
            "session_rule": SESSION_RULE,
        },
    )
