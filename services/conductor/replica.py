"""Keeping a Conductor's state in step with etcd.

`load` rebuilds the state from a snapshot (warm start: index, bindings, cursors and policy
come back without engines re-sending). `follow` applies every later change from a watch: a
standby stays warm that way, and every Conductor, leader included, learns from it that an
instance's lease lapsed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

from kvsched.core.events import BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from services.common.store.interface import KeyValue, Store, WatchEvent
from services.conductor import keys
from services.conductor.election import Election
from services.conductor.keys import InstanceRecord
from services.conductor.state import ConductorState

log = logging.getLogger(__name__)


def apply_snapshot(state: ConductorState, kvs: Iterable[KeyValue]) -> None:
    """Put every record of a `/kvsched/v1/` snapshot into `state` (instances first)."""
    by_prefix: dict[str, list[KeyValue]] = defaultdict(list)
    for kv in kvs:
        key = kv.key.decode()
        for prefix in (keys.INSTANCES, keys.CURSORS, keys.BLOCKS, keys.SESSIONS, keys.POLICY):
            if key.startswith(prefix):
                by_prefix[prefix].append(kv)
                break
    for kv in by_prefix[keys.POLICY]:
        _set_policy(state, kv.value.decode())
    for kv in by_prefix[keys.INSTANCES]:
        state.add_instance(InstanceRecord.decode(kv.value))
    for kv in by_prefix[keys.CURSORS]:
        inst = state.instances.get(keys.tail(kv.key.decode(), keys.CURSORS))
        if inst is not None:
            inst.next_sequence = int(kv.value)
    blocks: dict[int, list[tuple[Tier, int, int | None]]] = defaultdict(list)
    for kv in by_prefix[keys.BLOCKS]:
        instance_id, tier, block = keys.parse_block_key(kv.key.decode())
        slot = state.slot_of(instance_id)
        if slot is not None:
            blocks[slot].append((tier, block, keys.decode_parent(kv.value)))
    for slot, entries in blocks.items():
        state.blocks_restored(slot, entries)
    for kv in by_prefix[keys.SESSIONS]:
        state.restore_session(keys.tail(kv.key.decode(), keys.SESSIONS), kv.value)


def _set_policy(state: ConductorState, spec: str) -> None:
    if spec and spec != state.scheduler.spec:
        try:
            state.set_policy(spec)
        except RequestError as exc:
            log.error("ignoring the policy recorded in etcd: %s", exc)


async def load(store: Store, state: ConductorState) -> int:
    """Warm start; returns the revision to follow from."""
    kvs, revision = await store.snapshot(keys.ROOT.encode())
    apply_snapshot(state, kvs)
    log.info(
        "warm start: %d instances, %d sessions, %d blocks, policy %s",
        len(state.instances),
        len(state.cluster.sessions),
        len(state.cluster.index),
        state.scheduler.spec,
    )
    return revision


def apply_change(state: ConductorState, election: Election, event: WatchEvent) -> None:
    """Apply one watched change. The leader wrote most keys itself and skips them; lapsed
    instance leases and the leader key matter to everyone."""
    key = event.key.decode()
    value = event.value if event.kind == "put" else None
    if key == keys.LEADER:
        election.observe(value, event.revision)
        return
    if key.startswith(keys.INSTANCES):
        instance_id = keys.tail(key, keys.INSTANCES)
        if value is None:
            if instance_id in state.instances:
                log.info("instance %s left (lease lapsed or deregistered)", instance_id)
            state.remove_instance(instance_id)
        elif not election.is_leader:
            inst = state.instances.get(instance_id)
            state.add_instance(InstanceRecord.decode(value), inst.next_sequence if inst else 0)
        return
    if election.is_leader:
        return
    if key.startswith(keys.BLOCKS):
        instance_id, tier, block = keys.parse_block_key(key)
        slot = state.slot_of(instance_id)
        if slot is None:
            return
        if value is None:
            change: KvEvent = BlocksRemoved((block,), tier)
        else:
            change = BlocksStored((block,), keys.decode_parent(value), tier)
        state.scheduler.apply(slot, (change,), observe=False)  # the leader wrote it
    elif key.startswith(keys.CURSORS) and value is not None:
        inst = state.instances.get(keys.tail(key, keys.CURSORS))
        if inst is not None:
            inst.next_sequence = int(value)
    elif key.startswith(keys.SESSIONS):
        session_id = keys.tail(key, keys.SESSIONS)
        if value is None:
            state.forget_session(session_id)  # the leader forgot it: idle, or over the cap
        else:
            state.restore_session(session_id, value)
    elif key == keys.POLICY and value is not None:
        _set_policy(state, value.decode())


async def follow(store: Store, state: ConductorState, election: Election, revision: int) -> None:
    """Apply changes after `revision` until cancelled."""
    async for event in store.watch_prefix(keys.ROOT.encode(), revision + 1):
        try:
            apply_change(state, election, event)
        except (ValueError, KeyError) as exc:  # a record we cannot read: skip, never crash
            key = keys.loggable(event.key.decode(errors="replace"))
            log.error("skipping unreadable record %r: %s", key, exc)
