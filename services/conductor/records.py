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


@dataclass(slots=True)
class Outbox:
    """Pending etcd writes, coalesced: the last write to a key wins, order of first write
    kept. `None` means delete. `bindings` counts the session keys among them: the writes
    placements add (block records are bounded by the index itself)."""

    writes: OrderedDict[str, tuple[bytes | None, int]] = field(default_factory=OrderedDict)
    bindings: int = 0

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self._count(key)
        self.writes[key] = (value, lease)

    def delete(self, key: str) -> None:
        self._count(key)
        self.writes[key] = (None, 0)

    def take(self) -> list[tuple[str, bytes | None, int]]:
        batch = [(k, v, lease) for k, (v, lease) in self.writes.items()]
        self.writes.clear()
        self.bindings = 0
        return batch

    def restore(self, batch: Sequence[tuple[str, bytes | None, int]]) -> None:
        """Queue again a batch `take` gave that etcd did not take; newer writes to the same
        keys, queued since, win."""
        for key, value, lease in batch:
            if key not in self.writes:
                self._count(key)
                self.writes[key] = (value, lease)

    def _count(self, key: str) -> None:
        if key.startswith(keys.SESSIONS) and key not in self.writes:
            self.bindings += 1

    def __len__(self) -> int:
        return len(self.writes)


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
