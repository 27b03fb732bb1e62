"""Warm standby state for KV events: the batches Messengers mirror to a standby, kept per
instance in sequence order until etcd counts them, to be applied by this Conductor should it
take over (the dead leader had applied them, but its write-behind had not yet made them
durable). Pure: no I/O; the caller passes each instance's cursor and lease as it knows them.

What is kept is only ever a shortcut: a batch is applied at takeover only where it continues
the instance's cursor in etcd without a gap, under the lease it was kept with; anything else
is sent again by the Messenger from the new leader's resume point, as without a mirror.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

DEFAULT_KEPT_BATCHES = 512  # per instance: a few seconds of events, far beyond a flush


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where an instance's events stand as this Conductor knows them: the sequence the next
    batch must carry, and the lease the instance is registered under."""

    next_sequence: int
    lease_id: int


@dataclass(slots=True)
class MirrorCounters:
    """What happened to the mirrored batches this Conductor received."""

    kept: int = 0  # kept (for now)
    durable: int = 0  # already counted by the instance's cursor: not kept, or let go
    unknown: int = 0  # of an instance this Conductor does not know: not kept
    pushed_out: int = 0  # let go, oldest first, by an instance over the cap


class _Kept:
    """One instance's batches: contiguous sequences, one lease, oldest first."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self.batches: deque[pb.KvEventBatch] = deque()


class MirroredBatches:
    """The batches kept for takeover, per instance. `keep` as they come (a standby), `take`
    once elected; both change only this object."""

    def __init__(self, max_per_instance: int = DEFAULT_KEPT_BATCHES) -> None:
        if max_per_instance < 1:
            raise ValueError("max_per_instance must be at least 1")
        self.max_per_instance = max_per_instance
        self._kept: dict[str, _Kept] = {}
        self.counters = MirrorCounters()

    def __len__(self) -> int:
        return sum(len(k.batches) for k in self._kept.values())

    def kept(self, instance_id: str) -> list[int]:
        """The sequences kept for an instance, oldest first."""
        entry = self._kept.get(instance_id)
        return [] if entry is None else [b.sequence for b in entry.batches]

    def keep(self, batch: pb.KvEventBatch, cursor: Cursor | None) -> bool:
        """Keep a mirrored batch unless `cursor` (None: the instance is unknown) already counts
        it. A resync batch, a new lease or a break in the sequence starts the instance's
        batches over from this one (what came before no longer continues to it). Past the cap
        the oldest go. Returns whether it was kept."""
        counters = self.counters
        iid = batch.instance_id
        if cursor is None:
            counters.unknown += 1
            self._kept.pop(iid, None)
            return False
        if batch.sequence < cursor.next_sequence:
            counters.durable += 1
            return False
        entry = self._kept.get(iid)
        if (
            entry is None
            or entry.lease_id != cursor.lease_id
            or batch.resync
            or not entry.batches
            or batch.sequence != entry.batches[-1].sequence + 1
        ):
            entry = self._kept[iid] = _Kept(cursor.lease_id)
        entry.batches.append(batch)
        counters.kept += 1
        self._let_go(entry, cursor.next_sequence)
        if len(entry.batches) > self.max_per_instance:
            entry.batches.popleft()
            counters.pushed_out += 1
        return True

    def _let_go(self, entry: _Kept, next_sequence: int) -> None:
        while entry.batches and entry.batches[0].sequence < next_sequence:
            entry.batches.popleft()
            self.counters.durable += 1

    def take(self, cursor_of: Callable[[str], Cursor | None]) -> dict[str, list[pb.KvEventBatch]]:
        """Empty the store, returning per instance the batches that continue its cursor
        (`cursor_of`, from etcd: None for an instance no longer registered) without a gap,
        under the lease they were kept with, in sequence order. A resync batch continues any
        cursor (the leader would take it at any sequence)."""
        kept, self._kept = self._kept, {}
        out: dict[str, list[pb.KvEventBatch]] = {}
        for iid, entry in kept.items():
            cursor = cursor_of(iid)
            if cursor is None or cursor.lease_id != entry.lease_id:
                continue
            self._let_go(entry, cursor.next_sequence)
            if not entry.batches:
                continue
            first = entry.batches[0]
            if first.sequence == cursor.next_sequence or first.resync:
                out[iid] = list(entry.batches)  # contiguous by construction
        return out

    def clear(self) -> None:
        """Forget everything kept (a leader keeps nothing)."""
        self._kept.clear()
