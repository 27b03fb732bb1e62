"""What only `EtcdStore` does, against a real etcd (tests/fixtures/etcd.py): settings, the
transaction plan, paged snapshots, etcd's own limits, failover and TLS. The `Store` contract
both stores keep is in test_store.py."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import pytest
from aetcd import rpc

from services.common.store.etcd import MAX_TXN_OPS, EtcdStore, plan_transactions, prefix_range_end
from services.common.store.interface import (
    Delete,
    DeletePrefix,
    EtcdSettings,
    Op,
    Put,
    StoreError,
    StoreUnavailable,
)
from services.launcher.ports import free_port
from tests.common.test_store import take
from tests.fixtures.etcd import EtcdServer, make_tls, start_etcd

SECRET = "s3cr3t-pa55word"


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


# --------------------------------------------------------------------------- transactions


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


# --------------------------------------------------------------------------- snapshots


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
        client = await store._etcd.connected()
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
            client = await store._etcd.connected()
            real = client.kvstub.Range
            limits: list[int] = []

            async def spy(request: rpc.RangeRequest, **kw: object) -> object:
                limits.append(request.limit)  # noqa: B023  # consumed within the iteration
                return await real(request, **kw)  # noqa: B023

            client.kvstub.Range = spy
            kvs, _ = await store.snapshot(etcd_prefix)
        assert len(kvs) == 100
        assert limits == expected_limits


# --------------------------------------------------------------------------- etcd's limits


async def test_etcd_really_rejects_a_129_op_transaction(
    etcd_store: EtcdStore, etcd_prefix: bytes
) -> None:
    """The limit the store chunks for is etcd's: one more op is refused."""
    with pytest.raises(StoreError, match="too many operations"):
        await etcd_store._txn([Put(etcd_prefix + b"%d" % i, b"v") for i in range(MAX_TXN_OPS + 1)])
    await etcd_store._txn([Put(etcd_prefix + b"%d" % i, b"v") for i in range(MAX_TXN_OPS)])


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
            client = await admin._etcd.connected()
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
