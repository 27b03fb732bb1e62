"""`EtcdStore`: the `Store` interface (`services.common.store.interface`) over etcd's v3 API,
through the aetcd client's channel, auth and generated protobuf messages, calling the gRPC stubs
directly where aetcd does not expose what we need: paged ranges pinned to one revision,
transactions whose failures keep their gRPC status, one-shot lease keep-alives and one watch
stream per `watch_prefix` call. The package docstring lists the semantics worth knowing."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio
from aetcd import rpc

from services.common.store.etcd.client import EtcdClient
from services.common.store.etcd.connection import EtcdConnection
from services.common.store.etcd.errors import interrupted, task_cancelled
from services.common.store.etcd.transactions import (
    check_prefix,
    commit_planned,
    prefix_range_end,
    range_start,
)
from services.common.store.interface import (
    CommitResult,
    Delete,
    EtcdSettings,
    Fenced,
    Guard,
    KeyValue,
    Lease,
    LeaseNotFound,
    Op,
    Put,
    StoreCompacted,
    StoreError,
    WatchEvent,
)

PAGE_SIZE = 10_000
"""Keys in the first range request of `snapshot`/`get_prefix`, and the least in later ones."""
PAGE_BYTES = 32 << 20
"""Later pages are sized to about this many bytes. etcd 3.5 walks the whole rest of the range
on every limited request (to count it), so fixed small pages cost O(N²): 1M keys in pages of
10k take ~30 s, in three pages sized like this ~5 s."""
PAGE_TIMEOUT_S = 60.0
"""Deadline of one range page (at least `timeout_s`): a page can hold 500k keys."""

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs


class EtcdStore:
    """`Store` over etcd (v3 API) through aetcd. Use `async with EtcdStore(settings) as s:` or
    `connect()`/`close()`; calls made before `connect()` connect on demand."""

    def __init__(
        self,
        settings: EtcdSettings | None = None,
        *,
        page_size: int = PAGE_SIZE,
        page_bytes: int = PAGE_BYTES,
    ) -> None:
        if page_size < 1 or page_bytes < 0:
            raise ValueError("page_size must be positive and page_bytes not negative")
        self.page_bytes = page_bytes
        self.settings = settings or EtcdSettings()
        self.page_size = page_size
        self._etcd = EtcdConnection(self.settings)

    def __repr__(self) -> str:
        return f"EtcdStore(endpoint={self.endpoint!r}, settings={self.settings!r})"

    @property
    def endpoint(self) -> str | None:
        """The endpoint in use, None when not connected."""
        return self._etcd.endpoint

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect to the first endpoint that answers, trying each in turn (starting after
        the one that last failed); `StoreUnavailable` lists what went wrong with each."""
        await self._etcd.connect()

    async def close(self) -> None:
        """Close the channel; open watches end. The store can be connected again."""
        await self._etcd.close()

    # ---- reads

    def _timeout(self) -> float:
        return self.settings.timeout_s

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._etcd.call(
            f"get {key!r}",
            lambda c: c.kvstub.Range(
                rpc.RangeRequest(key=key), timeout=self._timeout(), metadata=c.metadata
            ),
        )
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        """Every key under `prefix`, sorted by key (one consistent revision)."""
        kvs, _ = await self.snapshot(prefix)
        return kvs

    async def snapshot(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, sorted by key, and the revision they were read at; watch
        from revision + 1 to see every later change. Read in pages (`page_size` keys first,
        then about `page_bytes` each, never fewer than `page_size` keys), all at the first
        page's revision (restarted if that revision is compacted mid-way)."""
        for _ in range(3):
            try:
                return await self._snapshot(prefix)
            except StoreCompacted:
                continue
        return await self._snapshot(prefix)

    async def _snapshot(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        end = prefix_range_end(prefix)
        start = range_start(prefix)
        revision = 0
        limit = self.page_size
        out: list[KeyValue] = []
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=limit, revision=revision)
            resp = await self._etcd.call(
                f"range {prefix!r}", functools.partial(self._range, request)
            )
            if revision == 0:
                revision = int(resp.header.revision)
            page = [_kv(kv) for kv in resp.kvs]
            out.extend(page)
            if not resp.more or not page:
                return out, revision
            start = page[-1].key + b"\0"
            # `count` is how many keys [start of this page, end) held: size the next page.
            remaining = int(resp.count) - len(page)
            kv_bytes = sum(len(kv.key) + len(kv.value) for kv in page) // len(page) + 32
            limit = max(self.page_size, min(remaining, self.page_bytes // kv_bytes))

    async def _range(self, request: Any, client: EtcdClient) -> Any:
        return await client.kvstub.Range(
            request,
            timeout=max(self._timeout(), PAGE_TIMEOUT_S),
            metadata=client.metadata,
        )

    async def revision(self) -> int:
        """The store's current revision (linearizable)."""
        resp = await self._etcd.call(
            "revision",
            lambda c: c.kvstub.Range(
                rpc.RangeRequest(key=b"\0", count_only=True),
                timeout=self._timeout(),
                metadata=c.metadata,
            ),
        )
        return int(resp.header.revision)

    # ---- writes

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write `key`; returns the new store revision. `LeaseNotFound` if `lease` is gone."""
        resp = await self._etcd.call(
            f"put {key!r}",
            lambda c: c.kvstub.Put(
                rpc.PutRequest(key=key, value=value, lease=lease),
                timeout=self._timeout(),
                metadata=c.metadata,
            ),
        )
        return int(resp.header.revision)

    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool:
        """Write `key` only if it does not exist; True if this call created it."""
        request = rpc.TxnRequest(
            compare=[
                rpc.Compare(
                    key=key,
                    target=rpc.Compare.CREATE,
                    result=rpc.Compare.EQUAL,
                    create_revision=0,
                )
            ],
            success=[_request_op(Put(key, value, lease))],
        )
        resp = await self._etcd.call(
            f"create {key!r}",
            lambda c: c.kvstub.Txn(request, timeout=self._timeout(), metadata=c.metadata),
        )
        return bool(resp.succeeded)

    async def delete(self, key: bytes) -> bool:
        """Delete `key`; True if it existed."""
        resp = await self._etcd.call(
            f"delete {key!r}",
            lambda c: c.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=key), timeout=self._timeout(), metadata=c.metadata
            ),
        )
        return int(resp.deleted) > 0

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under `prefix` (not b""); returns how many there were."""
        check_prefix(prefix)
        resp = await self._etcd.call(
            f"delete prefix {prefix!r}",
            lambda c: c.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=prefix, range_end=prefix_range_end(prefix)),
                timeout=self._timeout(),
                metadata=c.metadata,
            ),
        )
        return int(resp.deleted)

    async def commit(self, ops: Sequence[Op], guard: Guard | None = None) -> CommitResult:
        """Apply `ops` in order in transactions of at most `MAX_TXN_OPS` ops (see the package
        docstring); puts bound to leases that no longer exist are dropped and counted. With
        `guard`, every transaction also compares the guard's key's lease, and the first
        refused raises `Fenced` (that transaction applied nothing)."""
        return await commit_planned(ops, functools.partial(self._txn, guard=guard), self.lease_ttl)

    async def _txn(self, ops: Sequence[Op], guard: Guard | None = None) -> int:
        compare = [] if guard is None else [_guard_compare(guard)]
        request = rpc.TxnRequest(compare=compare, success=[_request_op(op) for op in ops])
        resp = await self._etcd.call(
            f"commit of {len(ops)} op(s)",
            lambda c: c.kvstub.Txn(request, timeout=self._timeout(), metadata=c.metadata),
        )
        if not resp.succeeded:
            assert guard is not None  # an unconditional transaction always succeeds
            raise Fenced(
                f"etcd at {self.endpoint} refused a write: {guard.key!r} is no longer bound to "
                f"lease {guard.lease:x} (another term leads)"
            )
        return int(resp.header.revision)

    # ---- leases

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease; etcd may grant a longer TTL than asked (its minimum TTL)."""
        resp = await self._etcd.call(
            "grant lease",
            lambda c: c.leasestub.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self._timeout(), metadata=c.metadata
            ),
        )
        if resp.error:
            raise StoreError(f"etcd at {self.endpoint} refused a lease: {resp.error}")
        return Lease(int(resp.ID), int(resp.TTL))

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh the lease once; returns its TTL in seconds, 0 if the lease is gone."""

        async def once(c: EtcdClient) -> int:
            call = c.leasestub.LeaseKeepAlive(timeout=self._timeout(), metadata=c.metadata)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                await call.done_writing()
                resp = await call.read()
            finally:
                call.cancel()
            if resp is _EOF:
                raise StoreError(f"etcd at {c.endpoint} closed a lease keep-alive stream")
            return int(resp.TTL)

        return await self._etcd.call(f"keep lease {lease_id:x} alive", once)

    async def revoke_lease(self, lease_id: int) -> bool:
        """Revoke the lease (its keys are deleted); False if it did not exist."""
        try:
            await self._etcd.call(
                f"revoke lease {lease_id:x}",
                lambda c: c.leasestub.LeaseRevoke(
                    rpc.LeaseRevokeRequest(ID=lease_id),
                    timeout=self._timeout(),
                    metadata=c.metadata,
                ),
            )
        except LeaseNotFound:
            return False
        return True

    async def lease_ttl(self, lease_id: int) -> int:
        """Remaining TTL in seconds; -1 if the lease does not exist (expired or revoked)."""
        resp = await self._etcd.call(
            f"lease {lease_id:x} ttl",
            lambda c: c.leasestub.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id, keys=False),
                timeout=self._timeout(),
                metadata=c.metadata,
            ),
        )
        return int(resp.TTL)

    # ---- watch

    async def watch_prefix(
        self, prefix: bytes, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Every change under `prefix` from `start_revision` (inclusive; None: changes after
        the watch is set up, which happens on the first `__anext__`), in revision order.

        Runs until cancelled or closed: use `contextlib.aclosing(store.watch_prefix(...))` or
        cancel the consuming task; either cancels the server-side watch. Raises
        `StoreCompacted` if `start_revision` was compacted, `StoreUnavailable` if the stream
        breaks; ends when the store is closed."""
        client = await self._etcd.connected()
        endpoint = client.endpoint
        what = f"watch {prefix!r}"
        create = rpc.WatchCreateRequest(
            key=range_start(prefix),
            range_end=prefix_range_end(prefix),
            start_revision=start_revision or 0,
        )
        call = client.watchstub.Watch(metadata=client.metadata)
        try:
            await call.write(rpc.WatchRequest(create_request=create))
            while True:
                resp = await call.read()
                if resp is _EOF:
                    return
                if resp.compact_revision:
                    raise StoreCompacted(
                        f"etcd at {endpoint}: {what} from revision {start_revision} is "
                        f"compacted (oldest kept: {resp.compact_revision}); reload a snapshot",
                        int(resp.compact_revision),
                    )
                if resp.canceled:
                    raise StoreError(
                        f"etcd at {endpoint} cancelled {what}: {resp.cancel_reason or '?'}"
                    )
                for ev in resp.events:
                    kv = ev.kv
                    yield WatchEvent(
                        "delete" if ev.type == rpc.Event.DELETE else "put",
                        bytes(kv.key),
                        bytes(kv.value),
                        int(kv.mod_revision),
                    )
        except asyncio.CancelledError:
            if client.closed_by_store and not task_cancelled():
                return
            if (error := interrupted(client, what)) is None:
                raise
            raise error from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and client.closed_by_store:
                return
            raise await self._etcd.error(client, what, e) from e
        except grpc.aio.UsageError:
            if client.closed_by_store:
                return
            raise
        finally:
            call.cancel()


def _kv(kv: Any) -> KeyValue:
    return KeyValue(bytes(kv.key), bytes(kv.value), int(kv.lease), int(kv.mod_revision))


def _guard_compare(guard: Guard) -> Any:
    """True while the guard's key exists bound to its lease (a missing key compares as lease
    0, which no granted lease is)."""
    return rpc.Compare(
        key=guard.key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=guard.lease
    )


def _request_op(op: Op) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key))
    return rpc.RequestOp(
        request_delete_range=rpc.DeleteRangeRequest(
            key=range_start(op.prefix), range_end=prefix_range_end(op.prefix)
        )
    )
