"""KV memory claimed by active sessions on each instance.

A session that ran a turn recently will come back for its context: its tokens count against
its host's KV capacity until it has been idle for the active window. LRU eviction cannot tell a
session thinking between turns from one that ended, so placement has to.
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt

from kvsched.core.sessions import SessionTable


class ResidentSessions:
    """Per-instance context tokens of sessions active within `window_s`."""

    def __init__(self, n: int, window_s: float) -> None:
        self.tokens: npt.NDArray[np.float64] = np.zeros(n)
        self._claims: dict[str, tuple[int, float]] = {}  # session -> (host, tokens)
        self._expiry: list[tuple[float, str]] = []
        self.window_s = window_s

    def claim(self, session_id: str, host: int, tokens: float, now: float) -> None:
        """`session_id` now keeps about `tokens` of KV on `host` (replacing its old claim)."""
        old = self._claims.get(session_id)
        if old is not None:
            self.tokens[old[0]] -= old[1]
        self._claims[session_id] = (host, tokens)
        self.tokens[host] += tokens
        heapq.heappush(self._expiry, (now + self.window_s, session_id))

    def expire(self, now: float, sessions: SessionTable) -> None:
        """Drop the claims of sessions idle for longer than the window."""
        while self._expiry and self._expiry[0][0] <= now:
            _, sid = heapq.heappop(self._expiry)
            session = sessions.get(sid)
            last = max(session.last_finish_at, session.last_arrival_at) if session else -np.inf
            if last + self.window_s <= now and sid in self._claims:
                host, tokens = self._claims.pop(sid)
                self.tokens[host] -= tokens
