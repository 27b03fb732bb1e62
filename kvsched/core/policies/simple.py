"""Load-only baselines: round robin, random, least loaded."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import least_pending
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView


class RoundRobin(Policy):
    """Rule: the next live instance in slot order, ignoring cache and load."""

    name = "round_robin"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._next = 0

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        n = self.cluster.n
        for step in range(n):
            slot = (self._next + step) % n
            if view.eligible[slot]:
                self._next = slot + 1
                terms = ttft_terms(self.cluster.cost, self.cluster.load, view, view.hit_tokens)
                return placement(view, slot, "next instance in turn", terms)
        raise ValueError("no live instance")


class RandomChoice(Policy):
    """Rule: a uniformly random live instance (seeded)."""

    name = "random"

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        slots = np.flatnonzero(view.eligible)
        if not len(slots):
            raise ValueError("no live instance")
        slot = int(slots[rng.randrange(len(slots))])
        terms = ttft_terms(self.cluster.cost, self.cluster.load, view, view.hit_tokens)
        return placement(view, slot, "uniform random", terms)


class LeastLoaded(Policy):
    """Rule: the instance with the fewest pending prefill tokens (ties: fewer requests in
    flight, then the lowest slot). Cache hits are ignored when choosing."""

    name = "least_loaded"

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster = self.cluster
        load = cluster.load
        slot = least_pending(cluster, view.eligible)
        terms = ttft_terms(cluster.cost, load, view, view.hit_tokens)
        terms["pending_prefill_tokens"] = load.pending_prefill_tokens.copy()
        return placement(view, slot, "fewest pending prefill tokens", terms)
