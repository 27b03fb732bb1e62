"""Dynamo / llm-d style weighted KV cost."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import argmin_eligible
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView


class KvCost(Policy):
    """Rule (NVIDIA Dynamo's KV router, temperature 0): minimise

        overlap_weight × potential prefill blocks + potential decode blocks

    where potential prefill blocks = the request's uncached blocks there + blocks of prompt
    work already pending there, and potential decode blocks = KV blocks in use there + the
    request's blocks. Ties go to the lowest slot (no random tie-break, so replays repeat)."""

    name = "kv_cost"
    defaults = {"overlap_weight": 1.0}

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster = self.cluster
        bs = cluster.block_size
        load = cluster.load
        req_blocks = -(-view.req.prompt_tokens // bs)
        new_blocks = req_blocks - view.hit_blocks
        prefill_blocks = new_blocks + load.pending_prefill_tokens / bs
        used = cluster.capacity_blocks - load.free_blocks
        decode_blocks = np.maximum(used, 0.0) + req_blocks
        cost = self.param("overlap_weight") * prefill_blocks + decode_blocks
        terms = ttft_terms(cluster.cost, load, view, view.hit_tokens)
        terms.update(prefill_blocks=prefill_blocks, decode_blocks=decode_blocks, cost=cost)
        slot = argmin_eligible(cost, view.eligible, load.in_flight)
        return placement(view, slot, "min weighted prefill + decode blocks", terms)
