"""Events are coalesced: cut after the window, at once when a batch is full; only the latest
load report waits; a resync drops what waits."""

from __future__ import annotations

import asyncio

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.messenger.batcher import Batcher
from tests.fixtures.poll import wait_for

CLEARED = pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared())


def load(tokens: int) -> pb.KvEvent:
    return pb.KvEvent(load=common.LoadReport(pending_prefill_tokens=tokens))


def collect() -> tuple[list[tuple[list[pb.KvEvent], float | None]], Batcher]:
    cuts: list[tuple[list[pb.KvEvent], float | None]] = []
    return cuts, Batcher(lambda events, ts: cuts.append((events, ts)), max_events=3)


def test_full_batches_are_cut_at_once_with_their_oldest_timestamp() -> None:
    cuts, b = collect()
    b.add([CLEARED] * 2, engine_ts=5.0)
    assert cuts == []
    b.add([CLEARED] * 5, engine_ts=6.0)
    assert [(len(e), ts) for e, ts in cuts] == [(3, 5.0), (3, 6.0)]
    b.flush()
    assert [(len(e), ts) for e, ts in cuts[2:]] == [(1, 6.0)]


def test_only_the_latest_load_rides_with_the_next_batch_and_clear_drops_all() -> None:
    cuts, b = collect()
    b.set_load(load(1))
    b.set_load(load(2))
    b.add([CLEARED], engine_ts=1.0)
    b.flush()
    assert cuts == [([CLEARED, load(2)], 1.0)]
    b.add([CLEARED])
    b.set_load(load(3))
    b.clear()
    b.flush()
    assert len(cuts) == 1


async def test_the_window_cuts_what_waits() -> None:
    cuts, b = collect()
    runner = asyncio.create_task(b.run())
    try:
        b.add([CLEARED])
        await wait_for(lambda: cuts, 2.0, message="a batch is cut after the window")
        assert cuts == [([CLEARED], None)]
    finally:
        runner.cancel()
