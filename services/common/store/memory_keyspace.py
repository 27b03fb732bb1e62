"""`MemoryKeyspace`: what one etcd cluster holds, in process memory: keys, leases, the revision
and the history of changes. `MemoryStore` handles (`services.common.store.memory`) read and
write it as `EtcdStore`s read and write one etcd.

Every method is synchronous, so each one is atomic under asyncio, and applies lease expiry
first: a lease whose deadline on `clock` has passed is gone, its keys deleted in one revision
(as etcd revokes it), before anything else is read or written.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.store.etcd.transactions import check_prefix
from services.common.store.interface import (
    Delete,
    DeletePrefix,
    KeyValue,
    Lease,
    LeaseNotFound,
    Op,
    Put,
    WatchEvent,
)


@dataclass(slots=True)
class _Lease:
    ttl_s: int
    deadline: float  # on the keyspace's clock
    keys: set[bytes] = field(default_factory=set)


class MemoryKeyspace:
    """Keys, leases, revisions and history, with etcd's rules: the keyspace starts at
    revision 1; a transaction that changes something bumps it by one (a put always does,
    deleting a missing key does not) and every key keeps the revision that last wrote it.
    Leases last at least `min_lease_ttl_s` on `clock` (seconds; `time.monotonic` unless a
    test injects its own and calls `expire_leases()` after moving it)."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, min_lease_ttl_s: int = 1
    ) -> None:
        self.clock = clock
        self.min_lease_ttl_s = min_lease_ttl_s
        self.revision = 1
        self.compacted = 0
        """Watches from an earlier revision raise `StoreCompacted` (see `compact`)."""
        self._kvs: dict[bytes, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._last_lease = 0
        self._history: list[WatchEvent] = []
        self._changed = asyncio.Event()

    # ---- reads

    def get(self, key: bytes) -> KeyValue | None:
        self.expire_leases()
        return self._kvs.get(key)

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under `prefix`, sorted by key."""
        self.expire_leases()
        return [self._kvs[key] for key in self._keys_under(prefix)]

    def _keys_under(self, prefix: bytes) -> list[bytes]:
        return sorted(key for key in self._kvs if key.startswith(prefix))

    # ---- writes

    def apply(self, ops: Sequence[Op]) -> int:
        """One transaction: every op or none (`LeaseNotFound` when a put names a lease that
        does not exist, `ValueError` for the empty prefix). Returns the revision after it."""
        self.expire_leases()
        for op in ops:
            if isinstance(op, DeletePrefix):
                check_prefix(op.prefix)
            elif isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise LeaseNotFound(f"memory store: put {op.key!r}: requested lease not found")
        return self._write(ops)

    def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Write `key` only if it does not exist; True if this call created it."""
        if self.get(key) is not None:
            return False
        self.apply([Put(key, value, lease)])
        return True

    def _write(self, ops: Sequence[Op]) -> int:
        revision = self.revision + 1
        events: list[WatchEvent] = []
        for op in ops:
            if isinstance(op, Put):
                self._put(op, revision)
                events.append(WatchEvent("put", op.key, op.value, revision))
                continue
            keys = [op.key] if isinstance(op, Delete) else self._keys_under(op.prefix)
            for key in keys:
                if self._delete(key):
                    events.append(WatchEvent("delete", key, b"", revision))
        if events:
            self.revision = revision
            self._history.extend(events)
            self.notify()
        return self.revision

    def _put(self, op: Put, revision: int) -> None:
        old = self._kvs.get(op.key)
        if old is not None and old.lease and old.lease != op.lease:
            self._leases[old.lease].keys.discard(op.key)
        if op.lease:
            self._leases[op.lease].keys.add(op.key)
        self._kvs[op.key] = KeyValue(op.key, op.value, op.lease, revision)

    def _delete(self, key: bytes) -> bool:
        old = self._kvs.pop(key, None)
        if old is None:
            return False
        if old.lease:
            self._leases[old.lease].keys.discard(key)
        return True

    # ---- leases

    def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease of `ttl_s` (at least `min_lease_ttl_s`) seconds."""
        self.expire_leases()
        ttl = max(ttl_s, self.min_lease_ttl_s)
        self._last_lease += 1
        self._leases[self._last_lease] = _Lease(ttl, self.clock() + ttl)
        return Lease(self._last_lease, ttl)

    def keep_alive(self, lease_id: int) -> int:
        """Restart the lease's TTL; returns it, 0 if the lease is gone."""
        self.expire_leases()
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0
        lease.deadline = self.clock() + lease.ttl_s
        return lease.ttl_s

    def revoke_lease(self, lease_id: int) -> bool:
        """End the lease and delete its keys (one revision); False if it did not exist."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._write([Delete(key) for key in sorted(lease.keys)])
        del self._leases[lease_id]
        return True

    def lease_ttl(self, lease_id: int) -> int:
        """Whole seconds left (truncated, as etcd reports them); -1 for a missing lease."""
        self.expire_leases()
        lease = self._leases.get(lease_id)
        return -1 if lease is None else max(0, int(lease.deadline - self.clock()))

    def expire_leases(self) -> None:
        """Revoke every lease whose deadline has passed on the clock."""
        now = self.clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self.revoke_lease(lease_id)

    def until_next_expiry(self) -> float | None:
        """Seconds on the clock until the next lease deadline; None without leases."""
        if not self._leases:
            return None
        return max(0.0, min(lease.deadline for lease in self._leases.values()) - self.clock())

    # ---- history

    @property
    def changed(self) -> asyncio.Event:
        """Set at the next change (or `notify`); take it before reading what to wait for."""
        return self._changed

    def notify(self) -> None:
        """Wake everyone waiting on `changed`."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def events_from(self, revision: int) -> list[WatchEvent]:
        """Every change at `revision` or later, in order (whole revisions only)."""
        start = bisect.bisect_left(self._history, revision, key=lambda ev: ev.revision)
        return self._history[start:]

    def compact(self, revision: int) -> None:
        """Forget the changes before `revision`, as etcd's compaction does."""
        self.compacted = max(self.compacted, revision)
        start = bisect.bisect_left(self._history, self.compacted, key=lambda ev: ev.revision)
        del self._history[:start]
