"""`elastic`: session affinity whose migrations leave the critical path (ours).

It starts from EAR (affinity by default, move a busy host's sessions, cooldown) and adds five
parts, each switchable for ablation:

(a) `idle_migration`: when a turn ends on a host whose queue will outlast the session's idle
    gap (or whose active sessions' contexts no longer fit its KV memory), copy the session's
    KV during that gap, while the agent runs its tool, so the next turn finds it on the target
    and the copy costs no latency. The session is rebound only once its KV has landed and no
    turn ran meanwhile; a failed or late copy leaves it on its source. No move follows a turn
    that failed, nor one whose end came after the session's next turn arrived (a parallel
    call's, or an end reported late): the session is not idle.
(b) `ttft_target`: decide *whether* and *where* to migrate by estimated TTFT including the
    part of the transfer a gap does not hide, moving only when that beats staying by
    `min_gain_s`. Off: EAR's `t_hot_tokens` trigger and least-pending target.
(c) `global_index`: cold starts (new sessions, sessionless requests) go where the estimated
    TTFT is lowest using every instance's cached prefix — plus the extra prefill a placement
    costs over the best holder's, weighted by the share of instances busy (that compute
    delays whoever queues behind it) — fetching a longer shared prefix (a system prompt) from
    its holder when the transfer beats recomputing it, and preferring instances whose active
    sessions leave room for the new context.
(d) `replicate`: prefixes that cold starts reuse often (frequency score hits / sqrt(age), seed
    000) are copied ahead of time to the least-loaded instance lacking them when the expected
    saving exceeds 1.5 × the copy's cost.
(e) `admission`: reject (with a retry delay) a request when no instance, with or without
    moving its session's KV, meets the TTFT SLO although one would on an idle cluster.

(f) `prefetch` (off by default: `elastic:prefetch=1`): when a turn ends on a host whose node
    has a pool (the index has seen its DRAM tier), plan loading the session's context from
    the pool back into the host's GPU shortly before its next turn is expected:
    `prefetch_checks` loads, each due the load's time and `prefetch_lead_s` before a quantile
    of the session's last gaps (evenly spaced from `prefetch_quantile` to
    `prefetch_last_quantile`) of at least `prefetch_min_gap_s` (`kvsched.core.prefetch`).
    The executor starts each then only if the host has no queued work and room, and loads
    only what the GPU lost meanwhile. Not with an idle-gap move (a) of the same session.
    Without a pool it plans nothing. Off by default: on WEKA sessions it did not lower the
    tail robustly (docs/evaluation.md, "Idle-gap prefetch").
(g) `fanout` (off by default: `elastic:fanout=1`): a call that arrives while another of its
    session still runs (an agent's parallel calls) goes to the instance where it is estimated
    to start first, when that beats the host by `min_gain_s`, and the session stays bound to
    its host: affinity (and a cooldown) would otherwise queue a whole burst of parallel calls
    on one instance, where their decodes share every pass.

Every TTFT estimate above counts KV tiers: a prefix held only in an instance's node pool (the
DRAM tier) costs the part of its load over the host link that the prefill of the rest does
not hide (`load_wait_s`, `cost.pool_load`); one in GPU memory costs nothing to reuse. (The
idle-gap planning of (a) still reads GPU holdings only.)

The policy class here decides and keeps what it alone tracks; (c)'s score is
`elastic_cold_score`'s, (a)'s and (f)'s plans are `elastic_idle_gap`'s and (e)'s refusal is
`elastic_admission`'s (beside this module).
"""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.cost import fetch_plan, fetch_when_cheaper, ttft_terms
from kvsched.core.decision import Completion, Decision, TransferPlan
from kvsched.core.decision_builders import Refusal, placement, placement_unless_refused
from kvsched.core.hotness import PrefixHeat
from kvsched.core.migration import MigrationPlanner
from kvsched.core.pickers import argmin_eligible, least_pending
from kvsched.core.policies.base import Policy
from kvsched.core.policies.elastic_admission import slo_refusal
from kvsched.core.policies.elastic_cold_score import cold_score
from kvsched.core.policies.elastic_idle_gap import (
    IdleMoveRule,
    idle_gap_move,
    idle_gap_prefetch,
)
from kvsched.core.prefetch import GapHistory, PrefetchRule
from kvsched.core.replication import hot_prefix_copy
from kvsched.core.request_view import FloatVec, RequestView
from kvsched.core.residency import ResidentSessions
from kvsched.core.sessions import NO_HOST, Session


