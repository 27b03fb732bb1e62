"""The batches a standby keeps from the Messengers' mirror: what it keeps, what it lets go,
and what it applies at takeover (only what continues the cursor, under the same lease)."""

from __future__ import annotations

import pytest

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.conductor.mirror import Cursor, MirroredBatches

IID = "node-a/engine-0"
LEASE = 7


def batch(sequence: int, *, iid: str = IID, resync: bool = False) -> pb.KvEventBatch:
    return pb.KvEventBatch(instance_id=iid, sequence=sequence, resync=resync)


def sequences(taken: dict[str, list[pb.KvEventBatch]], iid: str = IID) -> list[int]:
    return [b.sequence for b in taken.get(iid, [])]


def test_keeps_in_sequence_and_lets_go_what_the_cursor_counts() -> None:
    kept = MirroredBatches()
    assert not kept.keep(batch(4), Cursor(5, LEASE))  # durable already
    for seq in (5, 6, 7):
        assert kept.keep(batch(seq), Cursor(5, LEASE))
    assert kept.kept(IID) == [5, 6, 7]
    # The watch moved the cursor past 6: the next batch lets 5 and 6 go.
    assert kept.keep(batch(8), Cursor(7, LEASE))
    assert kept.kept(IID) == [7, 8]
    assert kept.counters.durable == 3  # 4, then 5 and 6


def test_unknown_instance_is_not_kept() -> None:
    kept = MirroredBatches()
    assert not kept.keep(batch(0), None)
    assert kept.kept(IID) == []
    assert kept.counters.unknown == 1


def test_cap_pushes_out_the_oldest_and_the_gap_blocks_takeover() -> None:
    kept = MirroredBatches(max_per_instance=3)
    for seq in range(10, 15):
        kept.keep(batch(seq), Cursor(10, LEASE))
    assert kept.kept(IID) == [12, 13, 14]
    assert kept.counters.pushed_out == 2
    # The cursor in etcd is still 10: 10 and 11 are missing, so nothing can be applied.
    assert kept.take(lambda _: Cursor(10, LEASE)) == {}
    assert len(kept) == 0  # take empties the store


def test_take_returns_what_continues_the_cursor() -> None:
    kept = MirroredBatches()
    for seq in range(3, 8):
        kept.keep(batch(seq), Cursor(3, LEASE))
    # etcd counts up to 5 by now: 5, 6, 7 continue it.
    assert sequences(kept.take(lambda _: Cursor(5, LEASE))) == [5, 6, 7]


def test_take_skips_a_cursor_ahead_of_everything_kept() -> None:
    kept = MirroredBatches()
    kept.keep(batch(3), Cursor(3, LEASE))
    assert kept.take(lambda _: Cursor(9, LEASE)) == {}


def test_a_break_in_the_sequence_starts_over() -> None:
    kept = MirroredBatches()
    for seq in (3, 4, 6, 7):  # 5 never came
        kept.keep(batch(seq), Cursor(3, LEASE))
    assert kept.kept(IID) == [6, 7]
    assert kept.take(lambda _: Cursor(3, LEASE)) == {}  # 3..5 would be a gap


def test_a_new_lease_starts_over_and_take_checks_the_lease() -> None:
    kept = MirroredBatches()
    kept.keep(batch(3), Cursor(3, LEASE))
    kept.keep(batch(4), Cursor(3, LEASE + 1))  # re-registered meanwhile
    assert kept.kept(IID) == [4]
    # Registered again under yet another lease by the time of takeover: not applied.
    assert kept.take(lambda _: Cursor(4, LEASE + 2)) == {}


def test_gone_instance_is_not_applied() -> None:
    kept = MirroredBatches()
    kept.keep(batch(0), Cursor(0, LEASE))
    assert kept.take(lambda _: None) == {}


def test_resync_replaces_what_came_before_and_continues_any_cursor() -> None:
    kept = MirroredBatches()
    for seq in (3, 4):
        kept.keep(batch(seq), Cursor(3, LEASE))
    kept.keep(batch(9, resync=True), Cursor(3, LEASE))
    kept.keep(batch(10), Cursor(3, LEASE))
    assert kept.kept(IID) == [9, 10]
    taken = kept.take(lambda _: Cursor(3, LEASE))
    assert sequences(taken) == [9, 10]
    assert taken[IID][0].resync


def test_instances_are_kept_apart() -> None:
    kept = MirroredBatches()
    other = "node-b/engine-0"
    kept.keep(batch(1), Cursor(1, LEASE))
    kept.keep(batch(5, iid=other), Cursor(5, LEASE))
    kept.keep(batch(2), Cursor(1, LEASE))
    taken = kept.take(lambda iid: Cursor(1 if iid == IID else 5, LEASE))
    assert sequences(taken) == [1, 2]
    assert sequences(taken, other) == [5]


def test_bad_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        MirroredBatches(max_per_instance=0)
