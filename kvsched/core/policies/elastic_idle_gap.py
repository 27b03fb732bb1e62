"""(a) and (f) of `elastic` (`kvsched.core.policies.elastic`): what it plans for a session's
idle gap once a turn has ended, while the agent runs its tool. Either it moves the session off
a busy or crowded host (a, `idle_gap_move`), or it loads the session's context back from the
host's node pool before the next turn is expected (f, `idle_gap_prefetch`). Both read the
cluster and change nothing: the policy returns their plans.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsched.core.cluster import ClusterState, Role
from kvsched.core.decision import TransferPlan
from kvsched.core.index import Tier
from kvsched.core.migration import MigrationPlanner
from kvsched.core.prefetch import (
    GapHistory,
    PrefetchRule,
    pool_load_s,
    prefetch_plan,
    prefetch_times,
)
from kvsched.core.request_view import FloatVec
from kvsched.core.sessions import NO_HOST, Session


@dataclass(frozen=True, slots=True)
class IdleMoveRule:
    """When (a) may move a session: not within `t_cool_s` of its last move; and where its
    host counts as crowded: its active sessions' contexts exceed `capacity_tokens`."""

    t_cool_s: float
    capacity_tokens: float


def idle_gap_move(
    cluster: ClusterState,
    planner: MigrationPlanner,
    session: Session,
    now: float,
    resident: FloatVec,
    *,
    rule: IdleMoveRule,
) -> TransferPlan | None:
    """(a): move a session off a busy or crowded host while its agent is busy. `resident`:
    every instance's active sessions' context tokens; a host is busy by `planner`'s rule (the
    one its moves on arrival follow), crowded by `rule`."""
    host, gap = session.host, session.idle_gap_s
    if host == NO_HOST or gap < 0 or session.pending_target != NO_HOST:
        return None  # unbound, no gap seen yet, or already moving
    if session.in_cooldown(now, rule.t_cool_s) or not session.context_hashes:
        return None
    capacity_tokens = rule.capacity_tokens
    load = cluster.load
    crowded = resident[host] > capacity_tokens
    if planner.by_ttft:
        busy = load.pending_prefill_s[host] - gap > planner.min_gain_s
    else:
        busy = load.pending_prefill_tokens[host] > planner.t_hot_tokens
    if not (busy or crowded):
        return None  # the host will be free, and its memory holds its sessions
    context = session.context_tokens + max(session.growth_tokens, 0.0)
    room = resident + context <= capacity_tokens
    # On a crowded host the context may be evicted before the next turn.
    penalty = 0.0
    if crowded:
        overflow = 1.0 - capacity_tokens / resident[host]
        penalty = overflow * cluster.cost.prefill_one(session.prompt_tokens, 0)
    # Only where the host's model is served (and the session's adapter can be held): the
    # next turn asks for the same.
    eligible = cluster.slots_with(Role.BOTH, Role.PREFILL, model=cluster.models[host])
    if session.adapter:
        eligible &= cluster.adapters.costs(session.adapter, 0.0, now)[0]
    return planner.during_gap(session, gap, eligible, room, penalty)


def idle_gap_prefetch(
    cluster: ClusterState,
    session: Session,
    host: int,
    now: float,
    *,
    gaps: GapHistory,
    rule: PrefetchRule,
) -> list[TransferPlan]:
    """(f): loads of the session's context from `host`'s node pool back into its GPU, timed by
    `rule` from the gaps the session showed (`gaps`) to land before its next turn; none
    without a pool, or while the session moves."""
    if not session.context_hashes or session.pending_target != NO_HOST:
        return []
    if cluster.index.block_count(host, Tier.CPU) <= 0:
        return []  # no pool on the host's node (or nothing in it yet)
    load_s = pool_load_s(cluster.cost, session.context_tokens)
    times = prefetch_times(rule, gaps.gaps(session.session_id), now, load_s)
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
