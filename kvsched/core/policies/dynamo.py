"""NVIDIA Dynamo's KV router: the default worker cost, from its source.

Source: ai-dynamo/dynamo. The cost as `lib/kv-router/src/scheduling/selector.rs` (read at
01690d42) computes it, with the defaults of `scheduling/config.rs` (0243c51b) and
`docs/components/router/router-configuration.md` (057096c3): prefill load scale 1, device-hit
credit 1, host-tier credit 0.75, disk 0.25, temperature 0. At those defaults it is the classic
`lib/llm/src/kv_router/scheduler.rs` (db19bd2a) formula `overlap_score_weight ×
potential_prefill_blocks + potential_decode_blocks` with `overlap_score_weight` 1
(`docs/router/README.md`, 17ecc2dd). The decode term is the router's own tally of the blocks
its in-flight requests hold on each worker (`sequence.rs`, 581ee33e: `active_blocks`, plus the
new request's blocks not among them), not the engine's reported KV usage; the prefill term's
active tokens are the prompt tokens still to compute there.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Completion, Decision, RequestId, TransferPlan
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import any_of
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView
from kvsched.core.routed_paths import RoutedPaths


class Dynamo(Policy):
    """Rules (Dynamo's defaults; our blocks are its blocks):

    - credit = blocks of the prompt's prefix the worker holds in GPU memory + 0.75 × those
      only its node's DRAM pool holds;
    - prefill blocks = max((prompt tokens still to compute there + the prompt's tokens) /
      block size − credit, 0);
    - decode blocks = distinct blocks of the requests routed to the worker and not finished,
      plus the request's full blocks not among them;
    - the worker with the lowest `prefill_weight` × prefill blocks + decode blocks; ties go
      to the smallest indexed cache, then at random (temperature 0 keeps every minimum).
    """

    name = "dynamo"
    defaults = {"prefill_weight": 1.0, "host_credit": 0.75}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.active = RoutedPaths(self.cluster.n)  # blocks of in-flight requests per slot
        self.routed: dict[RequestId, tuple[int, int]] = {}  # in flight -> (slot, first block)

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster, eligible = self.cluster, view.eligible
        bs, load = cluster.block_size, cluster.load
        hashes = view.req.block_hashes
        pool_blocks = 0.0 if view.pool_tokens is None else view.pool_tokens / bs
        credit = view.hit_blocks - (1.0 - self.param("host_credit")) * pool_blocks
        raw_prefill = (load.pending_prefill_tokens + view.req.prompt_tokens) / bs
        prefill_blocks = np.maximum(raw_prefill - credit, 0.0)
        active = self.active.sizes()
        decode_blocks = active + len(hashes) - self.active.shared_by_slot(hashes)
        cost = self.param("prefill_weight") * prefill_blocks + decode_blocks
        slot = lowest_cost(cost, eligible, cluster.index.block_counts(), rng)
        if hashes:
            self.active.add(slot, view.req.request_id, hashes, now, subsume=False)
            self.routed[view.req.request_id] = (slot, hashes[0])
        terms = ttft_terms(cluster.cost, load, view, view.hit_tokens)
        terms.update(prefill_blocks=prefill_blocks, decode_blocks=decode_blocks, cost=cost)
        return placement(view, slot, "min prefill + decode blocks", terms)

    def after_finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        routed = self.routed.pop(done.request_id, None)
        if routed is not None:
            self.active.remove(routed[0], done.request_id, routed[1])
        return ()


def lowest_cost(cost: np.ndarray, eligible: np.ndarray, tree_sizes: list[int], rng: Random) -> int:
    """Dynamo's temperature-0 pick: the eligible minimum; ties to the smallest indexed cache,
    then uniformly at random."""
    masked = np.where(eligible, cost, np.inf)
    best = masked == masked.min()
    sizes = np.where(best, np.array(tree_sizes, dtype=float), np.inf)
    return any_of(sizes == sizes.min(), rng)
