"""Ideal automatic-prefix-cache (APC) ceilings of a trace: one unbounded cache, trace order."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvsched.core.latency import LatencyModel
from kvsched.sim.traces.model import Trace

Scope = Literal["global", "session"]

# The hits of each trace asked about, for as long as the trace lives: a report asks for them
# once per ceiling and once per policy row, and one pass over a long agentic trace takes
# seconds. Keyed by the trace's id, the entry going with the trace (a weak reference's
# callback), so the cache never keeps a trace alive: holding the last four kept four of a
# knee search's traces, gigabytes each at its loads, in every search process.
_HITS: dict[tuple[int, str], tuple[weakref.ref[Trace], tuple[int, ...]]] = {}


def matched_blocks(ids: Sequence[int], seen: set[int] | frozenset[int]) -> int:
    """Leading ids of `ids` that are in `seen` (the count before the first unseen id).

    Exact for any ids; fast for prefix ids: a binary search finds the candidate boundary (where
    seen-ness is monotone, as with prefix ids), a C-level superset check confirms it, and only
    when that fails does a linear scan run. O(len(ids))."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if ids[mid] in seen:
            lo = mid + 1
        else:
            hi = mid
    # ids[lo] (if any) was found unseen by the search, so lo is exact once ids[:lo] are all seen
    if seen.issuperset(ids[:lo]):
        return lo
    m = 0
    for x in ids:
        if x not in seen:
            break
        m += 1
    return m


def ideal_hits(trace: Trace, *, scope: Scope = "global") -> tuple[int, ...]:
    """Per call, the prompt tokens one unbounded cache fed in trace order would serve:
    H = min(matched leading blocks × block_tokens, P − 1).

    scope "global": a block is matched when any earlier call had that id; scope "session": only
    earlier calls of the same session count (calls with session "" never hit). Blocks are
    counted as listed in `block_ids`. O(total block ids) the first time for a trace, then
    remembered while the trace lives.

    Raises ValueError for an unknown scope."""
    if scope not in ("global", "session"):
        raise ValueError(f"scope must be 'global' or 'session', got {scope!r}")
    key = (id(trace), scope)
    found = _HITS.get(key)
    if found is not None and found[0]() is trace:
        return found[1]
    hits = _walk(trace, scope)
    # the callback runs as the trace is freed, before its id can name another trace
    _HITS[key] = (weakref.ref(trace, lambda _: _HITS.pop(key, None)), hits)
    return hits


def _walk(trace: Trace, scope: Scope) -> tuple[int, ...]:
    bt = trace.block_tokens
    seen_all: set[int] = set()
    by_session: dict[str, set[int]] = {}
    out: list[int] = []
    for call in trace.calls:
        ids = call.block_ids
        if scope == "global":
            seen = seen_all
        elif call.session:
            seen = by_session.setdefault(call.session, set())
        else:
            seen = set()
        m = matched_blocks(ids, seen)
        out.append(max(0, min(m * bt, call.input_tokens - 1)))
        seen.update(ids[m:])
    return tuple(out)


def ideal_apc(
    trace: Trace, *, scope: Scope = "global", window: range | Sequence[bool] | None = None
) -> float:
    """Token-weighted ideal APC = ΣH / ΣP (H from `ideal_hits`) over the calls in `window`: a
    range of call indices or one boolean per call (all calls when None). Calls outside the
    window still warm the cache. Returns 0.0 when the window holds no prompt tokens.

    Raises ValueError for an unknown scope or a window outside the trace."""
    calls = trace.calls
    if window is None:
        chosen: Sequence[bool] = [True] * len(calls)
    elif isinstance(window, range):
        if len(window) and (min(window) < 0 or max(window) >= len(calls)):
            raise ValueError(f"window {window} is outside the trace's {len(calls)} calls")
        chosen = [False] * len(calls)
        for i in window:
            chosen[i] = True
    else:
        if len(window) != len(calls):
            raise ValueError(f"window mask has {len(window)} entries for {len(calls)} calls")
        chosen = window
    hits = ideal_hits(trace, scope=scope)
    prompt = sum(c.input_tokens for c, keep in zip(calls, chosen, strict=True) if keep)
    served = sum(h for h, keep in zip(hits, chosen, strict=True) if keep)
    return served / prompt if prompt else 0.0


def ttft_floor(
    trace: Trace,
    latency: LatencyModel,
    chunk_tokens: int,
    window: Sequence[bool] | npt.NDArray[np.bool_],
) -> dict[str, float]:
    """TTFT percentiles (p50, p90, p99, in seconds) that no placement can beat: each call in
    `window` prefilled alone on an idle instance, its ideal global hit (`ideal_hits`) already
    in GPU memory, the rest in passes of `chunk_tokens`. Every memory tier, queue and transfer
    only adds to it. Empty when the window holds no call."""
    if len(window) != len(trace.calls):
        raise ValueError(f"window mask has {len(window)} entries for {len(trace.calls)} calls")
    hits = np.array(ideal_hits(trace, scope="global"), dtype=float)
    prompt = np.array([c.input_tokens for c in trace.calls], dtype=float)
    keep = np.asarray(window, dtype=bool)
    if not keep.any():
        return {}
    seconds = latency.prefill(prompt[keep] - hits[keep], hits[keep], chunk=chunk_tokens)
    return {f"p{q}": float(np.percentile(seconds, q)) for q in (50, 90, 99)}
