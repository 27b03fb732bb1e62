"""Coalescing one instance's Conductor events into few batches: fewer, larger messages on the
stream for a few milliseconds of delay."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

Cut = Callable[[list[pb.KvEvent], float | None], None]  # (events, oldest engine timestamp)


class Batcher:
    """Collects events and hands them to `cut` as one batch `window_s` after the first of
    them arrived, or at once when `max_events` are waiting. A load report rides with the
    next batch; only the latest one waiting is sent."""

    def __init__(self, cut: Cut, *, window_s: float = 0.005, max_events: int = 256) -> None:
        if window_s < 0 or max_events < 1:
            raise ValueError("need window_s >= 0 and max_events >= 1")
        self._cut = cut
        self.window_s = window_s
        self.max_events = max_events
        self._events: list[pb.KvEvent] = []
        self._load: pb.KvEvent | None = None
        self._oldest_ts: float | None = None
        self._arrived = asyncio.Event()

    def add(self, events: Sequence[pb.KvEvent], engine_ts: float | None = None) -> None:
        """Queue events (published by the engine at `engine_ts`); cuts full batches now."""
        if not events:
            return
        if engine_ts is not None and (self._oldest_ts is None or engine_ts < self._oldest_ts):
            self._oldest_ts = engine_ts
        self._events.extend(events)
        while len(self._events) >= self.max_events:
            head, self._events = self._events[: self.max_events], self._events[self.max_events :]
            ts, self._oldest_ts = self._oldest_ts, (engine_ts if self._events else None)
            self._cut(head, ts)
        self._arrived.set()

    def set_load(self, load: pb.KvEvent) -> None:
        """Send this load report with the next batch (replacing one still waiting)."""
        self._load = load
        self._arrived.set()

    def clear(self) -> None:
        """Drop everything waiting (a resync replaces it)."""
        self._events, self._load, self._oldest_ts = [], None, None
        self._arrived.clear()

    def flush(self) -> None:
        """Cut what is waiting now."""
        self._arrived.clear()
        events = self._events
        if self._load is not None:
            events.append(self._load)
        if not events:
            return
        ts = self._oldest_ts
        self._events, self._load, self._oldest_ts = [], None, None
        self._cut(events, ts)

    async def run(self) -> None:
        """Cut batches as their windows close, until cancelled."""
        while True:
            await self._arrived.wait()
            if self.window_s:
                await asyncio.sleep(self.window_s)
            self.flush()
