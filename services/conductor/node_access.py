"""A Messenger speaks only for its own node's instances: the checks the instance and KV event
RPCs make on the caller's identity (`authz.caller()`, None on a plaintext server, where
nothing is checked) before they change anything."""

from __future__ import annotations

from services.common.security.authz import caller, node_refusal
from services.conductor.rpc_status import Context
from services.conductor.state import ConductorState


async def require_node(context: Context, node: str, what: str) -> None:
    """Return if the caller may act for `what` on `node`; else end the call with
    PERMISSION_DENIED."""
    refusal = node_refusal(caller(), node, what)
    if refusal is not None:
        await context.abort(refusal.code, refusal.message)


async def require_instance_node(context: Context, state: ConductorState, instance_id: str) -> None:
    """`require_node` for the node `instance_id` is registered on; an unknown instance passes
    (the RPC itself answers NOT_FOUND for it)."""
    inst = state.instances.get(instance_id)
    if inst is not None:
        await require_node(context, inst.spec.node, f"instance {instance_id!r}")
