"""Instances joining, staying and leaving, in the order etcd needs.

An instance's record is bound to a lease of its own: when the instance stops keeping it
alive, etcd drops the record and everything bound to it (its cursor, its blocks), and every
Conductor's watch removes the instance. Registering writes the record before the registry
learns of it; a re-registration moves the cursor and blocks to the new lease before it
revokes the old one, which would take them away.

A lease is renewed in etcd directly, which writes no key and needs no leader state: a standby
renews the leases of the instances it follows too (`renew`), so they outlive a leader change
however long the takeover takes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from services.common.store.interface import Lease, Put, Store, StoreError
from services.conductor import keys
from services.conductor.fencing import TermWriter
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.state import Instance
from services.conductor.term import CurrentTerm, Term


class Registrar:
    """Registers, keeps alive and deregisters instances in etcd and the current term.
    Every method raises RequestError (refused, nothing changed) or StoreError (etcd)."""

    def __init__(
        self,
        store: Store,
        writer: TermWriter,
        current: CurrentTerm,
        sync: Callable[[], Awaitable[None]],
        default_ttl_s: float,
    ) -> None:
        self.store = store
        self.writer = writer  # the term's guarded writes
        self.current = current
        self.sync = sync  # waits for the term's queued writes to reach etcd
        self.default_ttl_s = default_ttl_s
        # Registrations pick a slot, then await etcd: one at a time, or two could pick the
        # same free slot and the second would evict the first.
        self._registering = asyncio.Lock()

    async def register(self, spec: InstanceSpec, ttl_s: float | None) -> Lease:
        """Give the instance a slot and a lease, record it in etcd, then in the registry.
        `ttl_s` None or 0: the default time to live."""
        async with self._registering:
            return await self._register(spec, max(round(ttl_s or self.default_ttl_s), 1))

    async def _register(self, spec: InstanceSpec, ttl_s: int) -> Lease:
        state = self.current().state
        slot = state.free_slot(spec.instance_id)
        previous = state.instances.get(spec.instance_id)
        old_lease = previous.record.lease_id if previous else 0
        lease = await self.store.grant_lease(ttl_s)
        record = InstanceRecord(spec, slot, lease.id)
        await self.writer.commit(
            [Put(keys.instance_key(spec.instance_id).encode(), record.encode(), lease.id)]
        )
        self.current().state.add_instance(record, previous.next_sequence if previous else 0)
        if old_lease:
            # Its cursor and blocks were bound to the old lease: move them to the new one.
            _rebind_lease(self.current(), spec.instance_id)
            with contextlib.suppress(StoreError):
                await self.sync()  # moved before the old lease takes them away
                await self.store.revoke_lease(old_lease)
        return lease

    async def keep_alive(self, instance_id: str) -> tuple[Instance, float]:
        """Renew the instance's lease; returns it and the seconds left. A lease that lapsed
        removes the instance (NOT_FOUND: it must register again)."""
        inst = self.current().state.instance(instance_id)
        remaining = await self.store.keep_alive(inst.record.lease_id)
        if remaining <= 0:
            self.current().state.remove_instance(instance_id)
            raise RequestError(
                "not_found", f"the lease of instance {instance_id!r} lapsed; register it again"
            )
        return inst, remaining

    async def renew(self, instance_id: str) -> tuple[Instance, float]:
        """Renew the lease of an instance this Conductor follows without leading: etcd only
        (the watch removes an instance whose lease lapsed). Raises RequestError: not_found
        when the lease is gone, unavailable when this Conductor does not know the instance
        (yet: its registration may not have reached the watch)."""
        inst = self.current().state.instances.get(instance_id)
        if inst is None:
            raise RequestError("unavailable", f"this Conductor does not know {instance_id!r} yet")
        remaining = await self.store.keep_alive(inst.record.lease_id)
        if remaining <= 0:
            raise RequestError(
                "not_found", f"the lease of instance {instance_id!r} lapsed; register it again"
            )
        return inst, remaining

    async def deregister(self, instance_id: str) -> int:
        """Revoke the instance's lease (its keys go with it) and remove it; returns the
        sessions unbound."""
        inst = self.current().state.instance(instance_id)
        await self.store.revoke_lease(inst.record.lease_id)
        return self.current().state.remove_instance(instance_id)


def _rebind_lease(term: Term, instance_id: str) -> None:
    """Queue the instance's cursor and every block it holds again, bound to its current
    lease (after a re-registration granted a new one)."""
    term.cursors.save(instance_id)
    if not term.persist_blocks:
        return
    state = term.state
    inst, index = state.instance(instance_id), state.cluster.index
    for tier in Tier:
        for h in index.blocks_of(inst.slot, tier):
            value = keys.encode_parent(index.parent_of(h))
            term.outbox.put(keys.block_key(instance_id, tier, h), value, inst.record.lease_id)
