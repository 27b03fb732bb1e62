"""Hot-prefix replication: copy a frequently reused prefix to an instance that lacks it."""

from __future__ import annotations

from collections.abc import Callable

from kvsched.core.cluster import ClusterState
from kvsched.core.cost import plan_copy
from kvsched.core.decision import TransferKind, TransferPlan
from kvsched.core.hotness import PrefixHeat
from kvsched.core.pickers import least_pending
from kvsched.core.request_view import RequestView

BENEFIT_FACTOR = 1.5  # seed 000: replicate only when the benefit exceeds 1.5 × the cost


def hot_prefix_copy(
    cluster: ClusterState,
    view: RequestView,
    heat: PrefixHeat,
    *,
    holder: int,
    chosen: int,
    now: float,
    min_hits: int,
    hot_score: float,
    benefit_s: Callable[[TransferPlan, float], float],
) -> TransferPlan | None:
    """Count a reuse of the prefix this request shares with `holder`; when that prefix is hot
    (at least `min_hits` reuses and a frequency score of `hot_score`) order a copy to the
    least-loaded eligible instance lacking it (other than `chosen`, which gets it anyway),
    provided `benefit_s(plan, score)` exceeds 1.5 × the copy's time. Changes only `heat`
    (the reuse counted; reset when a copy is ordered)."""
    blocks = int(min(view.hit_blocks[holder], view.max_blocks))
    if blocks <= 0:
        return None
    key = view.req.block_hashes[blocks - 1]
    hits, score = heat.hit(key, now)
    if hits < min_hits or score < hot_score:
        return None
    lacking = view.eligible & (view.hit_blocks < blocks)
    lacking[chosen] = False
    if not lacking.any():
        return None
    target = least_pending(cluster, lacking)
    plan = plan_copy(
        cluster.cost,
        TransferKind.REPLICATE_PREFIX,
        holder,
        target,
        hashes=view.req.block_hashes,
        have=int(view.hit_blocks[target]),
        upto=blocks,
        on_path=False,
        request_id=view.req.request_id,
    )
    if plan is None or benefit_s(plan, score) <= BENEFIT_FACTOR * plan.est_seconds:
        return None
    heat.reset(key, now)
    return plan
