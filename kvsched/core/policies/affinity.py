"""Session affinity baselines: hard pinning (`sticky`) and EAR (elastic affinity routing)."""

from __future__ import annotations

from random import Random

import numpy as np

from kvsched.core.decision import Decision, TransferKind, TransferPlan
from kvsched.core.policies.base import Policy, View
from kvsched.core.sessions import NO_HOST, Session


class Sticky(Policy):
    """Rules: a session's first turn goes to the instance with the fewest pending prefill
    tokens; every later turn goes to that same instance for the session's life (re-chosen
    only if the instance died). Requests without a session go to the least loaded."""

    name = "sticky"

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        session = self.session(view)
        terms = self.ttft_terms(view, view.hit_tokens)
        if session is not None and session.host != NO_HOST and view.eligible[session.host]:
            return self.decision(view, session.host, "session pinned", terms)
        slot = self.least_pending(view.eligible)
        return self.decision(view, slot, "cold start: fewest pending prefill tokens", terms)

    def session(self, view: View) -> Session | None:
        sid = view.req.session_id
        return self.cluster.sessions.get(sid) if sid is not None else None


class Ear(Sticky):
    """EAR, as its design note describes it:

    - Affinity by default: a session's turns go to its current host.
    - Cold start: the instance with the fewest pending prefill tokens.
    - Migration: when the host's pending prefill tokens exceed `t_hot_tokens` and the session
      has not migrated within `t_cool_s`, the turn moves to the instance with the fewest pending
      prefill tokens among those that are strictly less loaded than the host and have free KV
      room for the session's context; the session's KV is transferred on this turn's critical
      path and the session is rebound there. With no such instance it stays (opportunistic).
    """

    name = "ear"
    defaults = {"t_hot_tokens": 8192.0, "t_cool_s": 30.0}

    def decide(self, view: View, now: float, rng: Random) -> Decision:
        session = self.session(view)
        if session is None or session.host == NO_HOST or not view.eligible[session.host]:
            return super().decide(view, now, rng)
        host = session.host
        pending = self.cluster.load.pending_prefill_tokens
        terms = self.ttft_terms(view, view.hit_tokens)
        if pending[host] <= self.param("t_hot_tokens") or session.in_cooldown(
            now, self.param("t_cool_s")
        ):
            return self.decision(view, host, "affinity", terms)
        context = view.req.prompt_tokens + view.req.output_tokens
        room = self.cluster.load.free_blocks * self.cluster.block_size >= context
        candidates = view.eligible & room & (pending < pending[host])
        candidates[host] = False
        if not candidates.any():
            return self.decision(view, host, "host hot, no cooler instance with room: stay", terms)
        target = self.least_pending(candidates)
        return self.migrate_now(view, host, target, "host hot: migrate to least pending prefill")

    def migrate_now(self, view: View, host: int, target: int, rule: str) -> Decision:
        """Move the session's KV from `host` to `target` on this turn's critical path."""
        plan = migration_plan(self, view, host, target, on_path=True)
        moved = plan.tokens if plan is not None else 0
        cached = np.array(view.hit_tokens)
        cached[target] = min(view.hit_tokens[target] + moved, max(view.req.prompt_tokens - 1, 0))
        transfer = np.zeros(self.cluster.n)
        transfer[target] = plan.est_seconds if plan is not None else 0.0
        terms = self.ttft_terms(view, cached, transfer)
        return self.decision(
            view,
            target,
            rule,
            terms,
            cached_tokens=view.hit_tokens[target],
            fetched_tokens=moved,
            transfers=(plan,) if plan is not None else (),
        )


def migration_plan(
    policy: Policy, view: View, source: int, target: int, *, on_path: bool
) -> TransferPlan | None:
    """Plan moving the blocks of this request's prompt that `source` holds and `target` lacks."""
    cluster = policy.cluster
    bs = cluster.block_size
    have = int(view.hit_blocks[target])
    upto = int(min(view.hit_blocks[source], view.max_blocks))
    if upto <= have:
        return None
    tokens = (upto - have) * bs
    return TransferPlan(
        kind=TransferKind.MIGRATE_SESSION,
        source=source,
        target=target,
        block_hashes=view.req.block_hashes[:upto],
        skip_blocks=have,
        tokens=tokens,
        nbytes=tokens * cluster.cost.kv_bytes_per_token,
        est_seconds=cluster.cost.transfer_s(source, target, tokens),
        on_critical_path=on_path,
        session_id=view.req.session_id,
        request_id=view.req.request_id,
    )
