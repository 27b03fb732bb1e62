"""`elastic`: session affinity whose migrations leave the critical path (ours).

It starts from EAR (affinity by default, migrate a hot host's sessions, cooldown) and adds five
parts, each switchable for ablation:

(a) `idle_migration`: when a turn ends on a host that is hot (or whose active sessions'
    contexts no longer fit its KV memory), move the session's KV during its idle gap, while the
    agent runs its tool, so the next turn finds it on the target and the transfer costs no
    latency. The session is rebound only once its KV has landed and no turn ran meanwhile; a
    failed or late copy leaves it on its source.
(b) `ttft_target`: choose migration targets by the next turn's estimated TTFT including the
    part of the transfer the gap does not hide, not by load alone; migrate only when that beats
    staying by `min_gain_s`.
(c) `global_index`: cold starts (new sessions, sessionless requests) go where the estimated
    TTFT is lowest using every instance's cached prefix, fetching a longer shared prefix (a
    system prompt) from its holder when the transfer beats recomputing it, and preferring
    instances whose active sessions leave room for the new context.
(d) `replicate`: prefixes that cold starts reuse often (frequency score hits / sqrt(age), seed
    000) are copied ahead of time to the least-loaded instance lacking them when the expected
    saving exceeds 1.5 × the copy's cost.
(e) `admission`: reject (with a retry delay) a request whose best estimated TTFT misses the
    SLO because of queueing, i.e. one that would meet it on an idle instance.
"""

from __future__ import annotations

import heapq
import math
from random import Random

import numpy as np

from kvsched.core.cluster import Role
from kvsched.core.decision import Completion, Decision, TransferKind, TransferPlan
from kvsched.core.policies.affinity import migration_plan
from kvsched.core.policies.base import FloatVec, Policy, View, argmin_eligible
from kvsched.core.sessions import NO_HOST, Session


