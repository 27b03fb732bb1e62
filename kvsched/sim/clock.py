"""The replay's virtual clock: events due at a time, handled in time order.

Events at the same time are handled in the order they were pushed, so a run is the same to
the bit every time it is replayed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

# What an event is, as small ints rather than an enum: the loop indexes its tuple of
# handlers with them once per event.
ARRIVE, STEP, WAKE, TRANSFER_DONE, PREFETCH_DUE = 0, 1, 2, 3, 4


class EventQueue:
    """The pending events, and `now`: the time of the event being handled."""

    __slots__ = ("_heap", "_seq", "handled", "now")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0  # the tie-break: never equal, so kinds and payloads are never compared
        self.now = 0.0
        self.handled = 0  # events handled, those of a run a handler ended by raising included

    def __bool__(self) -> bool:
        return bool(self._heap)

    def push(self, t: float, kind: int, payload: Any) -> None:
        """Schedule an event of `kind` at time `t`, after those already due at `t`."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def pop(self) -> tuple[int, Any]:
        """Take the earliest event and move `now` to its time; returns its kind and payload."""
        t, _, kind, payload = heapq.heappop(self._heap)
        self.now = t
        return kind, payload

    def discard(self, kind: int) -> int:
        """Drop every pending event of `kind`; returns how many. The others keep their order."""
        kept = [e for e in self._heap if e[2] != kind]
        dropped = len(self._heap) - len(kept)
        if dropped:
            heapq.heapify(kept)
            self._heap[:] = kept  # in place: `run` holds the list
        return dropped

    def run(self, handlers: Sequence[Callable[[Any], None]]) -> None:
        """Handle every event, those that handlers push included, until none is left or a
        handler raises: `handlers[kind](payload)` with `now` at the event's time. Adds how
        many ran to `handled`."""
        heap, pop = self._heap, heapq.heappop
        count = 0
        try:
            while heap:  # `pop`, inlined: this loop runs once per simulated event
                t, _, kind, payload = pop(heap)
                self.now = t
                count += 1
                handlers[kind](payload)
        finally:
            self.handled += count
