"""The Conductor's in-memory state: the control core (`kvsched.core.scheduler.Scheduler`,
the same object the simulator drives) plus what only a service needs around it: instances
named by id and bound to slots, event batch cursors, and the etcd records of it all.

No I/O here. Every change that must reach etcd is queued in `outbox` (coalesced by key);
the persister drains it. Validation happens before anything changes, so a refused call
leaves the state exactly as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsched.core.cluster import ClusterConfig, ClusterState
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferPlan
from kvsched.core.events import AllBlocksCleared, BlocksStored, KvEvent
from kvsched.core.index import Tier
from kvsched.core.requests import RequestError
from kvsched.core.scheduler import Scheduler
from kvsched.core.sessions import Session
from services.conductor import keys
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.records import EtcdRecords, Outbox


@dataclass(slots=True)
class Instance:
    """A registered instance."""

    record: InstanceRecord
    next_sequence: int = 0

    @property
    def spec(self) -> InstanceSpec:
        return self.record.spec

    @property
    def slot(self) -> int:
        return self.record.slot


class ConductorState:
    """Control core, registry and bookkeeping of one Conductor process."""

    def __init__(
        self,
        config: ClusterConfig,
        policy: str,
        seed: int,
        *,
        transfer_prefix: str,
        max_prompt_tokens: int = 131_072,
        persist_blocks: bool = True,
    ) -> None:
        """`transfer_prefix` names this term's transfer orders: unique across terms and
        restarts, since a Messenger still knows the ids of the last term."""
        self.outbox = Outbox()
        self.instances: dict[str, Instance] = {}
        self.by_slot: list[str | None] = [None] * config.n_instances
        self._nodes: dict[str, int] = {}
        records = EtcdRecords(self.outbox, self._holder, persist_blocks=persist_blocks)
        self.scheduler = Scheduler(
            config,
            policy,
            seed,
            max_prompt_tokens=max_prompt_tokens,
            transfer_prefix=transfer_prefix,
            observer=records,
            empty=True,  # slots fill as instances register
        )
        self.config = config
        self.persist_blocks = persist_blocks

    @property
    def cluster(self) -> ClusterState:
        return self.scheduler.cluster

    # ---- instances -------------------------------------------------------------------

    def instance(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise RequestError("not_found", f"unknown instance {instance_id!r}")
        return inst

    def _holder(self, slot: int) -> tuple[str, int] | None:
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
        self.scheduler.add_instance(record.slot, record.spec.role, node)
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

    # ---- KV events -----------------------------------------------------------------------

    def apply_events(
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
        inst = self.instance(instance_id)
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
        self.scheduler.apply(inst.slot, events)
        inst.next_sequence = sequence + 1
        self.outbox.put(
            keys.cursor_key(instance_id), str(inst.next_sequence).encode(), inst.record.lease_id
        )
        return inst.next_sequence

    def rebind_lease(self, instance_id: str) -> None:
        """Queue the instance's cursor and every block it holds again, bound to its current
        lease (after a re-registration granted a new one)."""
        inst = self.instance(instance_id)
        lease, index = inst.record.lease_id, self.cluster.index
        self.outbox.put(keys.cursor_key(instance_id), str(inst.next_sequence).encode(), lease)
        if not self.persist_blocks:
            return
        for tier in Tier:
            for h in index.blocks_of(inst.slot, tier):
                value = keys.encode_parent(index.parent_of(h))
                self.outbox.put(keys.block_key(instance_id, tier, h), value, lease)

    def blocks_restored(self, slot: int, entries: Iterable[tuple[Tier, int, int | None]]) -> None:
        """Blocks read back from etcd: indexed, not written again."""
        events = [BlocksStored((block,), parent, tier) for tier, block, parent in entries]
        self.scheduler.apply(slot, events, observe=False)

    # ---- requests ----------------------------------------------------------------------

    def request_info(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        hashes: Sequence[int],
        session_id: str,
    ) -> RequestInfo:
        """A placement request as the core takes it (the core checks its limits when it
        places or explains it); raises RequestError without an id."""
        if not request_id:
            raise RequestError("invalid", "request_id is required (it is the idempotency key)")
        return RequestInfo(
            request_id, prompt_tokens, max(output_tokens, 1), tuple(hashes), session_id or None
        )

    def finish(
        self,
        request_id: str,
        *,
        session_id: str,
        instance_id: str,
        decode_instance_id: str,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        hashes: Sequence[int],
        ttft_s: float,
        e2e_s: float,
        ok: bool,
        now: float,
    ) -> Sequence[TransferPlan]:
        """Record a completion once per request id; returns transfers to start now."""
        if not request_id:
            raise RequestError("invalid", "request_id is required")
        slot = self.instance(instance_id).slot
        decode = self.instance(decode_instance_id).slot if decode_instance_id else slot
        arrival = now - max(e2e_s, 0.0)
        done = Completion(
            request_id=request_id,
            session_id=session_id or None,
            instance=slot,
            decode_instance=decode,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            cached_tokens=cached_tokens,
            block_hashes=tuple(hashes),
            arrival=arrival,
            first_token_at=arrival + max(ttft_s, 0.0),
            finished_at=now,
            ok=ok,
        )
        return self.scheduler.finish(done, now)

    def place(self, req: RequestInfo, now: float) -> Decision:
        return self.scheduler.place(req, now)

    def explain(self, req: RequestInfo, now: float) -> Decision:
        return self.scheduler.explain(req, now)

    def transfer_done(
        self, transfer_id: str, ok: bool, now: float, *, nbytes: int = 0, seconds: float = 0.0
    ) -> bool:
        return self.scheduler.transfer_done(transfer_id, ok, now, nbytes=nbytes, seconds=seconds)

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

    def set_policy(self, spec: str) -> str:
        """Switch the policy; returns the previous spec. Raises RequestError on a bad spec."""
        return self.scheduler.set_policy(spec)
