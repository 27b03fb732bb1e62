"""A cluster started by `kvsched up` with no security flags is authenticated and authorised:
every gRPC hop is mutual TLS, each RPC is open only to the roles that need it, a Messenger
speaks only for its own node's instances, and the Conductor's admin HTTP API asks for the
admin token (docs/security.md)."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsched.api.common.v1 import common_pb2
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from kvsched.api.router.v1 import router_service_pb2 as rpb
from kvsched.api.router.v1 import router_service_pb2_grpc as rpb_grpc
from services.common.security.identity import Identity, Role
from services.common.security.tls import ClientTls, aio_channel
from tests.conftest import REPO
from tests.e2e.conftest import ADMIN, LocalCluster

pytestmark = pytest.mark.slow

NODE_0 = Identity(Role.MESSENGER, "node-0")
ROUTER_0 = Identity(Role.ROUTER, "router-0")
TIMEOUT_S = 5.0


def _conductor(cluster: LocalCluster) -> str:
    return str(cluster.endpoints["conductors"][0]["url"])


async def _code(call: object) -> grpc.StatusCode:
    """The status code a call ends with (OK when it is answered)."""
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture
async def as_node_0(cluster: LocalCluster) -> AsyncIterator[pb_grpc.ConductorServiceAsyncStub]:
    async with aio_channel(_conductor(cluster), cluster.tls(NODE_0)) as channel:
        yield pb_grpc.ConductorServiceStub(channel)


def _spec(instance_id: str, node: str) -> pb.InstanceSpec:
    return pb.InstanceSpec(
        instance_id=instance_id,
        url="http://127.0.0.1:9",
        node=node,
        role=common_pb2.ROLE_BOTH,
        model="forged",
        messenger_url="127.0.0.1:9",
    )


async def _instances(cluster: LocalCluster) -> dict[str, pb.InstanceSpec]:
    async with aio_channel(_conductor(cluster), cluster.tls(ADMIN)) as channel:
        stub = pb_grpc.ConductorServiceStub(channel)
        listed = await stub.ListInstances(pb.ListInstancesRequest(), timeout=TIMEOUT_S)
    return {status.spec.instance_id: status.spec for status in listed.instances}


async def test_the_cluster_is_secure_by_default(cluster: LocalCluster) -> None:
    assert "admin" in cluster.endpoints  # kvsched up minted the credentials
    assert cluster.endpoints["etcd"]["url"].startswith("https://")


async def test_clients_without_a_certificate_get_no_answer(cluster: LocalCluster) -> None:
    request = pb.GetLeaderRequest()
    async with grpc.aio.insecure_channel(_conductor(cluster)) as channel:  # plaintext
        stub = pb_grpc.ConductorServiceStub(channel)
        assert await _code(stub.GetLeader(request, timeout=TIMEOUT_S)) in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAUTHENTICATED,
        )
    ca_only = ClientTls(str(cluster.tls(ADMIN).ca_file))  # type: ignore[union-attr]
    async with aio_channel(_conductor(cluster), ca_only) as channel:  # TLS, no certificate
        stub = pb_grpc.ConductorServiceStub(channel)
        assert await _code(stub.GetLeader(request, timeout=TIMEOUT_S)) in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.UNAUTHENTICATED,
        )
    servers = [m["url"] for m in cluster.endpoints["messengers"]]
    servers += [r["grpc_url"] for r in cluster.endpoints["routers"]]
    for url in servers:  # every gRPC server, not only the Conductor
        async with grpc.aio.insecure_channel(url) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            call = check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert await _code(call) == grpc.StatusCode.UNAVAILABLE


async def test_each_role_is_refused_what_it_does_not_need(
    cluster: LocalCluster, as_node_0: pb_grpc.ConductorServiceAsyncStub
) -> None:
    set_policy = pb.SetPolicyRequest(spec="least_loaded")
    assert await _code(as_node_0.SetPolicy(set_policy, timeout=TIMEOUT_S)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    async with aio_channel(_conductor(cluster), cluster.tls(ROUTER_0)) as channel:
        as_router = pb_grpc.ConductorServiceStub(channel)
        forged = pb.RegisterInstanceRequest(spec=_spec("forged-e0", "node-0"))
        assert await _code(as_router.RegisterInstance(forged, timeout=TIMEOUT_S)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
    assert "forged-e0" not in await _instances(cluster)
    router_grpc = cluster.endpoints["routers"][0]["grpc_url"]
    async with aio_channel(router_grpc, cluster.tls(ROUTER_0)) as channel:
        drain = rpb.SetDrainingRequest(draining=True)
        call = rpb_grpc.RouterServiceStub(channel).SetDraining(drain, timeout=TIMEOUT_S)
        assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
    async with aio_channel(router_grpc, cluster.tls(ADMIN)) as channel:
        status = rpb_grpc.RouterServiceStub(channel).GetRouterStatus(
            rpb.GetRouterStatusRequest(), timeout=TIMEOUT_S
        )
        assert not (await status).draining


async def test_a_messenger_acts_for_its_own_node_only(
    cluster: LocalCluster, as_node_0: pb_grpc.ConductorServiceAsyncStub
) -> None:
    before = await _instances(cluster)
    theirs = next(iid for iid, spec in before.items() if spec.node == "node-1")
    refused = [
        as_node_0.RegisterInstance(  # a new instance claimed on another node
            pb.RegisterInstanceRequest(spec=_spec("forged-e1", "node-1")), timeout=TIMEOUT_S
        ),
        as_node_0.RegisterInstance(  # another node's instance taken over as its own
            pb.RegisterInstanceRequest(spec=_spec(theirs, "node-0")), timeout=TIMEOUT_S
        ),
        as_node_0.KeepAliveInstance(
            pb.KeepAliveInstanceRequest(instance_id=theirs), timeout=TIMEOUT_S
        ),
        as_node_0.DeregisterInstance(
            pb.DeregisterInstanceRequest(instance_id=theirs), timeout=TIMEOUT_S
        ),
        as_node_0.PublishKvEvents(
            pb.PublishKvEventsRequest(batch=pb.KvEventBatch(instance_id=theirs, resync=True)),
            timeout=TIMEOUT_S,
        ),
    ]
    for call in refused:
        assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
    after = await _instances(cluster)
    assert "forged-e1" not in after and after[theirs] == before[theirs]  # nothing applied


async def test_the_operator_may_set_the_policy(cluster: LocalCluster) -> None:
    async with aio_channel(_conductor(cluster), cluster.tls(ADMIN)) as channel:
        stub = pb_grpc.ConductorServiceStub(channel)
        policy = await stub.GetPolicy(pb.GetPolicyRequest(), timeout=TIMEOUT_S)
        same = pb.SetPolicyRequest(spec=policy.spec)  # the same one: later tests keep theirs
        answer = await stub.SetPolicy(same, timeout=TIMEOUT_S)
        assert answer.spec == policy.spec


async def test_the_admin_http_api_takes_the_admin_token(cluster: LocalCluster) -> None:
    stats = f"{cluster.conductor_http}/api/nodes/stats"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, cluster.auth):
            async with http.get(stats, headers=headers) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["type"] == "authentication_error"
        async with http.get(stats, headers=cluster.admin_headers) as resp:
            assert resp.status == 200 and (await resp.json())["instances"]
        async with http.get(f"{cluster.conductor_http}/metrics") as resp:
            assert resp.status == 200  # scraped without a credential


async def test_etcd_takes_only_clients_with_a_certificate(cluster: LocalCluster) -> None:
    health = f"{cluster.endpoints['etcd']['url']}/health"
    tls = cluster.tls(ADMIN)
    assert tls is not None and tls.cert_file and tls.key_file
    anonymous = ssl.create_default_context(cafile=tls.ca_file)
    mutual = ssl.create_default_context(cafile=tls.ca_file)
    mutual.load_cert_chain(tls.cert_file, tls.key_file)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http:
        with pytest.raises(aiohttp.ClientError):
            async with http.get(health, ssl=anonymous) as resp:
                await resp.read()
        async with http.get(health, ssl=mutual) as resp:
            assert resp.status == 200


def _admin_cli(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    endpoints = cluster.run_dir.parent / "endpoints.json"  # where local_cluster has it written
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "admin", "--endpoints", str(endpoints), *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


async def test_kvsched_admin_calls_as_the_operator(cluster: LocalCluster) -> None:
    shown = await asyncio.to_thread(_admin_cli, cluster, "policy")
    assert shown.returncode == 0, shown.stderr
    policy = shown.stdout.strip()
    assert policy == cluster.endpoints["policy"]
    node_0 = cluster.tls(NODE_0)
    assert node_0 is not None and node_0.cert_file and node_0.key_file
    as_messenger = ("--cert", node_0.cert_file, "--key", node_0.key_file)
    refused = await asyncio.to_thread(_admin_cli, cluster, *as_messenger, "policy", policy)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
    router_grpc = cluster.endpoints["routers"][0]["grpc_url"]
    async with aio_channel(router_grpc, cluster.tls(ADMIN)) as channel:
        stub = rpb_grpc.RouterServiceStub(channel)
        for state, draining in (("on", True), ("off", False)):
            done = await asyncio.to_thread(_admin_cli, cluster, "drain", state)
            assert done.returncode == 0, done.stderr
            status = await stub.GetRouterStatus(rpb.GetRouterStatusRequest(), timeout=TIMEOUT_S)
            assert status.draining is draining
