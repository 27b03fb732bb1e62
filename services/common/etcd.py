"""The etcd implementation of the `Store` interface (`services.common.store`).

`Store` is the protocol; `EtcdStore` implements it over `aetcd` (the client's channel, auth and
generated protobuf messages), calling the gRPC stubs directly where aetcd does not expose what
we need: paged ranges pinned to one revision, transactions whose failures keep their gRPC status,
one-shot lease keep-alives and one watch stream per `watch_prefix` call.

Semantics worth knowing:

* Keys and values are bytes. Prefix operations take the plain prefix (`b"/kvsched/v1/"`);
  `DeletePrefix`/`delete_prefix` refuse the empty prefix (that would wipe the whole keyspace).
* `snapshot(prefix)` returns every key under the prefix *as of one revision* (a first page of
  `page_size` keys, later pages of about `page_bytes` pinned to the first page's revision) and
  that revision, so `watch_prefix(prefix, revision + 1)` continues exactly where it left off.
  1M small keys take ~6-8 s (etcd ~4 s, building the `KeyValue`s ~2-3 s).
* `commit(ops)` applies the ops in order, in transactions of at most `MAX_TXN_OPS` ops (etcd's
  default `--max-txn-ops`) and about `MAX_TXN_BYTES` bytes (under etcd's default
  `--max-request-bytes`). etcd rejects a transaction that puts one key twice or puts a key that
  the same transaction deletes, so a new transaction is also started before such an op: order
  is preserved, each transaction is atomic, the batch as a whole is not. If a transaction fails
  because a `Put` is bound to a lease that no longer exists (expired or revoked), the puts bound
  to the missing leases are dropped and the transaction is retried without them; the count is
  returned in `CommitResult.dropped_puts`. Any other failure raises and leaves the earlier
  transactions applied.
* Endpoints are tried in order on `connect()`; the first that answers is used. When a call
  fails because that endpoint became unreachable the call raises `StoreUnavailable` and, if
  there are other endpoints, the next call reconnects starting from the next one.
* Every gRPC failure surfaces as a `StoreError`; unreachable/timed-out endpoints (and rejected
  credentials) as its subclass `StoreUnavailable`, whose message names the endpoint, the
  operation and what gRPC reported, never the password. etcd's own "request timed out" is a
  `StoreUnavailable` too, but the request may still be applied: deleting a prefix (or revoking
  a lease) holding ~1M keys takes longer than etcd's request timeout and does complete.
* An auth token that etcd expired is renewed transparently (one reconnect and retry). Calls
  and watches running on a connection the store closes (failover, token renewal, `close()`)
  raise `StoreUnavailable`; watches end quietly on `close()`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import aetcd
import grpc
import grpc.aio
from aetcd import rpc

from services.common.store import (
    CommitResult,
    Delete,
    DeletePrefix,
    EtcdSettings,
    KeyValue,
    Lease,
    LeaseNotFound,
    Op,
    Put,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
    WatchEvent,
    split_endpoint,
)

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`: more operations in one transaction are rejected."""
MAX_TXN_BYTES = 1 << 20
"""Soft cap on one transaction's payload; etcd's default `--max-request-bytes` is 1.5 MiB."""
PAGE_SIZE = 10_000
"""Keys in the first range request of `snapshot`/`get_prefix`, and the least in later ones."""
PAGE_BYTES = 32 << 20
"""Later pages are sized to about this many bytes. etcd 3.5 walks the whole rest of the range
on every limited request (to count it), so fixed small pages cost O(N²): 1M keys in pages of
10k take ~30 s, in three pages sized like this ~5 s."""
PAGE_TIMEOUT_S = 60.0
"""Deadline of one range page (at least `timeout_s`): a page can hold 500k keys."""

_T = TypeVar("_T")

