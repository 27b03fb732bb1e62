"""Block hashes as packed little-endian u64 bytes (`packed_block_hashes`) next to the repeated
`block_hashes` field: the codec, the Conductor's conversion (both forms give the same core
values and the same decisions; bad payloads are refused before anything changes), and the
live RPCs, the placement stream's per-item errors included."""

from __future__ import annotations

import random
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from clients.python import pack_hashes, unpack_hashes
from clients.python.packed_hashes import hash_count
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.cluster import Role
from kvsched.core.decision import Decision
from kvsched.core.requests import RequestError
from services.conductor import kv_event_batches, placement_messages
from services.conductor.keys import InstanceRecord, InstanceSpec
from services.conductor.settings import ConductorSettings
from services.conductor.term import Term
from tests.conductor.conftest import chain, stub
from tests.conductor.test_conductor import (
    IID,
    SERVED,
    Start,
    conductor_state,
    publish,
    refused,
    register,
    sched,
    stored,
)

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

U64 = st.integers(min_value=0, max_value=2**64 - 1)
MAX_BLOCKS = 131_072 // 16  # the test settings' longest prompt, in blocks
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def packed(hashes: Sequence[int]) -> bytes:
    return pack_hashes(hashes)


# ---- the codec -------------------------------------------------------------------------


@given(st.lists(U64, max_size=300))
def test_packing_is_little_endian_u64_and_round_trips(hashes: list[int]) -> None:
    data = pack_hashes(hashes)
    assert data == struct.pack(f"<{len(hashes)}Q", *hashes)
    assert hash_count(data) == len(hashes)
    assert unpack_hashes(data) == hashes


def test_a_length_not_a_multiple_of_8_or_a_value_outside_u64_is_refused() -> None:
    with pytest.raises(ValueError, match="13 bytes are not a whole number of 8-byte"):
        unpack_hashes(bytes(13))
    with pytest.raises(ValueError, match="not a whole number"):
        hash_count(b"\x01")
    for bad in (-1, 2**64):
        with pytest.raises(OverflowError):
            pack_hashes([bad])


# ---- the conversion boundary -----------------------------------------------------------


@given(st.lists(U64, max_size=64), st.integers(min_value=0, max_value=15))
def test_both_forms_give_the_same_request(hashes: list[int], extra: int) -> None:
    prompt = len(hashes) * 16 + extra + 1
    repeated = pb.ScheduleRequest(request_id="r", prompt_tokens=prompt, block_hashes=hashes)
    packed_form = pb.ScheduleRequest(
        request_id="r", prompt_tokens=prompt, packed_block_hashes=packed(hashes)
    )
    assert placement_messages.request_info(
        packed_form, MAX_BLOCKS
    ) == placement_messages.request_info(repeated, MAX_BLOCKS)


def _bad_hashes(**fields: object) -> pb.ScheduleRequest:
    return pb.ScheduleRequest(request_id="r", prompt_tokens=100, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (
            _bad_hashes(block_hashes=[1], packed_block_hashes=packed([1])),
            "block_hashes and packed_block_hashes are both set; give one",
        ),
        (
            _bad_hashes(packed_block_hashes=bytes(20)),
            "packed_block_hashes: 20 bytes are not a whole number of 8-byte little-endian u64",
        ),
        (
            _bad_hashes(packed_block_hashes=bytes(8 * (MAX_BLOCKS + 1))),
            f"packed_block_hashes holds {MAX_BLOCKS + 1} block hashes; at most {MAX_BLOCKS}",
        ),
    ],
    ids=["both", "length", "oversize"],
)
def test_a_bad_packed_payload_is_refused_as_invalid(
    request_: pb.ScheduleRequest, fragment: str
) -> None:
    with pytest.raises(RequestError, match=fragment) as refusal:
        placement_messages.request_info(request_, MAX_BLOCKS)
    assert refusal.value.kind == "invalid"


def _term(n: int = 4) -> Term:
    term = Term.build(ConductorSettings(max_instances=n, policy="elastic"), "test")
    for slot in range(n):
        spec = InstanceSpec(IID[slot], f"http://{slot}", f"node-{slot // 2}", Role.BOTH)
        term.state.add_instance(InstanceRecord(spec, slot, slot + 1))
    return term


def _events(slot: int, seq: int, chains: list[list[int]], *, pack: bool) -> pb.KvEventBatch:
    out = pb.KvEventBatch(instance_id=IID[slot], sequence=seq)
    for hashes in chains:
        event = pb.BlocksStored(tier=common.TIER_GPU)
        if pack:
            event.packed_block_hashes = packed(hashes)
        else:
            event.block_hashes.extend(hashes)
        out.events.add().blocks_stored.CopyFrom(event)
    removed = out.events.add().blocks_removed
    removed.tier = common.TIER_GPU
    if pack:
        removed.packed_block_hashes = packed(chains[0][-2:])
    else:
        removed.block_hashes.extend(chains[0][-2:])
    return out


