"""Protobuf messages to and from core values, with the boundary checks (unspecified enums,
missing fields) that raise `RequestError`. Pure conversion: nothing here changes the state
it reads ids and slots from."""

from __future__ import annotations

import math
from collections.abc import Sequence

from clients.python.packed_hashes import hash_count, unpack_hashes
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import (
    MAX_ADAPTER_NAME,
    MAX_ADAPTERS,
    NO_CHANGE,
    AdapterChange,
    AdapterReport,
)
from kvsched.core.cluster import Role
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.packed import PackedHashes
from kvsched.core.requests import RequestError
from kvsched.core.sessions import NO_HOST, Session
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.durations import duration, seconds
from services.common.kv_event_messages import TIER_VALUES, adapter_message
from services.conductor.keys import InstanceSpec
from services.conductor.state import ConductorState

ROLES: dict[int, Role] = {
    common.ROLE_BOTH: Role.BOTH,
    common.ROLE_PREFILL: Role.PREFILL,
    common.ROLE_DECODE: Role.DECODE,
}
ROLE_VALUES: dict[Role, common.Role.ValueType] = {
    Role.BOTH: common.ROLE_BOTH,
    Role.PREFILL: common.ROLE_PREFILL,
    Role.DECODE: common.ROLE_DECODE,
}
TIERS: dict[int, Tier] = {value: tier for tier, value in TIER_VALUES.items()}
KINDS = {
    TransferKind.FETCH_PREFIX: common.TRANSFER_KIND_FETCH_PREFIX,
    TransferKind.MIGRATE_SESSION: common.TRANSFER_KIND_MIGRATE_SESSION,
    TransferKind.REPLICATE_PREFIX: common.TRANSFER_KIND_REPLICATE_PREFIX,
    TransferKind.HANDOFF: common.TRANSFER_KIND_HANDOFF,
}


def role(value: int) -> Role:
    found = ROLES.get(value)
    if found is None:
        raise RequestError(
            "invalid", f"role must be ROLE_BOTH, ROLE_PREFILL or ROLE_DECODE, got {value}"
        )
    return found


def tier(value: int) -> Tier:
    found = TIERS.get(value)
    if found is None:
        raise RequestError("invalid", f"tier must be TIER_GPU, TIER_CPU or TIER_DISK, got {value}")
    return found


def instance_spec(msg: pb.InstanceSpec) -> InstanceSpec:
    if not msg.instance_id:
        raise RequestError("invalid", "spec.instance_id is required")
    if len(msg.instance_id) > 256:
        raise RequestError("invalid", "spec.instance_id is longer than 256 characters")
    return InstanceSpec(
        instance_id=msg.instance_id,
        url=msg.url,
        node=msg.node,
        role=role(msg.role),
        model=msg.model,
        messenger_url=msg.messenger_url,
        max_model_len=msg.max_model_len,
    )


def load_report(msg: common.LoadReport) -> LoadReport:
    adapters = None
    if msg.HasField("adapters"):
        a = msg.adapters
        if len(a.held) > MAX_ADAPTERS or len(a.busy) > MAX_ADAPTERS:
            raise RequestError("invalid", f"an engine holds at most {MAX_ADAPTERS} adapters")
        for name in (*a.held, *a.busy):
            _check_adapter(name, "adapters")
        adapters = AdapterReport(a.capacity, frozenset(a.held), frozenset(a.busy))
    return LoadReport(
        pending_prefill_tokens=msg.pending_prefill_tokens,
        pending_prefill_s=seconds(msg.pending_prefill),
        waiting=msg.waiting,
        running=msg.running,
        decode_tokens=msg.decode_tokens,
        free_blocks=msg.free_blocks,
        adapters=adapters,
    )


def _check_adapter(name: str, where: str) -> None:
    if not name or len(name) > MAX_ADAPTER_NAME:
        raise RequestError(
            "invalid", f"{where}: an adapter name has 1 to {MAX_ADAPTER_NAME} characters"
        )


