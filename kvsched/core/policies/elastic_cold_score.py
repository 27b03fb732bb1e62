"""(c) of `elastic` (`kvsched.core.policies.elastic`): the score it ranks slots by for a cold
start (a new session or a sessionless request), and the slots it picks from.

The numpy here is the reference; `Kernels.cold_score` (`kvsched.core.scoring`) is the compiled
version, which must agree with it.
"""

from __future__ import annotations

import numpy as np

from kvsched.core.pickers import masked_min
from kvsched.core.request_view import BoolVec, FloatVec
from kvsched.core.scoring import Kernels


def cold_score(
    terms: dict[str, FloatVec],
    pending_s: FloatVec,
    eligible: BoolVec,
    *,
    resident: FloatVec,
    context_tokens: int,
    capacity_tokens: float,
    kernels: Kernels | None,
) -> tuple[FloatVec, BoolVec]:
    """(c)'s score of every slot for a cold start, and the slots to pick from: those whose
    active sessions leave room for the new context (all eligible ones when none does).
    Recomputing what another instance holds also delays whoever queues behind it: a request
    arriving at a busy instance waits, so the extra prefill over the cheapest slot's is
    charged at the share of instances busy now (for Poisson arrivals, the chance of finding
    one busy). The numpy below is the reference; the compiled `kernels`, where given, compute
    the same."""
    ttft, prefill = terms["ttft_s"], terms["prefill_s"]
    if kernels is not None:
        out = kernels.cold_score(
            ttft, prefill, pending_s, eligible, resident, context_tokens, capacity_tokens
        )
        if out is not NotImplemented:
            return out
    busy_share = float(np.mean(pending_s[eligible] > 0))
    extra = prefill - masked_min(prefill, eligible, kernels=kernels)
    score: FloatVec = ttft + busy_share * extra
    fits = eligible & (resident + context_tokens <= capacity_tokens)
    return score, fits if fits.any() else eligible
