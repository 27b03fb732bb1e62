"""Where a turn runs after its transfers: the rule the Router and the simulator share, as a
table (named by instance ids here; the simulator names them by slot)."""

from __future__ import annotations

import pytest

from kvsched.core.decision import TransferKind
from kvsched.core.turn_host import (
    HANDOFF_FAILED,
    MIGRATION_FAILED,
    TransferOutcome,
    TurnHost,
    turn_host,
)

FETCH = TransferKind.FETCH_PREFIX
MIGRATE = TransferKind.MIGRATE_SESSION
REPLICATE = TransferKind.REPLICATE_PREFIX
HANDOFF = TransferKind.HANDOFF


def moved(
    kind: TransferKind, source: str, landed: bool, *, target: str = "p", on_path: bool = True
) -> TransferOutcome[str]:
    return TransferOutcome(kind, source, target, on_path, landed)


# (why, the decision's transfers, where the turn placed on "p" runs)
TABLE: list[tuple[str, list[TransferOutcome[str]], TurnHost[str]]] = [
    ("no transfers", [], TurnHost("p", "p")),
    ("a fetch landed", [moved(FETCH, "h", True)], TurnHost("p", "p")),
    ("a fetch failed: recomputed where placed", [moved(FETCH, "h", False)], TurnHost("p", "p")),
    ("a migration landed", [moved(MIGRATE, "s", True)], TurnHost("p", "p")),
    (
        "a migration failed: back to its source",
        [moved(MIGRATE, "s", False)],
        TurnHost("s", "s", MIGRATION_FAILED),
    ),
    (
        "an idle-gap migration failed: not this turn's",
        [moved(MIGRATE, "s", False, on_path=False)],
        TurnHost("p", "p"),
    ),
    (
        "the first failed migration decides",
        [moved(FETCH, "h", False), moved(MIGRATE, "s", False), moved(MIGRATE, "t", False)],
        TurnHost("s", "s", MIGRATION_FAILED),
    ),
    (
        "a failed replication is not the turn's",
        [moved(REPLICATE, "h", False, target="r", on_path=False)],
        TurnHost("p", "p"),
    ),
    (
        "a hand-off landed: decoded on its target",
        [moved(HANDOFF, "p", True, target="d", on_path=False)],
        TurnHost("p", "d"),
    ),
    (
        "a hand-off failed: decoded on the prefill instance",
        [moved(HANDOFF, "p", False, target="d", on_path=False)],
        TurnHost("p", "p", HANDOFF_FAILED),
    ),
    (
        "a hand-off decides before a migration",
        [moved(MIGRATE, "s", False), moved(HANDOFF, "p", True, target="d", on_path=False)],
        TurnHost("p", "d"),
    ),
]


@pytest.mark.parametrize(
    ("outcomes", "host"), [row[1:] for row in TABLE], ids=[r[0] for r in TABLE]
)
def test_where_a_turn_runs(outcomes: list[TransferOutcome[str]], host: TurnHost[str]) -> None:
    assert turn_host("p", outcomes) == host
    assert turn_host("p", iter(outcomes)) == host  # any iterable, read once


def test_a_failed_migration_to_a_source_that_is_gone_stays_where_placed() -> None:
    failed = [moved(MIGRATE, "s", False)]
    assert turn_host("p", failed, up={"p", "t"}) == TurnHost("p", "p")
    assert turn_host("p", failed, up={"p", "s"}) == TurnHost("s", "s", MIGRATION_FAILED)
    handoff = [moved(HANDOFF, "p", True, target="d", on_path=False)]
    assert turn_host("p", handoff, up=set()) == TurnHost("p", "d")  # the decision named it


def test_slots_name_instances_as_well() -> None:
    failed = TransferOutcome(MIGRATE, 3, 5, True, False)
    host = turn_host(5, [failed])
    assert (host.prefill, host.decode, host.handed_off) == (3, 3, False)
    assert turn_host(0, [TransferOutcome(HANDOFF, 0, 4, False, True)]).handed_off
