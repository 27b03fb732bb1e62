"""Where the Conductor last placed each session, as this Router saw it: the fallback sends a
session's turn there while the Conductor does not answer (a leader change), so the turn finds
its KV cache instead of going to the session's hash instance. Bounded: the least recently
placed sessions are forgotten first (they fall back to the hash)."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 100_000  # about 10 MB of ids at most


class SessionHosts:
    """Session id → the instance the Conductor last placed it on, at most `capacity` of them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, not {capacity}")
        self.capacity = capacity
        self._hosts: OrderedDict[str, str] = OrderedDict()

    def placed(self, session_id: str, instance_id: str) -> None:
        """The Conductor placed `session_id` on `instance_id`: remember it, most recent last."""
        if not session_id or not self.capacity:
            return
        self._hosts[session_id] = instance_id
        self._hosts.move_to_end(session_id)
        while len(self._hosts) > self.capacity:
            self._hosts.popitem(last=False)

    def host(self, session_id: str) -> str | None:
        """The instance the Conductor last placed the session on; None if not remembered."""
        return self._hosts.get(session_id)

    def __len__(self) -> int:
        return len(self._hosts)
