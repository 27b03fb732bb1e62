"""The Conductor's HTTP admin endpoint (aiohttp client against a live Conductor on a fresh
real etcd): leader, node stats, sessions, explain and Prometheus metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from google.protobuf.duration_pb2 import Duration
from prometheus_client.parser import text_string_to_metric_families

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.conductor.app import Conductor
from tests.conductor.conftest import chain, instance, stub
from tests.fixtures.poll import wait_for

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

Start = Callable[..., Awaitable[Conductor]]
BS = 16
IID = [instance(i).instance_id for i in range(8)]


async def register(s: ConductorServiceAsyncStub, i: int) -> pb.InstanceStatus:
    request = pb.RegisterInstanceRequest(spec=instance(i), lease_ttl=Duration(seconds=30))
    return (await s.RegisterInstance(request)).instance


async def publish(s: ConductorServiceAsyncStub, iid: str, seq: int, *events: pb.KvEvent) -> None:
    batch = pb.KvEventBatch(instance_id=iid, sequence=seq, events=events)
    await s.PublishKvEvents(pb.PublishKvEventsRequest(batch=batch))


def stored(hashes: Sequence[int]) -> pb.KvEvent:
    return pb.KvEvent(blocks_stored=pb.BlocksStored(block_hashes=hashes, tier=common.TIER_GPU))


def sched(rid: str, hashes: Sequence[int], session: str = "") -> pb.ScheduleRequest:
    return pb.ScheduleRequest(
        request_id=rid,
        prompt_tokens=len(hashes) * BS + 1,
        output_tokens=8,
        block_hashes=hashes,
        session_id=session,
    )


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as r:
        return r.status, await r.json()


async def post(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> tuple[int, Any]:
    async with http.post(url, **kwargs) as r:
        return r.status, await r.json()


def assert_error(status: int, body: Any, expected: int) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and set(body) == {"error"}
    assert body["error"]["code"] == expected
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


async def test_leader_endpoint_on_leader_and_standby(start_conductor: Start) -> None:
    c1 = await start_conductor(conductor_id="c1")
    c2 = await start_conductor(conductor_id="c2", lead=False)
    async with aiohttp.ClientSession() as http:
        status, body = await get(http, f"{c1.http_url}/api/leader")
        assert status == 200
        assert body == {
            "self_id": "c1",
            "is_leader": True,
            "leader_id": "c1",
            "leader_url": c1.http_url,
        }

        async def standby_view() -> Any:
            _, view = await get(http, f"{c2.http_url}/api/leader")
            return view if view["leader_id"] == "c1" else None

        body = await wait_for(standby_view, 5.0, message="the standby learns who leads")
        assert body == {
            "self_id": "c2",
            "is_leader": False,
            "leader_id": "c1",
            "leader_url": c1.http_url,
        }


async def test_node_stats_list_instances_with_their_load(start_conductor: Start) -> None:
    c = await start_conductor()
    async with stub(c.url) as s, aiohttp.ClientSession() as http:
        _, empty = await get(http, f"{c.http_url}/api/nodes/stats")
        assert empty["instances"] == [] and empty["policy"] == "cache_aware"
        slots = [(await register(s, i)).slot for i in range(2)]
        load = common.LoadReport(running=3, waiting=2, pending_prefill_tokens=100, free_blocks=500)
        await publish(s, IID[1], 0, stored(chain(1, 4)), pb.KvEvent(load=load))
        placed = await s.Schedule(sched("r1", chain(1, 4), session="sess"))
        assert placed.decision.instance_id == IID[1]
        status, body = await get(http, f"{c.http_url}/api/nodes/stats")
        assert status == 200
        assert body["policy"] == "cache_aware"
        assert body["sessions"] == 1
        assert body["index_blocks"] == 4
        rows = {row["instance_id"]: row for row in body["instances"]}
        assert list(rows) == IID[:2]  # by slot
        listed = (await s.ListInstances(pb.ListInstancesRequest())).instances
        for st in listed:
            row = rows[st.spec.instance_id]
            assert row["slot"] == st.slot == slots[IID.index(st.spec.instance_id)]
            assert row["url"] == st.spec.url and row["node"] == st.spec.node
            assert row["in_flight"] == st.in_flight
            assert row["gpu_blocks"] == st.gpu_blocks
            assert row["pending_prefill_tokens"] == st.load.pending_prefill_tokens
            assert row["running"] == st.load.running
            assert row["waiting"] == st.load.waiting
            assert row["free_blocks"] == st.load.free_blocks
            assert row["sessions_bound"] == st.sessions_bound
            assert row["next_event_sequence"] == st.next_event_sequence
        busy = rows[IID[1]]
        assert busy["in_flight"] == 1 and busy["sessions_bound"] == 1
        assert busy["running"] == 3 and busy["next_event_sequence"] == 1
        assert busy["waiting"] == 3  # the report plus the placement since
        assert busy["pending_prefill_tokens"] > 100  # the report plus the uncached prompt
        assert busy["gpu_blocks"] >= 4
        idle = rows[IID[0]]
        assert idle["in_flight"] == 0 and idle["gpu_blocks"] == 0 and idle["running"] == 0


async def test_session_endpoint_known_and_unknown(start_conductor: Start) -> None:
    c = await start_conductor()
    async with stub(c.url) as s, aiohttp.ClientSession() as http:
        await register(s, 0)
        placed = await s.Schedule(sched("r1", chain(1, 2), session="chat-1"))
        status, body = await get(http, f"{c.http_url}/api/sessions/chat-1")
        assert status == 200
        assert body["session_id"] == "chat-1"
        assert body["host_instance_id"] == placed.decision.instance_id == IID[0]
        assert body["turns"] == 1
        assert body["migrations"] == 0
        assert body["moving_to_instance_id"] == ""
        # An id with a `/` (or other reserved characters) is reached percent-encoded.
        await s.Schedule(sched("r2", chain(2, 2), session="user/7 a?"))
        status, body = await get(http, f"{c.http_url}/api/sessions/user%2F7%20a%3F")
        assert status == 200, body
        assert body["session_id"] == "user/7 a?" and body["turns"] == 1
        status, body = await get(http, f"{c.http_url}/api/sessions/nobody")
        assert_error(status, body, 404)
        assert "nobody" in body["error"]["message"]


async def test_explain_by_query_hashes_and_prompt(start_conductor: Start) -> None:
    c = await start_conductor()
    text = "The quick brown fox jumps over the lazy dog, again and again and again."
    prompt_hashes = VllmBlockHasher(BS).hash_prompt(list(text.encode()))
    assert len(prompt_hashes) == len(text.encode()) // BS
    hashes = chain(1, 5)
    async with stub(c.url) as s, aiohttp.ClientSession() as http:
        for i in range(3):
            await register(s, i)
        await publish(s, IID[1], 0, stored(hashes))
        await publish(s, IID[2], 0, stored(prompt_hashes))
        url = f"{c.http_url}/api/explain"

        def check(body: Any, chosen: str, cached: int) -> None:
            assert body["policy"] == "cache_aware"
            assert body["rule"] and body["rejected"] is False
            assert body["instance"] == chosen
            assert body["cached_tokens"] == cached
            rows = body["candidates"]
            assert {row["instance"] for row in rows} == set(IID[:3])
            assert [row["instance"] for row in rows if row["chosen"]] == [chosen]
            for row in rows:
                assert "ttft_s" in row and "hit_tokens" in row
                assert row["hit_tokens"] == (cached if row["instance"] == chosen else 0)
                # Each hit by tier: these are all in GPU memory, none only in a node's pool.
                assert (row["gpu_hit_tokens"], row["pool_tokens"]) == (row["hit_tokens"], 0)

        status, body = await get(http, f"{url}?hashes={','.join(map(str, hashes))}")
        assert status == 200, body
        check(body, IID[1], len(hashes) * BS)
        status, body = await post(http, url, json={"block_hashes": hashes})
        assert status == 200, body
        check(body, IID[1], len(hashes) * BS)
        status, body = await post(http, url, json={"prompt": text, "output_tokens": 4})
        assert status == 200, body
        check(body, IID[2], len(prompt_hashes) * BS)
        # Explaining changed nothing.
        assert float(c.state.cluster.load.in_flight.sum()) == 0
        assert c.state.cluster.index.pending_count() == 0


async def test_explain_refuses_malformed_requests(start_conductor: Start) -> None:
    c = await start_conductor()
    async with stub(c.url) as s, aiohttp.ClientSession() as http:
        url = f"{c.http_url}/api/explain"
        # No instance yet: nothing to explain against.
        async with http.post(url, json={"block_hashes": [1, 2]}) as r:
            assert_error(r.status, await r.json(), 503)
            assert r.headers["Retry-After"] == "1"
        await register(s, 0)
        bad: list[dict[str, Any]] = [
            {"data": b"{not json", "headers": {"Content-Type": "application/json"}},
            {"json": [1, 2, 3]},
            {"json": {"block_hashes": ["x"]}},
            {"json": {"block_hashes": 7}},
            {"json": {"block_hashes": [-1]}},
            {"json": {}},
            {"json": {"block_hashes": [1, 2], "token_ids": [1, 2, 3]}},
            {"json": {"block_hashes": [1, 2], "prompt_tokens": "many"}},
            # Nesting deeper than json's parser recurses, and a prompt that is not Unicode.
            {"data": b"[" * 100_000 + b"]" * 100_000},
            {"json": {"prompt": "a\ud800b"}},
        ]
        for kwargs in bad:
            status, body = await post(http, url, **kwargs)
            assert_error(status, body, 400)
        status, body = await get(http, f"{url}?hashes=1,zz")
        assert_error(status, body, 400)
        status, body = await get(http, url)
        assert_error(status, body, 400)


async def test_metrics_expose_decision_histogram_and_instance_gauges(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s, aiohttp.ClientSession() as http:
        for i in range(2):
            await register(s, i)
        for n in range(5):
            await s.Schedule(sched(f"r{n}", chain(n + 1, 2)))
        async with http.get(f"{c.http_url}/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    decision = families["kvsched_conductor_decision_seconds"]
    assert decision.type == "histogram"
    samples = {sample.name: sample for sample in decision.samples if not sample.labels}
    assert samples["kvsched_conductor_decision_seconds_count"].value == 5
    assert samples["kvsched_conductor_decision_seconds_sum"].value > 0
    buckets = [x for x in decision.samples if x.name.endswith("_bucket")]
    assert buckets and buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 5
    placed = [
        x.value for x in families["kvsched_conductor_decisions"].samples
        if x.name == "kvsched_conductor_decisions_total" and x.labels == {"outcome": "placed"}
    ]  # fmt: skip
    assert placed == [5]
    in_flight = {
        x.labels["instance"]: x.value
        for x in families["kvsched_conductor_instance_in_flight"].samples
    }
    assert set(in_flight) == set(IID[:2])
    assert sum(in_flight.values()) == 5
    pending = families["kvsched_conductor_instance_pending_prefill_tokens"].samples
    assert {x.labels["instance"] for x in pending} == set(IID[:2])
    assert sum(x.value for x in pending) > 0
    assert families["kvsched_conductor_is_leader"].samples[0].value == 1
