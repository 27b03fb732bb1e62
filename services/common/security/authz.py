"""Which roles may call which RPC, and the server interceptor that enforces it on mTLS
servers: the caller's identity comes from its verified client certificate (`identity`);
an RPC is refused UNAUTHENTICATED when the certificate names no kvsched identity, and
PERMISSION_DENIED when it names one whose role the RPC is not open to. Finer checks that
need a request's fields (a Messenger speaks for its own node's instances only) are the
handlers' own, through `caller()` and `may_act_for_node`.

Plaintext servers (`--insecure`) have no identities: nothing is checked there."""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from services.common.security.identity import Identity, Role, peer_identity
from services.common.serving.grpc_handlers import (
    Behavior,
    Handler,
    WrappingInterceptor,
    behavior_of,
    same_kind,
)

CONDUCTOR, ROUTER, MESSENGER, ADMIN = Role.CONDUCTOR, Role.ROUTER, Role.MESSENGER, Role.ADMIN
_CONDUCTOR_API = "/kvsched.conductor.v1.ConductorService/"
_MESSENGER_API = "/kvsched.messenger.v1.MessengerService/"
_ROUTER_API = "/kvsched.router.v1.RouterService/"

# Every RPC of the project's services and the roles it is open to: the least each caller
# needs (docs/security.md explains each row). Methods missing here are refused to all.
ACCESS: Mapping[str, frozenset[Role]] = {
    # Instances: their node's Messenger registers and keeps them (own node only, checked
    # by the handler); an operator may also deregister one.
    _CONDUCTOR_API + "RegisterInstance": frozenset({MESSENGER}),
    _CONDUCTOR_API + "KeepAliveInstance": frozenset({MESSENGER}),
    _CONDUCTOR_API + "DeregisterInstance": frozenset({MESSENGER, ADMIN}),
    _CONDUCTOR_API + "ListInstances": frozenset({ROUTER, MESSENGER, ADMIN}),
    # KV events: a Messenger publishes its own node's instances' (checked per batch).
    _CONDUCTOR_API + "StreamKvEvents": frozenset({MESSENGER}),
    _CONDUCTOR_API + "PublishKvEvents": frozenset({MESSENGER}),
    # ... and mirrors them to the standbys (own node's, checked per batch), which keep them.
    _CONDUCTOR_API + "MirrorKvEvents": frozenset({MESSENGER}),
    # Placement: the Routers'.
    _CONDUCTOR_API + "Schedule": frozenset({ROUTER}),
    _CONDUCTOR_API + "ScheduleStream": frozenset({ROUTER}),
    _CONDUCTOR_API + "Finish": frozenset({ROUTER}),
    # Transfers: a Router waits for the one its request needs; an executor of the
    # operator's own (`--execute-transfers=false`) reports them.
    _CONDUCTOR_API + "AwaitTransfer": frozenset({ROUTER, ADMIN}),
    _CONDUCTOR_API + "ReportTransfer": frozenset({ADMIN}),
    # Operators: inspect and change policy.
    _CONDUCTOR_API + "GetSession": frozenset({ADMIN}),
    _CONDUCTOR_API + "GetPolicy": frozenset({ADMIN}),
    _CONDUCTOR_API + "SetPolicy": frozenset({ADMIN}),
    _CONDUCTOR_API + "Explain": frozenset({ADMIN}),
    # Every client finds the leader with it.
    _CONDUCTOR_API + "GetLeader": frozenset({CONDUCTOR, ROUTER, MESSENGER, ADMIN}),
    # KV moves: the Conductor orders them from the target node's Messenger, which pulls
    # the blocks from the source node's Messenger.
    _MESSENGER_API + "StartTransfer": frozenset({CONDUCTOR}),
    _MESSENGER_API + "WatchTransfer": frozenset({CONDUCTOR}),
    _MESSENGER_API + "CancelTransfer": frozenset({CONDUCTOR}),
    _MESSENGER_API + "ExportBlocks": frozenset({MESSENGER}),
    _MESSENGER_API + "ReleaseExport": frozenset({MESSENGER}),
    # A Router's own admin API: operators'.
    _ROUTER_API + "GetRouterStatus": frozenset({ADMIN}),
    _ROUTER_API + "SetDraining": frozenset({ADMIN}),
}
# Services any authenticated peer may call (they reveal or change nothing of the cluster).
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "kvsched_caller", default=None
)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a call is refused: the status code and a message naming who and what."""

    code: grpc.StatusCode
    message: str


def check(method: str, identity: Identity | None) -> Refusal | None:
    """None when `identity` may call `method` (a full name, `/package.Service/Method`), else
    the refusal to answer with."""
    if identity is None:
        return Refusal(
            grpc.StatusCode.UNAUTHENTICATED,
            "the client certificate names no kvsched identity (spiffe://kvsched/<role>/<name>)",
        )
    if method.startswith(OPEN_SERVICES):
        return None
    allowed = ACCESS.get(method, frozenset())
    if identity.role in allowed:
        return None
    roles = ", ".join(sorted(allowed)) or "no one"
    return Refusal(
        grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not call {method} (open to: {roles})"
    )


def caller() -> Identity | None:
    """The identity of the peer of the RPC being handled; None on a plaintext server (where
    nothing is authorised) or outside an RPC."""
    return _CALLER.get()


def may_act_for_node(identity: Identity | None, node: str) -> bool:
    """Whether `identity` may act for an instance on `node`: a Messenger only for its own
    node; any other role the RPC is open to, and anyone where authorisation is off."""
    return identity is None or identity.role != Role.MESSENGER or identity.name == node


def node_refusal(identity: Identity | None, node: str, what: str) -> Refusal | None:
    """The PERMISSION_DENIED for `identity` acting on `what` of `node`, None when it may."""
    if may_act_for_node(identity, node):
        return None
    return Refusal(
        grpc.StatusCode.PERMISSION_DENIED, f"{identity} may not act for {what} of node {node!r}"
    )


def authz_interceptor() -> grpc.aio.ServerInterceptor[Any, Any]:
    """For an mTLS server: refuses each call `check` refuses, before its handler runs, and
    makes the caller's identity `caller()` while the handler runs."""
    return _AuthzInterceptor()