def load_message(state: ConductorState, slot: int) -> common.LoadReport:
    load = state.cluster.load
    msg = common.LoadReport(
        pending_prefill_tokens=int(load.pending_prefill_tokens[slot]),
        pending_prefill=duration(float(load.pending_prefill_s[slot])),
        waiting=int(load.waiting[slot]),
        running=int(load.running[slot]),
        decode_tokens=int(load.decode_tokens[slot]),
        free_blocks=max(int(load.free_blocks[slot]), 0),
    )
    adapters = state.cluster.adapters.reported(slot)
    if adapters.capacity:
        msg.adapters.CopyFrom(adapter_message(adapters))
    return msg


def block_hashes(
    repeated: Sequence[int], packed: bytes, max_blocks: int, where: str = ""
) -> Sequence[int]:
    """A message's block hashes from whichever of its two fields is set: `repeated`
    (`block_hashes`, copied out as today; the core checks its length) or `packed`
    (`packed_block_hashes`, its length checked before a single int is made, then unpacked in
    one C loop). Raises RequestError when both are set, or when the packed bytes are not a
    whole number of 8-byte hashes or hold more than `max_blocks`; `where` prefixes the
    field names in the message (e.g. "event 3: ")."""
    if not packed:
        return repeated[:]  # a list copy: the fastest way out of a repeated field
    if repeated:
        raise RequestError(
            "invalid", f"{where}block_hashes and packed_block_hashes are both set; give one"
        )
    _check_packed(packed, max_blocks, where)
    return unpack_hashes(packed)


def _check_packed(packed: bytes, max_blocks: int, where: str) -> None:
    try:
        n = hash_count(packed)
    except ValueError as exc:
        raise RequestError("invalid", f"{where}packed_block_hashes: {exc}") from None
    if n > max_blocks:
        raise RequestError(
            "invalid", f"{where}packed_block_hashes holds {n} block hashes; at most {max_blocks}"
        )


def event_hashes(
    repeated: Sequence[int], packed: bytes, max_blocks: int, where: str
) -> Sequence[int]:
    """An event's block hashes, refused as `block_hashes` refuses them; packed ones stay
    packed (`PackedHashes`): the compiled index reads their bytes, no Python int a hash."""
    if not packed:
        return tuple(repeated)
    if repeated:
        raise RequestError(
            "invalid", f"{where}block_hashes and packed_block_hashes are both set; give one"
        )
    _check_packed(packed, max_blocks, where)
    return PackedHashes(packed)


def kv_events(batch: pb.KvEventBatch, max_blocks: int) -> list[KvEvent]:
    """Decode a batch's events; raises RequestError on an unset event or enum, or on an
    event's block hashes as `block_hashes` refuses them (`max_blocks` bounds a packed
    list; the core checks the others). Packed hashes stay packed (`event_hashes`)."""
    out: list[KvEvent] = []
    for i, event in enumerate(batch.events):
        kind = event.WhichOneof("event")
        if kind == "blocks_stored":
            s = event.blocks_stored
            parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
            hashes = event_hashes(s.block_hashes, s.packed_block_hashes, max_blocks, f"event {i}: ")
            out.append(BlocksStored(hashes, parent, tier(s.tier)))
        elif kind == "blocks_removed":
            r = event.blocks_removed
            hashes = event_hashes(r.block_hashes, r.packed_block_hashes, max_blocks, f"event {i}: ")
            out.append(BlocksRemoved(hashes, tier(r.tier)))
        elif kind == "all_blocks_cleared":
            out.append(AllBlocksCleared())
        elif kind == "load":
            out.append(load_report(event.load))
        else:
            raise RequestError("invalid", f"event {i} of the batch has no event set")
    return out


