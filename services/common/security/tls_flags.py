"""The command-line flags naming a service's TLS files, one group per connection it secures:
as a client (the CA it trusts, and its certificate and key where servers ask for mutual TLS)
or as a server (its certificate and key, and the CA clients' certificates must chain to);
and `--insecure`, without which a service refuses to start unless every group is given."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.security.tls import ClientTls, ServerTls
from services.common.serving.flags import Flag


@dataclass(frozen=True, slots=True)
class ClientTlsFlags:
    """`--<prefix>ca`, `--<prefix>cert` and `--<prefix>key`, for connections to `peers`
    (the Router's `--conductor-ca` ... to "the Conductors")."""

    prefix: str
    peers: str

    def add(self, flag: Flag, parser: argparse.ArgumentParser) -> None:
        """Add the three flags to `parser`, each empty by default."""
        p = self.prefix
        flag(parser, f"{p}ca", "", f"CA (PEM) of {self.peers}' certificates: use TLS")
        flag(parser, f"{p}cert", "", f"client certificate (PEM) for mTLS to {self.peers}")
        flag(parser, f"{p}key", "", f"client private key (PEM) for mTLS to {self.peers}")

    def read(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> ClientTls | None:
        """The TLS the flags ask for (None: plaintext); a usage error (exit 2) when a
        certificate comes without its key or either without the CA."""
        p = self.prefix
        ca, cert, key = (getattr(args, _dest(p, name)) for name in ("ca", "cert", "key"))
        if bool(cert) != bool(key):
            parser.error(f"--{p}cert and --{p}key go together")
        if cert and not ca:
            parser.error(f"--{p}cert and --{p}key need --{p}ca")
        return ClientTls(ca, cert or None, key or None) if ca else None


@dataclass(frozen=True, slots=True)
class ServerTlsFlags:
    """`--<prefix>cert`, `--<prefix>key` and `--<prefix>client-ca`: the TLS a service's own
    server serves, mutual when the client CA is given."""

    prefix: str

    def add(self, flag: Flag, parser: argparse.ArgumentParser) -> None:
        """Add the three flags to `parser`, each empty by default."""
        p = self.prefix
        flag(parser, f"{p}cert", "", "server certificate (PEM) to serve TLS with")
        flag(parser, f"{p}key", "", "its private key (PEM)")
        flag(parser, f"{p}client-ca", "", "CA (PEM) client certificates must chain to (mTLS)")

    def read(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerTls | None:
        """The TLS the flags ask for (None: plaintext); a usage error (exit 2) when the
        certificate comes without its key or the key without it."""
        p = self.prefix
        cert, key, client_ca = (
            getattr(args, _dest(p, name)) for name in ("cert", "key", "client-ca")
        )
        if bool(cert) != bool(key):
            parser.error(f"--{p}cert and --{p}key go together")
        return ServerTls(cert, key, client_ca or None) if cert else None


def _dest(prefix: str, name: str) -> str:
    return f"{prefix}{name}".replace("-", "_")


def add_insecure(flag: Flag, parser: argparse.ArgumentParser) -> None:
    """`--insecure`: serve and call plaintext, no identities, nothing authorised."""
    flag(
        parser,
        "insecure",
        False,
        "plaintext gRPC, no client identities, every RPC open (behind a mesh's mTLS, or tests)",
    )


def require_secure(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    server: tuple[ServerTlsFlags, ServerTls | None],
    clients: Sequence[tuple[ClientTlsFlags, ClientTls | None]],
) -> None:
    """Secure by default: unless `--insecure`, the service's server must serve mutual TLS and
    it must present a certificate to each of its peers; with `--insecure`, no TLS flag may
    be given. A usage error (exit 2) naming the missing flags otherwise."""
    server_flags, server_tls = server
    if args.insecure:
        if server_tls is not None or any(tls is not None for _, tls in clients):
            parser.error("--insecure excludes the TLS flags: give one or the other")
        return
    missing = []
    if server_tls is None or server_tls.client_ca_file is None:
        p = server_flags.prefix
        missing.append(f"--{p}cert, --{p}key and --{p}client-ca")
    for client_flags, client_tls in clients:
        if client_tls is None or client_tls.cert_file is None:
            p = client_flags.prefix
            missing.append(f"--{p}ca, --{p}cert and --{p}key")
    if missing:
        parser.error(
            f"mutual TLS needs {'; '.join(missing)} (`kvsched up` makes them: see "
            "docs/security.md), or --insecure to run plaintext and unauthenticated"
        )
