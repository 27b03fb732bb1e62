"""Fuzzes every gRPC service of a running cluster (the Conductor's, a Messenger's, the
Router's, and their health service) with thousands of hypothesis-drawn calls: messages of each
method's request type with fuzzed field values, and raw bytes. No call is answered `UNKNOWN`
or `INTERNAL`, every server still answers health at the end, and a phase of calls that must all
be refused (undecodable requests) leaves the Conductor's state as it was."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from clients.python import pack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2
from kvsched.api.messenger.v1 import messenger_service_pb2
from kvsched.api.router.v1 import router_service_pb2
from services.messenger.app import Messenger
from tests.fixtures.poll import wait_for
from tests.fuzz.conftest import fuzz_settings
from tests.fuzz.test_router_http import LoopBridge, conductor_state
from tests.router.conftest import Stack

pytestmark = [
    pytest.mark.slow,
    # (as in test_router_http: the servers beside hypothesis's thread use `random`)
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

CALLS_PER_SERVICE = 25  # per hypothesis example, to each service
MIXED_EXAMPLES = 200  # 5,000 calls to each service
REFUSED_EXAMPLES = 20
MIN_CALLS_PER_SERVICE = 5_000
CALL_TIMEOUT_S = 5.0

# Answers no call may get: grpc's for a server bug.
REFUSED = grpc.StatusCode.INVALID_ARGUMENT
SERVER_BUGS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@dataclass(frozen=True)
class Method:
    """One RPC as the fuzzer calls it: its path, request type and streaming shape."""

    path: str
    request: type[Message]
    client_streaming: bool
    server_streaming: bool


def methods_of(service: pbd.ServiceDescriptor) -> list[Method]:
    return [
        Method(
            f"/{service.full_name}/{m.name}",
            GetMessageClass(m.input_type),
            m.client_streaming,
            m.server_streaming,
        )
        for m in service.methods
    ]


def service(module: Any, name: str) -> list[Method]:
    return methods_of(module.DESCRIPTOR.services_by_name[name])


HEALTH = [
    Method("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest, False, False),
    Method("/grpc.health.v1.Health/Watch", health_pb2.HealthCheckRequest, False, True),
]
SERVICES = {
    "conductor": service(conductor_service_pb2, "ConductorService"),
    "messenger": service(messenger_service_pb2, "MessengerService"),
    "router": service(router_service_pb2, "RouterService"),
    "health": HEALTH,
}

# -- strategies: a message of any type, its fields fuzzed ---------------------------------

F = pbd.FieldDescriptor
INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_ENUM: (-(2**31), 2**31 - 1),  # open enums: unknown values included
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
MAX_DEPTH = 3


def ints(low: int, high: int) -> st.SearchStrategy[int]:
    """Any int in range, the edges and small ones more often."""
    return st.one_of(
        st.sampled_from([0, 1, -1 if low < 0 else 2, low, high]),
        st.integers(-5 if low < 0 else 0, 100),
        st.integers(low, high),
    )


# Text a proto string carries: valid Unicode (its wire form must be UTF-8; invalid UTF-8
# goes as raw bytes below), known-looking ids now and then.
texts = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=30),
    st.sampled_from(["", "node-0/engine-0", "node-1/engine-0", "r1", "cache_aware", "x" * 5000]),
)


def value_of(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type in INT_RANGES:
        return ints(*INT_RANGES[field.type])
    if field.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.floats(width=32 if field.type == F.TYPE_FLOAT else 64)
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        return texts
    if field.type == F.TYPE_BYTES and field.name.startswith("packed_"):
        # Packed u64 hashes: well-formed lists (up to past a prompt's blocks) and ragged bytes.
        return st.one_of(
            st.lists(ints(0, 2**64 - 1), max_size=12).map(pack_hashes), st.binary(max_size=64)
        )
    if field.type == F.TYPE_BYTES:
        return st.binary(max_size=64)
    assert field.type == F.TYPE_MESSAGE and field.message_type is not None, field
    return messages(GetMessageClass(field.message_type), depth + 1)


def messages(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """A `cls` with some of its fields set to fuzzed values (repeated ones to lists)."""
    descriptor = cls.DESCRIPTOR
    assert isinstance(descriptor, pbd.Descriptor)  # (its stub's type is a union)
    fields = list(descriptor.fields)
    if depth >= MAX_DEPTH or not fields:
        return st.just(cls())

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for f in draw(st.lists(st.sampled_from(fields), max_size=len(fields), unique=True)):
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                continue  # maps: their entries are messages only protobuf builds
            values = value_of(f, depth)
            if f.is_repeated:
                items = draw(st.lists(values, max_size=4))
                target = getattr(msg, f.name)
                if f.type == F.TYPE_MESSAGE:
                    for item in items:
                        target.add().CopyFrom(item)
                else:
                    target.extend(items)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(draw(values))
            else:
                setattr(msg, f.name, draw(values))
        return msg

    return build()


def decodes(method: Method, payload: bytes) -> bool:
    try:
        method.request.FromString(payload)
    except DecodeError:
        return False
    return True


def undecodable(method: Method) -> st.SearchStrategy[bytes]:
    """Bytes no server can decode as `method`'s request: mostly starting with tag 0 (field
    number 0 is never valid, though protobuf takes `00 00` for an empty message)."""
    return st.binary(max_size=64).map(b"\x00".__add__).filter(lambda b: not decodes(method, b))


def payloads(method: Method) -> st.SearchStrategy[bytes]:
    """A request's bytes: a fuzzed message of its type (mostly), or raw bytes."""
    return st.one_of(
        messages(method.request).map(lambda m: m.SerializeToString()),
        messages(method.request).map(lambda m: m.SerializeToString()),
        st.binary(max_size=128),
        undecodable(method),
    )