def transfer_message(state: ConductorState, plan: TransferPlan) -> common.TransferPlan:
    return common.TransferPlan(
        transfer_id=plan.transfer_id,
        kind=KINDS[plan.kind],
        source_instance_id=state.id_of(plan.source),
        target_instance_id=state.id_of(plan.target),
        block_hashes=plan.block_hashes,
        skip_blocks=plan.skip_blocks,
        tokens=plan.tokens,
        bytes=plan.nbytes,
        estimated_duration=duration(plan.est_seconds),
        on_critical_path=plan.on_critical_path,
        session_id=plan.session_id or "",
        request_id="" if plan.request_id is None else str(plan.request_id),
    )


def decision_message(
    state: ConductorState,
    decision: Decision,
    *,
    landing: Sequence[TransferPlan] = (),
    explain: bool = False,
) -> pb.Decision:
    inst = state.instances.get(state.id_of(decision.instance))
    dec = state.instances.get(state.id_of(decision.decode_instance))
    msg = pb.Decision(
        request_id=str(decision.request_id),
        instance_id=state.id_of(decision.instance) if decision.instance >= 0 else "",
        instance_url=inst.spec.url if inst else "",
        decode_instance_id=state.id_of(decision.decode_instance)
        if decision.decode_instance >= 0
        else "",
        decode_instance_url=dec.spec.url if dec else "",
        cached_tokens=max(decision.cached_tokens, 0),
        fetched_tokens=max(decision.fetched_tokens, 0),
        estimated_ttft=duration(decision.estimated_ttft_s),
        rule=decision.rule,
        policy=state.scheduler.policy.name,
        transfers=[transfer_message(state, t) for t in decision.transfers],
        landing=[transfer_message(state, t) for t in landing],
    )
    if decision.adapter_change != NO_CHANGE:
        msg.adapter_change.CopyFrom(_change_message(decision.adapter_change))
    if decision.decode_adapter_change != NO_CHANGE:
        msg.decode_adapter_change.CopyFrom(_change_message(decision.decode_adapter_change))
    if explain:
        for row in decision.explain():
            slot = int(row.pop("instance"))
            chosen = bool(row.pop("chosen"))
            terms = {k: float(v) for k, v in row.items() if math.isfinite(float(v))}
            msg.candidates.append(
                pb.CandidateCost(instance_id=state.id_of(slot), terms=terms, chosen=chosen)
            )
    return msg


def _change_message(change: AdapterChange) -> pb.AdapterChange:
    return pb.AdapterChange(load=change.load, unload=change.unload)


def rejection_message(decision: Decision) -> pb.Rejection:
    return pb.Rejection(
        request_id=str(decision.request_id),
        rule=decision.rule,
        retry_after=duration(decision.retry_after_s),
        estimated_ttft=duration(decision.estimated_ttft_s),
    )


def session_message(state: ConductorState, session: Session) -> pb.Session:
    return pb.Session(
        session_id=session.session_id,
        host_instance_id=state.id_of(session.host) if session.host != NO_HOST else "",
        turns=session.turns,
        migrations=session.migrations,
        context_tokens=session.context_tokens,
        moving_to_instance_id=state.id_of(session.pending_target)
        if session.pending_target != NO_HOST
        else "",
    )


def instance_status(state: ConductorState, instance_id: str) -> pb.InstanceStatus:
    inst = state.instances[instance_id]
    spec, slot = inst.spec, inst.slot
    return pb.InstanceStatus(
        spec=pb.InstanceSpec(
            instance_id=spec.instance_id,
            url=spec.url,
            node=spec.node,
            role=ROLE_VALUES[spec.role],
            model=spec.model,
            messenger_url=spec.messenger_url,
            max_model_len=spec.max_model_len,
        ),
        slot=slot,
        lease_id=inst.record.lease_id,
        load=load_message(state, slot),
        in_flight=int(state.cluster.load.in_flight[slot]),
        gpu_blocks=state.cluster.index.block_count(slot),
        next_event_sequence=inst.next_sequence,
        sessions_bound=state.cluster.sessions.bound_on(slot),
    )


