"""The subscriber on real ZMQ sockets: an engine that restarts (its numbering starts again)
is reported, and batches a snapshot already covers are dropped without a replay."""

from __future__ import annotations

import asyncio
import socket

from services.engine.kv_publisher import KvEventPublisher
from services.kv_events.vllm_wire import AllBlocksCleared, EventBatch
from services.launcher.ports import free_port
from services.messenger.kv_subscriber import KvEventSubscriber, Resync
from tests.fixtures.poll import wait_for
from tests.messenger.test_subscriber_publisher import TOPIC, joined, next_item, stored


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` now (ZMQ closes its listeners asynchronously)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_a_restarted_publisher_is_reported_and_followed() -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    pub = KvEventPublisher(endpoint, topic=TOPIC)
    sub = KvEventSubscriber(endpoint, topic=TOPIC)
    items = sub.batches()
    try:
        await joined(pub, items)
        # Far ahead of what the new publisher sends while the SUB socket reconnects (those
        # batches are lost), so its numbers are surely lower.
        for _ in range(10):  # in rounds it reads up (a PUB socket drops past its high-water mark)
            for _ in range(100):
                await pub.publish([], ts=0.0)
            await joined(pub, items)
        await pub.close()
        await wait_for(lambda: port_free(port), 5.0, message="ZMQ let go of the port")
        pub = KvEventPublisher(endpoint, topic=TOPIC)  # numbering from 0 again
        getter = asyncio.ensure_future(anext(items))
        deadline = asyncio.get_running_loop().time() + 30.0
        # Publish until the SUB socket has reconnected (seconds on a loaded machine).
        while not getter.done() and asyncio.get_running_loop().time() < deadline:
            await pub.publish([AllBlocksCleared()], ts=0.0)
            await asyncio.wait({getter}, timeout=0.01)
        assert getter.done(), "the subscriber never heard the restarted publisher"
        marker = getter.result()
        assert isinstance(marker, Resync) and marker.restarted
        assert sub.restarts == 1
        after = await next_item(items)
        assert isinstance(after, EventBatch) and after.seq == marker.next_seq < 1000
    finally:
        sub.close()
        await pub.close()


async def test_batches_a_snapshot_covers_are_dropped_without_a_replay() -> None:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic=TOPIC)
    pub.start()
    sub = KvEventSubscriber(pub.endpoint, pub.replay_endpoint, topic=TOPIC)
    items = sub.batches()
    try:
        first = await joined(pub, items)
        assert isinstance(first, EventBatch)
        covered = [await pub.publish([stored(i)], ts=0.0) for i in range(3)]
        sub.skip_to(covered[-1] + 1)  # a snapshot taken now holds them
        fresh = await pub.publish([stored(9)], ts=0.0)
        got = await next_item(items)
        assert isinstance(got, EventBatch) and got.seq == fresh
        assert (sub.duplicates, sub.replayed, sub.resyncs) == (3, 0, 0)
    finally:
        sub.close()
        await pub.close()
