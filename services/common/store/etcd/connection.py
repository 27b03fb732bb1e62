"""`EtcdConnection`: the store's link to one etcd endpoint at a time.

Endpoints are tried in order on `connect()`; the first that answers is used. When a call
fails because that endpoint became unreachable the call raises `StoreUnavailable` and, if
there are other endpoints, the next call reconnects starting from the next one. An auth token
that etcd expired is renewed transparently (one reconnect and retry). Calls running on a
connection this closes (failover, token renewal, `close()`) raise `StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import grpc.aio
from aetcd import rpc

from services.common.store.etcd.client import EtcdClient, channel_credentials
from services.common.store.etcd.errors import (
    UNAVAILABLE_CODES,
    etcd_timed_out,
    interrupted,
    store_error,
    unavailable,
)
from services.common.store.interface import (
    EtcdSettings,
    StoreError,
    StoreUnavailable,
    split_endpoint,
)

_T = TypeVar("_T")


class EtcdConnection:
    """The client of the endpoint in use (none until `connect()` or the first call), and the
    one way calls run on it: `call`, which maps gRPC failures to `StoreError`s."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._client: EtcdClient | None = None
        self._endpoint: str | None = None
        self._next_endpoint = 0
        self._connect_lock = asyncio.Lock()
        self._credentials: grpc.ChannelCredentials | None = None
        self._credentials_loaded = False

    @property
    def endpoint(self) -> str | None:
        """The endpoint in use, None when not connected."""
        return self._endpoint

    async def connect(self) -> None:
        """Connect to the first endpoint that answers, trying each in turn (starting after
        the one that last failed); `StoreUnavailable` lists what went wrong with each."""
        async with self._connect_lock:
            if self._client is not None:
                return
            if not self._credentials_loaded:
                self._credentials = channel_credentials(self.settings)
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

    async def _open(self, endpoint: str) -> EtcdClient:
        _, host, port = split_endpoint(endpoint)
        s = self.settings
        client = EtcdClient(
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
            raise unavailable(endpoint, "connect", e, s.username) from e
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

    async def _drop(self, client: EtcdClient, reason: str, *, fail_over: bool) -> None:
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

    async def connected(self) -> EtcdClient:
        """The client in use, connecting first when there is none."""
        client = self._client
        if client is None:
            await self.connect()
            client = self._client
            assert client is not None
        return client

    async def call(self, what: str, fn: Callable[[EtcdClient], Awaitable[_T]]) -> _T:
        """Run one RPC, mapping gRPC failures to `StoreError`s. An expired auth token is
        renewed (reconnect) and the call tried once more."""
        for attempt in (0, 1):
            client = await self.connected()
            try:
                return await fn(client)
            except asyncio.CancelledError:
                if (error := interrupted(client, what)) is None:
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
                raise await self.error(client, what, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    async def error(self, client: EtcdClient, what: str, e: grpc.aio.AioRpcError) -> StoreError:
        """The `StoreError` for a failed call; an unreachable endpoint is dropped first, so
        that the next call fails over (when there is another endpoint)."""
        if e.code() in UNAVAILABLE_CODES:
            if len(self.settings.endpoints) > 1 and not etcd_timed_out(e):
                await self._drop(client, f"{client.endpoint} failed", fail_over=True)
            return unavailable(client.endpoint, what, e, self.settings.username)
        return store_error(client.endpoint, what, e)
