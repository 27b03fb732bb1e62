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
"""

from __future__ import annotations

from collections.abc import Mapping
from random import Random

import numpy as np

from kvsched.core import admission
from kvsched.core.cluster import Role
from kvsched.core.cost import (
    fetch_plan,
    fetch_when_cheaper,
    isolated_floor_s,
    moving_terms,
    ttft_terms,
)
from kvsched.core.decision import Completion, Decision, TransferPlan
from kvsched.core.decision_builders import (
    Refusal,
    placement,
    placement_unless_refused,
    rejection,
)
from kvsched.core.hotness import PrefixHeat
from kvsched.core.index import Tier
from kvsched.core.migration import MigrationPlanner
from kvsched.core.pickers import argmin_eligible, least_pending, masked_min
from kvsched.core.policies.base import Policy
from kvsched.core.prefetch import (
    GapHistory,
    PrefetchRule,
    pool_load_s,
    prefetch_plan,
    prefetch_times,
)
from kvsched.core.replication import hot_prefix_copy
from kvsched.core.request_view import BoolVec, FloatVec, RequestView
from kvsched.core.residency import ResidentSessions
from kvsched.core.scoring import Kernels
from kvsched.core.sessions import NO_HOST, Session


def cold_score(
    terms: dict[str, FloatVec],
    pending_s: FloatVec,
    eligible: BoolVec,
    *,
    resident: FloatVec,
    context_tokens: int,
    capacity_tokens: float,
    kernels: Kernels | None,
) -> tuple[FloatVec, BoolVec]:
    """(c)'s score of every slot for a cold start, and the slots to pick from: those whose
    active sessions leave room for the new context (all eligible ones when none does).
    Recomputing what another instance holds also delays whoever queues behind it: a request
    arriving at a busy instance waits, so the extra prefill over the cheapest slot's is
    charged at the share of instances busy now (for Poisson arrivals, the chance of finding
    one busy). The numpy below is the reference; the compiled `kernels`, where given, compute
    the same."""
    ttft, prefill = terms["ttft_s"], terms["prefill_s"]
    if kernels is not None:
        out = kernels.cold_score(
            ttft, prefill, pending_s, eligible, resident, context_tokens, capacity_tokens
        )
        if out is not NotImplemented:
            return out
    busy_share = float(np.mean(pending_s[eligible] > 0))
    extra = prefill - masked_min(prefill, eligible, kernels=kernels)
    score: FloatVec = ttft + busy_share * extra
    fits = eligible & (resident + context_tokens <= capacity_tokens)
    return score, fits if fits.any() else eligible


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
                return self._refusal(view, estimated_ttft_s, terms, session, moving)

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
            refused = self._refusal(view, float(terms["ttft_s"][slot]), terms, session)
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
        refused = self._refusal(view, decision.estimated_ttft_s, decision.terms, session)
        return decision if refused is None else refused

    def _refusal(
        self,
        view: RequestView,
        estimated_ttft_s: float,
        placed_terms: Mapping[str, FloatVec],
        session: Session | None,
        moving: dict[str, FloatVec] | None = None,
    ) -> Decision | None:
        """(e)'s rejection of a placement estimated at `estimated_ttft_s` and scored by
        `placed_terms`, or None when it stands; `moving`: the session host's `moving_terms`
        when the caller has them (computed here otherwise). Changes nothing."""
        waited = view.req.waited_s
        if not estimated_ttft_s + waited > self.cluster.config.slo.ttft_s:
            return None
        terms = dict(placed_terms)
        best = masked_min(terms["ttft_s"], view.eligible, kernels=view.kernels)
        if session is not None and session.host != NO_HOST:
            # Moving the KV is an option.
            if moving is None:
                moving = moving_terms(self.cluster.cost, self.cluster.load, view, session.host)
            best = min(best, masked_min(moving["ttft_s"], view.eligible, kernels=view.kernels))
        slo = self.cluster.config.slo
        refusal = admission.check(best, isolated_floor_s(view, terms), slo, waited_s=waited)
        if refusal is None:
            return None
        return rejection(view, refusal.rule, refusal.retry_after_s, terms)

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
            plan = self._idle_migration(session, now)
            if plan is not None:
                return [plan]
        if self.param("prefetch"):
            return self._prefetch(session, host, now)
        return []

    def _prefetch(self, session: Session, host: int, now: float) -> list[TransferPlan]:
        """(f): load the session's context back from the host's node pool before its next turn
        (see the module docstring). Changes nothing."""
        cluster = self.cluster
        if not session.context_hashes or session.pending_target != NO_HOST:
            return []
        if cluster.index.block_count(host, Tier.CPU) <= 0:
            return []  # no pool on the host's node (or nothing in it yet)
        load_s = pool_load_s(cluster.cost, session.context_tokens)
        gaps = self.gaps.gaps(session.session_id)
        times = prefetch_times(self._prefetch_rule, gaps, now, load_s)
        return [
            prefetch_plan(
                cluster.cost,
                host,
                session.context_hashes,
                session_id=session.session_id,
                not_before=at,
            )
            for at in times
        ]

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
        # Only where the host's model is served (and the session's adapter can be held): the
        # next turn asks for the same.
        eligible = cluster.slots_with(Role.BOTH, Role.PREFILL, model=cluster.models[host])
        if session.adapter:
            eligible &= cluster.adapters.costs(session.adapter, 0.0, now)[0]
        return self.planner.during_gap(session, gap, eligible, room, penalty)

    def after_transfer(self, plan: TransferPlan, moved: bool, now: float) -> None:
        """A moved session's context now counts on its new host."""
        session = self.cluster.sessions.get(plan.session_id) if moved and plan.session_id else None
        if session is not None:
            self.resident.claim(session.session_id, plan.target, session.context_tokens, now)