def _decisions(*, pack: bool) -> tuple[list[tuple[object, ...]], list[object]]:
    """A seeded run of events, placements and completions through one Conductor term, every
    hash list in one form; the decisions it made and the transfers the completions planned."""
    rng = random.Random(7)
    term = _term()
    state, limit = term.state, term.state.scheduler.limits.max_blocks
    chains = [[rng.getrandbits(64) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    for slot in range(4):
        batch = _events(slot, 0, chains[slot * 6 : slot * 6 + 6], pack=pack)
        term.cursors.apply(batch.instance_id, 0, False, kv_event_batches.kv_events(batch, limit))
    out: list[tuple[object, ...]] = []
    planned: list[object] = []
    for i in range(120):
        hashes = [*rng.choice(chains)[: rng.randrange(1, 40)], rng.getrandbits(64)]
        request = pb.ScheduleRequest(
            request_id=f"r{i}",
            prompt_tokens=len(hashes) * 16 + 3,
            output_tokens=32,
            session_id=f"s{i % 5}" if i % 3 == 0 else "",
        )
        if pack:
            request.packed_block_hashes = packed(hashes)
        else:
            request.block_hashes.extend(hashes)
        now = float(i)
        d: Decision = state.scheduler.place(placement_messages.request_info(request, limit), now)
        out.append((d.instance, d.rule, d.cached_tokens, d.rejected, len(d.transfers)))
        if d.rejected:
            continue
        done = pb.FinishRequest(
            request_id=request.request_id,
            session_id=request.session_id,
            instance_id=IID[d.instance],
            prompt_tokens=request.prompt_tokens,
            output_tokens=32,
            ok=True,
        )
        done.block_hashes.extend(request.block_hashes)
        done.packed_block_hashes = request.packed_block_hashes
        plans = state.scheduler.finish(
            placement_messages.completion(state, done, now + 0.5), now + 0.5
        )
        planned.append([(p.kind, p.source, p.target, p.block_hashes) for p in plans])
    return out, planned


def test_both_forms_give_identical_decisions_events_and_completions_included() -> None:
    decisions, planned = _decisions(pack=False)
    assert len(decisions) == 120 and planned
    assert len({d[0] for d in decisions}) > 1 and any(d[2] for d in decisions)  # hits count
    assert _decisions(pack=True) == (decisions, planned)


def test_a_bad_packed_event_refuses_its_whole_batch() -> None:
    term = _term()
    limit = term.state.scheduler.limits.max_blocks
    batch = _events(0, 0, [chain(1, 3)], pack=True)
    batch.events.add().blocks_stored.packed_block_hashes = bytes(12)
    with pytest.raises(RequestError, match="event 2: packed_block_hashes: 12 bytes"):
        kv_event_batches.kv_events(batch, limit)


# ---- live RPCs -------------------------------------------------------------------------


Call = Callable[["ConductorServiceAsyncStub"], Awaitable[object]]


def _sched_packed(rid: str, data: bytes, prompt: int = 100, session: str = "new") -> Call:
    request = pb.ScheduleRequest(
        request_id=rid, prompt_tokens=prompt, packed_block_hashes=data, session_id=session
    )
    return lambda s: s.Schedule(request)


BAD_CALLS: dict[str, tuple[Call, str]] = {
    "placement with both forms": (
        lambda s: s.Schedule(
            pb.ScheduleRequest(
                request_id="r-both",
                prompt_tokens=100,
                block_hashes=chain(4, 2),
                packed_block_hashes=packed(chain(4, 2)),
                session_id="new",
            )
        ),
        "both set",
    ),
    "placement with a ragged packed list": (
        _sched_packed("r-ragged", packed(chain(4, 2)) + b"\x00"),
        "17 bytes are not a whole number",
    ),
    "placement with more packed hashes than the cluster's longest prompt": (
        _sched_packed("r-huge", bytes(8 * (MAX_BLOCKS + 1)), prompt=131_072),
        f"holds {MAX_BLOCKS + 1} block hashes; at most {MAX_BLOCKS}",
    ),
    "placement with more packed hashes than its prompt has blocks": (
        _sched_packed("r-many", packed(chain(4, 8))),
        "at most 7",
    ),
    "a completion with a ragged packed list": (
        lambda s: s.Finish(
            pb.FinishRequest(
                request_id="ok",
                instance_id=IID[0],
                session_id="known",
                packed_block_hashes=bytes(9),
                ok=True,
            )
        ),
        "9 bytes are not a whole number",
    ),
    "events with a ragged packed list after a good event: the whole batch": (
        lambda s: s.PublishKvEvents(
            publish(
                IID[0],
                1,
                stored(chain(2, 2)),
                pb.KvEvent(
                    blocks_stored=pb.BlocksStored(
                        packed_block_hashes=bytes(7), tier=common.TIER_GPU
                    )
                ),
            )
        ),
        "event 1: packed_block_hashes: 7 bytes",
    ),
    "explaining with both forms": (
        lambda s: s.Explain(pb.ExplainRequest(block_hashes=[1], packed_block_hashes=packed([1]))),
        "both set",
    ),
}


@pytest.mark.parametrize("bad", BAD_CALLS.values(), ids=BAD_CALLS.keys())
async def test_a_bad_packed_payload_is_invalid_argument_and_changes_nothing(
    start_conductor: Start, bad: tuple[Call, str]
) -> None:
    call, fragment = bad
    c = await start_conductor()
    async with stub(c.url) as s:
        await register(s, 0)
        await s.PublishKvEvents(publish(IID[0], 0, stored(SERVED)))
        await s.Schedule(sched("ok", SERVED, session="known"))
        before = await conductor_state(c, s)
        err = await refused(call(s), INVALID)
        assert fragment in (err.details() or "")
        assert await conductor_state(c, s) == before


async def test_packed_hashes_place_explain_and_finish_as_the_repeated_ones(
    start_conductor: Start,
) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
        hashes = chain(3, 5)
        await s.PublishKvEvents(
            publish(
                IID[1],
                0,
                pb.KvEvent(
                    blocks_stored=pb.BlocksStored(
                        packed_block_hashes=packed(hashes), tier=common.TIER_GPU
                    )
                ),
            )
        )
        assert c.state.cluster.index.block_count(1) == 5  # the packed event was indexed
        explained = [
            await s.Explain(pb.ExplainRequest(block_hashes=hashes, output_tokens=8)),
            await s.Explain(pb.ExplainRequest(packed_block_hashes=packed(hashes), output_tokens=8)),
        ]
        assert explained[0] == explained[1]
        assert explained[0].decision.instance_id == IID[1]
        placed = await s.Schedule(
            pb.ScheduleRequest(
                request_id="p",
                prompt_tokens=len(hashes) * 16 + 1,
                output_tokens=8,
                packed_block_hashes=packed(hashes),
                session_id="sess",
            )
        )
        assert placed.decision.instance_id == IID[1]
        assert placed.decision.cached_tokens == len(hashes) * 16
        await s.Finish(
            pb.FinishRequest(
                request_id="p",
                session_id="sess",
                instance_id=IID[1],
                prompt_tokens=len(hashes) * 16 + 1,
                output_tokens=8,
                packed_block_hashes=packed(hashes),
                ok=True,
            )
        )
        session = c.state.cluster.sessions.get("sess")
        assert session is not None and session.context_tokens == len(hashes) * 16 + 1 + 8
        assert float(c.state.cluster.load.in_flight.sum()) == 0


async def test_a_bad_packed_item_on_a_stream_fails_only_itself(start_conductor: Start) -> None:
    c = await start_conductor()
    async with stub(c.url) as s:
        for i in range(2):
            await register(s, i)
        call = s.ScheduleStream()  # type: ignore[call-arg]  # the write/read API
        items = {
            "a": pb.ScheduleRequest(
                request_id="a", prompt_tokens=49, packed_block_hashes=packed(chain(1, 3))
            ),
            "ragged": pb.ScheduleRequest(
                request_id="ragged", prompt_tokens=49, packed_block_hashes=bytes(23)
            ),
            "both": pb.ScheduleRequest(
                request_id="both",
                prompt_tokens=49,
                block_hashes=chain(2, 3),
                packed_block_hashes=packed(chain(2, 3)),
            ),
            "b": pb.ScheduleRequest(request_id="b", prompt_tokens=49, block_hashes=chain(2, 3)),
        }
        for request in items.values():
            await call.write(pb.ScheduleStreamRequest(schedule=request))
        await call.write(
            pb.ScheduleStreamRequest(
                finish=pb.FinishRequest(
                    request_id="f", instance_id=IID[0], packed_block_hashes=bytes(5), ok=True
                )
            )
        )
        answers: dict[str, pb.ScheduleStreamResponse] = {}
        for _ in range(5):
            answer = await call.read()
            assert isinstance(answer, pb.ScheduleStreamResponse)
            answers[answer.request_id] = answer
        outcomes = {rid: a.WhichOneof("outcome") for rid, a in answers.items()}
        assert outcomes == {
            "a": "decision",
            "ragged": "error",
            "both": "error",
            "b": "decision",
            "f": "error",
        }
        for rid in ("ragged", "both", "f"):
            assert answers[rid].error.code == INVALID.value[0]
        assert "23 bytes" in answers["ragged"].error.message
        assert "both set" in answers["both"].error.message
        assert float(c.state.cluster.load.in_flight.sum()) == 2  # the two placed, no more
        # The stream goes on.
        await call.write(
            pb.ScheduleStreamRequest(
                schedule=pb.ScheduleRequest(
                    request_id="after", prompt_tokens=49, packed_block_hashes=packed(chain(1, 3))
                )
            )
        )
        after = await call.read()
        assert isinstance(after, pb.ScheduleStreamResponse)
        assert after.request_id == "after" and after.WhichOneof("outcome") == "decision"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
