"""KV event batches in sequence: each instance numbers its batches, and a batch is applied
only in its place, so a lost batch is noticed and resent instead of leaving the index wrong.
Where each instance's sequence stands is kept in etcd (its cursor), bound to its lease.

A batch that carries only load reports (what a Messenger sends every time an engine's load
changes, up to 20 times a second an engine, and at least every half second) changes nothing
etcd holds, so its cursor is not queued on its own: etcd's cursor may lag the applied one by
load-only batches, at most `MAX_LAGGING_BATCHES` of them and for at most `MAX_LAG_S` while
batches keep coming. Without that, every write-behind tick under load was a transaction of
cursors alone. After a takeover the lagging batches are applied again from the standby's
mirror or sent again by the Messenger (both keep far more: 512 and 1,024 batches an
instance), and applying a load report again only sets the load it already set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Final

from kvsched.core.events import AllBlocksCleared, KvEvent
from kvsched.core.load import LoadReport
from kvsched.core.requests import RequestError
from services.conductor import keys
from services.conductor.records import Outbox
from services.conductor.state import ConductorState

MAX_LAGGING_BATCHES: Final = 32  # load-only batches etcd's cursor may lag the applied one by
MAX_LAG_S: Final = 1.0  # how long a lagging cursor waits for a batch that writes it anyway


class EventCursors:
    """Applies KV event batches to `state` in each instance's sequence; queues the cursors
    in `outbox` (a load-only batch's within the bounds of the module docstring). `clock`
    (seconds, monotonic) times how long a cursor has lagged."""

    def __init__(
        self,
        state: ConductorState,
        outbox: Outbox,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.outbox = outbox
        self.clock = clock
        # Per instance whose etcd cursor lags: load-only batches not queued, since when.
        self._lagging: dict[str, tuple[int, float]] = {}

    def apply(
        self,
        instance_id: str,
        sequence: int,
        resync: bool,
        events: Sequence[KvEvent],
        *,
        merge: bool = False,
    ) -> int:
        """Apply one batch in order; returns the next expected sequence. A batch out of
        sequence is refused whole, naming where to resume. A resync batch restarts the
        sequence and replaces the instance's index, or, with `merge`, applies on top of it."""
        inst = self.state.instance(instance_id)
        expected = inst.next_sequence
        if not resync and sequence != expected:
            where = "in the past" if sequence < expected else "ahead (events were lost)"
            raise RequestError(
                "out_of_range",
                f"batch {sequence} for instance {instance_id!r} is {where}; "
                f"the next batch must carry sequence {expected}",
                next_sequence=expected,
            )
        if resync and not merge:
            events = [AllBlocksCleared(), *events]
        self.state.scheduler.apply(inst.slot, events)
        inst.next_sequence = sequence + 1
        if resync or not _load_only(events) or not self._may_lag(instance_id):
            self.save(instance_id)
        return inst.next_sequence

    def _may_lag(self, instance_id: str) -> bool:
        """Count one more load-only batch against the instance's lag; whether its cursor may
        stay unqueued for it (within both bounds)."""
        now = self.clock()
        skipped, since = self._lagging.get(instance_id, (0, now))
        if skipped >= MAX_LAGGING_BATCHES or now - since >= MAX_LAG_S:
            return False
        self._lagging[instance_id] = (skipped + 1, since)
        return True

    def save(self, instance_id: str) -> None:
        """Queue the instance's cursor, bound to its current lease, after every write queued
        so far: a flush cut into several transactions writes the cursor only after the blocks
        of the batches it counts, so a leader that dies mid-flush never leaves a cursor past
        blocks etcd lacks (the next leader asks for those batches again)."""
        self._lagging.pop(instance_id, None)
        inst = self.state.instance(instance_id)
        lease, key = inst.record.lease_id, keys.cursor_key(instance_id)
        self.outbox.put(key, str(inst.next_sequence).encode(), lease)
        self.outbox.writes.move_to_end(key)


def _load_only(events: Sequence[KvEvent]) -> bool:
    """Whether a batch's events are all load reports (none changes the index or etcd)."""
    return all(type(e) is LoadReport for e in events)
