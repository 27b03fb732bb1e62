"""Session bindings: which instance hosts a session's KV, and its migration history; and
how many sessions each tenant keeps.

A session's tenant is what its id holds before the first `/`: the Router scopes every
session id so (`tenant/session`; a tenant name has no `/`). An id without one is tenant "".
With a cap per tenant (`SessionTable.max_per_tenant`), a tenant's new session makes room by
forgetting that tenant's least recently touched idle session (no turn or copy in flight): a
tenant that floods fresh session ids churns only its own sessions, never another tenant's,
and no request is refused for it (a session is a placement hint, not a resource the client
holds; the forgotten one's next turn starts it afresh). Touched: a turn arrived or ended, a
copy of its KV started, it was bound elsewhere. When every session of the tenant is busy,
the new one is kept over the cap (by at most the tenant's turns in flight), and the next
sweep (`forget_idle`) trims the tenant back.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvsched.core.decision import RequestId

NO_HOST = -1


def tenant_of(session_id: str) -> str:
    """The tenant a session id is scoped to: what precedes its first `/` ("" if none)."""
    return session_id.partition("/")[0] if "/" in session_id else ""


@dataclass(slots=True)
class Session:
    """Mutable per-session record (hot: one lookup per request)."""

    session_id: str
    host: int = NO_HOST
    turns: int = 0
    last_arrival_at: float = float("-inf")
    # The last turn that arrived: an earlier turn's end, reported after it arrived, is not
    # the end of the session's activity (its finish report raced the agent's next call).
    last_request: RequestId | None = None
    last_finish_at: float = float("-inf")
    last_migration_at: float = float("-inf")
    migrations: int = 0
    context_hashes: tuple[int, ...] = ()  # the last prompt's block hashes
    context_tokens: int = 0  # the last prompt plus its output
    prompt_tokens: int = 0  # the last prompt
    growth_tokens: float = -1.0  # smoothed new prompt tokens per turn; -1 unknown
    idle_gap_s: float = -1.0  # smoothed gap between a finish and the next arrival; -1 unknown
    pending_target: int = NO_HOST  # a copy of its KV in flight to this slot
    pending_since: float = float("inf")  # when that copy started
    pending_on_path: bool = False  # the copy is on a turn's critical path (the turn runs there)
    # The last turn arrived while an earlier one was still running (an agent's parallel calls).
    parallel_arrival: bool = False
    adapter: str = ""  # the LoRA adapter its last turn ran with ("": the base model)

    def in_cooldown(self, now: float, cooldown_s: float) -> bool:
        return now - self.last_migration_at < cooldown_s

    @property
    def last_active_at(self) -> float:
        """The last time anything happened to it: a turn arrived or ended, a copy started."""
        pending = self.pending_since if self.pending_target != NO_HOST else float("-inf")
        return max(self.last_arrival_at, self.last_finish_at, self.last_migration_at, pending)

    @property
    def busy(self) -> bool:
        """A turn (arrived, not ended) or a copy of its KV is in flight."""
        return self.pending_target != NO_HOST or self.last_arrival_at > self.last_finish_at

    def forgettable(self, now: float, ttl_s: float) -> bool:
        """Whether it may be forgotten now when idle for `ttl_s`: no copy of its KV in
        flight, no turn in flight, and nothing happened for `ttl_s`. A turn whose end never
        came (rejected, or its Router died) holds it for at most one more `ttl_s`."""
        if self.pending_target != NO_HOST:
            return False
        idle_since = self.last_active_at
        if self.last_arrival_at > self.last_finish_at:  # a turn in flight
            idle_since = self.last_arrival_at + ttl_s
        return now - idle_since >= ttl_s


class SessionTable:
    """All sessions by id. Changes only through the methods below."""

    def __init__(self, gap_smoothing: float = 0.5, max_per_tenant: int = 0) -> None:
        """`max_per_tenant`: the most sessions one tenant keeps (0: no cap; see the module
        docstring)."""
        if max_per_tenant < 0:
            raise ValueError("the sessions cap per tenant must be 0 (none) or positive")
        self._sessions: dict[str, Session] = {}
        self._alpha = gap_smoothing
        self.bound: dict[int, int] = {}  # host -> sessions bound to it
        self.max_per_tenant = max_per_tenant
        # tenant -> its session ids, least recently touched first (a dict keeps its order)
        self._tenants: dict[str, dict[str, None]] = {}
        self._evicted: list[str] = []  # forgotten to make room, not yet taken

    def per_tenant(self, tenant: str) -> int:
        """How many sessions `tenant` has."""
        return len(self._tenants.get(tenant, ()))

    def take_evicted(self) -> list[str]:
        """The ids forgotten to make room for a tenant's new sessions since the last call, in
        that order (the caller deletes their durable records)."""
        out, self._evicted = self._evicted, []
        return out

    def _create(self, session_id: str) -> Session:
        s = self._sessions[session_id] = Session(session_id)
        self._tenants.setdefault(tenant_of(session_id), {})[session_id] = None
        return s

    def _touch(self, session_id: str) -> None:
        """Move the session to the recent end of its tenant's order."""
        order = self._tenants[tenant_of(session_id)]
        del order[session_id]
        order[session_id] = None

    def _make_room(self, tenant: str) -> None:
        """Forget `tenant`'s least recently touched idle session while it has the most it may
        keep (see the module docstring)."""
        order = self._tenants.get(tenant)
        if self.max_per_tenant <= 0 or order is None or len(order) < self.max_per_tenant:
            return
        idle = next((sid for sid in order if not self._sessions[sid].busy), None)
        if idle is not None:
            self._drop(idle)
            self._evicted.append(idle)

    def bound_on(self, host: int) -> int:
        return self.bound.get(host, 0)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def arrive(self, session_id: str, now: float, request_id: RequestId | None = None) -> Session:
        """The session's next turn (`request_id`) arrived: create the record if new (a tenant
        at its cap makes room first: see the module docstring), learn the idle gap."""
        s = self._sessions.get(session_id)
        if s is None:
            self._make_room(tenant_of(session_id))
            s = self._create(session_id)
        else:
            self._touch(session_id)
        if s.last_finish_at > float("-inf"):
            gap = max(0.0, now - s.last_finish_at)
            s.idle_gap_s = (
                gap if s.idle_gap_s < 0 else (self._alpha * gap + (1 - self._alpha) * s.idle_gap_s)
            )
        s.turns += 1
        s.parallel_arrival = s.last_arrival_at > s.last_finish_at
        s.last_arrival_at = now
        s.last_request = request_id
        return s

    def finish(
        self, session_id: str, hashes: tuple[int, ...], prompt: int, output: int, now: float
    ) -> None:
        """A turn ended: remember its context and how much the prompt grew."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        self._touch(session_id)
        if s.prompt_tokens:
            growth = max(prompt - s.prompt_tokens, 0)
            s.growth_tokens = (
                growth
                if s.growth_tokens < 0
                else (self._alpha * growth + (1 - self._alpha) * s.growth_tokens)
            )
        s.last_finish_at = now
        s.context_hashes = hashes
        s.prompt_tokens = prompt
        s.context_tokens = prompt + output

    def bind(self, session_id: str, host: int, now: float, migrated: bool) -> None:
        """Point the session at `host`; a migration starts its cooldown."""
        s = self._sessions.get(session_id)
        if s is None:
            s = self._create(session_id)
        if migrated and s.host != host:
            s.last_migration_at = now
            s.migrations += 1
            self._touch(session_id)
        if s.host != host:
            if s.host != NO_HOST:
                self.bound[s.host] -= 1
            self.bound[host] = self.bound.get(host, 0) + 1
        s.host = host
        self._clear_move(s)

    @staticmethod
    def _clear_move(s: Session) -> None:
        s.pending_target, s.pending_since, s.pending_on_path = NO_HOST, float("inf"), False

    def restore(self, session: Session) -> None:
        """Put back a session record saved elsewhere (a Conductor's warm start); replaces any
        record of the same id."""
        old = self._sessions.get(session.session_id)
        if old is not None and old.host != NO_HOST:
            self.bound[old.host] -= 1
        if old is None:
            self._tenants.setdefault(tenant_of(session.session_id), {})[session.session_id] = None
        self._sessions[session.session_id] = session
        if session.host != NO_HOST:
            self.bound[session.host] = self.bound.get(session.host, 0) + 1

    def begin_move(
        self, session_id: str, target: int, now: float, *, on_path: bool = False
    ) -> None:
        """A copy of the session's KV to `target` started: while the session is idle, or
        (`on_path`) for the turn arriving now, which runs on `target`. The session stays bound
        to its host until `end_move`."""
        s = self._sessions.get(session_id)
        if s is None:
            s = self._create(session_id)
        else:
            self._touch(session_id)
        s.pending_target, s.pending_since, s.pending_on_path = target, now, on_path

    def end_move(self, session_id: str, target: int, ok: bool, now: float) -> bool:
        """The copy to `target` ended. The session moves there only if every block landed
        verified and, for an idle-gap copy, no turn ran meanwhile (its host then holds newer
        KV); otherwise it stays on its host, which still has its KV. A report for a copy not in
        flight moves nothing. Returns whether it moved."""
        s = self._sessions.get(session_id)
        if s is None or s.pending_target == NO_HOST or s.pending_target != target:
            return False
        moved = ok and (s.pending_on_path or s.last_arrival_at < s.pending_since)
        self._clear_move(s)
        if moved:
            self.bind(session_id, target, now, migrated=True)
        return moved

    def forget_idle(self, now: float, ttl_s: float, max_sessions: int = 0) -> list[str]:
        """Drop the sessions idle for `ttl_s` (0: none); then, of each tenant over
        `max_per_tenant`, its least recently touched idle ones until it is not; then, while
        more than `max_sessions` (0: no cap) remain, the least recently active of those with
        no turn or copy in flight (ties by id). Returns the ids dropped, in that order."""
        table = self._sessions
        gone = (
            sorted(sid for sid, s in table.items() if s.forgettable(now, ttl_s))
            if ttl_s > 0
            else []
        )
        for sid in gone:
            self._drop(sid)
        if self.max_per_tenant > 0:
            for tenant in sorted(self._tenants):
                gone += self._trim_tenant(tenant)
        excess = len(table) - max_sessions
        if max_sessions > 0 and excess > 0:
            idle = [(s.last_active_at, sid) for sid, s in table.items() if not s.busy]
            for _, sid in heapq.nsmallest(excess, idle):
                self._drop(sid)
                gone.append(sid)
        return gone

    def forget(self, session_id: str) -> bool:
        """Drop one session, whatever its state; returns whether it was known."""
        if session_id not in self._sessions:
            return False
        self._drop(session_id)
        return True

    def _trim_tenant(self, tenant: str) -> list[str]:
        """Drop `tenant`'s least recently touched idle sessions while it is over the cap."""
        order = self._tenants[tenant]
        excess = len(order) - self.max_per_tenant
        if excess <= 0:
            return []
        idle = [sid for sid in order if not self._sessions[sid].busy][:excess]
        for sid in idle:
            self._drop(sid)
        return idle

    def _drop(self, session_id: str) -> None:
        s = self._sessions.pop(session_id)
        if s.host != NO_HOST:
            self.bound[s.host] -= 1
        tenant = tenant_of(session_id)
        order = self._tenants[tenant]
        del order[session_id]
        if not order:
            del self._tenants[tenant]

    def unbind_host(self, host: int) -> int:
        """Drop every binding to `host` (the instance died); returns how many moved."""
        n = 0
        self.bound.pop(host, None)
        for s in self._sessions.values():
            if s.host == host:
                s.host = NO_HOST
                n += 1
                self._clear_move(s)  # a copy from a dead host cannot complete a move
            if s.pending_target == host:
                self._clear_move(s)
        return n
