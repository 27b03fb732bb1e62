"""Placement's messages to and from core values: a ScheduleRequest, ExplainRequest or
FinishRequest into the core's `RequestInfo` or `Completion`, with the boundary checks that
raise `RequestError`, and a `Decision`, `Rejection`, `TransferPlan` or `Session` into its
message, instances named by their ids. Pure conversion: nothing here changes the state it
reads ids and slots from."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import NO_CHANGE, AdapterChange
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.requests import RequestError
from kvsched.core.sessions import NO_HOST, Session
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.serving.durations import duration, seconds
from services.conductor.block_hash_fields import block_hashes
from services.conductor.instance_messages import check_adapter_name
from services.conductor.state import ConductorState

KINDS = {
    TransferKind.FETCH_PREFIX: common.TRANSFER_KIND_FETCH_PREFIX,
    TransferKind.MIGRATE_SESSION: common.TRANSFER_KIND_MIGRATE_SESSION,
    TransferKind.REPLICATE_PREFIX: common.TRANSFER_KIND_REPLICATE_PREFIX,
    TransferKind.HANDOFF: common.TRANSFER_KIND_HANDOFF,
}


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
        check_adapter_name(adapter, "adapter")
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
