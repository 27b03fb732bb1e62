"""What the Conductor keeps in etcd, queued: an outbox of coalesced writes, and the observer
that turns what the core applies (blocks stored and removed, sessions changed) into them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from kvsched.core.sessions import NO_HOST, Session
from services.conductor import keys

# One queued write: key, value (None deletes), lease (0: none), and the place it was queued at.
Write = tuple[str, bytes | None, int, int]


@dataclass(slots=True)
class Outbox:
    """Pending etcd writes, coalesced: the last write to a key wins, in the place of its first.
    Session bindings are queued apart (`sessions`): a flush round writes them all first, so a
    placement waits for its binding only, never for the block records queued before it. The
    other records (`records`) go in rounds from the oldest; a cursor queued with `put_last`
    goes after every record queued before it (the blocks it counts). Places only grow, so
    `oldest` tells which writes queued so far are still pending."""

    records: OrderedDict[str, tuple[bytes | None, int, int]] = field(default_factory=OrderedDict)
    sessions: OrderedDict[str, tuple[bytes | None, int, int]] = field(default_factory=OrderedDict)
    queued: int = 0  # writes ever queued: the place the next one takes

    def _box(self, key: str) -> OrderedDict[str, tuple[bytes | None, int, int]]:
        return self.sessions if key.startswith(keys.SESSIONS) else self.records

    def _queue(self, key: str, value: bytes | None, lease: int) -> None:
        box = self._box(key)
        old = box.get(key)
        if old is None:
            box[key] = (value, lease, self.queued)
            self.queued += 1
        else:
            box[key] = (value, lease, old[2])

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self._queue(key, value, lease)

    def delete(self, key: str) -> None:
        self._queue(key, None, 0)

    def put_last(self, key: str, value: bytes, lease: int = 0) -> None:
        """Queue a write after every write queued so far (its earlier one, if any, dropped)."""
        self._box(key).pop(key, None)
        self._queue(key, value, lease)

    @property
    def bindings(self) -> int:
        """Session bindings pending: the writes placements add (block records are bounded by
        the index itself)."""
        return len(self.sessions)

    def take(self, records: int | None = None) -> list[Write]:
        """Every pending session binding, then the oldest `records` other writes (all when
        None), in that order; they are no longer pending."""
        batch = [(k, v, lease, at) for k, (v, lease, at) in self.sessions.items()]
        self.sessions.clear()
        box = self.records
        if records is None or records >= len(box):
            batch += [(k, v, lease, at) for k, (v, lease, at) in box.items()]
            box.clear()
            return batch
        for _ in range(records):
            k, (v, lease, at) = box.popitem(last=False)
            batch.append((k, v, lease, at))
        return batch

    def restore(self, batch: Sequence[Write]) -> None:
        """Queue again, in their places, writes `take` gave that etcd did not take; newer
        writes to the same keys, queued since, win."""
        for key, value, lease, at in reversed(batch):
            box = self._box(key)
            if key not in box:
                box[key] = (value, lease, at)
                box.move_to_end(key, last=False)

    def oldest(self) -> int:
        """The place of the oldest write still pending (`queued` when none is): every write
        queued before it has been taken."""
        heads = [next(iter(box.values()))[2] for box in (self.records, self.sessions) if box]
        return min(heads, default=self.queued)

    def __len__(self) -> int:
        return len(self.records) + len(self.sessions)


# An instance's id and lease by slot; None for a free slot.
Holder = Callable[[int], "tuple[str, int] | None"]


class EtcdRecords:
    """The core's `IndexObserver`: queues the etcd records of what it applied. Blocks are
    bound to their instance's lease (they go with it); `persist_blocks` False keeps only
    sessions (an index rebuilt from the engines' own replay instead)."""

    def __init__(self, outbox: Outbox, holder: Holder, *, persist_blocks: bool = True) -> None:
        self.outbox = outbox
        self.holder = holder
        self.persist_blocks = persist_blocks

    def stored(self, slot: int, event: BlocksStored) -> None:
        found = self.holder(slot) if self.persist_blocks else None
        if found is None:
            return
        iid, lease = found
        put, parent = self.outbox.put, event.parent
        for h in event.hashes:
            put(keys.block_key(iid, event.tier, h), keys.encode_parent(parent), lease)
            parent = h

    def removed(self, slot: int, tier: Tier, hashes: Sequence[int]) -> None:
        found = self.holder(slot) if self.persist_blocks else None
        if found is None:
            return
        iid = found[0]
        for h in hashes:
            self.outbox.delete(keys.block_key(iid, tier, h))

    def session_changed(self, session: Session) -> None:
        found = self.holder(session.host) if session.host != NO_HOST else None
        host = found[0] if found is not None else None
        self.outbox.put(keys.session_key(session.session_id), keys.encode_session(session, host))

    def session_forgotten(self, session_id: str) -> None:
        self.outbox.delete(keys.session_key(session_id))
