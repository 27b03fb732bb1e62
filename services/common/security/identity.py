"""Who is calling: a component's identity, named in its certificate as a SPIFFE-style URI
SAN, `spiffe://kvsched/<role>/<name>` (e.g. `spiffe://kvsched/messenger/node-0`), and read
back from a gRPC peer's authentication context. Pure apart from `peer_identity`, which only
reads the context grpc hands a handler."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TRUST_DOMAIN = "kvsched"
SCHEME = "spiffe://"
# A name is what a flag or a node's host name can be: no slashes, nothing to escape.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class Role(enum.StrEnum):
    """What a component is allowed to do is decided by its role alone (see `authz`), plus
    for Messengers, the node named in their identity."""

    CONDUCTOR = "conductor"
    ROUTER = "router"
    MESSENGER = "messenger"  # its name is the node whose instances it speaks for
    ADMIN = "admin"  # an operator (or a tool acting for one)
    ETCD = "etcd"  # etcd's server certificate under `kvsched up`: it calls no kvsched RPC


@dataclass(frozen=True, slots=True)
class Identity:
    """One component's identity; `name` is unique within its role (a Messenger's: its node)."""

    role: Role
    name: str

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"identity name {self.name!r}: use 1-128 of letters, digits, '.', '_', '-'"
            )

    @property
    def uri(self) -> str:
        """The URI SAN naming this identity in its certificate."""
        return f"{SCHEME}{TRUST_DOMAIN}/{self.role.value}/{self.name}"

    def __str__(self) -> str:
        return self.uri


def parse_uri(uri: str) -> Identity | None:
    """The identity a URI SAN names, or None for any other URI (another trust domain, an
    unknown role, a malformed name)."""
    if not uri.startswith(SCHEME):
        return None
    parts = uri[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[0] != TRUST_DOMAIN:
        return None
    try:
        return Identity(Role(parts[1]), parts[2])
    except ValueError:
        return None


def identity_of(sans: Iterable[str]) -> Identity | None:
    """The one kvsched identity among a certificate's subject alternative names; None when
    there is none, or more than one (a certificate must not speak for two components)."""
    found = {identity for identity in map(parse_uri, sans) if identity is not None}
    return found.pop() if len(found) == 1 else None


def sans_of(auth_context: Mapping[str, Sequence[bytes]]) -> list[str]:
    """The subject alternative names grpc read from the peer's verified certificate (URIs
    among them); empty for a plaintext or certificate-less peer."""
    return [value.decode("utf-8", "replace") for value in auth_context.get(_SAN_KEY, ())]


def peer_identity(context: Any) -> Identity | None:
    """The identity of the peer of an RPC (a grpc.aio ServicerContext), None when it showed
    no certificate naming one (always so on a plaintext server)."""
    return identity_of(sans_of(context.auth_context()))


_SAN_KEY = "x509_subject_alternative_name"
