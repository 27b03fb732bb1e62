"""Migration planning: when a session's KV leaves its host, where it goes, and the order.

Shared by `ear` (move a hot host's session on the turn's critical path, to the least-pending
instance) and `elastic` (decide by estimated TTFT including the transfer, and also move during
the session's idle gap so the copy leaves the critical path). Cooldowns and affinity stay with
the policies; this module only answers "move? where? how?".
"""

from __future__ import annotations

import numpy as np

from kvsched.core.cluster import ClusterState
from kvsched.core.cost import (
    copy_price,
    moving_terms,
    next_turn_ttft_s,
    plan_copy,
    ttft_terms,
)
from kvsched.core.decision import Decision, TransferKind, TransferPlan
from kvsched.core.decision_builders import Refusal, placement, placement_unless_refused
from kvsched.core.pickers import argmin_eligible, least_pending
from kvsched.core.request_view import BoolVec, FloatVec, RequestView
from kvsched.core.sessions import Session


class MigrationPlanner:
    """Target choice and transfer orders for moving sessions. With `by_ttft` a move must beat
    staying by `min_gain_s` of estimated TTFT; without it EAR's rule applies (the host holds
    more than `t_hot_tokens` pending prefill tokens; the target has the fewest). Reads the
    cluster (its cost model, load, index and sessions) and changes nothing in it: the caller
    records the decisions and plans it returns."""

    def __init__(
        self, cluster: ClusterState, *, by_ttft: bool, t_hot_tokens: float, min_gain_s: float
    ):
        self.cluster = cluster
        self.by_ttft = by_ttft
        self.t_hot_tokens = t_hot_tokens
        self.min_gain_s = min_gain_s

    def candidates(self, eligible: BoolVec, host: int, context_tokens: float) -> BoolVec:
        """Live instances other than the host with KV room for the context and strictly fewer
        pending prefill tokens than the host (never a busier or too small instance)."""
        load = self.cluster.load
        pending = load.pending_prefill_tokens
        kernels = self.cluster.cost.kernels
        if kernels is not None:
            free, bs = load.free_blocks, self.cluster.block_size
            found = kernels.candidates(eligible, free, bs, context_tokens, pending, host)
            if found is not NotImplemented:
                return found
        room = load.free_blocks * self.cluster.block_size >= context_tokens
        out: BoolVec = eligible & room & (pending < pending[host])
        out[host] = False
        return out

    def on_arrival(
        self,
        view: RequestView,
        host: int,
        terms: dict[str, FloatVec],
        refuse: Refusal | None = None,
    ) -> Decision:
        """A turn arrived for a session on `host` (outside its cooldown): stay, or move it now.
        `terms` are the staying estimates; `refuse` (admission), when given, may turn the
        chosen placement into its rejection (`placement_unless_refused`)."""
        if self.by_ttft:
            # Moving saves at most the host's queue: below the margin nothing can pay.
            if terms["queue_s"][host] <= self.min_gain_s:
                return placement_unless_refused(view, host, "affinity", terms, refuse)
        elif self.cluster.load.pending_prefill_tokens[host] <= self.t_hot_tokens:
            return placement_unless_refused(view, host, "affinity", terms, refuse)
        context = view.req.prompt_tokens + view.req.output_tokens
        candidates = self.candidates(view.eligible, host, context)
        if not candidates.any():
            rule = "host busy, no cooler instance with room: stay"
            return placement_unless_refused(view, host, rule, terms, refuse)
        if not self.by_ttft:
            target = least_pending(self.cluster, candidates)
            rule = "host hot: migrate to least pending"
            return self.move_now(view, host, target, rule, refuse=refuse)
        moving = moving_terms(self.cluster.cost, self.cluster.load, view, host)
        target = argmin_eligible(moving["ttft_s"], candidates, kernels=view.kernels)
        if moving["ttft_s"][target] + self.min_gain_s >= terms["ttft_s"][host]:
            rule = "host busy, moving does not pay: stay"
            return placement_unless_refused(view, host, rule, terms, refuse, moving=moving)
        rule = "host busy: migrate now, min TTFT incl. transfer"
        return self.move_now(view, host, target, rule, refuse=refuse, moving=moving)

    def move_now(
        self,
        view: RequestView,
        host: int,
        target: int,
        rule: str,
        *,
        refuse: Refusal | None = None,
        moving: dict[str, FloatVec] | None = None,
    ) -> Decision:
        """The decision sending this turn to `target` with the session's KV copied from `host`
        on its critical path (or `refuse`'s rejection of it: then no transfer order is built;
        `moving`, the host's `moving_terms` when already computed, goes to `refuse`)."""
        cluster = self.cluster
        have = int(view.hit_blocks[target])
        upto = int(min(view.hit_blocks[host], view.max_blocks))
        moved, est_seconds = copy_price(cluster.cost, host, target, have=have, upto=upto)
        cached = np.array(view.hit_tokens)
        cached[target] = min(view.hit_tokens[target] + moved, max(view.req.prompt_tokens - 1, 0))
        transfer = np.zeros(cluster.n)
        transfer[target] = est_seconds
        terms = ttft_terms(cluster.cost, cluster.load, view, cached, transfer)
        if refuse is not None:
            refused = refuse(float(terms["ttft_s"][target]), terms, moving)
            if refused is not None:
                return refused
        plan = plan_copy(
            cluster.cost,
            TransferKind.MIGRATE_SESSION,
            host,
            target,
            hashes=view.req.block_hashes,
            have=have,
            upto=upto,
            on_path=True,
            session_id=view.req.session_id,
            request_id=view.req.request_id,
        )
        return placement(
            view,
            target,
            rule,
            terms,
            cached_tokens=view.hit_tokens[target],
            fetched_tokens=moved,
            transfers=(plan,) if plan is not None else (),
        )

    def during_gap(
        self, session: Session, gap_s: float, eligible: BoolVec, room: BoolVec, penalty_s: float
    ) -> TransferPlan | None:
        """A turn of `session` just ended and the next is expected `gap_s` from now: plan
        moving its KV off its host now, so it lands before the next turn, or None.

        `room` marks instances that can take the context; `penalty_s` is added to staying (e.g.
        the expected recompute when the host's memory is oversubscribed)."""
        cluster = self.cluster
        host = session.host
        hashes = session.context_hashes
        blocks = np.zeros(cluster.n)
        for slot, count in cluster.index.match(hashes).items():
            blocks[slot] = count
        if blocks[host] <= 0:
            return None
        candidates = self.candidates(eligible, host, session.context_tokens) & room
        if not candidates.any():
            return None
        held = blocks * cluster.block_size
        est = next_turn_ttft_s(cluster.cost, cluster.load, session, held, host=host, gap_s=gap_s)
        est[host] += penalty_s
        if self.by_ttft:
            target = argmin_eligible(est, candidates, kernels=cluster.cost.kernels)
        else:
            target = least_pending(cluster, candidates)
        if est[target] + self.min_gain_s >= est[host]:
            return None
        return plan_copy(
            cluster.cost,
            TransferKind.MIGRATE_SESSION,
            host,
            target,
            hashes=hashes,
            have=int(blocks[target]),
            upto=int(blocks[host]),
            on_path=False,
            session_id=session.session_id,
        )
