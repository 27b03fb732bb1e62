"""The Conductor's instance registry around the control core: instances named by id and
bound to slots of the core `Scheduler` (the same object the simulator drives).

No I/O here, and nothing else: the etcd records of what changes are the observer's the
state is built with (`records`), a batch's place in its instance's sequence is the
cursors' (`cursors`), the conversion of messages is `instance_messages`',
`kv_event_batches`' and `placement_messages`'. Validation happens before anything changes,
so a refused call leaves the state exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvsched.core.cluster import ClusterConfig, ClusterState
from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from kvsched.core.scheduler import IndexObserver, Scheduler
from kvsched.core.sessions import Session
from services.conductor import keys
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.records import Holder


@dataclass(slots=True)
class Instance:
    """A registered instance, and the sequence its next KV event batch must carry."""

    record: InstanceRecord
    next_sequence: int = 0

    @property
    def spec(self) -> InstanceSpec:
        return self.record.spec

    @property
    def slot(self) -> int:
        return self.record.slot


class ConductorState:
    """Instances by id and slot, around the control core of one leadership term."""

    def __init__(
        self,
        config: ClusterConfig,
        policy: str,
        seed: int,
        *,
        transfer_prefix: str,
        max_prompt_tokens: int = 131_072,
        max_sessions_per_tenant: int = 0,
        observer: Callable[[Holder], IndexObserver] | None = None,
        pure: bool = False,
    ) -> None:
        """`transfer_prefix` names the transfer orders of the core. `observer`, given who
        holds each slot, builds what the core tells of every change it applies (the etcd
        records). `pure`: the core's references for its compiled index and scoring."""
        self.instances: dict[str, Instance] = {}
        self.by_slot: list[str | None] = [None] * config.n_instances
        self._nodes: dict[str, int] = {}
        self.scheduler = Scheduler(
            config,
            policy,
            seed,
            max_prompt_tokens=max_prompt_tokens,
            max_sessions_per_tenant=max_sessions_per_tenant,
            transfer_prefix=transfer_prefix,
            observer=observer(self.holder) if observer is not None else None,
            empty=True,  # slots fill as instances register
            pure=pure,
        )

    @property
    def cluster(self) -> ClusterState:
        return self.scheduler.cluster

    # ---- instances -------------------------------------------------------------------

    def instance(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise RequestError("not_found", f"unknown instance {instance_id!r}")
        return inst

    def holder(self, slot: int) -> tuple[str, int] | None:
        """The id and lease of the instance in `slot`; None for a free slot."""
        iid = self.by_slot[slot]
        if iid is None:
            return None
        return iid, self.instances[iid].record.lease_id

    def free_slot(self, instance_id: str) -> int:
        """The slot `instance_id` holds, or the lowest free one."""
        inst = self.instances.get(instance_id)
        if inst is not None:
            return inst.slot
        for slot, holder in enumerate(self.by_slot):
            if holder is None:
                return slot
        raise RequestError(
            "unavailable", f"all {len(self.by_slot)} instance slots are taken (raise max_instances)"
        )

    def add_instance(self, record: InstanceRecord, next_sequence: int = 0) -> Instance:
        """Register (or replace) an instance in its record's slot. A re-registration of the
        same instance with the same spec keeps its index and load."""
        old = self.instances.get(record.spec.instance_id)
        if old is not None and old.record.spec == record.spec and old.slot == record.slot:
            old.record = record
            return old
        if old is not None:
            self.remove_instance(old.spec.instance_id)
        holder = self.by_slot[record.slot]
        if holder is not None:
            self.remove_instance(holder)
        # Nodes are numbered as they first appear; racks group consecutive numbers.
        node = self._nodes.setdefault(record.spec.node, len(self._nodes))
        self.scheduler.add_instance(record.slot, record.spec.role, node, record.spec.model)
        inst = self.instances[record.spec.instance_id] = Instance(record, next_sequence)
        self.by_slot[record.slot] = record.spec.instance_id
        return inst

    def remove_instance(self, instance_id: str) -> int:
        """The instance left or its lease lapsed: it leaves routing, its blocks and load are
        dropped, its sessions rebind on their next turn. Returns the sessions unbound."""
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return 0
        self.by_slot[inst.slot] = None
        return self.scheduler.remove_instance(inst.slot)

    def slot_of(self, instance_id: str) -> int | None:
        inst = self.instances.get(instance_id)
        return None if inst is None else inst.slot

    def id_of(self, slot: int) -> str:
        return self.by_slot[slot] or ""

    def blocks_restored(self, slot: int, entries: Iterable[tuple[Tier, int, int | None]]) -> None:
        """Blocks read back from etcd: indexed, not written again."""
        events = [BlocksStored((block,), parent, tier) for tier, block, parent in entries]
        self.scheduler.apply(slot, events, observe=False)

    # ---- sessions and policy -------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        s = self.cluster.sessions.get(session_id) if session_id else None
        if s is None:
            raise RequestError("not_found", f"unknown session {session_id!r}")
        return s

    def restore_session(self, session_id: str, value: bytes) -> None:
        """Put back a session saved in etcd; its host binds only if that instance is here."""
        body_host = keys.decode_session(session_id, value, None)[1]
        session, _ = keys.decode_session(session_id, value, self.slot_of(body_host))
        self.scheduler.restore_session(session)

    def forget_session(self, session_id: str) -> None:
        """A session's etcd record was deleted (the leader forgot it): forget it here too."""
        self.scheduler.forget_session(session_id)

    def set_policy(self, spec: str) -> str:
        """Switch the policy; returns the previous spec. Raises RequestError on a bad spec."""
        return self.scheduler.set_policy(spec)
