"""How the Conductor's RPCs refuse: a `RequestError` as the gRPC status a caller can act on,
a write that reaches a standby sent to the leader, etcd away as UNAVAILABLE."""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvsched.core.requests import RequestError
from services.conductor.leadership import Leadership

Context = grpc.aio.ServicerContext[object, object]

CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}


async def abort(context: Context, exc: RequestError) -> NoReturn:
    """End the call with `exc`'s status; a batch out of sequence says where to resume."""
    if exc.next_sequence is not None:
        context.set_trailing_metadata((("kvsched-next-sequence", str(exc.next_sequence)),))
    await context.abort(CODES[exc.kind], str(exc))
    raise AssertionError("unreachable")  # abort raises


async def etcd_away(context: Context, what: str, exc: Exception) -> NoReturn:
    """End the call as UNAVAILABLE: `what` (e.g. "etcd is unavailable") and why."""
    await context.abort(grpc.StatusCode.UNAVAILABLE, f"{what}: {exc}")
    raise AssertionError("unreachable")  # abort raises


async def require_leader(leadership: Leadership, context: Context) -> None:
    """Return if this Conductor serves writes; else end the call with FAILED_PRECONDITION
    and the leader's address in the `kvsched-leader` trailer (empty when unknown)."""
    if leadership.serving:
        return
    leader = leadership.leader
    here = leader is not None and leader.id == leadership.self_id
    address = "" if leader is None or here else leader.url
    context.set_trailing_metadata((("kvsched-leader", address),))
    where = f"the leader is {leader.id} at {address}" if leader and address else "no leader yet"
    await context.abort(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"Conductor {leadership.self_id} does not lead; {where}",
    )
