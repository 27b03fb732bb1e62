"""The small key-value store interface the Conductor codes against: errors, values and the
`Store` protocol. `services.common.store.etcd.EtcdStore` implements it over etcd,
`services.common.store.memory.MemoryStore` in process memory."""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias
from urllib.parse import urlsplit

# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """The store rejected or failed an operation."""


class StoreUnavailable(StoreError):
    """No etcd endpoint could be reached (refused, timed out, credentials rejected)."""


class LeaseNotFound(StoreError):
    """A put or create named a lease that does not exist (never granted, expired or revoked)."""


class Fenced(StoreError):
    """A guarded transaction was refused because its `Guard` no longer holds (another term
    leads): nothing of it was applied."""


class StoreCompacted(StoreError):
    """A watch or snapshot asked for history etcd has already compacted away: reload."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


def split_endpoint(endpoint: str) -> tuple[str, str, int]:
    """`http://host:port`, `https://host:port` or `host:port` → (scheme, host, port)."""
    parts = urlsplit(endpoint if "//" in endpoint else f"//{endpoint}")
    scheme = parts.scheme or "http"
    try:
        port = parts.port or 2379
    except ValueError as e:
        raise ValueError(f"bad etcd endpoint {endpoint!r}: {e}") from None
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bad etcd endpoint {endpoint!r}: expected http(s)://host:port")
    return scheme, parts.hostname, port


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class EtcdSettings:
    """Where etcd is and how to log in. TLS is used when an endpoint is `https://` or any of
    `ca_file`/`cert_file`/`key_file` is set (no `ca_file`: the system's root certificates)."""

    endpoints: tuple[str, ...] = ("http://127.0.0.1:2379",)
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdSettings.endpoints is empty: give at least one etcd URL")
        if (self.username is None) != (self.password is None):
            raise ValueError("etcd username and password must be given together")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd client cert_file and key_file must be given together")
        if self.timeout_s <= 0:
            raise ValueError(f"etcd timeout_s must be positive, not {self.timeout_s}")
        for endpoint in self.endpoints:
            split_endpoint(endpoint)  # fail early on a malformed endpoint

    @classmethod
    def from_env(
        cls, prefix: str = "KVSCHED_ETCD_", environ: Mapping[str, str] | None = None
    ) -> EtcdSettings:
        """Read `{prefix}ENDPOINTS` (comma-separated), `USERNAME`, `PASSWORD`, `CA_FILE`,
        `CERT_FILE`, `KEY_FILE` and `TIMEOUT_S`; unset or empty variables keep the defaults."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(prefix + name, "").strip()
            return value or None

        endpoints = get("ENDPOINTS")
        timeout = get("TIMEOUT_S")
        defaults = cls()
        return cls(
            endpoints=(
                tuple(e.strip() for e in endpoints.split(",") if e.strip())
                if endpoints
                else defaults.endpoints
            ),
            username=get("USERNAME"),
            password=get("PASSWORD"),
            ca_file=get("CA_FILE"),
            cert_file=get("CERT_FILE"),
            key_file=get("KEY_FILE"),
            timeout_s=float(timeout) if timeout else defaults.timeout_s,
        )

    @property
    def uses_tls(self) -> bool:
        return any(f is not None for f in (self.ca_file, self.cert_file, self.key_file)) or any(
            split_endpoint(e)[0] == "https" for e in self.endpoints
        )

    def __repr__(self) -> str:
        password = "None" if self.password is None else "'***'"
        return (
            f"EtcdSettings(endpoints={self.endpoints!r}, username={self.username!r}, "
            f"password={password}, ca_file={self.ca_file!r}, cert_file={self.cert_file!r}, "
            f"key_file={self.key_file!r}, timeout_s={self.timeout_s!r})"
        )

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change under a watched prefix; `value` is empty for deletes (including lease expiry)."""

    kind: Literal["put", "delete"]
    key: bytes
    value: bytes
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl_s: int
    """The TTL etcd granted, which can exceed the one asked for (etcd's minimum TTL)."""


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


@dataclass(frozen=True, slots=True)
class DeletePrefix:
    prefix: bytes


Op: TypeAlias = Put | Delete | DeletePrefix


@dataclass(frozen=True, slots=True)
class Guard:
    """The condition a guarded transaction applies under: `key` exists, bound to `lease`. A
    leader guards its writes with its leader key and the lease it was elected with, so a
    leader that lost the key (or was elected again under another lease) writes nothing."""

    key: bytes
    lease: int


@dataclass(frozen=True, slots=True)
class CommitResult:
    revision: int
    """Store revision after the last transaction (0 if nothing was written)."""
    transactions: int
    """Transactions applied; each bumps the store revision by one."""
    dropped_puts: int
    """Puts dropped because their lease no longer existed."""


# --------------------------------------------------------------------------- protocol


class Store(Protocol):
    """What the Conductor needs from a consistent key-value store."""

    async def connect(self) -> None: ...
    async def close(self) -> None: ...
    async def get(self, key: bytes) -> KeyValue | None: ...
    async def get_prefix(self, prefix: bytes) -> list[KeyValue]: ...
    async def snapshot(self, prefix: bytes) -> tuple[list[KeyValue], int]: ...
    async def revision(self) -> int: ...
    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int: ...
    async def create(self, key: bytes, value: bytes, lease: int = 0) -> bool: ...
    async def delete(self, key: bytes) -> bool: ...
    async def delete_prefix(self, prefix: bytes) -> int: ...
    async def commit(self, ops: Sequence[Op], guard: Guard | None = None) -> CommitResult: ...
    async def grant_lease(self, ttl_s: int) -> Lease: ...
    async def keep_alive(self, lease_id: int) -> int: ...
    async def revoke_lease(self, lease_id: int) -> bool: ...
    async def lease_ttl(self, lease_id: int) -> int: ...
    def watch_prefix(
        self, prefix: bytes, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]: ...