_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.max_receive_message_length": 256 << 20,
    # Notice a vanished server on an idle watch stream. etcd's default
    # --grpc-keepalive-min-time is 5 s: pinging more often gets the connection closed.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# --------------------------------------------------------------------------- aetcd client


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
    """aetcd.Client whose `connect` can build a TLS channel (aetcd only makes insecure ones).

    Mirrors aetcd 1.0's `Client.connect` (channel, optional Authenticate for a token, the
    stubs, the watcher), minus its error wrapping: gRPC errors propagate as `AioRpcError` so
    `EtcdStore` can map them with their status code."""

    _is_connecting: bool

    def __init__(
        self,
        endpoint: str,
        host: str,
        port: int,
        *,
        username: str | None,
        password: str | None,
        timeout: float,
        credentials: grpc.ChannelCredentials | None,
    ) -> None:
        super().__init__(
            host=host,
            port=port,
            username=username,
            password=password,
            timeout=timeout,
            options=dict(_CHANNEL_OPTIONS),
        )
        self._credentials = credentials
        self.endpoint = endpoint
        self.watchstub: Any = None
        self.closed_by_store = False
        """Set when `EtcdStore.close()` closes this client (watches then end quietly)."""
        self.close_reason = ""
        """Why the store closed this client, for the calls it interrupts."""

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            host = f"[{self._host}]" if ":" in self._host else self._host
            target = f"{host}:{self._port}"
            options = list(self._options.items())
            if self._credentials is None:
                self.channel = rpc.insecure_channel(target, options=options)
            else:
                self.channel = rpc.secure_channel(target, self._credentials, options=options)
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self.watchstub = rpc.WatchStub(self.channel)
            self._watcher = aetcd.Watcher(
                self.watchstub, timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        except BaseException:
            if self.channel is not None:
                await self.channel.close()
            self._init_channel_attrs()
            raise
        finally:
            self._is_connecting = False


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise StoreError(f"cannot read etcd {what} {path!r}: {e.strerror}") from e


def _credentials(settings: EtcdSettings) -> grpc.ChannelCredentials | None:
    if not settings.uses_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.ca_file, "CA file") if settings.ca_file else None,
        private_key=_read(settings.key_file, "key file") if settings.key_file else None,
        certificate_chain=_read(settings.cert_file, "cert file") if settings.cert_file else None,
    )


# --------------------------------------------------------------------------- helpers


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range holding every key that starts with `prefix`
    (`b"\\0"`, meaning "to the end of the keyspace", for b"" or an all-0xff prefix)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _range_start(prefix: bytes) -> bytes:
    return prefix or b"\0"


def _kv(kv: Any) -> KeyValue:
    return KeyValue(bytes(kv.key), bytes(kv.value), int(kv.lease), int(kv.mod_revision))


def _request_op(op: Op) -> Any:
    if isinstance(op, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=op.key))
    return rpc.RequestOp(
        request_delete_range=rpc.DeleteRangeRequest(
            key=_range_start(op.prefix), range_end=prefix_range_end(op.prefix)
        )
    )


def _check_prefix(prefix: bytes) -> None:
    if not prefix:
        raise ValueError("refusing to delete the empty prefix (the whole keyspace)")


def _op_size(op: Op) -> int:
    if isinstance(op, Put):
        return len(op.key) + len(op.value) + 24
    if isinstance(op, Delete):
        return len(op.key) + 8
    return 2 * len(op.prefix) + 8


def plan_transactions(
    ops: Iterable[Op], max_ops: int = MAX_TXN_OPS, max_bytes: int = MAX_TXN_BYTES
) -> list[list[Op]]:
    """Split `ops`, in order, into transactions etcd accepts: at most `max_ops` ops and about
    `max_bytes` bytes each, never putting one key twice nor putting a key the same
    transaction deletes (etcd rejects both as "duplicate key given in txn request")."""
    txns: list[list[Op]] = []
    current: list[Op] = []
    size = 0
    puts: set[bytes] = set()
    deleted_keys: set[bytes] = set()
    deleted_prefixes: list[bytes] = []

    def conflicts(op: Op) -> bool:
        if isinstance(op, Put):
            return (
                op.key in puts
                or op.key in deleted_keys
                or any(op.key.startswith(p) for p in deleted_prefixes)
            )
        if isinstance(op, Delete):
            return op.key in puts
        return any(k.startswith(op.prefix) for k in puts)

    for op in ops:
        if isinstance(op, DeletePrefix):
            _check_prefix(op.prefix)
        op_size = _op_size(op)
        if current and (len(current) >= max_ops or size + op_size > max_bytes or conflicts(op)):
            txns.append(current)
            current, size = [], 0
            puts, deleted_keys, deleted_prefixes = set(), set(), []
        current.append(op)
        size += op_size
        if isinstance(op, Put):
            puts.add(op.key)
        elif isinstance(op, Delete):
            deleted_keys.add(op.key)
        else:
            deleted_prefixes.append(op.prefix)
    if current:
        txns.append(current)
    return txns


