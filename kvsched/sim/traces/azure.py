"""Reader for the Azure LLM inference trace 2023 (CSV: arrivals and lengths, no reuse)."""

from __future__ import annotations

import csv
import os
from datetime import datetime, timedelta
from pathlib import Path

from kvsched.sim.traces._io import check_cap
from kvsched.sim.traces.model import Trace, TraceCall

AZURE_BLOCK_TOKENS = 64
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TICKS_PER_S = 10_000_000  # the trace's timestamps have 7 fractional digits (100 ns)


def _ticks(stamp: str, where: str) -> int:
    """'YYYY-MM-DD HH:MM:SS[.fffffff]' → 100-ns ticks since 2000-01-01, exactly."""
    whole, _, frac = stamp.strip().partition(".")
    try:
        dt = datetime.fromisoformat(whole)
    except ValueError:
        raise ValueError(f"{where}: bad TIMESTAMP {stamp!r}") from None
    if len(frac) > 7 or not (frac == "" or frac.isdigit()):
        raise ValueError(f"{where}: bad TIMESTAMP fraction in {stamp!r}")
    seconds = (dt.replace(tzinfo=None) - datetime(2000, 1, 1)) // timedelta(seconds=1)
    return seconds * _TICKS_PER_S + int(frac.ljust(7, "0") or "0")


def _count(text: str, column: str, where: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {column} {text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{where}: {column} {value} < {minimum}")
    return value


def read_azure(path: str | os.PathLike[str], *, max_requests: int | None = None) -> Trace:
    """Read an Azure 2023 CSV into an open-loop `Trace` without reuse (64-token blocks).

    `timestamp_s` is relative to the first row (exact to 100 ns before the float conversion);
    every request gets fresh block ids (one per full block, numbered across the trace), session
    and group "". Reads at most `max_requests` rows (None: all).

    Raises ValueError naming file and line for a missing column or malformed row."""
    check_cap("max_requests", max_requests)
    p = Path(path)
    calls: list[TraceCall] = []
    next_id = 0
    first: int | None = None
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{p}:1: missing column(s) {', '.join(missing)}")
        for row in reader:
            if max_requests is not None and len(calls) >= max_requests:
                break
            where = f"{p}:{reader.line_num}"
            if None in row.values() or None in row:
                raise ValueError(f"{where}: expected {len(reader.fieldnames or [])} columns")
            ticks = _ticks(row["TIMESTAMP"], where)
            first = ticks if first is None else first
            inp = _count(row["ContextTokens"], "ContextTokens", where, 1)
            n_blocks = inp // AZURE_BLOCK_TOKENS
            calls.append(
                TraceCall(
                    index=len(calls),
                    session="",
                    group="",
                    timestamp_s=(ticks - first) / _TICKS_PER_S,
                    input_tokens=inp,
                    output_tokens=_count(row["GeneratedTokens"], "GeneratedTokens", where, 0),
                    block_ids=tuple(range(next_id, next_id + n_blocks)),
                )
            )
            next_id += n_blocks
    return Trace(
        name=p.name.split(".")[0],
        format="azure",
        block_tokens=AZURE_BLOCK_TOKENS,
        calls=tuple(calls),
        closed_loop=False,
        notes={"source": p.name, "reuse": "none: fresh block ids per request"},
    )
