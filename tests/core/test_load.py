"""The load tracker: charges add until an engine's report overwrites them, finishes release
what the scheduler counted, a reset forgets a slot, and every write shows in the vectors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvsched.core.load import LoadReport, LoadTracker

CAPACITY = 1000
FIELDS = (
    "pending_prefill_tokens",
    "pending_prefill_s",
    "waiting",
    "running",
    "decode_tokens",
    "free_blocks",
    "in_flight",
)


def values(load: LoadTracker, slot: int) -> dict[str, float]:
    return {name: float(getattr(load, name)[slot]) for name in FIELDS}


def idle(free_blocks: float = CAPACITY) -> dict[str, float]:
    return dict.fromkeys(FIELDS, 0.0) | {"free_blocks": free_blocks}


REPORT = LoadReport(
    pending_prefill_tokens=300,
    pending_prefill_s=0.25,
    waiting=2,
    running=5,
    decode_tokens=4000,
    free_blocks=600,
)


def test_a_new_tracker_is_idle_with_every_block_free() -> None:
    load = LoadTracker(3, CAPACITY)
    for name in FIELDS:
        assert len(getattr(load, name)) == 3
    assert all(values(load, slot) == idle() for slot in range(3))


def test_charges_add_up_on_their_slot_only() -> None:
    load = LoadTracker(3, CAPACITY)
    load.charge(1, 100, 0.5, 7)
    load.charge(1, 20, 0.25, 2)
    assert values(load, 1) == {
        "pending_prefill_tokens": 120.0,
        "pending_prefill_s": 0.75,
        "waiting": 2.0,
        "running": 0.0,  # the engine says when it admits them
        "decode_tokens": 0.0,
        "free_blocks": CAPACITY - 9.0,
        "in_flight": 2.0,
    }
    assert values(load, 0) == values(load, 2) == idle()


def test_a_report_replaces_the_charges_but_not_the_requests_in_flight() -> None:
    load = LoadTracker(2, CAPACITY)
    load.charge(0, 100, 0.5, 7)
    load.charge(0, 100, 0.5, 7)
    load.report(0, REPORT)
    assert values(load, 0) == {
        "pending_prefill_tokens": 300.0,
        "pending_prefill_s": 0.25,
        "waiting": 2.0,
        "running": 5.0,
        "decode_tokens": 4000.0,
        "free_blocks": 600.0,
        "in_flight": 2.0,  # counted by the scheduler, not reported
    }
    assert values(load, 1) == idle()


def test_a_charge_after_a_report_adds_to_it() -> None:
    load = LoadTracker(1, CAPACITY)
    load.report(0, REPORT)
    load.charge(0, 50, 0.125, 4)
    got = values(load, 0)
    assert (got["pending_prefill_tokens"], got["pending_prefill_s"]) == (350.0, 0.375)
    assert (got["waiting"], got["free_blocks"], got["in_flight"]) == (3.0, 596.0, 1.0)


@pytest.mark.parametrize(
    ("charged", "finished", "in_flight"),
    [(2, 1, 1.0), (2, 2, 0.0), (1, 3, 0.0), (0, 1, 0.0)],  # never below zero
)
def test_finishing_releases_a_request_in_flight_and_nothing_else(
    charged: int, finished: int, in_flight: float
) -> None:
    load = LoadTracker(2, CAPACITY)
    for _ in range(charged):
        load.charge(0, 10, 0.1, 1)
    before = values(load, 0)
    for _ in range(finished):
        load.finish(0)
    assert values(load, 0) == before | {"in_flight": in_flight}
    assert values(load, 1) == idle()


def test_a_reset_forgets_the_slot_with_the_capacity_given() -> None:
    load = LoadTracker(2, CAPACITY)
    for slot in (0, 1):
        load.report(slot, REPORT)
        load.charge(slot, 10, 0.1, 1)
    kept = values(load, 1)
    load.reset(0, 250)  # restarted with less memory
    assert values(load, 0) == idle(free_blocks=250.0)
    assert values(load, 1) == kept


WRITES: list[tuple[str, Callable[[LoadTracker], None], str, float]] = [
    ("charge", lambda load: load.charge(0, 10, 0.1, 1), "pending_prefill_tokens", 10.0),
    ("report", lambda load: load.report(0, REPORT), "running", 5.0),
    ("finish", lambda load: load.finish(0), "in_flight", 1.0),
    ("reset", lambda load: load.reset(0, 5), "free_blocks", 5.0),
]


@pytest.mark.parametrize(
    ("write", "field", "after"), [row[1:] for row in WRITES], ids=[row[0] for row in WRITES]
)
def test_every_write_shows_in_the_vectors_read_after_it(
    write: Callable[[LoadTracker], None], field: str, after: float
) -> None:
    load = LoadTracker(2, CAPACITY)
    load.charge(0, 0, 0.0, 0)
    load.charge(0, 0, 0.0, 0)  # two in flight, so a finish has one to release
    for name in FIELDS:
        getattr(load, name)  # build every vector before the write
    write(load)
    assert getattr(load, field)[0] == after


def test_reads_without_a_write_between_share_one_vector() -> None:
    load = LoadTracker(2, CAPACITY)
    first = load.pending_prefill_tokens
    assert load.pending_prefill_tokens is first
    load.charge(1, 10, 0.1, 1)
    assert load.pending_prefill_tokens is not first
    assert list(first) == [0.0, 0.0]  # a vector handed out earlier keeps what it showed
    assert list(load.pending_prefill_tokens) == [0.0, 10.0]