# --------------------------------------------------------------------------- the store


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
        self._client: _Client | None = None
        self._endpoint: str | None = None
        self._next_endpoint = 0
        self._connect_lock = asyncio.Lock()
        self._credentials: grpc.ChannelCredentials | None = None
        self._credentials_loaded = False

    def __repr__(self) -> str:
        return f"EtcdStore(endpoint={self._endpoint!r}, settings={self.settings!r})"

    @property
    def endpoint(self) -> str | None:
        """The endpoint in use, None when not connected."""
        return self._endpoint

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

    # ---- connection

    async def connect(self) -> None:
        """Connect to the first endpoint that answers, trying each in turn (starting after
        the one that last failed); `StoreUnavailable` lists what went wrong with each."""
        async with self._connect_lock:
            if self._client is not None:
                return
            if not self._credentials_loaded:
                self._credentials = _credentials(self.settings)
                self._credentials_loaded = True
            endpoints = self.settings.endpoints
            failures: list[str] = []
            for i in range(len(endpoints)):
                index = (self._next_endpoint + i) % len(endpoints)
                endpoint = endpoints[index]
                try:
                    client = await self._open(endpoint)
                except StoreUnavailable as e:
                    failures.append(str(e))
                    continue
                self._client, self._endpoint, self._next_endpoint = client, endpoint, index
                return
            what = "the etcd endpoint" if len(endpoints) == 1 else "any etcd endpoint"
            raise StoreUnavailable(f"cannot reach {what}: " + "; ".join(failures))

    async def _open(self, endpoint: str) -> _Client:
        _, host, port = split_endpoint(endpoint)
        s = self.settings
        client = _Client(
            endpoint,
            host,
            port,
            username=s.username,
            password=s.password,
            timeout=s.timeout_s,
            credentials=self._credentials,
        )
        try:
            await client.connect()
            # The channel connects lazily: make one cheap call so a dead endpoint fails here.
            await client.maintenancestub.Status(
                rpc.StatusRequest(), timeout=s.timeout_s, metadata=client.metadata
            )
        except grpc.aio.AioRpcError as e:
            await client.close()
            raise _unavailable(endpoint, "connect", e, s.username) from e
        except TimeoutError as e:
            await client.close()
            raise StoreUnavailable(f"{endpoint}: connect timed out after {s.timeout_s:g} s") from e
        return client

    async def close(self) -> None:
        """Close the channel; open watches end. The store can be connected again."""
        async with self._connect_lock:
            client, self._client, self._endpoint = self._client, None, None
        if client is not None:
            client.closed_by_store = True
            client.close_reason = "the store was closed"
            await client.close()

    async def _drop(self, client: _Client, reason: str, *, fail_over: bool) -> None:
        """Forget `client` (so the next call reconnects, at the next endpoint if `fail_over`)
        and close it: calls still running on it raise `StoreUnavailable` naming `reason`."""
        async with self._connect_lock:
            if self._client is not client:
                return
            self._client, self._endpoint = None, None
            if fail_over:
                self._next_endpoint = (self._next_endpoint + 1) % len(self.settings.endpoints)
        client.close_reason = reason
        await client.close()

    async def _connected(self) -> _Client:
        client = self._client
        if client is None:
            await self.connect()
            client = self._client
            assert client is not None
        return client

    async def _call(self, what: str, fn: Callable[[_Client], Awaitable[_T]]) -> _T:
        """Run one RPC, mapping gRPC failures to `StoreError`s. An expired auth token is
        renewed (reconnect) and the call tried once more."""
        for attempt in (0, 1):
            client = await self._connected()
            try:
                return await fn(client)
            except asyncio.CancelledError:
                if (error := _interrupted(client, what)) is None:
                    raise
                raise error from None
            except grpc.aio.AioRpcError as e:
                if (
                    attempt == 0
                    and e.code() == grpc.StatusCode.UNAUTHENTICATED
                    and "invalid auth token" in (e.details() or "")
                ):
                    await self._drop(client, "its auth token expired", fail_over=False)
                    continue
                raise await self._error(client, what, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    async def _error(self, client: _Client, what: str, e: grpc.aio.AioRpcError) -> StoreError:
        if e.code() in _UNAVAILABLE_CODES:
            if len(self.settings.endpoints) > 1 and not _etcd_timed_out(e):
                await self._drop(client, f"{client.endpoint} failed", fail_over=True)
            return _unavailable(client.endpoint, what, e, self.settings.username)
        return _store_error(client.endpoint, what, e)

    # ---- reads

    def _timeout(self) -> float:
        return self.settings.timeout_s

    async def get(self, key: bytes) -> KeyValue | None:
        resp = await self._call(
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
        start = _range_start(prefix)
        revision = 0
        limit = self.page_size
        out: list[KeyValue] = []
        while True:
            request = rpc.RangeRequest(key=start, range_end=end, limit=limit, revision=revision)
            resp = await self._call(f"range {prefix!r}", functools.partial(self._range, request))
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

    async def _range(self, request: Any, client: _Client) -> Any:
        return await client.kvstub.Range(
            request,
            timeout=max(self._timeout(), PAGE_TIMEOUT_S),
            metadata=client.metadata,
        )

    async def revision(self) -> int:
        """The store's current revision (linearizable)."""
        resp = await self._call(
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
        resp = await self._call(
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
        resp = await self._call(
            f"create {key!r}",
            lambda c: c.kvstub.Txn(request, timeout=self._timeout(), metadata=c.metadata),
        )
        return bool(resp.succeeded)

    async def delete(self, key: bytes) -> bool:
        """Delete `key`; True if it existed."""
        resp = await self._call(
            f"delete {key!r}",
            lambda c: c.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=key), timeout=self._timeout(), metadata=c.metadata
            ),
        )
        return int(resp.deleted) > 0

    async def delete_prefix(self, prefix: bytes) -> int:
        """Delete every key under `prefix` (not b""); returns how many there were."""
        _check_prefix(prefix)
        resp = await self._call(
            f"delete prefix {prefix!r}",
            lambda c: c.kvstub.DeleteRange(
                rpc.DeleteRangeRequest(key=prefix, range_end=prefix_range_end(prefix)),
                timeout=self._timeout(),
                metadata=c.metadata,
            ),
        )
        return int(resp.deleted)

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        """Apply `ops` in order in transactions of at most `MAX_TXN_OPS` ops (see the module
        docstring); puts bound to leases that no longer exist are dropped and counted."""
        revision = transactions = dropped = 0
        for txn in plan_transactions(ops):
            pending = txn
            while pending:
                try:
                    revision = await self._txn(pending)
                    transactions += 1
                    break
                except LeaseNotFound:
                    leases = {op.lease for op in pending if isinstance(op, Put) and op.lease}
                    gone = {lid for lid in leases if await self.lease_ttl(lid) < 0} or leases
                    if not gone:
                        raise
                    kept = [op for op in pending if not (isinstance(op, Put) and op.lease in gone)]
                    log.warning(
                        "etcd commit: dropped %d put(s) bound to missing lease(s) %s",
                        len(pending) - len(kept),
                        ", ".join(f"{lid:x}" for lid in sorted(gone)),
                    )
                    dropped += len(pending) - len(kept)
                    pending = kept
        return CommitResult(revision, transactions, dropped)

    async def _txn(self, ops: Sequence[Op]) -> int:
        request = rpc.TxnRequest(success=[_request_op(op) for op in ops])
        resp = await self._call(
            f"commit of {len(ops)} op(s)",
            lambda c: c.kvstub.Txn(request, timeout=self._timeout(), metadata=c.metadata),
        )
        return int(resp.header.revision)

    # ---- leases

    async def grant_lease(self, ttl_s: int) -> Lease:
        """A new lease; etcd may grant a longer TTL than asked (its minimum TTL)."""
        resp = await self._call(
            "grant lease",
            lambda c: c.leasestub.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=ttl_s), timeout=self._timeout(), metadata=c.metadata
            ),
        )
        if resp.error:
            raise StoreError(f"etcd at {self._endpoint} refused a lease: {resp.error}")
        return Lease(int(resp.ID), int(resp.TTL))

    async def keep_alive(self, lease_id: int) -> int:
        """Refresh the lease once; returns its TTL in seconds, 0 if the lease is gone."""

        async def once(c: _Client) -> int:
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

        return await self._call(f"keep lease {lease_id:x} alive", once)

    async def revoke_lease(self, lease_id: int) -> bool:
        """Revoke the lease (its keys are deleted); False if it did not exist."""
        try:
            await self._call(
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
        resp = await self._call(
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
        client = await self._connected()
        endpoint = client.endpoint
        what = f"watch {prefix!r}"
        create = rpc.WatchCreateRequest(
            key=_range_start(prefix),
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
            if client.closed_by_store and not _task_cancelled():
                return
            if (error := _interrupted(client, what)) is None:
                raise
            raise error from None
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and client.closed_by_store:
                return
            raise await self._error(client, what, e) from e
        except grpc.aio.UsageError:
            if client.closed_by_store:
                return
            raise
        finally:
            call.cancel()


# --------------------------------------------------------------------------- error mapping


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _interrupted(client: _Client, what: str) -> StoreUnavailable | None:
    """What to raise for a CancelledError out of a gRPC call: gRPC raises it both when our
    task is cancelled (None: re-raise that) and when the store closed the call's channel."""
    if _task_cancelled() or not client.close_reason:
        return None
    return StoreUnavailable(
        f"{client.endpoint}: {what} interrupted: the connection was closed because "
        f"{client.close_reason}; try again"
    )


def _details(e: grpc.aio.AioRpcError) -> str:
    return (e.details() or "").strip() or e.code().name


def _etcd_timed_out(e: grpc.aio.AioRpcError) -> bool:
    """etcd answered, but gave up waiting for the request to apply (or was overloaded)."""
    details = e.details() or ""
    return details.startswith(("etcdserver: request timed out", "etcdserver: too many requests"))


def _unavailable(
    endpoint: str, what: str, e: grpc.aio.AioRpcError, username: str | None
) -> StoreError:
    code = e.code()
    if code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    ) or "authentication failed" in _details(e):
        user = f"user {username!r}" if username else "no credentials"
        return StoreUnavailable(
            f"{endpoint}: {what} rejected ({user}): {_details(e)}; check "
            "KVSCHED_ETCD_USERNAME/KVSCHED_ETCD_PASSWORD"
        )
    if _etcd_timed_out(e):
        return StoreUnavailable(
            f"{endpoint}: {what} timed out inside etcd ({_details(e)}); it may still be "
            "applied. Large deletes (a prefix or a lease with very many keys) can take longer "
            "than etcd's request timeout"
        )
    if code in _UNAVAILABLE_CODES:
        return StoreUnavailable(
            f"{endpoint}: {what} failed, etcd unreachable ({code.name}: {_details(e)}); is etcd "
            "running there and are KVSCHED_ETCD_ENDPOINTS and the TLS files right?"
        )
    return _store_error(endpoint, what, e)


def _store_error(endpoint: str, what: str, e: grpc.aio.AioRpcError) -> StoreError:
    details = _details(e)
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseNotFound(f"etcd at {endpoint}: {what}: {details}")
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return StoreCompacted(f"etcd at {endpoint}: {what}: {details}", 0)
    return StoreError(f"etcd at {endpoint}: {what} failed ({code.name}: {details})")
