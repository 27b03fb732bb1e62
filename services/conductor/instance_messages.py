"""An instance's messages to and from core values: its `InstanceSpec` and role, the load it
reports (`LoadReport`, its adapters checked) and the `InstanceStatus` the Conductor answers
with, read out of its slot. Unspecified enums and missing fields raise `RequestError`."""

from __future__ import annotations

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.adapters import MAX_ADAPTER_NAME, MAX_ADAPTERS, AdapterReport
from kvsched.core.cluster import Role
from kvsched.core.load import LoadReport
from kvsched.core.requests import RequestError
from services.common.serving.durations import duration, seconds
from services.conductor.keys import InstanceSpec
from services.conductor.state import ConductorState
from services.kv_events.messages import adapter_message

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


def role(value: int) -> Role:
    found = ROLES.get(value)
    if found is None:
        raise RequestError(
            "invalid", f"role must be ROLE_BOTH, ROLE_PREFILL or ROLE_DECODE, got {value}"
        )
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
            check_adapter_name(name, "adapters")
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


def check_adapter_name(name: str, where: str) -> None:
    """Raises RequestError unless `name` is an adapter's: 1 to `MAX_ADAPTER_NAME` characters
    (`where` names the field in the message)."""
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
