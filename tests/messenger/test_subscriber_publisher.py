"""KV events over real ZMQ sockets on loopback: the engine's publisher and the Messenger's
subscriber, with gaps filled from the replay socket, lost batches reported, and malformed
messages skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from services.engine.kv_publisher import KvEventPublisher
from services.kv_events.vllm_wire import AllBlocksCleared, BlockStored, EventBatch, encode_frames
from services.messenger.kv_subscriber import KvEventSubscriber, Resync

TOPIC = b"kv"


def stored(i: int) -> BlockStored:
    return BlockStored((i,), None, tuple(range(16)), 16, "GPU")


async def next_item(items: AsyncIterator[EventBatch | Resync]) -> EventBatch | Resync:
    return await asyncio.wait_for(anext(items), 5.0)


async def joined(
    pub: KvEventPublisher, items: AsyncIterator[EventBatch | Resync]
) -> EventBatch | Resync:
    """Publish until the subscriber sees a batch (a SUB socket misses what is sent before it
    has joined), then drain up to a marker batch; returns the marker."""
    getter = asyncio.ensure_future(anext(items))
    try:
        for _ in range(500):
            await pub.publish([AllBlocksCleared()], ts=0.0)
            done, _ = await asyncio.wait({getter}, timeout=0.01)
            if done:
                break
        else:
            raise AssertionError("the subscriber never joined")
    finally:
        if not getter.done():
            getter.cancel()
    # Drain the probes sent while it was joining: read up to a marker batch.
    marker = await pub.publish([AllBlocksCleared()], ts=0.0)
    item = getter.result()
    while not (isinstance(item, EventBatch) and item.seq == marker):
        item = await next_item(items)
    return item


@pytest.fixture
async def pair() -> AsyncIterator[tuple[KvEventPublisher, KvEventSubscriber]]:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC, buffer_steps=8)
    pub.start()
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, topic=TOPIC)
    yield pub, sub
    sub.close()
    await pub.close()


async def test_batches_arrive_in_order_and_decode(
    pair: tuple[KvEventPublisher, KvEventSubscriber],
) -> None:
    pub, sub = pair
    items = sub.batches()
    first = await joined(pub, items)
    assert isinstance(first, EventBatch)
    seqs = [await pub.publish([stored(i)], ts=float(i)) for i in range(3)]
    got = [await next_item(items) for _ in seqs]
    assert [b.seq for b in got if isinstance(b, EventBatch)] == seqs
    assert [b.events for b in got if isinstance(b, EventBatch)] == [(stored(i),) for i in range(3)]
    assert sub.malformed == sub.resyncs == sub.replayed == 0


async def test_a_gap_is_filled_from_the_replay_socket(
    pair: tuple[KvEventPublisher, KvEventSubscriber],
) -> None:
    pub, sub = pair
    items = sub.batches()
    await joined(pub, items)
    pub.topic = b"elsewhere"  # batches the subscriber never sees live
    missed = [await pub.publish([stored(i)], ts=1.0) for i in range(3)]
    pub.topic = TOPIC
    live = await pub.publish([stored(99)], ts=2.0)
    got = [await next_item(items) for _ in range(4)]
    assert all(isinstance(b, EventBatch) for b in got)
    assert [b.seq for b in got if isinstance(b, EventBatch)] == [*missed, live]
    assert sub.replayed == 3 and sub.resyncs == 0


async def test_batches_lost_beyond_the_replay_buffer_ask_for_a_resync(
    pair: tuple[KvEventPublisher, KvEventSubscriber],
) -> None:
    pub, sub = pair
    items = sub.batches()
    first = await joined(pub, items)
    assert isinstance(first, EventBatch)
    await pub.publish([AllBlocksCleared()], ts=0.0)
    baseline = await next_item(items)
    assert isinstance(baseline, EventBatch)
    pub.topic = b"elsewhere"
    for i in range(12):  # the buffer keeps 8
        await pub.publish([stored(i)], ts=1.0)
    pub.topic = TOPIC
    live = await pub.publish([stored(99)], ts=2.0)
    got = [await next_item(items) for _ in range(2)]
    assert got[0] == Resync(baseline.seq, live)  # the oldest of the gap were evicted
    assert isinstance(got[1], EventBatch) and got[1].seq == live
    assert sub.resyncs == 1 and sub.replayed == 0


async def test_malformed_messages_are_counted_and_skipped() -> None:
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind("tcp://127.0.0.1:*")
    sub = KvEventSubscriber(raw.getsockopt_string(zmq.LAST_ENDPOINT), topic=TOPIC)
    items = sub.batches()
    try:
        getter = asyncio.ensure_future(anext(items))
        for _ in range(500):  # until the subscriber has joined
            await raw.send_multipart(encode_frames(TOPIC, 0, 0.0, [AllBlocksCleared()]))
            if (await asyncio.wait({getter}, timeout=0.01))[0]:
                break
        assert getter.done()
        await raw.send_multipart([TOPIC, b"short"])  # wrong frame count
        await raw.send_multipart([TOPIC, b"\x00" * 8, b"\xc1 not msgpack"])
        await raw.send_multipart(encode_frames(TOPIC, 1, 0.0, [stored(1)]))
        good = await next_item(items)
        assert isinstance(good, EventBatch) and good.seq == 1
        assert sub.malformed == 2
    finally:
        sub.close()
        raw.close()
