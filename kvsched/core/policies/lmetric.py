"""LMetric (arXiv 2603.15202): a product of a cache indicator and a load indicator."""

from __future__ import annotations

from random import Random

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import argmin_eligible
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView


class LMetric(Policy):
    """Rule: minimise (new prefill tokens if routed there) × (batch size there), with batch
    size = requests running or waiting. No knobs: the product makes the two indicators'
    scales cancel. Its one failure mode, a zero product (an idle instance, or a full hit),
    is settled by the fewest new tokens, then the smallest batch, then the lowest slot."""

    name = "lmetric"

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        load = self.cluster.load
        new_tokens = view.req.prompt_tokens - view.hit_tokens
        batch = load.running + load.waiting
        score = new_tokens * batch
        terms = ttft_terms(self.cluster.cost, load, view, view.hit_tokens)
        terms.update(new_tokens=new_tokens, batch=batch.copy(), score=score)
        slot = argmin_eligible(score, view.eligible, new_tokens, batch, kernels=view.kernels)
        return placement(view, slot, "min new tokens × batch size", terms)
