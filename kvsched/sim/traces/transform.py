"""Trace transformations (token scaling, capping) and a format-detecting loader."""

from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

from kvsched.sim.traces._io import open_text
from kvsched.sim.traces.azure import AZURE_COLUMNS, read_azure
from kvsched.sim.traces.model import Trace, TraceCall
from kvsched.sim.traces.mooncake import read_mooncake
from kvsched.sim.traces.weka import read_weka

FORMATS = ("mooncake", "weka", "azure")


def _as_fraction(factor: float | Fraction) -> Fraction:
    """The factor a person meant: 0.1 → 1/10 (a float goes through its shortest repr)."""
    if isinstance(factor, float):
        return Fraction(repr(factor))
    return Fraction(factor)


class _Rebinner:
    """Maps a call's original full-block ids to the ids of its scaled blocks.

    New block j ends at new token (j+1)·B_new, i.e. original token (j+1)·B_new/f; it carries the
    original id at index ceil((j+1)·B_new / (f·B_old)) − 1 = ceil((j+1)·p/q) − 1, the original
    block that ends that prefix. When p < q (new blocks smaller than the original blocks they
    map to) several new blocks would carry one original id, so each (original id, j) pair gets
    a fresh id instead, which keeps every id at one position."""

    def __init__(self, p: int, q: int) -> None:
        self.p, self.q = p, q
        self.fresh: dict[tuple[int, int], int] | None = {} if p < q else None

    def count(self, n_original: int, n_new_full: int) -> int:
        """New full blocks with an original full block behind them."""
        return min(n_new_full, n_original * self.q // self.p)

    def ids(self, original: tuple[int, ...], n: int) -> tuple[int, ...]:
        p, q = self.p, self.q
        if p == q:
            return original[:n]
        if self.fresh is None:
            return tuple(original[((j + 1) * p + q - 1) // q - 1] for j in range(n))
        fresh = self.fresh
        out = []
        for j in range(n):
            key = (original[((j + 1) * p + q - 1) // q - 1], j)
            new_id = fresh.get(key)
            if new_id is None:
                new_id = fresh[key] = len(fresh)
            out.append(new_id)
        return tuple(out)


def scale_tokens(trace: Trace, factor: float | Fraction, block_tokens: int | None = None) -> Trace:
    """Scale prompt lengths by `factor` (e.g. 0.25 to fit Claude-sized contexts to a smaller
    model) and re-block them into `block_tokens`-token blocks (default: the trace's).

    New input = round(P × factor) (halves up), at least 1; outputs, times and dependencies are
    unchanged. New block j carries the original id at index
    ceil((j+1)·(block_tokens/factor)/old_block_tokens) − 1 (the original block that ends the
    same prefix); only new full blocks with an original full block behind them are kept. When
    new blocks are finer than that mapping (the ratio < 1) ids are renumbered per (original id,
    position) so no id repeats within a prompt. Factor 1 with the same block size returns equal
    calls. The scaling is appended to `notes["scale_tokens"]`.

    Raises ValueError for a non-positive factor or block size."""
    f = _as_fraction(factor)
    new_bt = trace.block_tokens if block_tokens is None else block_tokens
    if f <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    if new_bt <= 0:
        raise ValueError(f"block_tokens must be > 0, got {new_bt}")
    rebin = _Rebinner(new_bt * f.denominator, f.numerator * trace.block_tokens)
    calls: list[TraceCall] = []
    for c in trace.calls:
        inp = max(1, (2 * c.input_tokens * f.numerator + f.denominator) // (2 * f.denominator))
        n = rebin.count(len(c.block_ids), inp // new_bt)
        calls.append(replace(c, input_tokens=inp, block_ids=rebin.ids(c.block_ids, n)))
    notes = dict(trace.notes)
    notes["scale_tokens"] = [
        *trace.notes.get("scale_tokens", []),
        {
            "factor": str(f),
            "block_tokens": [trace.block_tokens, new_bt],
            "ids_renumbered": rebin.fresh is not None,
        },
    ]
    return replace(trace, block_tokens=new_bt, calls=tuple(calls), notes=notes)


def cap_requests(trace: Trace, n: int) -> Trace:
    """The first `n` calls (trace order keeps every dependency before its dependant, so the cut
    is self-contained); recorded in `notes["capped_to"]`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if n >= len(trace.calls):
        return trace
    return replace(trace, calls=trace.calls[:n], notes={**trace.notes, "capped_to": n})


def cap_gaps(trace: Trace, max_gap_s: float) -> Trace:
    """Closed loop: shorten every think/idle gap longer than `max_gap_s` to it. A session idle
    for hours (a human away) is replayed as one that returns after the cap; recorded in
    `notes["max_gap_s"]` with how many gaps changed."""
    if max_gap_s < 0:
        raise ValueError(f"max_gap_s must be >= 0, got {max_gap_s}")
    changed = 0
    calls = []
    for call in trace.calls:
        if call.gap_s > max_gap_s:
            changed += 1
        calls.append(replace(call, gap_s=max_gap_s) if call.gap_s > max_gap_s else call)
    notes = {**trace.notes, "max_gap_s": max_gap_s, "gaps_capped": changed}
    return replace(trace, calls=tuple(calls), notes=notes)


def select_groups(trace: Trace, start: int, stop: int) -> Trace:
    """Keep groups [start, stop) in order of first appearance (e.g. a held-out half of the
    agentic traces); calls are renumbered and dependencies follow. Recorded in
    `notes["groups"]`."""
    if not 0 <= start <= stop:
        raise ValueError(f"need 0 <= start <= stop, got {start}:{stop}")
    order = group_order(trace)
    kept = _keep_groups(trace, {g for g, i in order.items() if start <= i < stop})
    return replace(kept, notes={**trace.notes, "groups": [start, min(stop, len(order))]})


def group_order(trace: Trace) -> dict[str, int]:
    """Each group's rank by its first call."""
    order: dict[str, int] = {}
    for call in trace.calls:
        order.setdefault(call.group, len(order))
    return order


def _keep_groups(trace: Trace, groups: set[str]) -> Trace:
    """The calls of `groups` only, renumbered, dependencies following."""
    kept = [c for c in trace.calls if c.group in groups]
    new_index = {c.index: i for i, c in enumerate(kept)}
    calls = tuple(
        replace(c, index=i, after=new_index[c.after] if c.after >= 0 else -1)
        for i, c in enumerate(kept)
    )
    return replace(trace, calls=calls)


def repeat_groups_fraction(trace: Trace, copies: float, seed: int) -> Trace:
    """`copies` copies of each group, fractions too (a load between two whole numbers of
    copies): the whole copies as `repeat_groups` makes them, then a seeded sample of the next
    copy's groups, `round(copies × groups)` groups in all. Recorded in `notes["repeat"]`."""
    if copies <= 0:
        raise ValueError(f"copies must be positive, got {copies:g}")
    n = len(group_order(trace))
    total = max(1, round(copies * n))
    whole, extra = divmod(total, n)
    out = repeat_groups(trace, whole + (1 if extra else 0))
    if extra:
        order = group_order(out)
        last = sorted((g for g, i in order.items() if i >= whole * n), key=order.__getitem__)
        sample = random.Random(f"copies:{seed}").sample(last, extra)
        out = _keep_groups(out, {g for g, i in order.items() if i < whole * n} | set(sample))
    return replace(out, notes={**trace.notes, "repeat": total / n})


def repeat_groups(trace: Trace, times: int) -> Trace:
    """Replay each group (agentic trace) `times` times as distinct users: copy k gets session
    and group names suffixed `#k` and block ids shifted past every original id, so copies share
    nothing. Copies follow the originals in trace order; recorded in `notes["repeat"]`."""
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    if times == 1:
        return trace
    calls = list(trace.calls)
    n = len(calls)
    stride = 1 + max((max(c.block_ids) for c in calls if c.block_ids), default=0)
    for k in range(1, times):
        shift = k * stride
        for c in trace.calls:
            calls.append(
                replace(
                    c,
                    index=c.index + k * n,
                    session=f"{c.session}#{k}" if c.session else "",
                    group=f"{c.group}#{k}",
                    block_ids=tuple(b + shift for b in c.block_ids),
                    after=c.after + k * n if c.after >= 0 else -1,
                )
            )
    return replace(trace, calls=tuple(calls), notes={**trace.notes, "repeat": times})


def detect_format(path: str | os.PathLike[str]) -> str:
    """'mooncake', 'weka' or 'azure' from the first non-blank line (xz or plain), or from the
    file name when the file is empty. Raises ValueError when neither tells."""
    p = Path(path)
    with open_text(p) as f:
        first = next((line for line in f if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            keys = set(json.loads(first))
        except (json.JSONDecodeError, TypeError):
            raise ValueError(f"{p}:1: first line is not a JSON object") from None
        if "new_hash_ids" in keys or "session_id" in keys:
            return "weka"
        if "hash_ids" in keys:
            return "mooncake"
    elif all(col in first for col in AZURE_COLUMNS):
        return "azure"
    name = p.name.lower()
    if not first:
        for fmt in FORMATS:
            if fmt in name:
                return fmt
    raise ValueError(f"{p}: cannot tell the trace format (expected one of {', '.join(FORMATS)})")


def load(path: str | os.PathLike[str], fmt: str | None = None, **opts: int | None) -> Trace:
    """Read a trace of format `fmt` (detected by `detect_format` when None).

    Options: `max_requests` (any format; for weka applied after reading, whole traces are not
    kept) and `max_sessions` (weka: whole traces in file order). Raises ValueError for an unknown
    format or an option the format does not take."""
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (expected one of {', '.join(FORMATS)})")
    allowed = {"max_requests", "max_sessions"} if fmt == "weka" else {"max_requests"}
    unknown = sorted(set(opts) - allowed)
    if unknown:
        raise ValueError(f"{fmt} traces take {sorted(allowed)}, not {unknown}")
    if fmt == "mooncake":
        return read_mooncake(path, max_requests=opts.get("max_requests"))
    if fmt == "azure":
        return read_azure(path, max_requests=opts.get("max_requests"))
    trace = read_weka(path, max_sessions=opts.get("max_sessions"))
    cap = opts.get("max_requests")
    return trace if cap is None else cap_requests(trace, cap)
