"""Session bindings: which instance hosts a session's KV, and its migration history."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

NO_HOST = -1


@dataclass(slots=True)
class Session:
    """Mutable per-session record (hot: one lookup per request)."""

    session_id: str
    host: int = NO_HOST
    turns: int = 0
    last_arrival_at: float = float("-inf")
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

    def __init__(self, gap_smoothing: float = 0.5) -> None:
        self._sessions: dict[str, Session] = {}
        self._alpha = gap_smoothing
        self.bound: dict[int, int] = {}  # host -> sessions bound to it

    def bound_on(self, host: int) -> int:
        return self.bound.get(host, 0)

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def arrive(self, session_id: str, now: float) -> Session:
        """The session's next turn arrived: create the record if new, learn the idle gap."""
        s = self._sessions.get(session_id)
        if s is None:
            s = self._sessions[session_id] = Session(session_id)
        elif s.last_finish_at > float("-inf"):
            gap = max(0.0, now - s.last_finish_at)
            s.idle_gap_s = (
                gap if s.idle_gap_s < 0 else (self._alpha * gap + (1 - self._alpha) * s.idle_gap_s)
            )
        s.turns += 1
        s.last_arrival_at = now
        return s

    def finish(
        self, session_id: str, hashes: tuple[int, ...], prompt: int, output: int, now: float
    ) -> None:
        """A turn ended: remember its context and how much the prompt grew."""
        s = self._sessions.get(session_id)
        if s is None:
            return
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
            s = self._sessions[session_id] = Session(session_id)
        if migrated and s.host != host:
            s.last_migration_at = now
            s.migrations += 1
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
            s = self._sessions[session_id] = Session(session_id)
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
        """Drop the sessions idle for `ttl_s` (0: none), then, while more than `max_sessions`
        (0: no cap) remain, the least recently active of those with no turn or copy in flight
        (ties by id). Returns the ids dropped, in that order."""
        table = self._sessions
        gone = (
            sorted(sid for sid, s in table.items() if s.forgettable(now, ttl_s))
            if ttl_s > 0
            else []
        )
        for sid in gone:
            self._drop(sid)
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

    def _drop(self, session_id: str) -> None:
        s = self._sessions.pop(session_id)
        if s.host != NO_HOST:
            self.bound[s.host] -= 1

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
