"""SGLang-router style cache-aware routing (sgl-router / SMG `cache_aware`)."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import argmin_eligible
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView


class CacheAware(Policy):
    """Rules, in order (defaults are the router's: cache_threshold 0.3, balance_abs_threshold
    64, balance_rel_threshold 1.5; load = requests in flight per instance):

    1. Imbalanced (max − min > abs threshold and max > rel threshold × min): shortest queue.
    2. Else, if the best prefix match covers more than `cache_threshold` of the prompt: the
       instance with the longest match (ties: shortest queue).
    3. Else: the instance with the fewest cached blocks (most room), ties by shortest queue.

    A match is a match whichever tier holds it (GPU memory or the node's pool), as the
    router's own radix tree does not know tiers; the TTFT terms it records price the load.
    """

    name = "cache_aware"
    defaults = {"cache_threshold": 0.3, "balance_abs_threshold": 64.0, "balance_rel_threshold": 1.5}

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        load = self.cluster.load.in_flight
        eligible = view.eligible
        live = load[eligible]
        hi, lo = float(live.max()), float(live.min())
        terms = ttft_terms(self.cluster.cost, self.cluster.load, view, view.hit_tokens)
        terms["in_flight"] = load.copy()
        if (
            hi - lo > self.param("balance_abs_threshold")
            and hi > self.param("balance_rel_threshold") * lo
        ):
            slot = argmin_eligible(load, eligible, self.cluster.load.running, kernels=view.kernels)
            return placement(view, slot, "imbalanced: shortest queue", terms)
        prompt = max(view.req.prompt_tokens, 1)
        best = float(np.max(np.where(eligible, view.hit_tokens, 0.0)))
        if best / prompt > self.param("cache_threshold"):
            slot = argmin_eligible(-view.hit_tokens, eligible, load, kernels=view.kernels)
            return placement(view, slot, "longest prefix match", terms)
        tree = np.array(self.cluster.index.block_counts(), dtype=float)
        terms["cached_blocks"] = tree
        slot = argmin_eligible(tree, eligible, load, kernels=view.kernels)
        return placement(view, slot, "low match: smallest cache", terms)
