"""The Router under overload: the bounded counts, the fallback's per-instance rule, the
Placer's choice between the Conductor, the fallback and a 429 (with a fake Conductor), and
a Router over its in-flight bound refusing before it reads a body."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
import pytest

from clients.python import ConductorError, Rejected, Unavailable
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.inference_api.openai_api import ApiError
from services.router.metrics import RouterMetrics
from services.router.overload import BoundedCount, fits_instance, shed
from services.router.placement import KnownInstance, PlacementQuery
from services.router.placer import Placer
from services.router.settings import parse
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, completion


def test_a_bounded_count_admits_up_to_its_limit_and_no_more() -> None:
    metrics = RouterMetrics()
    count = BoundedCount(2, metrics.placing, metrics.placing_limit)
    assert count.enter() and count.enter()
    assert not count.enter()  # full: refused, nothing counted
    assert count.depth == 2 and metrics.placing._value.get() == 2
    count.leave()
    assert count.enter() and count.depth == 2
    count.leave()
    count.leave()
    assert count.depth == 0 and metrics.placing_limit._value.get() == 2
    with pytest.raises(RuntimeError):
        count.leave()
    with pytest.raises(ValueError):
        BoundedCount(0)


def test_a_shed_request_is_an_openai_429_with_retry_after() -> None:
    err = shed("the queue is full")
    response = err.response()
    body = json.loads(response.body)  # type: ignore[arg-type]
    assert (response.status, response.headers["Retry-After"]) == (429, "1")
    assert body["error"]["code"] == "server_overloaded"
    assert body["error"]["type"] == "rate_limit_error"
    assert "the queue is full" in body["error"]["message"]


def test_the_fallback_admits_under_its_per_instance_bound() -> None:
    assert fits_instance(0, 1) and fits_instance(31, 32)
    assert not fits_instance(32, 32) and not fits_instance(40, 32)


class _FakeStream:
    """A placement stream whose answers the test gives (or withholds)."""

    def __init__(self) -> None:
        self.asked: list[pb.ScheduleRequest] = []
        self.answer: asyncio.Future[pb.Decision] | None = None

    async def schedule(self, request: pb.ScheduleRequest) -> pb.Decision:
        self.asked.append(request)
        assert self.answer is not None
        return await asyncio.shield(self.answer)

    async def finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        return pb.FinishResponse()


class _FakeClient:
    deadline_s = 1.0
    current_leader = None

    def __init__(self) -> None:
        self.list_error: ConductorError | None = None

    async def list_instances(self) -> list[pb.InstanceStatus]:
        if self.list_error is not None:
            raise self.list_error
        return [
            pb.InstanceStatus(spec=pb.InstanceSpec(instance_id=f"i{i}", url=f"http://h{i}"))
            for i in range(2)
        ]


def _placer(
    timeout_s: float = 0.05, **kw: Any
) -> tuple[Placer, _FakeStream, _FakeClient, RouterMetrics]:
    client = _FakeClient()
    metrics = RouterMetrics()
    placer = Placer(client, metrics, timeout_s=timeout_s, refresh_s=1.0, **kw)  # type: ignore[arg-type]
    stream = _FakeStream()
    placer._stream = stream  # type: ignore[assignment]
    return placer, stream, client, metrics


def _query(rid: str = "r1", session: str = "") -> PlacementQuery:
    return PlacementQuery(rid, 16, 4, b"", session)


async def test_a_late_placement_is_shed_and_released_never_placed_alone() -> None:
    placer, stream, _, metrics = _placer()
    await placer.refresh()
    released: list[pb.FinishRequest] = []
    placer.finish = released.append  # type: ignore[method-assign,assignment]
    stream.answer = asyncio.get_running_loop().create_future()
    with pytest.raises(ApiError) as err:
        await placer.place(_query())
    assert err.value.status == 429 and err.value.code == "server_overloaded"
    assert placer.fallback_decisions == 0 and placer.conductor_up  # slow is not down
    assert metrics.shed.labels("timeout")._value.get() == 1
    # The decision that comes late is given back at once.
    stream.answer.set_result(pb.Decision(instance_id="i0", instance_url="http://h0"))
    await wait_for(lambda: released, 5.0, message="the late decision released")
    assert [(r.request_id, r.instance_id, r.ok) for r in released] == [("r1", "i0", False)]


async def test_a_placement_tells_the_conductor_how_long_the_request_waited_here() -> None:
    placer, stream, _, _ = _placer()
    stream.answer = asyncio.get_running_loop().create_future()
    stream.answer.set_result(pb.Decision(instance_id="i0", instance_url="http://h0"))
    arrived = time.perf_counter() - 0.5  # it reached the Router half a second ago
    await placer.place(_query("r1"), arrived=arrived)
    await placer.place(_query("r2"))
    first, second = stream.asked
    assert first.queued.ToNanoseconds() >= 500_000_000
    assert not second.HasField("queued")


async def test_beyond_max_placing_a_request_is_shed_without_asking() -> None:
    placer, stream, _, metrics = _placer(max_placing=1, timeout_s=30.0)
    stream.answer = asyncio.get_running_loop().create_future()
    first = asyncio.create_task(placer.place(_query("r1")))
    await wait_for(lambda: stream.asked, 5.0, message="r1 asked")
    with pytest.raises(ApiError) as err:
        await placer.place(_query("r2"))
    assert err.value.status == 429
    assert [r.request_id for r in stream.asked] == ["r1"]  # r2 never reached the Conductor
    assert metrics.shed.labels("placing")._value.get() == 1
    stream.answer.set_result(pb.Decision(instance_id="i1", instance_url="http://h1"))
    assert (await first).instance_id == "i1"
    assert metrics.placing._value.get() == 0


async def test_a_refusal_by_the_conductor_is_429_and_the_fallback_stays_off() -> None:
    placer, stream, _, _ = _placer()
    stream.answer = asyncio.get_running_loop().create_future()
    stream.answer.set_exception(
        Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, "the Conductor is overloaded", None)
    )
    with pytest.raises(ApiError) as err:
        await placer.place(_query())
    assert (err.value.status, err.value.retry_after_s) == (429, 1.0)
    assert placer.fallback_decisions == 0


async def test_a_stream_that_gave_up_waiting_is_shed_but_an_unreachable_one_falls_back() -> None:
    placer, stream, _, metrics = _placer()
    await placer.refresh()
    loop = asyncio.get_running_loop()
    stream.answer = loop.create_future()
    stream.answer.set_exception(Unavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer"))
    with pytest.raises(ApiError) as err:
        await placer.place(_query())
    assert err.value.status == 429 and metrics.shed.labels("deadline")._value.get() == 1
    stream.answer = loop.create_future()
    stream.answer.set_exception(Unavailable(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    placement = await placer.place(_query())
    assert placement.fallback == "unavailable" and placement.instance_id in {"i0", "i1"}


async def test_only_an_unreachable_conductor_turns_the_fallback_on() -> None:
    placer, _, client, _ = _placer()
    await placer.refresh()
    seen = []
    for error in (
        Unavailable(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"),
        Unavailable(grpc.StatusCode.UNAVAILABLE, "connection refused"),
    ):
        client.list_error = error
        await placer.refresh()
        seen.append(placer.conductor_up)
    assert seen == [True, False]  # slow: still the Conductor's to place; refused: down
    assert (await placer.place(_query())).fallback == "conductor_down"


async def test_the_fallback_sheds_beyond_its_per_instance_bound() -> None:
    placer, _, client, metrics = _placer(fallback_max_in_flight=2)
    await placer.refresh()
    client.list_error = Unavailable(grpc.StatusCode.UNAVAILABLE, "connection refused")
    await placer.refresh()
    session = "tenant/s1"
    home = (await placer.place(_query("r0", session))).instance_id
    for _ in range(2):
        placer.begin(home)
    with pytest.raises(ApiError) as err:  # its instance is full: no move elsewhere, a 429
        await placer.place(_query("r1", session))
    assert err.value.status == 429
    other = next(i for i in ("i0", "i1") if i != home)
    assert (await placer.place(_query("r2"))).instance_id == other  # the other has room
    for _ in range(2):
        placer.begin(other)
    with pytest.raises(ApiError):
        await placer.place(_query("r3"))
    assert metrics.shed.labels("fallback_bound")._value.get() == 2
    placer.end(home)
    assert (await placer.place(_query("r4", session))).instance_id == home


def test_the_overload_flags() -> None:
    s = parse(["--no-auth", "--insecure"])
    assert (s.max_in_flight, s.max_placing, s.fallback_max_in_flight) == (2048, 256, 32)
    flags = ["--max-in-flight", "10", "--max-placing", "5", "--fallback-max-in-flight", "3"]
    s = parse(["--no-auth", "--insecure", *flags])
    assert (s.max_in_flight, s.max_placing, s.fallback_max_in_flight) == (10, 5, 3)
    with pytest.raises(SystemExit):
        parse(["--no-auth", "--insecure", "--max-placing", "0"])


def test_known_instances_are_what_the_fallback_picks_from() -> None:
    assert KnownInstance("i0", "http://h0").url == "http://h0"


async def test_over_max_in_flight_a_request_is_refused_before_its_body_is_read(
    stack: Stack,
) -> None:
    # One engine slow enough (the modelled GPU's own speed) that a long answer stays open.
    _, _, router = await stack.up(1, engine_flags={"time_scale": 1.0}, max_in_flight=1)
    body = completion(max_tokens=2000, stream=True, ignore_eos=True)
    async with stack.http.post(router.url + "/v1/completions", json=body) as held:
        assert held.status == 200
        await held.content.readline()  # streaming: it is open at the Router
        # Not even JSON: a 429 (not a 400) says the body was never read.
        status, headers, data = await stack.post(router.url + "/v1/completions", b"{not json")
        assert status == 429, data
        assert headers["Retry-After"] == "1"
        assert json.loads(data)["error"]["code"] == "server_overloaded"
        assert "x-kvsched-instance" not in headers
    await wait_for(lambda: router.in_flight.depth == 0, 10.0, message="the held one closed")
    status, _, data = await stack.post(router.url + "/v1/completions", completion())
    assert status == 200, data
    text = await stack.metrics(router)
    assert 'kvsched_router_shed_total{reason="in_flight"} 1.0' in text
    assert "kvsched_router_in_flight_limit 1.0" in text
