"""The KV event mirror's queues: one per Conductor, bounded, losing the oldest when full, and
none at all with a single Conductor."""

from __future__ import annotations

import pytest

from clients.python import ConductorClient
from clients.python.kv_mirror import KvEventMirror
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

A, B = "127.0.0.1:1", "127.0.0.1:2"


def batch(sequence: int) -> pb.KvEventBatch:
    return pb.KvEventBatch(instance_id="node-a/engine-0", sequence=sequence)


async def test_a_full_queue_loses_its_oldest_batches() -> None:
    async with ConductorClient([A, B]) as client:
        mirror = KvEventMirror(client, queue_batches=2)  # not started: nothing is sent
        for seq in range(5):
            mirror.put(batch(seq))
        # No leader known yet: every Conductor gets a copy, each queue keeps the newest two.
        assert mirror.queued(A) == mirror.queued(B) == 2
        assert mirror.counters.dropped == 6
        await mirror.close()


async def test_a_single_conductor_gets_no_mirror() -> None:
    async with ConductorClient([A]) as client:
        mirror = KvEventMirror(client)
        mirror.start()
        mirror.put(batch(0))
        assert mirror.queued(A) == 0
        await mirror.close()


async def test_nothing_is_queued_after_close() -> None:
    async with ConductorClient([A, B]) as client:
        mirror = KvEventMirror(client)
        await mirror.close()
        mirror.put(batch(0))
        assert mirror.queued(A) == mirror.queued(B) == 0


async def test_bad_queue_size_is_refused() -> None:
    async with ConductorClient([A, B]) as client:
        with pytest.raises(ValueError, match="at least 1"):
            KvEventMirror(client, queue_batches=0)
