"""The aetcd client the store talks through: `EtcdClient` makes insecure or TLS channels (aetcd
only makes insecure ones), `channel_credentials` reads the TLS files the settings name."""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import grpc
from aetcd import rpc

from services.common.store.interface import EtcdSettings, StoreError

CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.max_receive_message_length": 256 << 20,
    # Notice a vanished server on an idle watch stream. etcd's default
    # --grpc-keepalive-min-time is 5 s: pinging more often gets the connection closed.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}
_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class EtcdClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type information
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
            options=dict(CHANNEL_OPTIONS),
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
            async with asyncio.timeout(self._connect_wait_timeout):
                await self._connected.wait()
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


def channel_credentials(settings: EtcdSettings) -> grpc.ChannelCredentials | None:
    if not settings.uses_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.ca_file, "CA file") if settings.ca_file else None,
        private_key=_read(settings.key_file, "key file") if settings.key_file else None,
        certificate_chain=_read(settings.cert_file, "cert file") if settings.cert_file else None,
    )
