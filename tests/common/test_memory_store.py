"""What `MemoryStore` adds to the `Store` contract (test_store.py): leases on an injected clock,
compaction, and stores sharing one keyspace."""

from __future__ import annotations

import contextlib

import pytest

from services.common.store.interface import Put, StoreCompacted, WatchEvent
from services.common.store.memory import MemoryStore
from services.common.store.memory_keyspace import MemoryKeyspace
from tests.common.test_store import take


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_leases_expire_on_the_injected_clock() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    lease = await store.grant_lease(10)
    await store.put(b"k", b"v", lease.id)
    clock.now += 9.5
    assert await store.lease_ttl(lease.id) == 0  # whole seconds left, truncated
    assert await store.keep_alive(lease.id) == 10
    clock.now += 9.5
    assert await store.get(b"k") is not None
    clock.now += 0.5
    revision = await store.revision()
    assert await store.get(b"k") is None
    assert await store.lease_ttl(lease.id) == -1
    assert await store.keep_alive(lease.id) == 0
    # The expiry deleted the key in one revision of its own.
    async with contextlib.aclosing(store.watch_prefix(b"k", revision)) as events:
        assert await take(events, 1) == [WatchEvent("delete", b"k", b"", revision)]


async def test_a_waiting_watch_applies_the_expiry_when_told() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    lease = await store.grant_lease(1)
    start = await store.put(b"e", b"v", lease.id)
    async with contextlib.aclosing(store.watch_prefix(b"", start)) as events:
        assert [e.kind for e in await take(events, 1)] == ["put"]
        clock.now += 1
        store.keyspace.expire_leases()
        assert [e.kind for e in await take(events, 1)] == ["delete"]


async def test_watch_from_a_compacted_revision_raises() -> None:
    store = MemoryStore()
    first = await store.put(b"a", b"1")
    last = await store.put(b"a", b"2")
    store.keyspace.compact(last)
    with pytest.raises(StoreCompacted) as info:
        await anext(store.watch_prefix(b"", first))
    assert info.value.compact_revision == last
    async with contextlib.aclosing(store.watch_prefix(b"", last)) as events:
        assert [e.value for e in await take(events, 1)] == [b"2"]


async def test_stores_on_one_keyspace_share_it_and_close_apart() -> None:
    keyspace = MemoryKeyspace()
    one, two = MemoryStore(keyspace), MemoryStore(keyspace)
    revision = await one.put(b"a", b"1")
    assert (await two.snapshot(b"")) == ([await one.get(b"a")], revision)
    created = [await one.create(b"leader", b"1"), await two.create(b"leader", b"2")]
    assert created == [True, False]
    watch = two.watch_prefix(b"", revision)
    await one.close()  # ends only `one`'s watches
    assert [e.key for e in await take(watch, 2)] == [b"a", b"leader"]
    await watch.aclose()
    result = await two.commit([Put(b"b", b"1", 12345), Put(b"c", b"1")])
    assert (result.transactions, result.dropped_puts) == (1, 1)
    with pytest.raises(ValueError, match="not both"):
        MemoryStore(keyspace, clock=FakeClock())
