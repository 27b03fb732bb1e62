"""The per-instance log of the KV event stream: contiguous sequence numbers, rewinding to a
resume point it holds, a resync batch replacing what came before."""

from __future__ import annotations

from clients.python.kv_stream import _Entry, _Log
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb


def entry(seq: int, resync: bool = False) -> _Entry:
    batch = pb.KvEventBatch(instance_id="i", sequence=seq, resync=resync)
    return _Entry(pb.StreamKvEventsRequest(batch=batch), 0, None)


def pending(log: _Log) -> int | None:
    e = log.pending()
    return None if e is None else e.sequence


def fill(log: _Log, n: int) -> None:
    for _ in range(n):
        log.append(entry(log.next_sequence))


def test_rewind_within_the_log_and_not_beyond() -> None:
    log = _Log(10, capacity=4)
    log.append(entry(10, resync=True))
    fill(log, 5)  # 11..15; the log keeps 12..15
    assert (log.first_sequence, log.next_sequence) == (12, 16)
    assert log.rewind(13) and pending(log) == 13
    assert log.rewind(16) and pending(log) is None  # everything applied
    assert not log.rewind(11)  # pushed out
    assert not log.rewind(17)  # ahead of anything cut


def test_a_resync_batch_replaces_the_past_and_covers_any_resume_point() -> None:
    log = _Log(0, capacity=8)
    fill(log, 3)
    log.cursor = 1  # 1 and 2 unsent
    log.append(entry(3, resync=True))
    assert pending(log) == 3
    fill(log, 2)
    assert log.rewind(0)  # not held, but the resync batch makes it moot
    assert pending(log) == 3


def test_full_of_unsent_only_when_the_oldest_was_never_sent() -> None:
    log = _Log(0, capacity=2)
    fill(log, 2)
    assert log.full_of_unsent()
    log.cursor = 1
    assert not log.full_of_unsent()
