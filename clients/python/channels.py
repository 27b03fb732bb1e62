"""Channels to the Conductors: one per address, opened on first use with the client's
credentials, interceptors and options, each with its ConductorService stub."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias, cast

import grpc
from grpc import aio

from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc

ConductorStub: TypeAlias = "pb_grpc.ConductorServiceAsyncStub"  # exists only in the stubs
Interceptor: TypeAlias = (  # any grpc.aio client interceptor
    "aio.UnaryUnaryClientInterceptor[Any, Any] | aio.UnaryStreamClientInterceptor[Any, Any]"
    " | aio.StreamUnaryClientInterceptor[Any, Any] | aio.StreamStreamClientInterceptor[Any, Any]"
)


def tls_credentials(
    ca_file: str | Path, cert_file: str | Path | None = None, key_file: str | Path | None = None
) -> grpc.ChannelCredentials:
    """Credentials for Conductors serving (mutual) TLS: the CA their certificates chain to,
    and this client's certificate and key (its identity: an operator's `admin/...` one for
    SetPolicy; `kvsched up` writes its paths to the endpoints file's `admin` entry)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    key = Path(key_file).read_bytes() if key_file is not None else None
    cert = Path(cert_file).read_bytes() if cert_file is not None else None
    return grpc.ssl_channel_credentials(Path(ca_file).read_bytes(), key, cert)


def normalize_address(address: str) -> str:
    """`host:port` from an address that may carry a scheme or a trailing slash."""
    address = address.strip().rstrip("/")
    for scheme in ("grpc://", "grpcs://", "http://", "https://"):
        if address.startswith(scheme):
            return address[len(scheme) :]
    return address


class Channels:
    """The open channels by address; `stub` opens one, `close` closes them all."""

    def __init__(
        self,
        credentials: grpc.ChannelCredentials | None,
        interceptors: Sequence[Interceptor] | None,
        options: Sequence[tuple[str, Any]],
    ) -> None:
        self._credentials = credentials
        # (grpc-stubs types aio.ClientInterceptor as a placeholder that needs a cast)
        self._interceptors = cast("list[aio.ClientInterceptor]", list(interceptors or ())) or None
        self._options = list(options)
        self._open: dict[str, tuple[aio.Channel, ConductorStub]] = {}

    def stub(self, address: str) -> ConductorStub:
        """The stub on the channel to `address` (opened now if it is not open)."""
        entry = self._open.get(address)
        if entry is None:
            if self._credentials is None:
                channel = aio.insecure_channel(
                    address, options=self._options, interceptors=self._interceptors
                )
            else:
                channel = aio.secure_channel(
                    address, self._credentials, self._options, interceptors=self._interceptors
                )
            entry = (channel, pb_grpc.ConductorServiceStub(channel))
            self._open[address] = entry
        return entry[1]

    async def close(self) -> None:
        """Close every open channel (calls on them end CANCELLED)."""
        channels, self._open = self._open, {}
        for channel, _ in channels.values():
            await channel.close(None)