def _request_info(
    request_id: str,
    prompt_tokens: int,
    output_tokens: int,
    hashes: Sequence[int],
    session_id: str,
    *,
    waited_s: float = 0.0,
    model: str = "",
    adapter: str = "",
    adapter_bytes: int = 0,
) -> RequestInfo:
    if not request_id:
        raise RequestError("invalid", "request_id is required (it is the idempotency key)")
    if adapter:
        _check_adapter(adapter, "adapter")
    return RequestInfo(
        request_id,
        prompt_tokens,
        max(output_tokens, 1),
        tuple(hashes),
        session_id or None,
        waited_s,
        model,
        adapter,
        adapter_bytes,
    )


def request_info(
    request: pb.ScheduleRequest, max_blocks: int, time_scale: float = 1.0
) -> RequestInfo:
    """A placement request as the core takes it (the core checks its limits when it places
    it), its `queued` wall time in policy seconds (over `time_scale`); raises RequestError
    without an id, with a negative or non-finite `queued`, or with block hashes that
    `block_hashes` refuses (`max_blocks`: the cluster's `Limits.max_blocks`)."""
    waited_s = 0.0
    if request.HasField("queued"):
        waited_s = request.queued.seconds + request.queued.nanos / 1e9
        if not math.isfinite(waited_s) or waited_s < 0:
            raise RequestError("invalid", "queued must be a non-negative duration")
    return _request_info(
        request.request_id,
        request.prompt_tokens,
        request.output_tokens,
        block_hashes(request.block_hashes, request.packed_block_hashes, max_blocks),
        request.session_id,
        waited_s=waited_s / time_scale,
        model=request.model,
        adapter=request.adapter,
        adapter_bytes=request.adapter_bytes,
    )


def explain_request(
    state: ConductorState, request: pb.ExplainRequest, hasher: VllmBlockHasher
) -> RequestInfo:
    """The placement request an Explain describes (token ids hashed by `hasher`, as the
    engines do); raises RequestError."""
    if (request.block_hashes or request.packed_block_hashes) and request.token_ids:
        raise RequestError("invalid", "give block_hashes or token_ids, not both")
    bs = state.scheduler.config.block_size
    limit = state.scheduler.limits.max_blocks
    hashes = block_hashes(request.block_hashes, request.packed_block_hashes, limit)
    if request.token_ids:
        if request.adapter:  # its hashes name the adapter's path, which only Routers know
            raise RequestError("invalid", "an adapter's prompt takes block_hashes, not token_ids")
        hashes = hasher.hash_prompt(request.token_ids)
    prompt = request.prompt_tokens or len(request.token_ids) or len(hashes) * bs + 1
    if not hashes:
        raise RequestError("invalid", "give block_hashes or token_ids (at least one block)")
    return _request_info(
        "explain",
        prompt,
        request.output_tokens,
        hashes,
        request.session_id,
        model=request.model,
        adapter=request.adapter,
        adapter_bytes=request.adapter_bytes,
    )


def completion(state: ConductorState, request: pb.FinishRequest, now: float) -> Completion:
    """The completion a FinishRequest reports, its instances as `state` places them;
    raises RequestError."""
    if not request.request_id:
        raise RequestError("invalid", "request_id is required")
    slot = state.instance(request.instance_id).slot
    decode = state.instance(request.decode_instance_id).slot if request.decode_instance_id else slot
    e2e_s, ttft_s = seconds(request.end_to_end), seconds(request.time_to_first_token)
    arrival = now - max(e2e_s, 0.0)
    return Completion(
        request_id=request.request_id,
        session_id=request.session_id or None,
        instance=slot,
        decode_instance=decode,
        prompt_tokens=request.prompt_tokens,
        output_tokens=request.output_tokens,
        cached_tokens=request.cached_tokens,
        block_hashes=tuple(
            block_hashes(
                request.block_hashes,
                request.packed_block_hashes,
                state.scheduler.limits.max_blocks,
            )
        ),
        arrival=arrival,
        first_token_at=arrival + max(ttft_s, 0.0),
        finished_at=now,
        ok=request.ok,
    )
