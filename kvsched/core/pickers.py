"""Picking a slot from scored vectors: deterministic argmins with explicit tie-breaks."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cluster import ClusterState
from kvsched.core.request_view import BoolVec, FloatVec
from kvsched.core.scoring import Kernels


def argmin_eligible(
    values: FloatVec, eligible: BoolVec, *tiebreaks: FloatVec, kernels: Kernels | None
) -> int:
    """Index of the smallest value among eligible slots; ties go to the later keys, then the
    lowest slot. Deterministic: no random tie-break. (The numpy below is the reference; the
    compiled `kernels`, where given, pick the same slot.)"""
    if kernels is not None:
        out = kernels.argmin(values, eligible, tiebreaks)
        if out is not NotImplemented:
            return out
    if not eligible.any():
        raise ValueError("no eligible instance")
    masked = np.where(eligible, values, np.inf)
    best = int(np.argmin(masked))
    if not tiebreaks or np.count_nonzero(masked == masked[best]) == 1:
        return best  # the common case: a unique minimum
    keys = [np.where(eligible, v, np.inf) for v in reversed(tiebreaks)]
    return int(np.lexsort([*keys, masked])[0])


def any_of(mask: BoolVec, rng: Random) -> int:
    """A uniformly random slot of those set in `mask`; the RNG is drawn from only when there
    is more than one (a unique best leaves the seed's stream as it was)."""
    slots = np.flatnonzero(mask)
    if not len(slots):
        raise ValueError("no eligible instance")
    return int(slots[rng.randrange(len(slots))]) if len(slots) > 1 else int(slots[0])


def masked_min(values: FloatVec, mask: BoolVec, *, kernels: Kernels | None) -> float:
    """The smallest of `values` where `mask` is set (ValueError when none is); the compiled
    `kernels`, where given, find the same."""
    if kernels is not None:
        out = kernels.masked_min(values, mask)
        if out is not NotImplemented:
            return out
    return float(np.min(values[mask]))


def least_pending(cluster: ClusterState, mask: BoolVec) -> int:
    """The slot in `mask` with the fewest pending prefill tokens. Ties (common: most instants
    have no prompt work queued anywhere) go to the fewest requests in flight, then the fewest
    sessions bound, then the lowest slot."""
    load = cluster.load
    return argmin_eligible(
        load.pending_prefill_tokens,
        mask,
        load.in_flight,
        bound_per_slot(cluster),
        kernels=cluster.cost.kernels,
    )


def bound_per_slot(cluster: ClusterState) -> FloatVec:
    """Sessions bound to each slot (no Python loop over the slots: there may be thousands)."""
    out = np.zeros(cluster.n)
    bound = cluster.sessions.bound  # host -> sessions bound there
    if bound:
        hosts = np.fromiter(bound.keys(), dtype=np.intp, count=len(bound))
        counts = np.fromiter(bound.values(), dtype=np.float64, count=len(bound))
        inside = (hosts >= 0) & (hosts < cluster.n)
        out[hosts[inside]] = counts[inside]
    return out
