"""EtcdStore against a real etcd (tests/fixtures/etcd.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aetcd import rpc

from services.common.etcd import MAX_TXN_OPS, EtcdStore, plan_transactions, prefix_range_end
from services.common.store import (
    Delete,
    DeletePrefix,
    EtcdSettings,
    KeyValue,
    LeaseNotFound,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
    WatchEvent,
)
from services.launcher.ports import free_port
from tests.fixtures import wait_for
from tests.fixtures.etcd import EtcdServer, make_tls, start_etcd

SECRET = "s3cr3t-pa55word"


async def take(events: AsyncIterator[WatchEvent], n: int, timeout: float = 5.0) -> list[WatchEvent]:
    """The next `n` events, failing after `timeout` seconds."""
    out: list[WatchEvent] = []
    async with asyncio.timeout(timeout):
        async for ev in events:
            out.append(ev)
            if len(out) == n:
                break
    return out


# --------------------------------------------------------------------------- settings


def test_settings_repr_never_shows_password() -> None:
    s = EtcdSettings(username="root", password=SECRET)
    assert SECRET not in repr(s)
    assert SECRET not in str(s)
    assert "'***'" in repr(s) and "root" in repr(s)
    assert SECRET not in repr(EtcdStore(s))


def test_settings_from_env() -> None:
    env = {
        "KVSCHED_ETCD_ENDPOINTS": "http://10.0.0.1:2379, https://etcd-2:2379 ,",
        "KVSCHED_ETCD_USERNAME": "conductor",
        "KVSCHED_ETCD_PASSWORD": SECRET,
        "KVSCHED_ETCD_CA_FILE": "/ca.pem",
        "KVSCHED_ETCD_TIMEOUT_S": "2.5",
    }
    s = EtcdSettings.from_env(environ=env)
    assert s.endpoints == ("http://10.0.0.1:2379", "https://etcd-2:2379")
    assert (s.username, s.password, s.ca_file, s.cert_file) == (
        "conductor",
        SECRET,
        "/ca.pem",
        None,
    )
    assert s.timeout_s == 2.5 and s.uses_tls
    assert EtcdSettings.from_env(environ={}) == EtcdSettings()
    assert not EtcdSettings().uses_tls
    with pytest.raises(ValueError, match="together"):
        EtcdSettings(username="root")
    with pytest.raises(ValueError, match="bad etcd endpoint"):
        EtcdSettings(endpoints=("ftp://x:1",))


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"
    assert prefix_range_end(b"") == b"\0"


def test_plan_splits_at_limits_and_conflicts() -> None:
    puts: list[Op] = [Put(b"k%d" % i, b"v") for i in range(300)]
    assert [len(t) for t in plan_transactions(puts)] == [128, 128, 44]
    # A key put twice, or put and deleted in one transaction, is rejected by etcd.
    ops: list[Op] = [Put(b"a", b"1"), Put(b"b", b"1"), Delete(b"a"), Put(b"a", b"2")]
    assert plan_transactions(ops) == [ops[:2], ops[2:3], ops[3:]]
    ops = [DeletePrefix(b"p/"), Put(b"q", b"1"), Put(b"p/x", b"1"), Delete(b"q"), Put(b"q", b"2")]
    assert plan_transactions(ops) == [ops[:2], ops[2:4], ops[4:]]
    big = [Put(b"k%d" % i, b"x" * 400_000) for i in range(5)]
    assert [len(t) for t in plan_transactions(big)] == [2, 2, 1]
    with pytest.raises(ValueError, match="empty prefix"):
        plan_transactions([DeletePrefix(b"")])


# --------------------------------------------------------------------------- key-value


async def test_put_get_delete(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    key = etcd_prefix + b"a"
    assert await etcd_store.get(key) is None
    rev = await etcd_store.put(key, b"1")
    assert await etcd_store.get(key) == KeyValue(key, b"1", 0, rev)
    rev2 = await etcd_store.put(key, b"\x00\xff binary")
    assert rev2 == rev + 1
    assert await etcd_store.get(key) == KeyValue(key, b"\x00\xff binary", 0, rev2)
    assert await etcd_store.delete(key) is True
    assert await etcd_store.delete(key) is False
    assert await etcd_store.get(key) is None


async def test_prefix_is_sorted_and_scoped(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    names = [b"b", b"a/1", b"a", b"c\xff", b"a/0"]
    random.Random(7).shuffle(names)
    for n in names:
        await etcd_store.put(etcd_prefix + b"in/" + n, n)
    # Neighbours that share the prefix's bytes but are not under it.
    await etcd_store.put(etcd_prefix + b"in", b"x")
    await etcd_store.put(etcd_prefix + b"in0", b"x")
    await etcd_store.put(etcd_prefix + b"in.", b"x")
    got = await etcd_store.get_prefix(etcd_prefix + b"in/")
    assert [kv.key for kv in got] == [etcd_prefix + b"in/" + n for n in sorted(names)]
    assert all(kv.value == kv.key.rsplit(b"/in/", 1)[1] for kv in got)
    assert await etcd_store.delete_prefix(etcd_prefix + b"in/") == 5
    assert await etcd_store.get_prefix(etcd_prefix + b"in/") == []
    assert len(await etcd_store.get_prefix(etcd_prefix)) == 3
    with pytest.raises(ValueError):
        await etcd_store.delete_prefix(b"")


@pytest.mark.parametrize("n_keys", [0, 1, 49, 50])
async def test_snapshot_pages(
    etcd_server: EtcdServer, etcd_store: EtcdStore, etcd_prefix: bytes, n_keys: int
) -> None:
    """Pages of 7 keys: none, one, exactly seven full pages, seven pages and one key."""
    await etcd_store.commit([Put(etcd_prefix + b"%04d" % i, b"%d" % i) for i in range(n_keys)])
    async with EtcdStore(etcd_server.settings(), page_size=7, page_bytes=0) as paged:
        kvs, rev = await paged.snapshot(etcd_prefix)
        assert rev == await paged.revision()
        assert [kv.key for kv in kvs] == [etcd_prefix + b"%04d" % i for i in range(n_keys)]
        assert [kv.value for kv in kvs] == [b"%d" % i for i in range(n_keys)]
        assert kvs == await etcd_store.get_prefix(etcd_prefix)


async def test_snapshot_pinned_across_pages(
    etcd_server: EtcdServer, etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    """Writes landing between two pages must not show up in the snapshot."""
    await etcd_store.commit([Put(etcd_prefix + b"%02d" % i, b"old") for i in range(20)])
    store = EtcdStore(etcd_server.settings(), page_size=5, page_bytes=0)
    async with store:
        client = await store._connected()
        real = client.kvstub.Range
        calls = 0

        async def range_then_write(request: object, **kw: object) -> object:
            nonlocal calls
            calls += 1
            resp = await real(request, **kw)
            # After each page: overwrite a key on a later page and add one at the end.
            await etcd_store.put(etcd_prefix + b"%02d" % min(19, calls * 5 + 1), b"new")
            await etcd_store.put(etcd_prefix + b"99-%d" % calls, b"new")
            return resp

        client.kvstub.Range = range_then_write
        try:
            kvs, rev = await store.snapshot(etcd_prefix)
        finally:
            client.kvstub.Range = real
        assert calls == 4  # 20 keys in pages of 5; the writes after them are not counted
        assert [kv.value for kv in kvs] == [b"old"] * 20
        assert all(kv.mod_revision <= rev for kv in kvs)


async def test_snapshot_sizes_later_pages_by_bytes(
    etcd_server: EtcdServer, etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    """After the first page, pages grow to about `page_bytes` (etcd counts the rest of the
    range on every page, so many small pages would cost O(N²))."""
    await etcd_store.commit([Put(etcd_prefix + b"%03d" % i, b"x" * 68) for i in range(100)])
    kv_bytes = len(etcd_prefix) + 3 + 68 + 32
    for page_bytes, expected_limits in [
        (10**9, [5, 95]),  # everything left in one page
        (kv_bytes * 40, [5, 40, 40, 15]),
        (kv_bytes * 2, [5] * 20),  # never below page_size
    ]:
        store = EtcdStore(etcd_server.settings(), page_size=5, page_bytes=page_bytes)
        async with store:
            client = await store._connected()
            real = client.kvstub.Range
            limits: list[int] = []

            async def spy(request: rpc.RangeRequest, **kw: object) -> object:
                limits.append(request.limit)  # noqa: B023  # consumed within the iteration
                return await real(request, **kw)  # noqa: B023

            client.kvstub.Range = spy
            kvs, _ = await store.snapshot(etcd_prefix)
        assert len(kvs) == 100
        assert limits == expected_limits


async def test_create_is_exclusive(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    key = etcd_prefix + b"leader"
    results = await asyncio.gather(*(etcd_store.create(key, b"%d" % i) for i in range(10)))
    assert sorted(results) == [False] * 9 + [True]
    winner = results.index(True)
    kv = await etcd_store.get(key)
    assert kv is not None and kv.value == b"%d" % winner
    assert await etcd_store.create(key, b"again") is False
    assert await etcd_store.delete(key)
    assert await etcd_store.create(key, b"again") is True


# --------------------------------------------------------------------------- commit


async def test_commit_300_ops_in_transactions_of_at_most_128(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    ops: list[Op] = [Put(etcd_prefix + b"%03d" % i, b"v%d" % i) for i in range(300)]
    before = await etcd_store.revision()
    result = await etcd_store.commit(ops)
    after = await etcd_store.revision()
    assert after - before == 3  # each transaction bumps the revision by exactly one
    assert (result.transactions, result.dropped_puts, result.revision) == (3, 0, after)
    kvs = await etcd_store.get_prefix(etcd_prefix)
    assert [kv.value for kv in kvs] == [b"v%d" % i for i in range(300)]
    # Keys written by one transaction share its revision: 128 + 128 + 44, in order.
    by_rev = Counter(kv.mod_revision for kv in kvs)
    assert [by_rev[r] for r in (before + 1, before + 2, before + 3)] == [128, 128, 44]
    assert [kv.mod_revision for kv in kvs] == sorted(kv.mod_revision for kv in kvs)


async def test_etcd_really_rejects_a_129_op_transaction(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    """The limit the store chunks for is etcd's: one more op is refused."""
    with pytest.raises(StoreError, match="too many operations"):
        await etcd_store._txn([Put(etcd_prefix + b"%d" % i, b"v") for i in range(MAX_TXN_OPS + 1)])
    await etcd_store._txn([Put(etcd_prefix + b"%d" % i, b"v") for i in range(MAX_TXN_OPS)])


