"""The `Store` contract, run against `EtcdStore` on a real etcd (tests/fixtures/etcd.py) and
against `MemoryStore`; what only etcd does (paging, failover, TLS) is in test_etcd_store.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from services.common.store.interface import (
    Delete,
    DeletePrefix,
    Fenced,
    Guard,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    Store,
    WatchEvent,
)
from services.common.store.memory import MemoryStore
from tests.fixtures import wait_for


@pytest.fixture(params=["etcd", "memory"])
def store(request: pytest.FixtureRequest) -> Store:
    """A connected store of each implementation (the etcd one is `etcd_store`)."""
    if request.param == "etcd":
        etcd_store: Store = request.getfixturevalue("etcd_store")
        return etcd_store
    return MemoryStore()  # always connected


@pytest.fixture
def prefix(etcd_prefix: bytes) -> bytes:
    """A key prefix unique to this test."""
    return etcd_prefix


async def take(events: AsyncIterator[WatchEvent], n: int, timeout: float = 5.0) -> list[WatchEvent]:
    """The next `n` events, failing after `timeout` seconds."""
    out: list[WatchEvent] = []
    async with asyncio.timeout(timeout):
        async for ev in events:
            out.append(ev)
            if len(out) == n:
                break
    return out


# --------------------------------------------------------------------------- key-value


async def test_put_get_delete(store: Store, prefix: bytes) -> None:
    key = prefix + b"a"
    assert await store.get(key) is None
    rev = await store.put(key, b"1")
    assert await store.get(key) == KeyValue(key, b"1", 0, rev)
    rev2 = await store.put(key, b"\x00\xff binary")
    assert rev2 == rev + 1
    assert await store.get(key) == KeyValue(key, b"\x00\xff binary", 0, rev2)
    assert await store.delete(key) is True
    assert await store.delete(key) is False
    assert await store.get(key) is None


async def test_prefix_is_sorted_and_scoped(store: Store, prefix: bytes) -> None:
    names = [b"b", b"a/1", b"a", b"c\xff", b"a/0"]
    random.Random(7).shuffle(names)
    for n in names:
        await store.put(prefix + b"in/" + n, n)
    # Neighbours that share the prefix's bytes but are not under it.
    await store.put(prefix + b"in", b"x")
    await store.put(prefix + b"in0", b"x")
    await store.put(prefix + b"in.", b"x")
    got = await store.get_prefix(prefix + b"in/")
    assert [kv.key for kv in got] == [prefix + b"in/" + n for n in sorted(names)]
    assert all(kv.value == kv.key.rsplit(b"/in/", 1)[1] for kv in got)
    assert await store.delete_prefix(prefix + b"in/") == 5
    assert await store.get_prefix(prefix + b"in/") == []
    assert len(await store.get_prefix(prefix)) == 3
    with pytest.raises(ValueError):
        await store.delete_prefix(b"")


async def test_create_is_exclusive(store: Store, prefix: bytes) -> None:
    key = prefix + b"leader"
    results = await asyncio.gather(*(store.create(key, b"%d" % i) for i in range(10)))
    assert sorted(results) == [False] * 9 + [True]
    winner = results.index(True)
    kv = await store.get(key)
    assert kv is not None and kv.value == b"%d" % winner
    assert await store.create(key, b"again") is False
    assert await store.delete(key)
    assert await store.create(key, b"again") is True


# --------------------------------------------------------------------------- commit


async def test_commit_300_ops_in_transactions_of_at_most_128(store: Store, prefix: bytes) -> None:
    ops: list[Op] = [Put(prefix + b"%03d" % i, b"v%d" % i) for i in range(300)]
    before = await store.revision()
    result = await store.commit(ops)
    after = await store.revision()
    assert after - before == 3  # each transaction bumps the revision by exactly one
    assert (result.transactions, result.dropped_puts, result.revision) == (3, 0, after)
    kvs = await store.get_prefix(prefix)
    assert [kv.value for kv in kvs] == [b"v%d" % i for i in range(300)]
    # Keys written by one transaction share its revision: 128 + 128 + 44, in order.
    by_rev = Counter(kv.mod_revision for kv in kvs)
    assert [by_rev[r] for r in (before + 1, before + 2, before + 3)] == [128, 128, 44]
    assert [kv.mod_revision for kv in kvs] == sorted(kv.mod_revision for kv in kvs)


async def test_commit_mixed_ops_in_order(store: Store, prefix: bytes) -> None:
    p = prefix
    await store.commit([Put(p + b"d/1", b"x"), Put(p + b"d/2", b"x"), Put(p + b"k", b"0")])
    before = await store.revision()
    result = await store.commit(
        [
            Put(p + b"a", b"1"),
            Put(p + b"a", b"2"),  # same key again: a second transaction
            DeletePrefix(p + b"d/"),
            Put(p + b"d/3", b"new"),  # under a prefix deleted in this txn: a third
            Delete(p + b"k"),
        ]
    )
    assert result.transactions == 3
    assert await store.revision() == before + 3
    got = {kv.key: kv.value for kv in await store.get_prefix(p)}
    assert got == {p + b"a": b"2", p + b"d/3": b"new"}
    assert await store.commit([]) == type(result)(0, 0, 0)


async def test_commit_drops_only_puts_on_a_missing_lease(store: Store, prefix: bytes) -> None:
    p = prefix
    live = await store.grant_lease(30)
    dead = await store.grant_lease(30)
    assert await store.revoke_lease(dead.id) is True
    await store.put(p + b"old", b"x")
    ops: list[Op] = [Put(p + b"a%03d" % i, b"v", live.id) for i in range(130)]  # chunk 1 + 2
    ops += [Put(p + b"dead1", b"v", dead.id), Put(p + b"plain", b"v"), Delete(p + b"old")]
    ops += [Put(p + b"dead2", b"v", dead.id)]
    before = await store.revision()
    result = await store.commit(ops)
    assert result.dropped_puts == 2
    assert result.transactions == 2
    assert await store.revision() == before + 2
    keys = {kv.key: kv.lease for kv in await store.get_prefix(p)}
    assert p + b"dead1" not in keys and p + b"dead2" not in keys and p + b"old" not in keys
    assert keys[p + b"plain"] == 0
    assert sum(1 for lease in keys.values() if lease == live.id) == 130
    # A single put or create on a missing lease is an error the caller sees.
    with pytest.raises(LeaseNotFound, match="lease not found"):
        await store.put(p + b"x", b"v", dead.id)
    with pytest.raises(LeaseNotFound):
        await store.create(p + b"x", b"v", dead.id)
    # Everything in a chunk bound to dead leases: the chunk is skipped, nothing fails.
    assert await store.commit([Put(p + b"y", b"v", dead.id)]) == type(result)(0, 0, 1)
    await store.revoke_lease(live.id)


async def test_a_guarded_commit_applies_only_while_its_key_holds_its_lease(
    store: Store, prefix: bytes
) -> None:
    p = prefix
    leader = p + b"leader"
    old_term, new_term = await store.grant_lease(30), await store.grant_lease(30)
    assert await store.create(leader, b"old", old_term.id)
    await store.commit([Put(p + b"a", b"1")], Guard(leader, old_term.id))
    assert (await store.get(p + b"a")) is not None
    # The old term ends (its key taken away, a new leader elected): its writes are refused.
    await store.commit([Delete(leader)], Guard(leader, old_term.id))
    assert await store.create(leader, b"new", new_term.id)
    before = await store.revision()
    ops: list[Op] = [Put(p + b"b%03d" % i, b"v") for i in range(130)]
    ops.append(Delete(p + b"a"))
    with pytest.raises(Fenced, match="no longer bound"):
        await store.commit(ops, Guard(leader, old_term.id))
    assert await store.revision() == before  # nothing of it applied
    assert [kv.key for kv in await store.get_prefix(p)] == [p + b"a", leader]
    # A missing key fences too; the current term writes.
    with pytest.raises(Fenced):
        await store.commit([Put(p + b"c", b"v")], Guard(p + b"missing", new_term.id))
    result = await store.commit(ops, Guard(leader, new_term.id))
    assert result.transactions == 2
    assert await store.get(p + b"a") is None and await store.get(p + b"b129") is not None
    for lease in (old_term, new_term):
        await store.revoke_lease(lease.id)


# --------------------------------------------------------------------------- leases


async def test_one_second_lease_expires_and_removes_its_keys(store: Store, prefix: bytes) -> None:
    lease = await store.grant_lease(1)
    assert lease.ttl_s == 1  # with etcd's default timing the minimum TTL would make this 2
    key = prefix + b"ephemeral"
    await store.put(key, b"v", lease.id)
    await store.put(prefix + b"stays", b"v")
    kv = await store.get(key)
    assert kv is not None and kv.lease == lease.id
    start = time.monotonic()

    async def gone() -> bool:
        return await store.get(key) is None

    await wait_for(gone, timeout=3.0, message="key bound to a 1 s lease deleted")
    assert time.monotonic() - start < 2.5
    assert await store.lease_ttl(lease.id) == -1
    assert await store.keep_alive(lease.id) <= 0
    assert await store.revoke_lease(lease.id) is False
    assert await store.get(prefix + b"stays") is not None


async def test_keep_alive_and_revoke(store: Store, prefix: bytes) -> None:
    lease = await store.grant_lease(20)
    assert 0 < await store.lease_ttl(lease.id) <= 20
    assert await store.keep_alive(lease.id) == 20
    await store.put(prefix + b"k", b"v", lease.id)
    assert await store.revoke_lease(lease.id) is True
    assert await store.get(prefix + b"k") is None  # revocation deletes at once
    assert await store.keep_alive(lease.id) == 0
    assert await store.lease_ttl(lease.id) == -1


# --------------------------------------------------------------------------- watch


async def test_watch_sees_puts_and_deletes_from_a_revision(store: Store, prefix: bytes) -> None:
    p = prefix
    await store.put(p + b"before", b"0")
    start = await store.revision() + 1
    r1 = await store.put(p + b"a", b"1")
    await store.put(prefix[:-1] + b"-elsewhere", b"x")  # not under the prefix
    result = await store.commit([Put(p + b"b", b"2"), Delete(p + b"before")])
    r3 = await store.delete(p + b"a")
    assert r3
    async with contextlib.aclosing(store.watch_prefix(p, start)) as events:
        got = await take(events, 4)
        assert got == [
            WatchEvent("put", p + b"a", b"1", r1),
            WatchEvent("put", p + b"b", b"2", result.revision),
            WatchEvent("delete", p + b"before", b"", result.revision),
            WatchEvent("delete", p + b"a", b"", got[3].revision),
        ]
        assert got[3].revision == result.revision + 1
        # ...and then live changes.
        r5 = await store.put(p + b"c", b"3")
        assert await take(events, 1) == [WatchEvent("put", p + b"c", b"3", r5)]
    await store.delete_prefix(prefix[:-1] + b"-elsewhere")


async def test_watch_reports_lease_expiry_as_delete(store: Store, prefix: bytes) -> None:
    lease = await store.grant_lease(1)
    start = await store.put(prefix + b"e", b"v", lease.id)
    async with contextlib.aclosing(store.watch_prefix(prefix, start)) as events:
        put, delete = await take(events, 2, timeout=4.0)
    assert (put.kind, delete.kind, delete.key) == ("put", "delete", prefix + b"e")


async def test_watch_cancels_cleanly(store: Store, prefix: bytes) -> None:
    started = asyncio.Event()
    seen: list[WatchEvent] = []

    start = await store.revision() + 1

    async def consume() -> None:
        async for ev in store.watch_prefix(prefix, start):
            seen.append(ev)
            started.set()

    task = asyncio.create_task(consume())
    await store.put(prefix + b"a", b"1")
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The store still works, and a new watch sees new events.
    rev = await store.put(prefix + b"b", b"2")
    async with contextlib.aclosing(store.watch_prefix(prefix, rev)) as events:
        assert [e.key for e in await take(events, 1)] == [prefix + b"b"]
    assert [e.key for e in seen] == [prefix + b"a"]


async def test_watch_ends_when_store_closes(store: Store, prefix: bytes) -> None:
    rev = await store.put(prefix + b"a", b"1")
    events = store.watch_prefix(prefix, rev)
    assert (await anext(events)).key == prefix + b"a"
    pending = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)
    await store.close()
    async with asyncio.timeout(5):
        with pytest.raises(StopAsyncIteration):
            await pending
    await events.aclose()
