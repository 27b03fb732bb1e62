"""What a placement, a completion and a transfer's outcome change in the cluster state, the
same for every policy.

A policy only decides (`Policy.decide` reads the state); these functions record what it
decided at once (speculative index entries, load charge, session binding) so the next request
sees it, and what then happened. A policy's own follow-ups stay its hooks: `after_finish`
returns transfers to start, `after_transfer` updates what the policy alone keeps.
"""

from __future__ import annotations

from dataclasses import replace
from random import Random

from kvsched.core.adapters import NO_CHANGE
from kvsched.core.cluster import ClusterState
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.decision_builders import rejection
from kvsched.core.policies.base import Policy
from kvsched.core.request_view import RequestView, request_view


def place(
    cluster: ClusterState, policy: Policy, req: RequestInfo, now: float, rng: Random
) -> Decision:
    """Decide where `req` goes and record that decision in the cluster state (a rejection
    records nothing but the session's arrival)."""
    cluster.index.expire(now)
    if req.session_id is not None:
        cluster.sessions.arrive(req.session_id, now, req.request_id).adapter = req.adapter
    view = request_view(cluster, req, now)
    decision = adapter_refusal(cluster, view, now) or policy.decide(view, now, rng)
    if decision.rejected:
        return decision
    record_placement(cluster, req, decision, now)
    if req.adapter:
        adapters, decode = cluster.adapters, decision.decode_instance
        change = adapters.place(decision.instance, req.adapter, now)
        decode_change = (
            NO_CHANGE
            if decode in (-1, decision.instance)
            else adapters.place(decode, req.adapter, now)
        )
        decision = replace(decision, adapter_change=change, decode_adapter_change=decode_change)
    return decision


def adapter_refusal(cluster: ClusterState, view: RequestView, now: float) -> Decision | None:
    """The rejection of an adapter's request that no instance can take now (none holds the
    adapter, every adapter slot is in use), retried when the first of them may be freed;
    None where some instance can. (vLLM would queue it behind its slots; a Router answers
    429 with Retry-After.)"""
    if view.adapter_able is None or view.eligible.any():
        return None
    retry = cluster.adapters.retry_after_s(now)
    return rejection(view, "adapter_slots_full", retry, {})


def record_placement(
    cluster: ClusterState, req: RequestInfo, decision: Decision, now: float
) -> None:
    """Charge the chosen instance, add speculative index entries for the prompt there, and
    bind its session (or start moving it, when the turn carries the session's KV)."""
    slot = decision.instance
    bs = cluster.block_size
    cached = decision.cached_tokens + decision.fetched_tokens
    n_new = req.prompt_tokens - cached
    prefill_s = cluster.cost.prefill_one(n_new, cached)
    blocks = -(-(req.prompt_tokens + req.output_tokens) // bs) - cached // bs
    cluster.load.charge(slot, n_new, prefill_s, blocks)
    cluster.index.speculate(slot, req.block_hashes, now + cluster.config.speculative_ttl_s)
    if req.session_id is not None:
        session = cluster.sessions.get(req.session_id)
        if session is not None and session.host != slot and not decision.keeps_binding:
            if any(t.kind is TransferKind.MIGRATE_SESSION for t in decision.transfers):
                # The turn runs on `slot` while its KV moves there; the session is rebound
                # only once the copy landed verified (a failed copy leaves it on its host).
                cluster.sessions.begin_move(req.session_id, slot, now, on_path=True)
            else:
                cluster.sessions.bind(req.session_id, slot, now, migrated=False)


def finish(
    cluster: ClusterState, policy: Policy, done: Completion, now: float
) -> list[TransferPlan]:
    """A request ended: record it in its session and the load, then ask the policy for
    transfers to start now; a session whose KV one of them moves is marked moving."""
    if done.session_id is not None:
        cluster.sessions.finish(
            done.session_id, done.block_hashes, done.prompt_tokens, done.output_tokens, now
        )
    cluster.load.finish(done.instance)
    plans = list(policy.after_finish(done, now))
    for plan in plans:
        if plan.kind is TransferKind.MIGRATE_SESSION and plan.session_id is not None:
            # Rebound only once it landed (off the path: and no turn ran meanwhile).
            cluster.sessions.begin_move(
                plan.session_id, plan.target, now, on_path=plan.on_critical_path
            )
    return plans


def transfer_ended(
    cluster: ClusterState, policy: Policy, plan: TransferPlan, ok: bool, now: float
) -> bool:
    """A transfer a policy ordered ended. A migration rebinds its session if the KV landed (an
    idle-gap one only if no turn ran meanwhile). Returns whether a session moved."""
    moved = False
    if plan.kind is TransferKind.MIGRATE_SESSION and plan.session_id is not None:
        moved = cluster.sessions.end_move(plan.session_id, plan.target, ok, now)
    policy.after_transfer(plan, moved, now)
    return moved