async def test_commit_mixed_ops_in_order(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    p = etcd_prefix
    await etcd_store.commit([Put(p + b"d/1", b"x"), Put(p + b"d/2", b"x"), Put(p + b"k", b"0")])
    before = await etcd_store.revision()
    result = await etcd_store.commit(
        [
            Put(p + b"a", b"1"),
            Put(p + b"a", b"2"),  # same key again: a second transaction
            DeletePrefix(p + b"d/"),
            Put(p + b"d/3", b"new"),  # under a prefix deleted in this txn: a third
            Delete(p + b"k"),
        ]
    )
    assert result.transactions == 3
    assert await etcd_store.revision() == before + 3
    got = {kv.key: kv.value for kv in await etcd_store.get_prefix(p)}
    assert got == {p + b"a": b"2", p + b"d/3": b"new"}
    assert await etcd_store.commit([]) == type(result)(0, 0, 0)


async def test_commit_drops_only_puts_on_a_missing_lease(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    p = etcd_prefix
    live = await etcd_store.grant_lease(30)
    dead = await etcd_store.grant_lease(30)
    assert await etcd_store.revoke_lease(dead.id) is True
    await etcd_store.put(p + b"old", b"x")
    ops: list[Op] = [Put(p + b"a%03d" % i, b"v", live.id) for i in range(130)]  # chunk 1 + 2
    ops += [Put(p + b"dead1", b"v", dead.id), Put(p + b"plain", b"v"), Delete(p + b"old")]
    ops += [Put(p + b"dead2", b"v", dead.id)]
    before = await etcd_store.revision()
    result = await etcd_store.commit(ops)
    assert result.dropped_puts == 2
    assert result.transactions == 2
    assert await etcd_store.revision() == before + 2
    keys = {kv.key: kv.lease for kv in await etcd_store.get_prefix(p)}
    assert p + b"dead1" not in keys and p + b"dead2" not in keys and p + b"old" not in keys
    assert keys[p + b"plain"] == 0
    assert sum(1 for lease in keys.values() if lease == live.id) == 130
    # A single put or create on a missing lease is an error the caller sees.
    with pytest.raises(LeaseNotFound, match="lease not found"):
        await etcd_store.put(p + b"x", b"v", dead.id)
    with pytest.raises(LeaseNotFound):
        await etcd_store.create(p + b"x", b"v", dead.id)
    # Everything in a chunk bound to dead leases: the chunk is skipped, nothing fails.
    assert await etcd_store.commit([Put(p + b"y", b"v", dead.id)]) == type(result)(0, 0, 1)
    await etcd_store.revoke_lease(live.id)


# --------------------------------------------------------------------------- leases


async def test_one_second_lease_expires_and_removes_its_keys(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    lease = await etcd_store.grant_lease(1)
    assert lease.ttl_s == 1  # with etcd's default timing the minimum TTL would make this 2
    key = etcd_prefix + b"ephemeral"
    await etcd_store.put(key, b"v", lease.id)
    await etcd_store.put(etcd_prefix + b"stays", b"v")
    kv = await etcd_store.get(key)
    assert kv is not None and kv.lease == lease.id
    start = time.monotonic()

    async def gone() -> bool:
        return await etcd_store.get(key) is None

    await wait_for(gone, timeout=3.0, message="key bound to a 1 s lease deleted")
    assert time.monotonic() - start < 2.5
    assert await etcd_store.lease_ttl(lease.id) == -1
    assert await etcd_store.keep_alive(lease.id) <= 0
    assert await etcd_store.revoke_lease(lease.id) is False
    assert await etcd_store.get(etcd_prefix + b"stays") is not None


async def test_keep_alive_and_revoke(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    lease = await etcd_store.grant_lease(20)
    assert 0 < await etcd_store.lease_ttl(lease.id) <= 20
    assert await etcd_store.keep_alive(lease.id) == 20
    await etcd_store.put(etcd_prefix + b"k", b"v", lease.id)
    assert await etcd_store.revoke_lease(lease.id) is True
    assert await etcd_store.get(etcd_prefix + b"k") is None  # revocation deletes at once
    assert await etcd_store.keep_alive(lease.id) == 0
    assert await etcd_store.lease_ttl(lease.id) == -1


# --------------------------------------------------------------------------- watch


async def test_watch_sees_puts_and_deletes_from_a_revision(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    p = etcd_prefix
    await etcd_store.put(p + b"before", b"0")
    start = await etcd_store.revision() + 1
    r1 = await etcd_store.put(p + b"a", b"1")
    await etcd_store.put(etcd_prefix[:-1] + b"-elsewhere", b"x")  # not under the prefix
    result = await etcd_store.commit([Put(p + b"b", b"2"), Delete(p + b"before")])
    r3 = await etcd_store.delete(p + b"a")
    assert r3
    async with contextlib.aclosing(etcd_store.watch_prefix(p, start)) as events:
        got = await take(events, 4)
        assert got == [
            WatchEvent("put", p + b"a", b"1", r1),
            WatchEvent("put", p + b"b", b"2", result.revision),
            WatchEvent("delete", p + b"before", b"", result.revision),
            WatchEvent("delete", p + b"a", b"", got[3].revision),
        ]
        assert got[3].revision == result.revision + 1
        # ...and then live changes.
        r5 = await etcd_store.put(p + b"c", b"3")
        assert await take(events, 1) == [WatchEvent("put", p + b"c", b"3", r5)]
    await etcd_store.delete_prefix(etcd_prefix[:-1] + b"-elsewhere")


async def test_watch_reports_lease_expiry_as_delete(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    lease = await etcd_store.grant_lease(1)
    start = await etcd_store.put(etcd_prefix + b"e", b"v", lease.id)
    async with contextlib.aclosing(etcd_store.watch_prefix(etcd_prefix, start)) as events:
        put, delete = await take(events, 2, timeout=4.0)
    assert (put.kind, delete.kind, delete.key) == ("put", "delete", etcd_prefix + b"e")


async def test_snapshot_then_watch_misses_nothing(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    """Load a snapshot while writers run, then watch from its revision + 1: replaying the
    events onto the snapshot must give exactly the final state."""
    p = etcd_prefix
    await etcd_store.commit([Put(p + b"%03d" % i, b"init") for i in range(50)])
    rng = random.Random(11)
    stop = asyncio.Event()

    async def writer() -> int:
        n = 0
        while not stop.is_set() or n < 30:
            i = rng.randrange(60)
            if rng.random() < 0.3:
                await etcd_store.delete(p + b"%03d" % i)
            else:
                await etcd_store.put(p + b"%03d" % i, b"w%d" % n)
            n += 1
        return n

    task = asyncio.create_task(writer())
    await asyncio.sleep(0)  # let the writer start before the snapshot
    # Several pages while the writes land.
    store2 = EtcdStore(etcd_store.settings, page_size=8, page_bytes=0)
    async with store2:
        kvs, rev = await store2.snapshot(p)
    stop.set()
    await task
    state = {kv.key: kv.value for kv in kvs}
    final_rev = await etcd_store.put(p + b"zz-end", b"end")
    async with contextlib.aclosing(etcd_store.watch_prefix(p, rev + 1)) as events:
        async with asyncio.timeout(5):
            async for ev in events:
                assert ev.revision > rev
                if ev.kind == "put":
                    state[ev.key] = ev.value
                else:
                    state.pop(ev.key, None)
                if ev.revision == final_rev:
                    break
    assert state == {kv.key: kv.value for kv in await etcd_store.get_prefix(p)}


async def test_watch_cancels_cleanly(etcd_store: EtcdStore, etcd_prefix: bytes) -> None:
    started = asyncio.Event()
    seen: list[WatchEvent] = []

    start = await etcd_store.revision() + 1

    async def consume() -> None:
        async for ev in etcd_store.watch_prefix(etcd_prefix, start):
            seen.append(ev)
            started.set()

    task = asyncio.create_task(consume())
    await etcd_store.put(etcd_prefix + b"a", b"1")
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The store still works, and a new watch sees new events.
    rev = await etcd_store.put(etcd_prefix + b"b", b"2")
    async with contextlib.aclosing(etcd_store.watch_prefix(etcd_prefix, rev)) as events:
        assert [e.key for e in await take(events, 1)] == [etcd_prefix + b"b"]
    assert [e.key for e in seen] == [etcd_prefix + b"a"]


async def test_watch_ends_when_store_closes(etcd_server: EtcdServer, etcd_prefix: bytes) -> None:
    store = EtcdStore(etcd_server.settings())
    await store.connect()
    rev = await store.put(etcd_prefix + b"a", b"1")
    events = store.watch_prefix(etcd_prefix, rev)
    assert (await anext(events)).key == etcd_prefix + b"a"
    pending = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0)
    await store.close()
    async with asyncio.timeout(5):
        with pytest.raises(StopAsyncIteration):
            await pending
    await events.aclose()


# --------------------------------------------------------------------------- failures


async def test_unreachable_endpoint_is_store_unavailable_with_a_clear_message() -> None:
    port = free_port()  # nothing listens here
    settings = EtcdSettings(
        endpoints=(f"http://127.0.0.1:{port}",), username="u", password=SECRET, timeout_s=2
    )
    store = EtcdStore(settings)
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        await store.connect()
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message
    assert "unreachable" in message and "onnect" in message
    assert SECRET not in message and SECRET not in repr(info.value)
    assert time.monotonic() - start < 2
    # Any call connects on demand and fails the same way.
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        await store.get(b"k")


async def test_fails_over_to_the_next_endpoint(etcd_server: EtcdServer, etcd_prefix: bytes) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdStore(etcd_server.settings(endpoints=(dead, etcd_server.url))) as store:
        assert store.endpoint == etcd_server.url
        rev = await store.put(etcd_prefix + b"k", b"v")
        assert rev > 0


async def test_server_going_away_raises_store_unavailable(
    tmp_path: Path, etcd_prefix: bytes
) -> None:
    with start_etcd(tmp_path, name="doomed") as server:
        async with EtcdStore(server.settings(timeout_s=2)) as store:
            rev = await store.put(etcd_prefix + b"k", b"v")
            events = store.watch_prefix(etcd_prefix, rev)
            assert (await anext(events)).key == etcd_prefix + b"k"
            pending = asyncio.ensure_future(anext(events))
            server.kill()
            async with asyncio.timeout(5):
                with pytest.raises(StoreUnavailable, match=server.url):
                    await pending
            with pytest.raises(StoreUnavailable, match=f"{server.url}: get"):
                await store.get(etcd_prefix + b"k")
            await events.aclose()


async def test_fails_over_when_the_endpoint_in_use_dies(
    tmp_path: Path, etcd_server: EtcdServer, etcd_prefix: bytes
) -> None:
    with start_etcd(tmp_path, name="first") as first:
        settings = etcd_server.settings(endpoints=(first.url, etcd_server.url), timeout_s=2)
        async with EtcdStore(settings) as store:
            assert store.endpoint == first.url
            rev = await store.put(etcd_prefix + b"k", b"on-first")
            events = store.watch_prefix(etcd_prefix, rev)
            assert (await anext(events)).value == b"on-first"
            pending = asyncio.ensure_future(anext(events))
            first.kill()
            async with asyncio.timeout(5):
                with pytest.raises(StoreUnavailable, match=first.url):
                    await pending
            await events.aclose()
            # The failed endpoint was dropped: the next call connects to the other one.
            assert await store.get(etcd_prefix + b"k") is None
            assert store.endpoint == etcd_server.url
            await store.put(etcd_prefix + b"k", b"on-second")


async def test_tls_and_password_auth(tmp_path: Path, etcd_prefix: bytes) -> None:
    """A TLS etcd with client certificates and auth enabled: the TLS channel and the
    user/password login both work, and a wrong password is a clear StoreUnavailable."""
    tls = make_tls(tmp_path)
    with start_etcd(tmp_path, name="secure", tls=tls) as server:
        assert server.url.startswith("https://")
        # Enable auth through the raw API: a root user with the root role.
        async with EtcdStore(server.settings()) as admin:
            client = await admin._connected()
            auth = rpc.AuthStub(client.channel)
            await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password=SECRET))
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
            await auth.AuthEnable(rpc.AuthEnableRequest())
            with pytest.raises(StoreError):
                await admin.put(etcd_prefix + b"anon", b"v")  # no token any more
        async with EtcdStore(server.settings(username="root", password=SECRET)) as store:
            await store.put(etcd_prefix + b"k", b"v")
            kv = await store.get(etcd_prefix + b"k")
            assert kv is not None and kv.value == b"v"
            lease = await store.grant_lease(5)
            assert await store.keep_alive(lease.id) == 5
            async with contextlib.aclosing(store.watch_prefix(etcd_prefix, 1)) as events:
                assert [e.key for e in await take(events, 1)] == [etcd_prefix + b"k"]
        bad = EtcdStore(server.settings(username="root", password="wrong"))
        with pytest.raises(StoreUnavailable, match="root") as info:
            await bad.connect()
        assert "wrong" not in str(info.value)
        # Without the CA the server's certificate is not trusted.
        untrusting = EtcdStore(server.settings(ca_file=None, cert_file=None, key_file=None))
        with pytest.raises(StoreUnavailable):
            await untrusting.connect()