class Elastic(Policy):
    """See the module docstring for the rules and their switches."""

    name = "elastic"
    affinity = True
    defaults = {
        "t_hot_tokens": 8192.0,  # EAR's trigger, used when `ttft_target` is off
        "t_cool_s": 30.0,
        "idle_migration": True,
        "ttft_target": True,
        "global_index": True,
        "replicate": True,
        "admission": True,
        "min_gain_s": 0.05,
        "hot_score": 1.0,
        "min_hits": 3,
        "horizon_s": 60.0,
        "active_window_s": 300.0,  # a session idle longer no longer claims KV memory
        "prefetch": False,
        "fanout": False,
        "prefetch_quantile": 0.1,
        "prefetch_last_quantile": 1.0,
        "prefetch_checks": 5,
        "prefetch_min_gap_s": 10.0,
        "prefetch_lead_s": 1.0,
    }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        cluster = self.cluster
        self.planner = MigrationPlanner(
            cluster,
            by_ttft=self.param("ttft_target"),
            t_hot_tokens=self.param("t_hot_tokens"),
            min_gain_s=self.param("min_gain_s"),
        )
        self.resident = ResidentSessions(cluster.n, self.param("active_window_s"))
        self._heat = PrefixHeat()
        self._capacity_tokens = float(cluster.capacity_blocks * cluster.block_size)
        self._move_rule = IdleMoveRule(self.param("t_cool_s"), self._capacity_tokens)
        self.gaps = GapHistory()
        self._prefetch_rule = PrefetchRule(
            quantile=float(self.param("prefetch_quantile")),
            last_quantile=float(self.param("prefetch_last_quantile")),
            checks=int(self.param("prefetch_checks")),
            min_gap_s=float(self.param("prefetch_min_gap_s")),
            lead_s=float(self.param("prefetch_lead_s")),
        )

    # ---- placement ---------------------------------------------------------------------

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        self.resident.expire(now, self.cluster.sessions)
        sid = view.req.session_id
        session = self.cluster.sessions.get(sid) if sid is not None else None
        if session is not None and self.param("prefetch"):
            self.gaps.observe(session.session_id, session.last_finish_at, now)
        # Admission runs inside both: a refused request builds no placement or transfer order.
        if session is not None and session.host != NO_HOST and view.eligible[session.host]:
            decision = self._affine(view, session, now)
        else:
            decision = self._cold(view, session, now)
        if not decision.rejected and sid is not None:
            self.resident.claim(sid, decision.instance, view.req.prompt_tokens, now)
        return decision

    def _affine(self, view: RequestView, session: Session, now: float) -> Decision:
        """Stay on the session's host or move it now (b), then (e)."""
        host = session.host
        terms = ttft_terms(self.cluster.cost, self.cluster.load, view, view.hit_tokens)
        refuse: Refusal | None = None
        if self.param("admission"):

            def refuse(
                estimated_ttft_s: float,
                terms: dict[str, FloatVec],
                moving: dict[str, FloatVec] | None,
            ) -> Decision | None:
                return slo_refusal(
                    self.cluster, view, estimated_ttft_s, terms, session, moving=moving
                )

        if self.param("fanout") and session.parallel_arrival:
            spill = self._spill(view, host, terms, refuse)
            if spill is not None:
                return spill
        if session.pending_target != NO_HOST:
            # Its KV is on the wire; the source still holds it: no second move.
            rule = "affinity (migration in flight)"
            return placement_unless_refused(view, host, rule, terms, refuse)
        if session.in_cooldown(now, self.param("t_cool_s")):
            return placement_unless_refused(view, host, "affinity (cooldown)", terms, refuse)
        return self.planner.on_arrival(view, host, terms, refuse)

    def _spill(
        self, view: RequestView, host: int, terms: dict[str, FloatVec], refuse: Refusal | None
    ) -> Decision | None:
        """(g): a call that arrived while another of its session runs (an agent's parallel
        calls) goes where it is estimated to start first, by `min_gain_s` over the host, and
        the session stays bound to its host. None: the host is as good."""
        slot = argmin_eligible(terms["ttft_s"], view.eligible, kernels=view.kernels)
        if (
            slot == host
            or terms["ttft_s"][slot] + self.param("min_gain_s") >= terms["ttft_s"][host]
        ):
            return None
        rule = "parallel call: where it starts first, the session stays bound"
        return placement_unless_refused(view, slot, rule, terms, refuse, keeps_binding=True)

    def _cold(self, view: RequestView, session: Session | None, now: float) -> Decision:
        """(c), then (e): a refusal is decided before the placement's transfer orders are
        built, which it would throw away (the replication's reuse count still runs, as it
        did when admission came after)."""
        cluster = self.cluster
        if not self.param("global_index"):
            slot = least_pending(cluster, view.eligible)
            terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
            decision = placement(view, slot, "cold start: fewest pending prefill tokens", terms)
            return self._admit(view, decision, session) if self.param("admission") else decision
        best = view.best_slot
        hits = view.hit_tokens
        cached, transfer = hits, np.zeros(cluster.n)
        if best >= 0:
            # Fetch the best holder's longer prefix where copying beats recomputing it.
            prefix = fetch_when_cheaper(
                cluster.cost, best, view.req.prompt_tokens, hits, view.eligible
            )
            cached, transfer = prefix.cached, prefix.transfer_s
        terms = ttft_terms(cluster.cost, cluster.load, view, cached, transfer)
        context = view.req.prompt_tokens + view.req.output_tokens
        resident = self.resident.tokens
        terms["score_s"], pool = cold_score(
            terms,
            cluster.load.pending_prefill_s,
            view.eligible,
            resident=resident,
            context_tokens=context,
            capacity_tokens=self._capacity_tokens,
            kernels=view.kernels,
        )
        slot = argmin_eligible(
            terms["score_s"], pool, resident, cluster.load.in_flight, kernels=view.kernels
        )
        terms["resident_tokens"] = resident.copy()
        # Counts the reuse (and may reset its count) whether or not the request is refused.
        replica = self._replicate(view, best, slot, now) if best >= 0 else None
        if self.param("admission"):
            refused = slo_refusal(cluster, view, float(terms["ttft_s"][slot]), terms, session)
            if refused is not None:
                return refused
        transfers: list[TransferPlan] = []
        fetched = 0
        if cached[slot] > hits[slot]:
            plan = fetch_plan(cluster.cost, view, best, slot)
            if plan is not None:
                fetched = plan.tokens
                transfers.append(plan)
        if replica is not None:
            transfers.append(replica)
        rule = "cold start: min TTFT over the global index"
        return placement(
            view,
            slot,
            rule + (" (fetching shared prefix)" if fetched else ""),
            terms,
            cached_tokens=hits[slot],
            fetched_tokens=fetched,
            transfers=tuple(transfers),
        )

    def _replicate(
        self, view: RequestView, best: int, chosen: int, now: float
    ) -> TransferPlan | None:
        """(d), when switched on: the saving is the prefill of the copied prefix for each cold
        start expected on the target over the horizon (the reuse rate spread over the
        instances). Changes only the prefix heat (`hot_prefix_copy`)."""
        if not self.param("replicate"):
            return None
        cost = self.cluster.cost

        def saving(plan: TransferPlan, score: float) -> float:
            instances = max(int(np.count_nonzero(view.eligible)), 1)  # only when a copy pays
            expected = score * self.param("horizon_s") / instances
            have = plan.skip_blocks * self.cluster.block_size
            return float(expected * cost.prefill_one(plan.tokens, have))

        return hot_prefix_copy(
            self.cluster,
            view,
            self._heat,
            holder=best,
            chosen=chosen,
            now=now,
            min_hits=self.param("min_hits"),
            hot_score=self.param("hot_score"),
            benefit_s=saving,
        )

    def _admit(self, view: RequestView, decision: Decision, session: Session | None) -> Decision:
        """(e): refuse only when the cluster as a whole cannot meet the TTFT SLO now."""
        refused = slo_refusal(
            self.cluster, view, decision.estimated_ttft_s, decision.terms, session
        )
        return decision if refused is None else refused

    # ---- completions and idle-gap migration ------------------------------------------------

    def after_finish(self, done: Completion, now: float) -> list[TransferPlan]:
        """Counts the session's context on its host, and plans its idle-gap move (a) or
        prefetch (f): not after a turn that failed (it may be tried again at once, or ran
        elsewhere) nor when a later turn of the session already arrived (it is not idle)."""
        sid = done.session_id
        session = self.cluster.sessions.get(sid) if sid is not None else None
        if session is None:
            return []
        host = session.host if session.host != NO_HOST else done.instance
        self.resident.claim(session.session_id, host, session.context_tokens, now)
        if not done.ok or session.last_request not in (None, done.request_id):
            return []
        if self.param("idle_migration"):
            plan = idle_gap_move(
                self.cluster, self.planner, session, now, self.resident.tokens, rule=self._move_rule
            )
            if plan is not None:
                return [plan]
        if self.param("prefetch"):
            return idle_gap_prefetch(
                self.cluster, session, host, now, gaps=self.gaps, rule=self._prefetch_rule
            )
        return []

    def after_transfer(self, plan: TransferPlan, moved: bool, now: float) -> None:
        """A moved session's context now counts on its new host."""
        session = self.cluster.sessions.get(plan.session_id) if moved and plan.session_id else None
        if session is not None:
            self.resident.claim(session.session_id, plan.target, session.context_tokens, now)
