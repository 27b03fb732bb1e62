"""The control core: one policy on one cluster state with its seeded random source, and the
bookkeeping around it that the simulator and the live Conductor share.

Both drive this one object, built by this one constructor: the same validation (a refused
call changes nothing), the same idempotency (a placement asked twice is decided once, a
completion recorded once), the same transfer naming, the same write path for KV events. Every
input that can change a decision enters through the methods below, each taking `now` from the
caller's clock, so replaying the same calls with the same seed gives the same decisions
wherever they run (the parity test replays a trace through both).

The core works in instance slots; naming instances, sequencing event batches and persisting
are the services' (a Conductor observes what is applied through `IndexObserver`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from kvsched.core import recording
from kvsched.core.cluster import ClusterConfig, ClusterState, Role, build_cluster
from kvsched.core.decision import (
    ENGINE_ORDERS,
    Completion,
    Decision,
    RequestInfo,
    TransferKind,
    TransferPlan,
)
from kvsched.core.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.policies import Policy, make_policy
from kvsched.core.recent import Recent
from kvsched.core.request_view import request_view, tier_terms
from kvsched.core.requests import Limits, RequestError
from kvsched.core.sessions import NO_HOST, Session
from kvsched.core.transfer_book import TransferBook

RECENT_DECISIONS = 65_536  # idempotency window for placements and completions asked again


class SchedulerPort(Protocol):
    """What a driver (the simulator, the Conductor's RPC layer) calls."""

    def place(self, req: RequestInfo, now: float) -> Decision:
        """Decide where `req` runs and record the placement; raises RequestError."""
        ...

    def finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        """A request ended; returns transfers to start now."""
        ...

    def transfer_done(self, transfer_id: str, ok: bool, now: float) -> bool:
        """A transfer ended; returns whether a session moved."""
        ...

    def apply(self, slot: int, events: Sequence[KvEvent]) -> None:
        """An instance's caches changed, or it reported its load."""
        ...


class IndexObserver(Protocol):
    """Told what the core applied, to keep a durable copy (the Conductor's etcd records)."""

    def stored(self, slot: int, event: BlocksStored) -> None:
        """`event`'s blocks are now indexed on `slot`."""

    def removed(self, slot: int, tier: Tier, hashes: Sequence[int]) -> None:
        """`hashes` (descendants included) are about to leave `slot`'s `tier`."""

    def session_changed(self, session: Session) -> None:
        """A session's binding or history changed."""

    def session_forgotten(self, session_id: str) -> None:
        """A session was forgotten (idle too long, or over the cap)."""


class Scheduler:
    """The in-process `SchedulerPort`, and the one front door to the core's state."""

    def __init__(
        self,
        config: ClusterConfig,
        policy: str,
        seed: int,
        *,
        max_prompt_tokens: int,
        transfer_prefix: str = "transfer",
        observer: IndexObserver | None = None,
        empty: bool = False,
        max_sessions_per_tenant: int = 0,
        runs_engine_orders: bool = False,
        pure: bool = False,
    ) -> None:
        """`pure`: the reference prefix index and scoring rather than the compiled ones (the
        same decisions; `build_cluster`).
        `runs_engine_orders`: the caller executes the plans stock vLLM cannot
        (`ENGINE_ORDERS`: PREFETCH and RETAIN; the simulator does); otherwise `finish` drops
        them before opening them.
        `empty`: start with no live instance (they join with `add_instance`).
        `max_sessions_per_tenant`: the most sessions one tenant keeps (0: no cap); a new one
        past it forgets that tenant's least recently touched idle session (`sessions`)."""
        if max_sessions_per_tenant < 0:
            raise ValueError("max_sessions_per_tenant must be 0 (no cap) or positive")
        self.cluster: ClusterState = build_cluster(config, pure=pure)
        self.cluster.sessions.max_per_tenant = max_sessions_per_tenant
        if empty:
            self.cluster.alive[:] = False
        self.config = config
        self.policy: Policy = make_policy(policy, self.cluster)
        self.spec = policy
        self.rng = random.Random(seed)
        self.limits = Limits(max_prompt_tokens, config.block_size)
        self.transfers = TransferBook(transfer_prefix)
        self.runs_engine_orders = runs_engine_orders
        self.observer = observer
        self._decisions: Recent[Decision] = Recent(RECENT_DECISIONS)
        self._finished: Recent[None] = Recent(RECENT_DECISIONS)
        self.rejections = 0
        self.migrations = 0  # sessions rebound from one live host to another
        self.sessions_evicted = 0  # forgotten to make room for their tenant's new ones

    # ---- policy ------------------------------------------------------------------------

    def set_policy(self, spec: str) -> str:
        """Switch policy on the same cluster state (the index, load and sessions stay);
        returns the previous spec. Raises RequestError on a bad spec."""
        try:
            policy = make_policy(spec, self.cluster)
        except ValueError as exc:
            raise RequestError("invalid", str(exc)) from exc
        previous, self.policy, self.spec = self.spec, policy, spec
        return previous

    # ---- instances ---------------------------------------------------------------------

    def add_instance(self, slot: int, role: Role, node: int | None = None, model: str = "") -> None:
        """An instance joined (or came back) in `slot`, serving `model` ("": any): it starts
        empty and idle."""
        self._forget_slot(slot)
        self.cluster.add_instance(slot, role, node, model)

    def remove_instance(self, slot: int) -> int:
        """An instance left: its blocks and load are dropped, its sessions rebind on their
        next turn, and orders or remembered decisions naming it are forgotten (they would
        name the slot's next holder). Returns the sessions unbound."""
        unbound = self.cluster.sessions.bound_on(slot)
        self.cluster.remove_instance(slot)
        self._forget_slot(slot)
        return unbound

    def _forget_slot(self, slot: int) -> None:
        self.transfers.forget_slot(slot)
        self._decisions.forget(lambda d: slot in (d.instance, d.decode_instance))

    # ---- KV events ---------------------------------------------------------------------

    def apply(self, slot: int, events: Sequence[KvEvent], *, observe: bool = True) -> None:
        """Apply an instance's events in order; the whole batch is refused (RequestError)
        when any event names more blocks than the longest prompt has. `observe`: tell the
        observer (False for events read back from its own durable copy)."""
        if len(events) == 1:  # what every engine step sends: its load alone, unchecked
            event = events[0]
            if type(event) is LoadReport:
                self._report_load(slot, event)
                return
        self.limits.check_events(events)
        index = self.cluster.index
        observer = self.observer if observe else None
        for event in events:
            if isinstance(event, BlocksStored):
                index.store(slot, event.hashes, event.parent, event.tier)
                if observer is not None:
                    observer.stored(slot, event)
            elif isinstance(event, BlocksRemoved):
                if observer is not None:
                    observer.removed(
                        slot, event.tier, index.subtree_of(slot, event.hashes, event.tier)
                    )
                index.remove(slot, event.hashes, event.tier)
            elif isinstance(event, AllBlocksCleared):
                if observer is not None:
                    for tier in Tier:
                        observer.removed(slot, tier, index.blocks_of(slot, tier))
                index.clear_instance(slot)
            else:
                self._report_load(slot, event)

    def _report_load(self, slot: int, report: LoadReport) -> None:
        self.cluster.load.report(slot, report)
        if report.adapters is not None:
            self.cluster.adapters.report(slot, report.adapters)

    # ---- requests ----------------------------------------------------------------------

    def place(self, req: RequestInfo, now: float) -> Decision:
        """Place `req`, or return the decision already made for its id. A placement that
        rebinds a session of a policy that follows bindings says so (`Decision.rebound`):
        the Conductor makes the binding durable before it answers."""
        self.limits.check_request(req)
        key = str(req.request_id)
        seen = self._decisions.get(key)
        if seen is not None:
            return seen
        if not self.cluster.alive.any():
            raise RequestError("unavailable", "no instance is registered")
        sessions = self.cluster.sessions
        before = sessions.get(req.session_id) if req.session_id else None
        host_before = NO_HOST if before is None else before.host
        try:
            decision = recording.place(self.cluster, self.policy, req, now, self.rng)
        except ValueError as exc:  # no eligible instance of the needed role
            raise RequestError("unavailable", str(exc)) from exc
        finally:  # the arrival is recorded whatever the policy decides, and so is its room
            self._evicted(sessions.take_evicted())
        if decision.rejected:
            self.rejections += 1
            return decision
        changes: dict[str, Any] = {}  # applied in one copy: `replace` costs microseconds
        if decision.transfers:
            changes["transfers"] = tuple(self.transfers.open(plan) for plan in decision.transfers)
        if req.session_id:
            after = sessions.get(req.session_id)
            if after is not None and after.host != host_before:
                if host_before != NO_HOST:
                    self.migrations += 1
                changes["rebound"] = self.policy.affinity
            self._session_changed(req.session_id)
        if changes:
            decision = replace(decision, **changes)
        # Slim: the window keeps many; a retry needs neither terms nor candidates.
        self._decisions.add(key, replace(decision, terms={}, candidates=None, rebound=False))
        return decision

    def explain(self, req: RequestInfo, now: float) -> Decision:
        """The decision `place` would make now, changing nothing (not even the RNG) but what
        `place` changes first: speculative placements whose time is up leave the index, so
        the hits shown are the ones a placement now would see, not claims the engine's events
        have since contradicted. Its terms add to the policy's each candidate's hit split by
        tier (`tier_terms`), whatever the policy reads."""
        self.limits.check_request(req)
        if not self.cluster.alive.any():
            raise RequestError("unavailable", "no instance is registered")
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        # A policy's own bookkeeping (a round-robin cursor, prefix heat) moves as it decides:
        # ask a copy of it that shares the cluster state, which deciding only reads.
        shared = {id(value): value for value in vars(self.cluster).values()}
        shared[id(self.cluster)] = self.cluster
        policy = copy.deepcopy(self.policy, shared)
        self.cluster.index.expire(now)
        view = request_view(self.cluster, req, now)
        try:
            decision = recording.adapter_refusal(self.cluster, view, now) or policy.decide(
                view, now, rng
            )
        except ValueError as exc:
            raise RequestError("unavailable", str(exc)) from exc
        if not decision.terms:  # (a rejection before any candidate was weighed)
            return decision
        return replace(decision, terms={**decision.terms, **tier_terms(self.cluster, view)})

    def finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        """Record a completion once per request id; returns transfers to start now."""
        self.limits.check_hashes(done.block_hashes)
        key = str(done.request_id)
        if key in self._finished:
            return ()
        plans = recording.finish(self.cluster, self.policy, done, now)
        if not self.runs_engine_orders:
            plans = [p for p in plans if p.kind not in ENGINE_ORDERS]
        self._finished.add(key, None)
        if done.session_id:
            self._session_changed(done.session_id)
        return tuple(self.transfers.open(plan) for plan in plans)

    def transfer_done(
        self, transfer_id: str, ok: bool, now: float, *, nbytes: int = 0, seconds: float = 0.0
    ) -> bool:
        """Record a transfer's outcome, and what it measured (`nbytes` in `seconds` of policy
        time) for the cost model; returns whether a session moved. Raises RequestError for
        an unknown or already reported transfer."""
        plan = self.transfers.close(transfer_id)
        if plan is None:
            raise RequestError("not_found", f"unknown or already reported transfer {transfer_id!r}")
        # A hand-off's time includes the prefill it overlaps: no bandwidth to learn from it.
        if ok and nbytes > 0 and seconds > 0 and plan.kind is not TransferKind.HANDOFF:
            cluster = self.cluster
            cluster.cost = cluster.cost.with_measured_transfer(
                plan.source, plan.target, nbytes, seconds
            )
        moved = recording.transfer_ended(self.cluster, self.policy, plan, ok, now)
        if moved and plan.session_id:
            self.migrations += 1
            self._session_changed(plan.session_id)
        return moved

    # ---- sessions ----------------------------------------------------------------------

    def restore_session(self, session: Session) -> None:
        """Put back a session read from the durable copy (not observed again)."""
        self.cluster.sessions.restore(session)

    def forget_session(self, session_id: str) -> None:
        """Drop a session the durable copy no longer has (not observed again)."""
        self.cluster.sessions.forget(session_id)

    def forget_idle_sessions(self, now: float, ttl_s: float, max_sessions: int = 0) -> list[str]:
        """Forget the sessions idle for `ttl_s` (0: none) and, over `max_sessions` (0: no
        cap), the least recently active idle ones; the observer is told of each. Returns
        their ids. A forgotten session's next turn starts it afresh. The simulator never
        calls this, so its decisions do not depend on it."""
        gone = self.cluster.sessions.forget_idle(now, ttl_s, max_sessions)
        if self.observer is not None:
            for session_id in gone:
                self.observer.session_forgotten(session_id)
        return gone

    def _evicted(self, session_ids: list[str]) -> None:
        self.sessions_evicted += len(session_ids)
        if self.observer is not None:
            for session_id in session_ids:
                self.observer.session_forgotten(session_id)

    def _session_changed(self, session_id: str) -> None:
        if self.observer is None:
            return
        session = self.cluster.sessions.get(session_id)
        if session is not None:
            self.observer.session_changed(session)
