"""The pipeline's pure pieces: the Finish report a request's outcome makes, the lengths the
prepare stage checks, and where a settled placement sends the request."""

from __future__ import annotations

from typing import Any

import pytest

from clients.python import pack_hashes, unpack_hashes
from kvsched.core.turn_host import HANDOFF_FAILED, MIGRATION_FAILED, TurnHost
from services.common.inference_api.openai_api import ApiError, Kind, parse_request
from services.common.serving.durations import seconds
from services.router.finish import RequestOutcome, finish_report
from services.router.kv_moves import Forward, forward
from services.router.placement import Placement, PlacementQuery
from services.router.prepare import output_budget
from services.router.proxy import Relayed
from services.router.usage import Usage

QUERY = PlacementQuery("r1", 100, 16, pack_hashes([11, 22]), "acme/s1")
PLACED = Placement("r1", "e1", "http://e1", "cache_aware", "min TTFT", 64)
FALLBACK = Placement("r1", "e1", "http://e1", "", "fewest in flight", 0, fallback="timeout")


def outcome(
    relayed: Relayed | None,
    *,
    kind: Kind = "completion",
    stream: bool = True,
    placement: Placement = PLACED,
    prefill: str = "",
) -> RequestOutcome:
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "hi"}
    )
    req = parse_request(kind, {**prompt, "stream": stream})
    return RequestOutcome(req, QUERY, placement, relayed, 10.0, 12.5, prefill)


def relayed(events: int = 0, usage: Usage | None = None, *, ok: bool = True) -> Relayed:
    return Relayed(200 if ok else 500, ok, 10.25, usage, events)


# (why, outcome, (instance, decode instance, output, cached, ttft, ok))
TABLE = [
    ("usage counts", outcome(relayed(9, Usage(100, 7, 48))), ("e1", "", 7, 48, 0.25, True)),
    (
        "a stream without usage: events less [DONE], as expected",
        outcome(relayed(9)),
        ("e1", "", 8, 64, 0.25, True),
    ),
    (
        "a chat stream also less its role chunk",
        outcome(relayed(9), kind="chat"),
        ("e1", "", 7, 64, 0.25, True),
    ),
    (
        "no stream: the end-to-end time bounds the first token",
        outcome(relayed(0, Usage(100, 7, 0)), stream=False),
        ("e1", "", 7, 0, 2.5, True),
    ),
    (
        "cached tokens at most the prompt",
        outcome(relayed(1, Usage(100, 1, 500))),
        ("e1", "", 1, 100, 0.25, True),
    ),
    ("the engine failed before answering", outcome(None), ("e1", "", 0, 0, 2.5, False)),
    ("the engine answered an error", outcome(relayed(1, ok=False)), ("e1", "", 0, 64, 0.25, False)),
    (
        "a hand-off: prefilled on one, decoded on the other",
        outcome(relayed(3), placement=PLACED, prefill="p0"),
        ("p0", "e1", 2, 64, 0.25, True),
    ),
]


@pytest.mark.parametrize(("done", "want"), [row[1:] for row in TABLE], ids=[r[0] for r in TABLE])
def test_the_finish_report_of_an_outcome(
    done: RequestOutcome, want: tuple[str, str, int, int, float, bool]
) -> None:
    report = finish_report(done)
    assert report is not None
    got = (
        report.instance_id,
        report.decode_instance_id,
        report.output_tokens,
        report.cached_tokens,
        seconds(report.time_to_first_token),
        report.ok,
    )
    assert got == want
    assert (report.request_id, report.session_id, report.prompt_tokens) == ("r1", "acme/s1", 100)
    assert unpack_hashes(report.packed_block_hashes) == [11, 22] and not report.block_hashes
    assert seconds(report.end_to_end) == 2.5


def test_a_request_the_fallback_placed_is_not_reported() -> None:
    assert finish_report(outcome(relayed(3), placement=FALLBACK)) is None


@pytest.mark.parametrize(
    ("prompt_tokens", "output", "param"),
    [
        (100, 16, ""),
        (120, 8, ""),  # served, cut at the context
        (0, 0, "prompt"),  # empty
        (128, 0, "input_tokens"),  # no room left for output (`check_length`)
    ],
)
def test_the_lengths_the_router_checks(prompt_tokens: int, output: int, param: str) -> None:
    req = parse_request("completion", {"prompt": "x", "max_tokens": 16})
    if not param:
        assert output_budget(req, prompt_tokens, 128) == output
        return
    with pytest.raises(ApiError) as err:
        output_budget(req, prompt_tokens, 128)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == param


def test_an_empty_chat_is_refused_by_its_messages() -> None:
    chat = parse_request("chat", {"messages": [{"role": "user", "content": ""}]})
    with pytest.raises(ApiError) as err:
        output_budget(chat, 0, 128)
    assert err.value.body()["error"]["param"] == "messages"


DISAGG = Placement(
    "r1", "p0", "http://p0", "static_pd", "pd", 64, decode_instance_id="d0", decode_url="http://d0"
)
URLS = {"p0": "http://p0", "s0": "http://s0", "e1": "http://e1"}


@pytest.mark.parametrize(
    ("placement", "host", "want"),
    [
        (PLACED, TurnHost("e1", "e1"), Forward(PLACED)),
        (
            PLACED,
            TurnHost("s0", "s0", MIGRATION_FAILED),
            Forward(
                Placement("r1", "s0", "http://s0", "cache_aware", "min TTFT" + MIGRATION_FAILED, 0)
            ),
        ),
        (
            DISAGG,
            TurnHost("p0", "d0"),
            Forward(
                Placement(
                    "r1",
                    "d0",
                    "http://d0",
                    "static_pd",
                    "pd",
                    0,
                    decode_instance_id="d0",
                    decode_url="http://d0",
                ),
                prefill_instance_id="p0",
            ),
        ),
        (
            DISAGG,
            TurnHost("p0", "p0", HANDOFF_FAILED),
            Forward(
                Placement(
                    "r1",
                    "p0",
                    "http://p0",
                    "static_pd",
                    "pd" + HANDOFF_FAILED,
                    64,
                    decode_instance_id="d0",
                    decode_url="http://d0",
                )
            ),
        ),
    ],
    ids=["as placed", "migration failed", "handed off", "hand-off failed"],
)
def test_where_a_settled_placement_sends_the_request(
    placement: Placement, host: TurnHost[str], want: Forward
) -> None:
    assert forward(placement, host, URLS) == want
