"""The command-line flags naming a service's TLS files, one group per connection it secures:
as a client (the CA it trusts, and its certificate and key where servers ask for mutual TLS)
or as a server (its certificate and key, and the CA clients' certificates must chain to)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.flags import Flag
from services.common.tls import ClientTls, ServerTls


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
