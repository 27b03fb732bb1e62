"""The Conductor's in-memory state: the core scheduler plus the instance registry, event
cursors, transfer orders and idempotency records that the RPC layer needs.

No I/O here. Every change that must reach etcd is queued in `outbox` (coalesced by key);
the persister drains it. Validation happens before anything changes, so a refused call
leaves the state exactly as it was.
"""

from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvsched.core.cluster import ClusterConfig, ClusterState, build_cluster
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.scheduler import Scheduler
from kvsched.core.sessions import NO_HOST, Session
from services.conductor import keys
from services.conductor.keys import InstanceRecord, InstanceSpec

RECENT_DECISIONS = 65_536  # idempotency window for Schedule retries
OPEN_TRANSFERS = 65_536  # transfer orders kept for ReportTransfer


class RequestError(Exception):
    """A call the state refuses; `kind` maps to a gRPC status in the RPC layer."""

    def __init__(self, kind: str, message: str, next_sequence: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid", "not_found", "out_of_range", "unavailable"
        self.next_sequence = next_sequence


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """Blocks stored on an instance."""

    hashes: tuple[int, ...]
    parent: int | None
    tier: Tier


@dataclass(frozen=True, slots=True)
class RemovedEvent:
    """Blocks removed from an instance."""

    hashes: tuple[int, ...]
    tier: Tier


@dataclass(frozen=True, slots=True)
class ClearedEvent:
    """Every block of an instance dropped."""


KvEvent = StoredEvent | RemovedEvent | ClearedEvent | LoadReport


@dataclass(slots=True)
class Outbox:
    """Pending etcd writes, coalesced: the last write to a key wins, order of first write
    kept. `None` means delete."""

    writes: OrderedDict[str, tuple[bytes | None, int]] = field(default_factory=OrderedDict)

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.writes[key] = (value, lease)

    def delete(self, key: str) -> None:
        self.writes[key] = (None, 0)

    def take(self) -> list[tuple[str, bytes | None, int]]:
        batch = [(k, v, lease) for k, (v, lease) in self.writes.items()]
        self.writes.clear()
        return batch

    def __len__(self) -> int:
        return len(self.writes)


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
    """Scheduler, registry and bookkeeping of one Conductor process."""

    def __init__(
        self,
        config: ClusterConfig,
        policy: str,
        seed: int,
        *,
        self_id: str = "conductor",
        max_prompt_tokens: int = 131_072,
        persist_blocks: bool = True,
    ) -> None:
        cluster = build_cluster(config)
        cluster.alive[:] = False  # slots fill as instances register
        self.scheduler = Scheduler(cluster, policy, seed)
        self.config = config
        self.max_prompt_tokens = max_prompt_tokens
        self.max_blocks = -(-max_prompt_tokens // config.block_size)
        self.persist_blocks = persist_blocks
        self.instances: dict[str, Instance] = {}
        self.by_slot: list[str | None] = [None] * config.n_instances
        self._nodes: dict[str, int] = {}
        self.outbox = Outbox()
        self._decisions: OrderedDict[str, Decision] = OrderedDict()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._transfers: OrderedDict[str, TransferPlan] = OrderedDict()
        self._transfer_ids = itertools.count(1)
        # Unique across terms and restarts: a Messenger still knows the ids of the last term.
        self._transfer_prefix = f"{self_id}-{secrets.token_hex(4)}"
        self.rejections = 0
        self.migrations = 0

    # ---- instances -------------------------------------------------------------------

    @property
    def cluster(self) -> ClusterState:
        return self.scheduler.cluster

    def instance(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise RequestError("not_found", f"unknown instance {instance_id!r}")
        return inst

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
        self.cluster.add_instance(record.slot, record.spec.role, node)
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
        unbound = self.cluster.sessions.bound_on(inst.slot)
        self.cluster.remove_instance(inst.slot)
        slot = inst.slot
        # Orders and remembered decisions naming the slot would name its next holder.
        for plan_id in [t for t, p in self._transfers.items() if slot in (p.source, p.target)]:
            del self._transfers[plan_id]
        for rid in [
            r for r, d in self._decisions.items() if slot in (d.instance, d.decode_instance)
        ]:
            del self._decisions[rid]
        return unbound

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
        for event in events:
            if (
                isinstance(event, StoredEvent | RemovedEvent)
                and len(event.hashes) > self.max_blocks
            ):
                raise RequestError(
                    "invalid",
                    f"an event lists {len(event.hashes)} blocks; at most {self.max_blocks}",
                )
        slot = inst.slot
        scheduler = self.scheduler
        if resync and not merge:
            self._clear_blocks(inst)
        for event in events:
            if isinstance(event, StoredEvent):
                scheduler.blocks_stored(slot, event.hashes, event.parent, event.tier)
                self._persist_stored(inst, event)
            elif isinstance(event, RemovedEvent):
                self._persist_removed(inst, event)
                scheduler.blocks_removed(slot, event.hashes, event.tier)
            elif isinstance(event, ClearedEvent):
                self._clear_blocks(inst)
            else:
                scheduler.report_load(slot, event)
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

    def _clear_blocks(self, inst: Instance) -> None:
        index = self.cluster.index
        if self.persist_blocks:
            for tier in Tier:
                for h in index.blocks_of(inst.slot, tier):
                    self.outbox.delete(keys.block_key(inst.spec.instance_id, tier, h))
        index.clear_instance(inst.slot)

    def _persist_stored(self, inst: Instance, event: StoredEvent) -> None:
        if not self.persist_blocks:
            return
        parent, lease, iid = event.parent, inst.record.lease_id, inst.spec.instance_id
        put = self.outbox.put
        for h in event.hashes:
            put(keys.block_key(iid, event.tier, h), keys.encode_parent(parent), lease)
            parent = h

    def _persist_removed(self, inst: Instance, event: RemovedEvent) -> None:
        if not self.persist_blocks:
            return
        # Descendants leave with their ancestors (see PrefixIndex.remove): delete them too.
        index, iid = self.cluster.index, inst.spec.instance_id
        for h in index.subtree_of(inst.slot, event.hashes, event.tier):
            self.outbox.delete(keys.block_key(iid, event.tier, h))

    # ---- placement -------------------------------------------------------------------

    def request_info(
        self,
        request_id: str,
        prompt_tokens: int,
        output_tokens: int,
        hashes: Sequence[int],
        session_id: str,
    ) -> RequestInfo:
        """Validate a placement request; raises RequestError."""
        if not request_id:
            raise RequestError("invalid", "request_id is required (it is the idempotency key)")
        if prompt_tokens <= 0:
            raise RequestError("invalid", "prompt_tokens must be positive")
        if prompt_tokens > self.max_prompt_tokens:
            raise RequestError(
                "invalid",
                f"prompt of {prompt_tokens} tokens exceeds the limit of {self.max_prompt_tokens}",
            )
        bs = self.config.block_size
        if not hashes and prompt_tokens >= bs:
            raise RequestError(
                "invalid",
                f"block_hashes is empty but a {prompt_tokens}-token prompt has full "
                f"{bs}-token blocks",
            )
        if len(hashes) > -(-prompt_tokens // bs):
            raise RequestError(
                "invalid",
                f"{len(hashes)} block hashes for a {prompt_tokens}-token prompt "
                f"(block size {bs}): at most {-(-prompt_tokens // bs)}",
            )
        return RequestInfo(
            request_id, prompt_tokens, max(output_tokens, 1), tuple(hashes), session_id or None
        )

    def place(self, req: RequestInfo, now: float) -> tuple[Decision, bool]:
        """Place `req` (or return the decision already made for its id). Returns the decision
        and whether a session binding that the policy follows changed (the caller makes that
        durable before answering)."""
        key = str(req.request_id)
        seen = self._decisions.get(key)
        if seen is not None:
            return seen, False
        if not self.instances:
            raise RequestError("unavailable", "no instance is registered")
        sessions = self.cluster.sessions
        before = sessions.get(req.session_id) if req.session_id else None
        host_before = NO_HOST if before is None else before.host
        try:
            decision = self.scheduler.place(req, now)
        except ValueError as exc:  # no eligible instance of the needed role
            raise RequestError("unavailable", str(exc)) from exc
        if decision.rejected:
            self.rejections += 1
            return decision, False
        decision = self._name_transfers(decision)
        self._decisions[key] = replace(decision, terms={}, candidates=None)  # slim: a window
        if len(self._decisions) > RECENT_DECISIONS:
            self._decisions.popitem(last=False)
        rebound = False
        if req.session_id:
            after = sessions.get(req.session_id)
            rebound = after is not None and after.host != host_before
            if rebound and host_before != NO_HOST:
                self.migrations += 1
            rebound = rebound and self.scheduler.policy.affinity
            self._persist_session(req.session_id)
        return decision, rebound

    def _name_transfers(self, decision: Decision) -> Decision:
        if not decision.transfers:
            return decision
        named = tuple(self._open_transfer(plan) for plan in decision.transfers)
        return replace(decision, transfers=named)

    def _open_transfer(self, plan: TransferPlan) -> TransferPlan:
        """Give a transfer order its id and keep it until its outcome is reported."""
        named = replace(plan, transfer_id=f"{self._transfer_prefix}-{next(self._transfer_ids)}")
        self._transfers[named.transfer_id] = named
        if len(self._transfers) > OPEN_TRANSFERS:
            self._transfers.popitem(last=False)
        return named

    def explain(self, req: RequestInfo, now: float) -> Decision:
        if not self.instances:
            raise RequestError("unavailable", "no instance is registered")
        try:
            return self.scheduler.explain(req, now)
        except ValueError as exc:
            raise RequestError("unavailable", str(exc)) from exc

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
        if request_id in self._finished:
            return ()
        slot = self.instance(instance_id).slot
        decode = self.instance(decode_instance_id).slot if decode_instance_id else slot
        if len(hashes) > self.max_blocks:
            raise RequestError("invalid", f"{len(hashes)} block hashes; at most {self.max_blocks}")
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
        plans = self.scheduler.finish(done, now)
        self._finished[request_id] = None
        if len(self._finished) > RECENT_DECISIONS:
            self._finished.popitem(last=False)
        if session_id:
            self._persist_session(session_id)
        return tuple(self._open_transfer(plan) for plan in plans)

    def transfer_done(
        self, transfer_id: str, ok: bool, now: float, *, nbytes: int = 0, seconds: float = 0.0
    ) -> bool:
        """Record a transfer's outcome, and what it measured (`nbytes` in `seconds` of policy
        time) for the cost model; returns whether a session moved."""
        plan = self._transfers.pop(transfer_id, None)
        if plan is None:
            raise RequestError("not_found", f"unknown or already reported transfer {transfer_id!r}")
        # A hand-off's time includes the prefill it overlaps: no bandwidth to learn from it.
        if ok and nbytes > 0 and seconds > 0 and plan.kind is not TransferKind.HANDOFF:
            self.scheduler.transfer_measured(plan.source, plan.target, nbytes, seconds)
        moved = self.scheduler.transfer_done(plan, ok, now)
        if moved and plan.session_id:
            self.migrations += 1
            self._persist_session(plan.session_id)
        return moved

    # ---- sessions ----------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        s = self.cluster.sessions.get(session_id) if session_id else None
        if s is None:
            raise RequestError("not_found", f"unknown session {session_id!r}")
        return s

    def _persist_session(self, session_id: str) -> None:
        s = self.cluster.sessions.get(session_id)
        if s is None:
            return
        host = self.id_of(s.host) if s.host != NO_HOST else None
        self.outbox.put(keys.session_key(session_id), keys.encode_session(s, host))

    def restore_session(self, session_id: str, value: bytes) -> None:
        """Put back a session saved in etcd; its host binds only if that instance is here."""
        body_host = keys.decode_session(session_id, value, None)[1]
        session, _ = keys.decode_session(session_id, value, self.slot_of(body_host))
        self.cluster.sessions.restore(session)

    # ---- policy ----------------------------------------------------------------------

    def set_policy(self, spec: str) -> str:
        """Switch the policy; returns the previous spec. Raises RequestError on a bad spec."""
        previous = self.scheduler.spec
        try:
            self.scheduler.set_policy(spec)
        except ValueError as exc:
            raise RequestError("invalid", str(exc)) from exc
        return previous

    def blocks_restored(self, slot: int, entries: Iterable[tuple[Tier, int, int | None]]) -> None:
        for tier, block, parent in entries:
            self.scheduler.blocks_stored(slot, (block,), parent, tier)