class _AuthzInterceptor(WrappingInterceptor):
    """Checks the caller before each method's handler runs, keeping the handler's kind:
    coroutine, async generator or plain function, which tells grpc.aio how to call it."""

    def wrap_handler(self, handler: Handler, method: str) -> Handler:
        return same_kind(handler, _wrap(behavior_of(handler), method))


def _wrap(behavior: Behavior, method: str) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def checked_gen(request: Any, context: Any) -> AsyncIterator[Any]:
            # Set, not reset: a stream may be closed from another context, and the
            # RPC's task (whose context this is) ends with it.
            _CALLER.set(await _admit(method, context))
            async for item in behavior(request, context):
                yield item

        return checked_gen
    if inspect.iscoroutinefunction(behavior):

        async def checked(request: Any, context: Any) -> Any:
            identity = await _admit(method, context)
            token = _CALLER.set(identity)
            try:
                return await behavior(request, context)
            finally:
                _CALLER.reset(token)

        return checked

    def checked_sync(request: Any, context: Any) -> Any:  # run on grpc's thread pool
        identity = peer_identity(context)
        refusal = check(method, identity)
        if refusal is not None:
            context.abort(refusal.code, refusal.message)
        token = _CALLER.set(identity)
        try:
            return behavior(request, context)
        finally:
            _CALLER.reset(token)

    return checked_sync


async def _admit(method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Identity:
    """The caller's identity; aborts the call when `check` refuses it."""
    identity = peer_identity(context)
    refusal = check(method, identity)
    if refusal is not None:
        await context.abort(refusal.code, refusal.message)
    assert identity is not None  # check refuses a call without one
    return identity