@dataclass(frozen=True)
class Call:
    """One call as the fuzzer makes it: to which service, which method, what bytes."""

    service: str
    method: Method = field(repr=False)
    payload: bytes

    def __repr__(self) -> str:
        return f"Call({self.method.path}, {self.payload!r})"


def calls(payload: Callable[[Method], st.SearchStrategy[bytes]]) -> st.SearchStrategy[list[Call]]:
    """A batch: CALLS_PER_SERVICE calls to each service, methods and payloads drawn."""

    def to(name: str) -> st.SearchStrategy[list[Call]]:
        one = st.sampled_from(SERVICES[name]).flatmap(
            lambda m: payload(m).map(lambda p: Call(name, m, p))
        )
        return st.lists(one, min_size=CALLS_PER_SERVICE, max_size=CALLS_PER_SERVICE)

    return st.tuples(*(to(name) for name in SERVICES)).map(
        lambda lists: [c for calls in lists for c in calls]
    )


# -- calls ------------------------------------------------------------------------------


async def invoke(channel: grpc.aio.Channel, call: Call) -> grpc.StatusCode:
    """Make `call` (bytes in, bytes out); returns its status code."""
    m, timeout = call.method, CALL_TIMEOUT_S
    try:
        if m.client_streaming and m.server_streaming:
            stream = channel.stream_stream(m.path, None, None)(
                iter([call.payload]), timeout=timeout
            )
            async for _ in stream:
                break
            stream.cancel()
        elif m.client_streaming:
            await channel.stream_unary(m.path, None, None)(iter([call.payload]), timeout=timeout)
        elif m.server_streaming:
            answers = channel.unary_stream(m.path, None, None)(call.payload, timeout=1.0)
            async for _ in answers:
                break  # one answer is enough: a watch goes on answering
            answers.cancel()
        else:
            await channel.unary_unary(m.path, None, None)(call.payload, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def serving(channel: grpc.aio.Channel) -> bool:
    answer = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT_S
    )
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


async def test_every_grpc_service_survives_fuzzed_calls(stack: Stack, start_messenger: Any) -> None:
    conductor, _, router = await stack.up(1)
    [node_engine] = await stack.start_engines(1)  # node-1's, relayed by the Messenger
    messenger: Messenger = await start_messenger([conductor.url], [node_engine.url], node="node-1")
    await wait_for(
        lambda: node_engine.instance_id in conductor.state.instances,
        10.0,
        message="the Messenger registered its engine",
    )
    urls = {
        "conductor": conductor.url,
        "messenger": messenger.url,
        "router": router.grpc_url,
        "health": conductor.url,
    }
    channels = {name: grpc.aio.insecure_channel(url) for name, url in urls.items()}
    loop = LoopBridge(asyncio.get_running_loop())
    made: dict[str, int] = dict.fromkeys(SERVICES, 0)
    answered: Counter[str] = Counter()  # status codes, for the printed summary

    async def make(batch: Sequence[Call]) -> list[grpc.StatusCode]:
        codes = await asyncio.gather(*(invoke(channels[c.service], c) for c in batch))
        for c in batch:
            made[c.service] += 1
        answered.update(code.name for code in codes)
        return list(codes)

    def check(batch: list[Call], codes: list[grpc.StatusCode]) -> None:
        bugs = [(c, code) for c, code in zip(batch, codes, strict=True) if code in SERVER_BUGS]
        assert not bugs, bugs

    @fuzz_settings(REFUSED_EXAMPLES)
    @given(calls(undecodable))
    def fuzz_refused(batch: list[Call]) -> None:
        codes = loop.call(make(batch))
        check(batch, codes)
        accepted = [(c, code) for c, code in zip(batch, codes, strict=True) if code != REFUSED]
        assert not accepted, accepted

    @fuzz_settings(MIXED_EXAMPLES)
    @given(calls(payloads))
    def fuzz_mixed(batch: list[Call]) -> None:
        check(batch, loop.call(make(batch)))

    try:
        before = conductor_state(conductor)
        await loop.run(fuzz_refused)
        assert conductor_state(conductor) == before  # refused calls changed nothing
        await loop.run(fuzz_mixed)
        # A well-formed SetDraining(true) among the mixed calls is obeyed (health then says
        # NOT_SERVING, by design), and concurrent calls leave either answer last: undo it, as
        # an operator would, before asking every service whether it still serves.
        await router.set_draining(False)
        for name, channel in channels.items():
            assert await serving(channel), name
        assert min(made.values()) >= MIN_CALLS_PER_SERVICE, made
        print(f"gRPC calls made: {made}; answered: {dict(answered)}")
    finally:
        for channel in channels.values():
            await channel.close(None)
