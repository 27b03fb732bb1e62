"""SGLang's router, `cache_aware` policy: routing on an approximate radix tree of what it
routed, not on the engines' KV events.

Source: sgl-project/sglang, `sgl-router/src/policies/cache_aware.rs` (read at b6f20641), its
tree `sgl-router/src/policies/tree.rs` (4d40eec0), the load counting of
`sgl-router/src/routers/http/router.rs` (01d66b63) and the launcher's defaults in
`sgl-router/py_src/sglang_router/router_args.py` (083d6013): cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size
2**26 characters per worker. The tree holds the text of every request routed to a worker
(inserted at routing, whatever the engine then keeps) and is trimmed, least recently routed
leaves first, to `max_tree_size` every eviction interval; it never hears of the engine's own
evictions. Ours holds each routed prompt's blocks; its budget converts characters to blocks at
4 characters a token (OpenAI's rule of thumb for English text; the tree counts characters).
`cache_aware` applies the same rules to our event-fed index instead.
"""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.pickers import any_of
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView
from kvsched.core.routed_paths import RoutedPaths

CHARS_PER_TOKEN = 4.0


class Sglang(Policy):
    """Rules, in order (load = requests the router has in flight on each worker):

    1. Imbalanced (max − min > `balance_abs_threshold` and max > `balance_rel_threshold` ×
       min): the least loaded worker (ties: the lowest slot, as Rust's `min_by_key`).
    2. Else the longest match in the tree: if it covers more than `cache_threshold` of the
       prompt, the worker holding it (ties at random: the tree's map order is a hash order).
    3. Else the worker with the smallest tree (most room; ties at random).

    Every routed prompt, in either case, is inserted into the chosen worker's tree.
    """

    name = "sglang"
    defaults = {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64.0,
        "balance_rel_threshold": 1.5,
        "eviction_interval_s": 120.0,
        "max_tree_chars": float(2**26),
    }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tree = RoutedPaths(self.cluster.n)
        tokens = self.param("max_tree_chars") / CHARS_PER_TOKEN
        self.budget_blocks = int(tokens // self.cluster.block_size)
        self.next_eviction = self.param("eviction_interval_s")

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        self._evict_due(now)
        cluster, eligible = self.cluster, view.eligible
        load = cluster.load.in_flight
        hashes = view.req.block_hashes
        live = load[eligible]
        hi, lo = float(live.max()), float(live.min())
        matched = self.tree.shared_by_slot(hashes)
        tree = self.tree.sizes()
        terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
        terms |= {"in_flight": load.copy(), "tree_match_blocks": matched, "tree_blocks": tree}
        if (
            hi - lo > self.param("balance_abs_threshold")
            and hi > self.param("balance_rel_threshold") * lo
        ):
            slot, rule = int(np.flatnonzero(eligible & (load == lo))[0]), "imbalanced: least load"
        else:
            best = float(np.max(np.where(eligible, matched, 0.0)))
            rate = best * cluster.block_size / max(view.req.prompt_tokens, 1)
            if rate > self.param("cache_threshold"):
                slot, rule = any_of(eligible & (matched == best), rng), "longest tree match"
            else:
                smallest = float(np.min(tree[eligible]))
                slot, rule = any_of(eligible & (tree == smallest), rng), "low match: smallest tree"
        if hashes:
            self.tree.add(slot, view.req.request_id, hashes, now, subsume=True)
        return placement(view, slot, rule, terms)

    def _evict_due(self, now: float) -> None:
        """The router's eviction thread, run at its interval on the policy's clock."""
        interval = self.param("eviction_interval_s")
        if interval <= 0:
            return
        if now >= self.next_eviction:  # one pass catches up: trimming is idempotent
            for slot in range(self.cluster.n):
                self.tree.trim(slot, self.budget_blocks)
            self.next_eviction = (now // interval + 1) * interval
