"""`elastic`: session affinity whose migrations leave the critical path (ours).

It starts from EAR (affinity by default, move a busy host's sessions, cooldown) and adds five
parts, each switchable for ablation:

(a) `idle_migration`: when a turn ends on a host whose queue will outlast the session's idle
    gap (or whose active sessions' contexts no longer fit its KV memory), copy the session's
    KV during that gap, while the agent runs its tool, so the next turn finds it on the target
    and the copy costs no latency. The session is rebound only once its KV has landed and no
    turn ran meanwhile; a failed or late copy leaves it on its source.
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
"""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core import admission
from kvsched.core.cluster import Role
from kvsched.core.decision import Completion, Decision, TransferPlan
from kvsched.core.hotness import PrefixHeat
from kvsched.core.migration import MigrationPlanner
from kvsched.core.policies.base import Policy, View, argmin_eligible
from kvsched.core.replication import hot_prefix_copy
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
    }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        cluster = self.cluster
        self.planner = MigrationPlanner(
            self,
            by_ttft=self.param("ttft_target"),
            t_hot_tokens=self.param("t_hot_tokens"),
            min_gain_s=self.param("min_gain_s"),
        )
        self.resident = ResidentSessions(cluster.n, self.param("active_window_s"))
        self._heat = PrefixHeat()
        self._capacity_tokens = float(cluster.capacity_blocks * cluster.block_size)

    # ---- placement ---------------------------------------------------------------------

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        self.resident.expire(now, self.cluster.sessions)
        sid = view.req.session_id
        session = self.cluster.sessions.get(sid) if sid is not None else None
        if session is not None and session.host != NO_HOST and view.eligible[session.host]:
            decision = self._affine(view, session, now)
        else:
            decision = self._cold(view, now)
        if self.param("admission"):
            decision = self._admit(view, decision, session)
        if not decision.rejected and sid is not None:
            self.resident.claim(sid, decision.instance, view.req.prompt_tokens, now)
        return decision

    def _affine(self, view: View, session: Session, now: float) -> Decision:
        host = session.host
        terms = self.ttft_terms(view, view.hit_tokens)
        if session.pending_target != NO_HOST:
            # Its KV is on the wire; the source still holds it: no second move.
            return self.decision(view, host, "affinity (migration in flight)", terms)
        if session.in_cooldown(now, self.param("t_cool_s")):
            return self.decision(view, host, "affinity (cooldown)", terms)
        return self.planner.on_arrival(view, host, terms)

    def _cold(self, view: View, now: float) -> Decision:
        cluster = self.cluster
        if not self.param("global_index"):
            slot = self.least_pending(view.eligible)
            terms = self.ttft_terms(view, view.hit_tokens)
            return self.decision(view, slot, "cold start: fewest pending prefill tokens", terms)
        best = view.best_slot
        hits = view.hit_tokens
        cached, transfer = hits, np.zeros(cluster.n)
        if best >= 0:
            # Fetch the best holder's longer prefix where copying beats recomputing it.
            extra = np.clip(hits[best] - hits, 0.0, None)
            fetch_s = cluster.cost.transfer_from(best, extra)
            n = float(view.req.prompt_tokens)
            saved = cluster.cost.prefill_s(n - hits, hits) - cluster.cost.prefill_one(
                int(n - hits[best]), int(hits[best])
            )
            fetch = view.eligible & (extra > 0) & (fetch_s < saved)
            cached = np.where(fetch, hits[best], hits)
            transfer = np.where(fetch, fetch_s, 0.0)
        terms = self.ttft_terms(view, cached, transfer)
        # Recomputing what another instance holds also delays whoever queues behind it: a
        # request arriving at a busy instance waits, so charge the extra prefill at the share
        # of instances busy now (for Poisson arrivals, the chance of finding one busy).
        prefill = terms["prefill_s"]
        busy_share = float(np.mean(cluster.load.pending_prefill_s[view.eligible] > 0))
        extra = prefill - float(np.min(prefill[view.eligible]))
        terms["score_s"] = terms["ttft_s"] + busy_share * extra
        context = view.req.prompt_tokens + view.req.output_tokens
        resident = self.resident.tokens
        fits = view.eligible & (resident + context <= self._capacity_tokens)
        pool = fits if fits.any() else view.eligible
        slot = argmin_eligible(terms["score_s"], pool, resident, cluster.load.in_flight)
        terms["resident_tokens"] = resident.copy()
        transfers: list[TransferPlan] = []
        fetched = 0
        if cached[slot] > hits[slot]:
            plan = self.fetch_plan(view, best, slot)
            if plan is not None:
                fetched = plan.tokens
                transfers.append(plan)
        if best >= 0 and self.param("replicate"):
            replica = self._replicate(view, best, slot, now)
            if replica is not None:
                transfers.append(replica)
        rule = "cold start: min TTFT over the global index"
        return self.decision(
            view,
            slot,
            rule + (" (fetching shared prefix)" if fetched else ""),
            terms,
            cached_tokens=hits[slot],
            fetched_tokens=fetched,
            transfers=tuple(transfers),
        )

    def _replicate(self, view: View, best: int, chosen: int, now: float) -> TransferPlan | None:
        """(d): the saving is the prefill of the copied prefix for each cold start expected on
        the target over the horizon (the reuse rate spread over the instances)."""
        cost = self.cluster.cost
        instances = max(int(view.eligible.sum()), 1)

        def saving(plan: TransferPlan, score: float) -> float:
            expected = score * self.param("horizon_s") / instances
            have = plan.skip_blocks * self.cluster.block_size
            return float(expected * cost.prefill_one(plan.tokens, have))

        return hot_prefix_copy(
            self,
            view,
            self._heat,
            holder=best,
            chosen=chosen,
            now=now,
            min_hits=self.param("min_hits"),
            hot_score=self.param("hot_score"),
            benefit_s=saving,
        )

    def _admit(self, view: View, decision: Decision, session: Session | None) -> Decision:
        """(e): refuse only when the cluster as a whole cannot meet the TTFT SLO now."""
        if not decision.estimated_ttft_s > self.cluster.config.slo.ttft_s:
            return decision
        terms = dict(decision.terms)
        best = float(np.min(terms["ttft_s"][view.eligible]))
        if session is not None and session.host != NO_HOST:
            moving = self.planner.moving_terms(view, session.host)  # moving the KV is an option
            best = min(best, float(np.min(moving["ttft_s"][view.eligible])))
        refusal = admission.check(best, self.isolated_floor(view, terms), self.cluster.config.slo)
        if refusal is None:
            return decision
        return self.reject(view, refusal.rule, refusal.retry_after_s, terms)

    # ---- completions and idle-gap migration ------------------------------------------------

    def on_finish(self, done: Completion, now: float, rng: Random) -> list[TransferPlan]:
        plans = list(super().on_finish(done, now, rng))
        sid = done.session_id
        session = self.cluster.sessions.get(sid) if sid is not None else None
        if session is None:
            return plans
        host = session.host if session.host != NO_HOST else done.instance
        self.resident.claim(session.session_id, host, session.context_tokens, now)
        if self.param("idle_migration"):
            plan = self._idle_migration(session, now)
            if plan is not None:
                plans.append(plan)
        return plans

    def _idle_migration(self, session: Session, now: float) -> TransferPlan | None:
        """(a): move a session off a busy or crowded host while its agent is busy."""
        host, gap = session.host, session.idle_gap_s
        if host == NO_HOST or gap < 0 or session.pending_target != NO_HOST:
            return None  # unbound, no gap seen yet, or already moving
        if session.in_cooldown(now, self.param("t_cool_s")) or not session.context_hashes:
            return None
        cluster = self.cluster
        load = cluster.load
        resident = self.resident.tokens
        crowded = resident[host] > self._capacity_tokens
        if self.param("ttft_target"):
            busy = load.pending_prefill_s[host] - gap > self.param("min_gain_s")
        else:
            busy = load.pending_prefill_tokens[host] > self.param("t_hot_tokens")
        if not (busy or crowded):
            return None  # the host will be free, and its memory holds its sessions
        context = session.context_tokens + max(session.growth_tokens, 0.0)
        room = resident + context <= self._capacity_tokens
        # On a crowded host the context may be evicted before the next turn.
        penalty = 0.0
        if crowded:
            overflow = 1.0 - self._capacity_tokens / resident[host]
            penalty = overflow * cluster.cost.prefill_one(session.prompt_tokens, 0)
        eligible = cluster.slots_with(Role.BOTH, Role.PREFILL)
        plan = self.planner.during_gap(session, gap, eligible, room, penalty)
        if plan is not None:
            cluster.sessions.begin_move(session.session_id, plan.target, now)
        return plan

    def on_transfer(self, plan: TransferPlan, ok: bool, now: float) -> bool:
        moved = super().on_transfer(plan, ok, now)
        session = self.cluster.sessions.get(plan.session_id) if moved and plan.session_id else None
        if session is not None:
            self.resident.claim(session.session_id, plan.target, session.context_tokens, now)
        return moved
