"""Migration accounting: how many sessions moved, what it cost, whether it broke the cooldown
and whether the moved sessions' next turns found their new host cool."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsched.core.decision import TransferPlan
from kvsched.sim.engine import Engine

# How many of a migrated session's next turns are followed to its new host.
FOLLOWED_TURNS = 3


@dataclass(slots=True)
class MigrationLog:
    """Migration accounting (DESIGN: count, bytes, downtime and critical path, cooldown,
    whether the target stayed cool)."""

    count: int = 0
    on_path: int = 0
    bytes: int = 0
    # Copy time a turn waited for; also the session's downtime, since a session stalls only
    # while a copy is on its turn's critical path (a copy in its idle gap stalls nothing).
    critical_path_s: float = 0.0
    failed: int = 0
    cooldown_violations: int = 0
    follow_turns: int = 0  # turns served on a migration target within 3 turns after
    follow_cool: int = 0  # ... of which found the target not hot
    # (start, source, target, session) of every migration, in order.
    events: list[tuple[float, int, int, str]] = field(default_factory=list)


class MigrationTracker:
    """Keeps a `MigrationLog` as migrations start or fail and migrated sessions' turns land."""

    def __init__(self, engines: Sequence[Engine], cooldown_s: float, hot_tokens: float) -> None:
        """`cooldown_s`: the policy's least time between two moves of a session; `hot_tokens`:
        the pending prefill tokens above which an instance is hot."""
        self.log = MigrationLog()
        self._engines = engines
        self._cooldown_s = cooldown_s
        self._hot_tokens = hot_tokens
        self._last_move: dict[str, float] = {}  # session -> when it last moved
        self._followed: dict[str, tuple[int, int]] = {}  # session -> (target, turns left)

    def started(
        self,
        plan: TransferPlan,
        nbytes: int,
        *,
        start: float,
        end: float,
        on_path: bool,
        now: float,
    ) -> None:
        """Log a migration decided at `now` whose copy runs from `start` to `end` (a turn
        waits for it when `on_path`), and follow its session's next turns."""
        log = self.log
        log.count += 1
        log.bytes += nbytes
        log.events.append((start, plan.source, plan.target, plan.session_id or ""))
        if on_path:
            log.on_path += 1
            log.critical_path_s += end - now
        if plan.session_id is not None:
            last = self._last_move.get(plan.session_id, -math.inf)
            if now - last < self._cooldown_s:
                log.cooldown_violations += 1
            self._last_move[plan.session_id] = now
            self._followed[plan.session_id] = (plan.target, FOLLOWED_TURNS)

    def failed(self) -> None:
        """Log a migration that could not start (no room on its target)."""
        self.log.failed += 1

    def turn_placed(self, session_id: str | None, slot: int) -> None:
        """A turn of `session_id` runs on `slot`: if the session moved lately, log whether
        the turn followed it to its new host and found that host cool."""
        if session_id is None or session_id not in self._followed:
            return
        target, left = self._followed[session_id]
        if slot == target:
            self.log.follow_turns += 1
            if self._engines[target].pending_tokens <= self._hot_tokens:
                self.log.follow_cool += 1
        if left <= 1:
            del self._followed[session_id]
        else:
            self._followed[session_id] = (target, left - 1)