class Elastic(Policy):
    """See the module docstring for the rules and their switches."""

    name = "elastic"
    defaults = {
        "t_hot_tokens": 8192.0,  # EAR's trigger, kept so the ablation isolates the new parts
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
        n = self.cluster.n
        self._resident = np.zeros(n)  # context tokens of active sessions, per host
        self._claims: dict[str, tuple[int, float]] = {}  # session -> (host, tokens)
        self._expiry: list[tuple[float, str]] = []
        self._inflight: dict[str, tuple[int, float]] = {}  # session -> (target, started)
        self._prefix_hits: dict[int, tuple[int, float]] = {}
        self._gap_s = -1.0  # cluster-wide smoothed idle gap, for sessions with no history
        self._capacity_tokens = float(self.cluster.capacity_blocks * self.cluster.block_size)

    # ---- placement ---------------------------------------------------------------------

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        self._expire_claims(now)
        session = self._session(view)
        if session is not None and session.host != NO_HOST and view.eligible[session.host]:
            decision = self._affine(view, session, now)
        else:
            decision = self._cold(view, now)
        if self.param("admission"):
            decision = self._admit(view, decision)
        if not decision.rejected and session is not None:
            self._claim(session.session_id, decision.instance, view.req.prompt_tokens, now)
        return decision

    def _session(self, view: View) -> Session | None:
        sid = view.req.session_id
        return self.cluster.sessions.get(sid) if sid is not None else None

    def _affine(self, view: View, session: Session, now: float) -> Decision:
        host = session.host
        pending = self.cluster.load.pending_prefill_tokens
        terms = self.ttft_terms(view, view.hit_tokens)
        if session.session_id in self._inflight:
            # Its KV is on the wire; the source still holds it: no second move.
            return self.decision(view, host, "affinity (idle migration in flight)", terms)
        if pending[host] <= self.param("t_hot_tokens") or session.in_cooldown(
            now, self.param("t_cool_s")
        ):
            return self.decision(view, host, "affinity", terms)
        context = view.req.prompt_tokens + view.req.output_tokens
        cluster = self.cluster
        room = cluster.load.free_blocks * cluster.block_size >= context
        candidates = view.eligible & room & (pending < pending[host])
        candidates[host] = False
        if not candidates.any():
            return self.decision(view, host, "host hot, no cooler instance with room: stay", terms)
        if not self.param("ttft_target"):
            target = self.least_pending(candidates)
            return self._move_now(view, host, target, "host hot: migrate to least pending")
        moved = np.clip(view.hit_tokens[host] - view.hit_tokens, 0.0, None)
        moving = self.ttft_terms(
            view,
            np.maximum(view.hit_tokens, view.hit_tokens[host]),
            cluster.cost.transfer_from(host, moved),
        )
        target = argmin_eligible(moving["ttft_s"], candidates)
        if moving["ttft_s"][target] + self.param("min_gain_s") >= terms["ttft_s"][host]:
            return self.decision(view, host, "host hot, moving does not pay: stay", terms)
        return self._move_now(
            view, host, target, "host hot: migrate now to min TTFT incl. transfer"
        )

    def _move_now(self, view: View, host: int, target: int, rule: str) -> Decision:
        plan = migration_plan(self, view, host, target, on_path=True)
        moved = plan.tokens if plan is not None else 0
        cached = np.array(view.hit_tokens)
        cached[target] = min(view.hit_tokens[target] + moved, max(view.req.prompt_tokens - 1, 0))
        transfer = np.zeros(self.cluster.n)
        transfer[target] = plan.est_seconds if plan is not None else 0.0
        return self.decision(
            view,
            target,
            rule,
            self.ttft_terms(view, cached, transfer),
            cached_tokens=view.hit_tokens[target],
            fetched_tokens=moved,
            transfers=(plan,) if plan is not None else (),
        )

    def _cold(self, view: View, now: float) -> Decision:
        cluster = self.cluster
        load = cluster.load
        if not self.param("global_index"):
            slot = self.least_pending(view.eligible)
            return self.decision(
                view,
                slot,
                "cold start: fewest pending prefill tokens",
                self.ttft_terms(view, view.hit_tokens),
            )
        best = view.best_slot
        hits = view.hit_tokens
        cached, transfer = hits, np.zeros(cluster.n)
        if best >= 0:
            extra = np.clip(hits[best] - hits, 0.0, None)
            fetch_s = cluster.cost.transfer_from(best, extra)
            n = float(view.req.prompt_tokens)
            saved = cluster.cost.prefill_s(n - hits, hits) - cluster.cost.prefill_s(
                n - hits[best], np.full(cluster.n, hits[best])
            )
            fetch = view.eligible & (extra > 0) & (fetch_s < saved)
            cached = np.where(fetch, hits[best], hits)
            transfer = np.where(fetch, fetch_s, 0.0)
        terms = self.ttft_terms(view, cached, transfer)
        context = view.req.prompt_tokens + view.req.output_tokens
        fits = view.eligible & (self._resident + context <= self._capacity_tokens)
        pool = fits if fits.any() else view.eligible
        slot = argmin_eligible(terms["ttft_s"], pool, self._resident, load.in_flight)
        terms["resident_tokens"] = self._resident.copy()
        transfers: list[TransferPlan] = []
        fetched = int(cached[slot] - hits[slot])
        if fetched > 0:
            transfers.append(
                self._copy_plan(view, best, slot, kind=TransferKind.FETCH_PREFIX, on_path=True)
            )
        if best >= 0 and self.param("replicate"):
            transfers.extend(self._replicate(view, best, slot, now))
        rule = "cold start: min TTFT over the global index" + (
            " (fetching shared prefix)" if fetched else ""
        )
        return self.decision(
            view,
            slot,
            rule,
            terms,
            cached_tokens=hits[slot],
            fetched_tokens=fetched,
            transfers=tuple(transfers),
        )

    def _copy_plan(
        self,
        view: View,
        source: int,
        target: int,
        *,
        kind: TransferKind,
        on_path: bool,
        upto: int = -1,
    ) -> TransferPlan:
        cluster = self.cluster
        have = int(view.hit_blocks[target])
        end = int(min(view.hit_blocks[source], view.max_blocks)) if upto < 0 else upto
        tokens = (end - have) * cluster.block_size
        return TransferPlan(
            kind=kind,
            source=source,
            target=target,
            block_hashes=view.req.block_hashes[:end],
            skip_blocks=have,
            tokens=tokens,
            nbytes=tokens * cluster.cost.kv_bytes_per_token,
            est_seconds=cluster.cost.transfer_s(source, target, tokens),
            on_critical_path=on_path,
            session_id=view.req.session_id if kind is not TransferKind.REPLICATE_PREFIX else None,
            request_id=view.req.request_id,
        )

    def _replicate(self, view: View, best: int, chosen: int, now: float) -> list[TransferPlan]:
        """(d): copy a frequently reused cold-start prefix to the least-loaded instance that
        lacks it, when the expected saving beats 1.5 × the copy's cost."""
        blocks = int(min(view.hit_blocks[best], view.max_blocks))
        key = view.req.block_hashes[blocks - 1]
        hits, first = self._prefix_hits.get(key, (0, now))
        hits += 1
        self._prefix_hits[key] = (hits, first)
        score = hits / math.sqrt(max(now - first, 1.0))
        if hits < self.param("min_hits") or score < self.param("hot_score"):
            return []
        cluster = self.cluster
        lacking = view.eligible & (view.hit_blocks < blocks)
        lacking[chosen] = False
        if not lacking.any():
            return []
        target = self.least_pending(lacking)
        plan = self._copy_plan(
            view, best, target, kind=TransferKind.REPLICATE_PREFIX, on_path=False, upto=blocks
        )
        # Saving: the prefill of the missing prefix, for the cold starts expected there.
        expected = score * self.param("horizon_s") / max(int(view.eligible.sum()), 1)
        saving = expected * cluster.cost.prefill_one(
            plan.tokens, int(view.hit_blocks[target]) * cluster.block_size
        )
        if saving <= 1.5 * plan.est_seconds:
            return []
        self._prefix_hits[key] = (0, now)
        return [plan]

    def _admit(self, view: View, decision: Decision) -> Decision:
        """(e): reject what queueing alone makes miss the TTFT SLO."""
        slo = self.cluster.config.slo.ttft_s
        estimate = decision.estimated_ttft_s
        if not estimate > slo:
            return decision
        if self.isolated_floor(view, dict(decision.terms)) > slo:
            return decision  # it cannot meet the SLO anywhere: serve it as well as we can
        return self.reject(
            view,
            "estimated TTFT misses the SLO through queueing: reject",
            estimate - slo,
            dict(decision.terms),
        )

    # ---- completions and idle-gap migration ------------------------------------------------

    def on_finish(self, done: Completion, now: float, rng: Random) -> list[TransferPlan]:
        plans = list(super().on_finish(done, now, rng))
        sid = done.session_id
        if sid is None:
            return plans
        session = self.cluster.sessions.get(sid)
        if session is None:
            return plans
        self._claim(
            sid,
            session.host if session.host != NO_HOST else done.instance,
            session.context_tokens,
            now,
        )
        if self.param("idle_migration"):
            plan = self._idle_migration(session, now)
            if plan is not None:
                plans.append(plan)
        return plans

    def _learn_gap(self, session: Session) -> float:
        if session.idle_gap_s >= 0:
            self._gap_s = (
                session.idle_gap_s
                if self._gap_s < 0
                else 0.9 * self._gap_s + 0.1 * session.idle_gap_s
            )
            return session.idle_gap_s
        return max(self._gap_s, 0.0)

    def _idle_migration(self, session: Session, now: float) -> TransferPlan | None:
        """(a): move a session off a hot or crowded host while its agent is busy."""
        host = session.host
        gap = self._learn_gap(session)
        if host == NO_HOST or session.session_id in self._inflight:
            return None
        if session.in_cooldown(now, self.param("t_cool_s")) or not session.context_hashes:
            return None
        cluster = self.cluster
        load = cluster.load
        pending = load.pending_prefill_tokens
        hot = pending[host] > self.param("t_hot_tokens")
        crowded = self._resident[host] > self._capacity_tokens
        if not (hot or crowded):
            return None
        bs = cluster.block_size
        hashes = session.context_hashes
        blocks = np.zeros(cluster.n)
        for slot, count in cluster.index.match(hashes).items():
            blocks[slot] = count
        held = blocks * bs
        if held[host] <= 0:
            return None
        est = self._next_turn_estimate(session, held, host, gap)
        if crowded:  # on a crowded host the context may be evicted before the next turn
            overflow = 1.0 - self._capacity_tokens / self._resident[host]
            est[host] += overflow * cluster.cost.prefill_one(session.prompt_tokens, 0)
        context = session.context_tokens + max(session.growth_tokens, 0.0)
        eligible = cluster.slots_with(Role.BOTH, Role.PREFILL)
        room = (load.free_blocks * bs >= context) & (
            self._resident + context <= self._capacity_tokens
        )
        candidates = eligible & room & (pending < pending[host])
        candidates[host] = False
        if not candidates.any():
            return None
        if self.param("ttft_target"):
            target = argmin_eligible(est, candidates)
        else:
            target = self.least_pending(candidates)
        if est[target] + self.param("min_gain_s") >= est[host]:
            return None
        upto = int(blocks[host])
        have = int(blocks[target])
        tokens = (upto - have) * bs
        if tokens <= 0:
            return None
        plan = TransferPlan(
            kind=TransferKind.MIGRATE_SESSION,
            source=host,
            target=target,
            block_hashes=hashes[:upto],
            skip_blocks=have,
            tokens=tokens,
            nbytes=tokens * cluster.cost.kv_bytes_per_token,
            est_seconds=cluster.cost.transfer_s(host, target, tokens),
            on_critical_path=False,
            session_id=session.session_id,
        )
        self._inflight[session.session_id] = (target, now)
        session.pending_target = target
        session.pending_ready_at = now + plan.est_seconds
        return plan

    def _next_turn_estimate(
        self, session: Session, held: FloatVec, host: int, gap: float
    ) -> FloatVec:
        """Estimated TTFT of the session's next turn on every instance if it arrives `gap`
        from now: the queue left by then, the transfer the gap does not hide, and the prefill
        of its new tokens on the context it would find there."""
        cluster = self.cluster
        cost, load = cluster.cost, cluster.load
        growth = max(session.growth_tokens, float(cluster.block_size))
        prompt = session.prompt_tokens + growth
        moved = np.clip(held[host] - held, 0.0, None)
        cached = np.maximum(held, held[host])
        transfer = cost.transfer_from(host, moved)
        queue = np.maximum(load.pending_prefill_s - gap, 0.0)
        prefill = cost.prefill_s(prompt - cached, cached)
        est: FloatVec = queue + prefill + np.maximum(transfer - gap, 0.0)
        est[host] = queue[host] + float(cost.prefill_one(int(prompt - held[host]), int(held[host])))
        return est

    def on_transfer(self, plan: TransferPlan, ok: bool, now: float) -> None:
        sid = plan.session_id
        if (
            plan.kind is not TransferKind.MIGRATE_SESSION
            or sid is None
            or sid not in self._inflight
        ):
            super().on_transfer(plan, ok, now)
            return
        _, started = self._inflight.pop(sid)
        session = self.cluster.sessions.get(sid)
        if session is None:
            return
        session.pending_target = NO_HOST
        session.pending_ready_at = float("inf")
        # Rebind only if no turn ran while the KV moved: otherwise the source holds newer KV.
        if ok and session.last_arrival_at < started:
            self.cluster.sessions.bind(sid, plan.target, now, migrated=True)
            self._claim(sid, plan.target, session.context_tokens, now)

    # ---- active-session memory claims --------------------------------------------------------

    def _claim(self, sid: str, host: int, tokens: float, now: float) -> None:
        """Session `sid` keeps about `tokens` of KV on `host` for the next window."""
        old = self._claims.get(sid)
        if old is not None:
            self._resident[old[0]] -= old[1]
        self._claims[sid] = (host, tokens)
        self._resident[host] += tokens
        heapq.heappush(self._expiry, (now + self.param("active_window_s"), sid))

    def _expire_claims(self, now: float) -> None:
        sessions = self.cluster.sessions
        window = self.param("active_window_s")
        while self._expiry and self._expiry[0][0] <= now:
            _, sid = heapq.heappop(self._expiry)
            session = sessions.get(sid)
            last = max(session.last_finish_at, session.last_arrival_at) if session else -math.inf
            if last + window <= now and sid in self._claims:
                host, tokens = self._claims.pop(sid)
                self._resident[host] -= tokens
