"""`MemoryStore`: the `Store` interface (`services.common.store.interface`) in process memory,
for tests and single-process runs, keeping the promises `EtcdStore` keeps:

* revisions, `snapshot` and `watch_prefix(prefix, revision + 1)` as etcd's (see
  `services.common.store.memory_keyspace`);
* `commit` cuts the ops into the transactions etcd would apply and drops puts bound to leases
  that no longer exist, counting them (the same loop as `EtcdStore`'s);
* leases expire on the keyspace's clock; a watch waiting past a lease deadline applies the
  expiry itself, so it sees the deletes as a watch on etcd does;
* `close()` ends this store's watches quietly; it can be used again afterwards.

Several `MemoryStore`s on one `MemoryKeyspace` see one keyspace, as several `EtcdStore`s see
one etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable, Sequence

from services.common.store.etcd.transactions import check_prefix, commit_planned
from services.common.store.interface import (
    CommitResult,
    Delete,
    DeletePrefix,
    Fenced,
    Guard,
    KeyValue,
    Lease,
    Op,
    Put,
    StoreCompacted,
    WatchEvent,
)
from services.common.store.memory_keyspace import MemoryKeyspace


class MemoryStore:
    """`Store` over a `MemoryKeyspace`: a private one on `clock` unless one is given."""

    def __init__(
        self, keyspace: MemoryKeyspace | None = None, *, clock: Callable[[], float] | None = None
    ) -> None:
        if keyspace is not None and clock is not None:
            raise ValueError("give a keyspace or a clock for a new one, not both")
        self.keyspace = keyspace or MemoryKeyspace(clock=clock or time.monotonic)
        self._closes = 0  # watches started before the latest close end

    async def connect(self) -> None:
        """Nothing to reach: always connected."""

    async def close(self) -> None:
        """End this store's open watches (quietly)."""
        self._closes += 1
        self.keyspace.notify()

    # Every call yields to the event loop once, as a call to etcd does: a caller looping on
    # store calls must not starve the other tasks.

    async def get(self, key: bytes) -> KeyValue | None:
        await asyncio.sleep(0)
        return self.keyspace.get(key)

    async def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under `prefix`, sorted by key."""
        await asyncio.sleep(0)
        return self.keyspace.get_prefix(prefix)

    async def snapshot(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, sorted by key, and the revision they were read at."""
        await asyncio.sleep(0)
        return self.keyspace.get_prefix(prefix), self.keyspace.revision

    async def revision(self) -> int:
        await asyncio.sleep(0)
        self.keyspace.expire_leases()
        return self.keyspace.revision

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write `key`; returns the new revision. `LeaseNotFound` if `lease` is gone."""
        return await self._txn([Put(key, value, lease)])

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Write `key` only if it does not exist; True if this call created it."""
        await asyncio.sleep(0)
        return self.keyspace.create(key, value, lease)

    async def delete(self, key: bytes) -> bool:
        """Delete `key`; True if it existed."""
        await asyncio.sleep(0)
        existed = self.keyspace.get(key) is not None
        self.keyspace.apply([Delete(key)])
        return existed

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under `prefix` (not b""); returns how many there were."""
        check_prefix(prefix)
        await asyncio.sleep(0)
        count = len(self.keyspace.get_prefix(prefix))
        self.keyspace.apply([DeletePrefix(prefix)])
        return count

    async def commit(self, ops: Sequence[Op], guard: Guard | None = None) -> CommitResult:
        """Apply `ops` in order in the transactions etcd would; puts bound to leases that no
        longer exist are dropped and counted. With `guard`, a transaction whose guard no
        longer holds raises `Fenced` and applies nothing."""
        return await commit_planned(ops, functools.partial(self._txn, guard=guard), self.lease_ttl)

    async def _txn(self, ops: Sequence[Op], guard: Guard | None = None) -> int:
        await asyncio.sleep(0)
        if guard is not None:
            held = self.keyspace.get(guard.key)
            if held is None or held.lease != guard.lease:
                raise Fenced(f"memory store: {guard.key!r} is no longer bound to the guard's lease")
        return self.keyspace.apply(ops)

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease of at least the keyspace's minimum TTL."""
        await asyncio.sleep(0)
        return self.keyspace.grant_lease(ttl_s)

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh the lease once; returns its TTL in seconds, 0 if the lease is gone."""
        await asyncio.sleep(0)
        return self.keyspace.keep_alive(lease_id)

    async def revoke_lease(self, lease_id: int) -> bool:
        """Revoke the lease (its keys are deleted); False if it did not exist."""
        await asyncio.sleep(0)
        self.keyspace.expire_leases()
        return self.keyspace.revoke_lease(lease_id)

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL in seconds; -1 if the lease does not exist (expired or revoked)."""
        await asyncio.sleep(0)
        return self.keyspace.lease_ttl(lease_id)

    async def watch_prefix(
        self, prefix: bytes, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Every change under `prefix` from `start_revision` (inclusive; None: changes after
        the first `__anext__`), in revision order, until cancelled, closed or this store is
        closed. Raises `StoreCompacted` if `start_revision` was compacted."""
        keyspace = self.keyspace
        closes = self._closes
        keyspace.expire_leases()
        next_revision = start_revision or keyspace.revision + 1
        while closes == self._closes:
            if next_revision < keyspace.compacted:
                raise StoreCompacted(
                    f"memory store: watch {prefix!r} from revision {next_revision} is compacted "
                    f"(oldest kept: {keyspace.compacted}); reload a snapshot",
                    keyspace.compacted,
                )
            changed = keyspace.changed
            for event in keyspace.events_from(next_revision):
                next_revision = event.revision + 1
                if event.key.startswith(prefix):
                    yield event
                if closes != self._closes:
                    return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(keyspace.until_next_expiry()):
                    await changed.wait()
            keyspace.expire_leases()
