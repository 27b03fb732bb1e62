"""llm-d's default scheduling profile, with its precise prefix-cache scorer.

Source: llm-d-inference-scheduler (github.com/llm-d/llm-d-inference-scheduler, read at
520af478): `pkg/epp/config/loader/defaults.go` (the default profile: `queue-scorer` weight 2,
`kv-cache-utilization-scorer` weight 2, a prefix-cache scorer weight 3, the `max-score-picker`);
`scorer/queuedepth/queue.go`, `scorer/kvcacheutilization/kvcache_utilization.go`,
`scorer/preciseprefixcache/precise_prefix_cache.go` (the precise scorer, fed by the engines' KV
events as our index is) and `picker/maxscore/picker.go`.
"""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import any_of
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import FloatVec, RequestView


class Llmd(Policy):
    """Rules (llm-d's default profile; weights as its defaults):

    - prefix score: the request's blocks an instance holds, over the request's full blocks,
      in [0, 1] (the precise prefix-cache scorer: matched blocks / total blocks; a block in
      either tier counts, as the scorer's default medium weights count both);
    - queue score: (max waiting − waiting) / (max waiting − min waiting) over the candidates,
      1 for every one when all wait alike (`waiting`: requests not yet admitted, as vLLM's
      `num_requests_waiting`, charged with our placements until the next report);
    - KV score: 1 − the instance's KV-cache usage (vLLM's `kv_cache_usage_perc`);
    - the instance with the highest 3 × prefix + 2 × queue + 2 × KV; ties at random (the
      max-score picker shuffles before its stable sort).
    """

    name = "llmd"
    defaults = {"prefix_weight": 3.0, "queue_weight": 2.0, "kv_weight": 2.0}

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster, eligible = self.cluster, view.eligible
        load = cluster.load
        blocks = max(len(view.req.block_hashes), 1)
        prefix = np.clip(view.hit_blocks / blocks, 0.0, 1.0)
        queue = queue_scores(load.waiting, eligible)
        kv = np.clip(load.free_blocks / max(cluster.capacity_blocks, 1), 0.0, 1.0)  # 1 - usage
        score = (
            self.param("prefix_weight") * prefix
            + self.param("queue_weight") * queue
            + self.param("kv_weight") * kv
        )
        masked = np.where(eligible, score, -np.inf)
        slot = any_of(masked == masked.max(), rng)
        terms = ttft_terms(cluster.cost, load, view, view.hit_tokens)
        terms |= {"prefix_score": prefix, "queue_score": queue, "kv_score": kv, "score": score}
        return placement(view, slot, "max weighted score", terms)


def queue_scores(waiting: FloatVec, eligible: np.ndarray) -> FloatVec:
    """llm-d's queue scorer over the candidates: the shortest queue 1, the longest 0."""
    live = waiting[eligible]
    hi, lo = float(live.max()), float(live.min())
    if hi == lo:
        return np.ones(len(waiting))
    return (hi - waiting) / (hi - lo)
