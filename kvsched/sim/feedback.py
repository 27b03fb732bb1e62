"""What the simulated engines tell the scheduler, as the live services tell it: their cache
events (forwarded as a Messenger forwards vLLM's KV events) and their load reports."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from kvsched.core.events import BlocksRemoved, BlocksStored, KvEvent, split
from kvsched.core.scheduler import SchedulerPort
from kvsched.sim.clock import EventQueue
from kvsched.sim.engine import Engine
from kvsched.sim.meters import HotspotMeter


class EngineFeedback:
    """Carries each engine's cache events and load into the scheduler's view of it."""

    def __init__(
        self,
        engines: Sequence[Engine],
        scheduler: SchedulerPort,
        hotspot: HotspotMeter,
        max_blocks: int,
        clock: EventQueue,
    ) -> None:
        """`max_blocks`: the most blocks one forwarded event may name (the longest prompt)."""
        self._engines = engines
        self._scheduler = scheduler
        self._hotspot = hotspot
        self._max_blocks = max_blocks
        self._clock = clock

    def drain(self, slot: int) -> None:
        """Apply the engine's pending cache events to the scheduler's index, cut as a
        Messenger cuts them (no event longer than the longest prompt); empties the engine's
        event buffer."""
        engine = self._engines[slot]
        events = engine.cache.drain_events()
        if not events:
            return
        # As the replay always applied them: the stores of the window, then its removals.
        stored: list[KvEvent] = [e for e in events if isinstance(e, BlocksStored)]
        removals = [e for e in events if isinstance(e, BlocksRemoved)]
        if len(removals) == 1:  # the usual case (one eviction a step): the event as it is
            stored.append(removals[0])
        elif removals:
            stored.append(BlocksRemoved(tuple(chain.from_iterable(e.hashes for e in removals))))
        self._scheduler.apply(slot, list(split(stored, self._max_blocks)))
        if removals and engine.tier is not None:
            self._write_back(slot, removals)

    def _write_back(self, slot: int, removals: list[BlocksRemoved]) -> None:
        """The GPU of `slot` evicted blocks: its node's tier keeps them (`NodeTier.evicted`),
        and every instance of the node hears the tier moves, as a Messenger relays its node
        pool's events for each of its engines."""
        tier = self._engines[slot].tier
        assert tier is not None
        now = self._clock.now
        for e in removals:
            tier.evicted(slot, e.hashes, now)
        moves: list[KvEvent] = list(tier.drain_events())
        if moves:
            for node_slot in tier.slots:
                self._scheduler.apply(node_slot, list(split(moves, self._max_blocks)))

    def report(self, slot: int) -> None:
        """Send the engine's load report to the scheduler, and its pending prefill tokens and
        queued prefill seconds to the hotspot meter, as of now. The replay reports after
        every submission and step, so every change of the queue is seen when it happens."""
        engine = self._engines[slot]
        self._scheduler.apply(slot, (engine.report(),))
        hotspot, now = self._hotspot, self._clock.now
        hotspot.set(now, slot, float(engine.pending_tokens))
        if engine.queued_s != hotspot.queued[slot]:  # most steps leave the queue as it was
            hotspot.set_queued(now, slot, engine.queued_s)
