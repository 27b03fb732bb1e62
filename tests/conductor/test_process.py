"""A Conductor as its operators run it: a process that can be killed, serving health and
reflection, and mutual TLS."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.python import ConductorClient
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.security.tls import ServerTls
from services.common.store.etcd import EtcdStore
from services.conductor import keys
from services.conductor.app import SERVICE_NAME, Conductor
from tests.conductor.conftest import ConductorProcess, instance, leader_of
from tests.fixtures.etcd import EtcdServer, make_tls
from tests.fixtures.poll import wait_for

Start = Callable[..., Awaitable[Conductor]]


async def test_a_conductor_killed_with_sigkill_comes_back_warm(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    first = ConductorProcess(etcd, "c0", tmp_path / "c0.log", policy="sticky")
    hashes = [(7 << 40) + i for i in range(6)]
    try:
        async with ConductorClient([first.url], deadline_s=1.0) as client:
            await wait_for(lambda: leader_of(client), 15.0, message="the first Conductor leads")
            for i in range(2):
                await client.register_instance(instance(i), lease_ttl_s=60)
            iid = instance(0).instance_id
            stored = pb.BlocksStored(block_hashes=hashes, tier=common.TIER_GPU)
            batch = pb.KvEventBatch(
                instance_id=iid, sequence=0, events=[pb.KvEvent(blocks_stored=stored)]
            )
            await client.publish_events(batch)
            placed = await client.schedule(
                pb.ScheduleRequest(
                    request_id="r0",
                    prompt_tokens=len(hashes) * 16 + 1,
                    output_tokens=4,
                    block_hashes=hashes,
                    session_id="agent-1",
                )
            )
            assert placed.instance_id == iid and placed.cached_tokens == len(hashes) * 16
            # Block metadata is written behind: wait until it is in etcd, then crash.
            prefix = keys.blocks_prefix(iid).encode()
            await wait_for(
                lambda: _count(etcd, prefix, len(hashes)), 5.0, message="blocks persisted"
            )
    finally:
        first.kill()
    second = ConductorProcess(etcd, "c1", tmp_path / "c1.log", policy="least_loaded")
    try:
        async with ConductorClient([second.url], deadline_s=1.0) as client:
            # The dead one's leader key lives on until its lease lapses.
            await wait_for(lambda: leader_of(client), 15.0, message="the new Conductor leads")
            listed = {i.spec.instance_id: i for i in await client.list_instances()}
            assert set(listed) == {instance(0).instance_id, instance(1).instance_id}
            assert listed[iid].gpu_blocks == len(hashes)
            assert listed[iid].next_event_sequence == 1
            session = await client.get_session("agent-1")
            assert session.host_instance_id == iid
            assert (await client.get_policy()).spec == "sticky"  # etcd's, not the flag's
    finally:
        second.stop()


async def _count(etcd: EtcdServer, prefix: bytes, n: int) -> bool:
    async with EtcdStore(etcd.settings()) as store:
        return len(await store.get_prefix(prefix)) == n


async def test_health_and_reflection(start_conductor: Start) -> None:
    leader = await start_conductor(conductor_id="c1")
    standby = await start_conductor(conductor_id="c2", lead=False)
    for c, expected in ((leader, "SERVING"), (standby, "NOT_SERVING")):
        async with grpc.aio.insecure_channel(c.url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert overall.status == health_pb2.HealthCheckResponse.SERVING
            mine = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert health_pb2.HealthCheckResponse.ServingStatus.Name(mine.status) == expected
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            async for answer in stub.ServerReflectionInfo(iter([ask])):
                names = {s.name for s in answer.list_services_response.service}
                assert SERVICE_NAME in names
                break


async def test_mutual_tls_admits_only_clients_with_a_certificate(
    start_conductor: Start, tmp_path: Path
) -> None:
    tls = make_tls(tmp_path)
    files = ServerTls(str(tls.server_cert), str(tls.server_key), str(tls.ca_file))
    c = await start_conductor(tls=files)
    ca = tls.ca_file.read_bytes()
    good = grpc.ssl_channel_credentials(
        ca, tls.client_key.read_bytes(), tls.client_cert.read_bytes()
    )
    async with ConductorClient([c.url], credentials=good, deadline_s=2.0) as client:
        assert (await client.get_leader()).is_leader
    anonymous = grpc.ssl_channel_credentials(ca)
    async with grpc.aio.secure_channel(c.url, anonymous) as channel:
        call = channel.unary_unary(
            "/kvsched.conductor.v1.ConductorService/GetLeader",
            request_serializer=pb.GetLeaderRequest.SerializeToString,
            response_deserializer=pb.GetLeaderResponse.FromString,
        )
        try:
            await call(pb.GetLeaderRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        else:
            raise AssertionError("a client without a certificate was served")
