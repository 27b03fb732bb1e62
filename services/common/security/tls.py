"""TLS for the project's gRPC servers and channels: certificates named by file, read when a
server starts or a channel opens. A server with a client CA admits only clients presenting a
certificate it signed (mutual TLS); a client with a certificate presents it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What a client trusts (the CA of the servers' certificates) and, for servers that ask
    for one (mTLS), its own certificate and key."""

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate and key; with `client_ca_file` set, clients must present a
    certificate that CA signed (mTLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None


def channel_credentials(tls: ClientTls | None) -> grpc.ChannelCredentials | None:
    """Credentials for a secure channel, or None for a plaintext one."""
    if tls is None:
        return None
    key = cert = None
    if tls.cert_file and tls.key_file:
        key, cert = _read(tls.key_file), _read(tls.cert_file)
    return grpc.ssl_channel_credentials(_read(tls.ca_file), key, cert)


def aio_channel(
    target: str,
    tls: ClientTls | None,
    *,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """A channel to `target`, secure when `tls` is given."""
    credentials = channel_credentials(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(target, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, interceptors=interceptors)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Listen on `address` (TLS when `tls` is given); returns the port, 0 when it failed."""
    if tls is None:
        return server.add_insecure_port(address)
    client_ca = _read(tls.client_ca_file) if tls.client_ca_file else None
    credentials = grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
    return server.add_secure_port(address, credentials)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
