"""Load-only baselines: round robin, random, least loaded."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.decision import Decision
from kvsched.core.policies.base import Policy, View


class RoundRobin(Policy):
    """Rule: the next live instance in slot order, ignoring cache and load."""

    name = "round_robin"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._next = 0

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        n = self.cluster.n
        for step in range(n):
            slot = (self._next + step) % n
            if view.eligible[slot]:
                self._next = slot + 1
                terms = self.ttft_terms(view, view.hit_tokens)
                return self.decision(view, slot, "next instance in turn", terms)
        raise ValueError("no live instance")


class RandomChoice(Policy):
    """Rule: a uniformly random live instance (seeded)."""

    name = "random"

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        slots = np.flatnonzero(view.eligible)
        if not len(slots):
            raise ValueError("no live instance")
        slot = int(slots[rng.randrange(len(slots))])
        return self.decision(view, slot, "uniform random", self.ttft_terms(view, view.hit_tokens))


class LeastLoaded(Policy):
    """Rule: the instance with the fewest pending prefill tokens (ties: fewer requests in
    flight, then the lowest slot). Cache hits are ignored when choosing."""

    name = "least_loaded"

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        load = self.cluster.load
        slot = self.least_pending(view.eligible)
        terms = self.ttft_terms(view, view.hit_tokens)
        terms["pending_prefill_tokens"] = load.pending_prefill_tokens.copy()
        return self.decision(view, slot, "fewest pending prefill tokens", terms)
