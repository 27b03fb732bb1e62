"""The roles table: every RPC of every service has its roles, each call is refused with the
right code, and a Messenger acts for its own node only."""

from __future__ import annotations

import grpc
import pytest

from kvsched.api.conductor.v1 import conductor_service_pb2
from kvsched.api.messenger.v1 import messenger_service_pb2
from kvsched.api.router.v1 import router_service_pb2
from services.common.security.authz import ACCESS, check, may_act_for_node, node_refusal
from services.common.security.identity import Identity, Role

ADMIN = Identity(Role.ADMIN, "operator")
ROUTER = Identity(Role.ROUTER, "router-0")
MESSENGER = Identity(Role.MESSENGER, "node-0")
CONDUCTOR = Identity(Role.CONDUCTOR, "conductor-0")
ETCD = Identity(Role.ETCD, "etcd")
CONDUCTOR_API = "/kvsched.conductor.v1.ConductorService/"


def _methods() -> set[str]:
    out = set()
    for module in (conductor_service_pb2, messenger_service_pb2, router_service_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_every_rpc_has_roles_and_the_table_names_only_rpcs() -> None:
    assert set(ACCESS) == _methods()
    assert all(ACCESS.values())  # open to someone
    assert not any(Role.ETCD in roles for roles in ACCESS.values())


@pytest.mark.parametrize(
    ("identity", "method"),
    [
        (MESSENGER, "SetPolicy"),
        (ROUTER, "RegisterInstance"),
        (ROUTER, "PublishKvEvents"),
        (MESSENGER, "Schedule"),
        (ADMIN, "Schedule"),
        (CONDUCTOR, "RegisterInstance"),
        (ETCD, "GetLeader"),
        (ROUTER, "SetPolicy"),
        (ROUTER, "DeregisterInstance"),
    ],
)
def test_roles_are_refused_what_they_do_not_need(identity: Identity, method: str) -> None:
    refusal = check(CONDUCTOR_API + method, identity)
    assert refusal is not None and refusal.code is grpc.StatusCode.PERMISSION_DENIED
    assert str(identity) in refusal.message and method in refusal.message


@pytest.mark.parametrize(
    ("identity", "method"),
    [
        (ADMIN, CONDUCTOR_API + "SetPolicy"),
        (ADMIN, CONDUCTOR_API + "DeregisterInstance"),
        (ADMIN, "/kvsched.router.v1.RouterService/SetDraining"),
        (MESSENGER, CONDUCTOR_API + "RegisterInstance"),
        (MESSENGER, CONDUCTOR_API + "StreamKvEvents"),
        (MESSENGER, "/kvsched.messenger.v1.MessengerService/ExportBlocks"),
        (ROUTER, CONDUCTOR_API + "ScheduleStream"),
        (ROUTER, CONDUCTOR_API + "Finish"),
        (ROUTER, CONDUCTOR_API + "GetLeader"),
        (CONDUCTOR, "/kvsched.messenger.v1.MessengerService/StartTransfer"),
        (ETCD, "/grpc.health.v1.Health/Check"),  # health: any authenticated peer
    ],
)
def test_roles_are_allowed_what_they_need(identity: Identity, method: str) -> None:
    assert check(method, identity) is None


def test_no_identity_is_unauthenticated_and_unknown_methods_are_refused() -> None:
    refusal = check(CONDUCTOR_API + "GetLeader", None)
    assert refusal is not None and refusal.code is grpc.StatusCode.UNAUTHENTICATED
    refusal = check("/grpc.health.v1.Health/Check", None)
    assert refusal is not None and refusal.code is grpc.StatusCode.UNAUTHENTICATED
    refusal = check("/kvsched.other.v1.Other/Do", ADMIN)
    assert refusal is not None and refusal.code is grpc.StatusCode.PERMISSION_DENIED


def test_a_messenger_acts_for_its_own_node_only() -> None:
    assert may_act_for_node(MESSENGER, "node-0")
    assert not may_act_for_node(MESSENGER, "node-1")
    assert may_act_for_node(ADMIN, "node-1")  # an operator deregisters any instance
    assert may_act_for_node(None, "node-1")  # plaintext server: nothing authorised
    refusal = node_refusal(MESSENGER, "node-1", "instance 'e1'")
    assert refusal is not None and refusal.code is grpc.StatusCode.PERMISSION_DENIED
    assert "node-1" in refusal.message and "e1" in refusal.message
    assert node_refusal(MESSENGER, "node-0", "instance 'e0'") is None
