"""KV event batches in sequence: each instance numbers its batches, and a batch is applied
only in its place, so a lost batch is noticed and resent instead of leaving the index wrong.
Where each instance's sequence stands is kept in etcd (its cursor), bound to its lease."""

from __future__ import annotations

from collections.abc import Sequence

from kvsched.core.events import AllBlocksCleared, KvEvent
from kvsched.core.requests import RequestError
from services.conductor import keys
from services.conductor.records import Outbox
from services.conductor.state import ConductorState


class EventCursors:
    """Applies KV event batches to `state` in each instance's sequence; queues the cursors
    in `outbox`."""

    def __init__(self, state: ConductorState, outbox: Outbox) -> None:
        self.state = state
        self.outbox = outbox

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
        self.save(instance_id)
        return inst.next_sequence

    def save(self, instance_id: str) -> None:
        """Queue the instance's cursor, bound to its current lease, after every write queued
        so far: a flush cut into several transactions writes the cursor only after the blocks
        of the batches it counts, so a leader that dies mid-flush never leaves a cursor past
        blocks etcd lacks (the next leader asks for those batches again)."""
        inst = self.state.instance(instance_id)
        lease, key = inst.record.lease_id, keys.cursor_key(instance_id)
        self.outbox.put(key, str(inst.next_sequence).encode(), lease)
        self.outbox.writes.move_to_end(key)
