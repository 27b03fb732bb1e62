"""Session affinity baselines: hard pinning (`sticky`) and EAR (elastic affinity routing)."""

from __future__ import annotations

from random import Random

from kvsched.core.cost import ttft_terms
from kvsched.core.decision import Decision
from kvsched.core.decision_builders import placement
from kvsched.core.migration import MigrationPlanner
from kvsched.core.pickers import least_pending
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView
from kvsched.core.sessions import NO_HOST, Session


class Sticky(Policy):
    """Rules: a session's first turn goes to the instance with the fewest pending prefill
    tokens; every later turn goes to that same instance for the session's life (re-chosen
    only if the instance died). Requests without a session go to the least loaded."""

    name = "sticky"
    affinity = True

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        session = self.session(view)
        cluster = self.cluster
        terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
        if session is not None and session.host != NO_HOST and view.eligible[session.host]:
            return placement(view, session.host, "session pinned", terms)
        slot = least_pending(cluster, view.eligible)
        return placement(view, slot, "cold start: fewest pending prefill tokens", terms)

    def session(self, view: RequestView) -> Session | None:
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
      path and the session is rebound there once it landed (a failed copy leaves it on its
      host). With no such instance it stays (opportunistic).
    """

    name = "ear"
    defaults = {"t_hot_tokens": 8192.0, "t_cool_s": 30.0}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.planner = MigrationPlanner(
            self.cluster, by_ttft=False, t_hot_tokens=self.param("t_hot_tokens"), min_gain_s=0.0
        )

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        session = self.session(view)
        if session is None or session.host == NO_HOST or not view.eligible[session.host]:
            return super().decide(view, now, rng)
        terms = ttft_terms(self.cluster.cost, self.cluster.load, view, view.hit_tokens)
        if session.pending_target != NO_HOST:
            return placement(view, session.host, "affinity (migration in flight)", terms)
        if session.in_cooldown(now, self.param("t_cool_s")):
            return placement(view, session.host, "affinity (cooldown)", terms)
        return self.planner.on_arrival(view, session.host, terms)
