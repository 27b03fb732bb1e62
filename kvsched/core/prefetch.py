"""Idle-gap prefetch: bring a session's KV back from its node's pool (the DRAM tier) into its
host's GPU memory shortly before its next turn is expected.

An agentic session alternates turns with tool calls. During a long call its KV may be evicted
from GPU memory to the node's DRAM (`kvsched.sim.tiers`); its next turn then loads it over the
host link (PCIe) before its prefill can finish. Prefetch moves that load into the gap: when a
turn ends, the policy predicts the next gap from the gaps the session already showed
(`GapHistory`, `predict_gap_s`) and plans loads at a few quantiles of them (`prefetch_times`,
`prefetch_plan`: `TransferPlan`s of kind PREFETCH whose `not_before` says when). The executor
starts each when due only if the host then has no queued work and room for the blocks
(`may_start`), and loads only what the pool holds beyond the GPU's prefix then: when the GPU
kept it all, it moves nothing.

Everything here is pure: callers pass `now`; nothing reads a clock or draws randomness.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvsched.core.cost_model import CostModel
from kvsched.core.decision import TransferKind, TransferPlan


@dataclass(frozen=True, slots=True)
class PrefetchRule:
    """When prefetches are planned: the session showed at least `min_gaps` gaps, and for each
    of `checks` quantiles of its last gaps, evenly spaced from `quantile` to `last_quantile`,
    that is at least `min_gap_s` (shorter gaps rarely outlast the GPU's memory), one load
    starts `lead_s` plus its own estimated time before that predicted arrival. Agentic gaps
    spread widely (a tool call, a human pause): several checks cover more of them than one,
    and a check that finds the context still on the GPU moves nothing."""

    quantile: float = 0.1
    last_quantile: float = 1.0
    checks: int = 5
    min_gaps: int = 2
    min_gap_s: float = 10.0
    lead_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.quantile <= self.last_quantile <= 1.0:
            raise ValueError("prefetch quantiles must satisfy 0 <= quantile <= last <= 1")
        if self.checks < 1 or self.min_gaps < 1 or self.min_gap_s < 0 or self.lead_s < 0:
            raise ValueError(
                "prefetch needs checks >= 1, min_gaps >= 1, min_gap_s >= 0 and lead_s >= 0"
            )

    def quantiles(self) -> tuple[float, ...]:
        if self.checks == 1:
            return (self.quantile,)
        step = (self.last_quantile - self.quantile) / (self.checks - 1)
        return tuple(self.quantile + i * step for i in range(self.checks))


def predict_gap_s(gaps: Sequence[float], quantile: float) -> float:
    """The `quantile` of `gaps` (linear interpolation between order statistics, as numpy's
    default); NaN when there are none. A low quantile predicts early: a prefetch that lands
    early costs only GPU memory held a little longer, one that lands late saves nothing."""
    if not gaps:
        return math.nan
    ordered = sorted(gaps)
    pos = quantile * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class GapHistory:
    """The last `keep` idle gaps (a turn's end to the session's next arrival) of each of the
    `max_sessions` sessions observed last. Changes only through `observe` and `forget`."""

    def __init__(self, keep: int = 8, max_sessions: int = 65_536) -> None:
        if keep < 1 or max_sessions < 1:
            raise ValueError("a gap history keeps at least one gap of one session")
        self._keep = keep
        # A long-running Conductor sees sessions without end: the least recently observed
        # ones go first (dicts keep insertion order; an observed session moves to the end).
        self._max_sessions = max_sessions
        self._gaps: dict[str, deque[float]] = {}
        self._counted: dict[str, float] = {}  # session -> the finish its last gap ran from

    def observe(self, session_id: str, finished_at: float, arrived_at: float) -> None:
        """A turn of `session_id` arrived at `arrived_at` after one ended at `finished_at`:
        record the gap between them, once per finish (a retried arrival adds nothing; a
        session with no finish yet, `finished_at` infinite, neither)."""
        if not math.isfinite(finished_at) or self._counted.get(session_id) == finished_at:
            return
        self._counted.pop(session_id, None)
        self._counted[session_id] = finished_at
        gaps = self._gaps.pop(session_id, None)
        if gaps is None:
            gaps = deque(maxlen=self._keep)
            if len(self._gaps) >= self._max_sessions:
                self.forget(next(iter(self._gaps)))
        self._gaps[session_id] = gaps
        gaps.append(max(arrived_at - finished_at, 0.0))

    def gaps(self, session_id: str) -> tuple[float, ...]:
        return tuple(self._gaps.get(session_id, ()))

    def forget(self, session_id: str) -> None:
        self._gaps.pop(session_id, None)
        self._counted.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._gaps)


def prefetch_times(
    rule: PrefetchRule, gaps: Sequence[float], finished_at: float, load_s: float
) -> tuple[float, ...]:
    """When to start loading a session whose turn ended at `finished_at` and whose load takes
    `load_s`: for each of the rule's quantiles of `gaps` of at least `rule.min_gap_s`,
    `rule.lead_s + load_s` before that predicted arrival, not before `finished_at`; distinct
    times, ascending. None when the session showed fewer than `rule.min_gaps` gaps."""
    if len(gaps) < rule.min_gaps:
        return ()
    times: set[float] = set()
    for q in rule.quantiles():
        gap = predict_gap_s(gaps, q)
        if gap >= rule.min_gap_s:
            times.add(max(finished_at, finished_at + gap - rule.lead_s - load_s))
    return tuple(sorted(times))


def prefetch_plan(
    cost: CostModel,
    host: int,
    hashes: tuple[int, ...],
    *,
    session_id: str,
    not_before: float,
) -> TransferPlan:
    """The order to load the session's context `hashes` from `host`'s node pool into `host`'s
    GPU memory at `not_before` (source and target are the host: the pool is its node's). Its
    size and time are the whole context's, an upper bound: the executor loads only what the
    GPU lacks then."""
    tokens = len(hashes) * cost.block_size
    nbytes = tokens * cost.kv_bytes_per_token
    return TransferPlan(
        kind=TransferKind.PREFETCH,
        source=host,
        target=host,
        block_hashes=hashes,
        skip_blocks=0,
        tokens=tokens,
        nbytes=nbytes,
        est_seconds=pool_load_s(cost, tokens),
        on_critical_path=False,
        session_id=session_id,
        not_before=not_before,
    )


def pool_load_s(cost: CostModel, tokens: int) -> float:
    """Seconds to load `tokens` of KV from a node's pool over the host link (no overlap)."""
    if tokens <= 0:
        return 0.0
    link = cost.pool_link
    return link.setup_s + tokens * cost.kv_bytes_per_token / link.bandwidth_bytes_per_s


def may_start(*, queued_jobs: int, room_pages: int, needed_pages: int) -> bool:
    """Whether a due prefetch starts on its host now: no request waits there (a load would
    compete with queued prompts for pages and the host link) and the host has `needed_pages`
    free or evictable pages (`room_pages`) for the blocks."""
    return queued_jobs == 0 and needed_pages > 0 and room_pages >= needed_pages
