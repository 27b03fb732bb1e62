"""API keys → tenants, and the cache salt each tenant's requests carry.

The keys file (JSON, written by `python -m services.router.api_keys new`):

    {"tenants": {"NAME": {"salt": "...", "keys": ["sha256:<hex of the key>", ...]}}}

Keys are stored as SHA-256 digests only; a request's `Authorization: Bearer KEY` is hashed and
looked up by digest, so neither the file nor the Router's memory holds a usable key. A tenant's
salt keeps its KV blocks apart from every other tenant's (the block hashes and the engine's
`cache_salt` both use it): one tenant can never hit, or probe, another's cached prefixes.
Neither keys nor salts are ever logged (`Tenant.__repr__` hides the salt).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.inference_api.openai_api import ApiError

KEY_PREFIX = "sha256:"


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request belongs to."""

    name: str
    salt: str = field(repr=False)

    def cache_salt(self, client_salt: str | None) -> str:
        """The `cache_salt` the engine gets, and (UTF-8 encoded) the salt of the block hashes:
        the tenant's salt, combined as `"{tenant}:{client}"` with a salt the client sent (a
        client may split its own traffic further, never join another tenant's)."""
        if not client_salt:
            return self.salt
        if not self.salt:
            return client_salt
        return f"{self.salt}:{client_salt}"


ANONYMOUS = Tenant("anonymous", "")


def key_digest(key: str) -> str:
    """How a key is stored: `sha256:<hex>`."""
    return KEY_PREFIX + hashlib.sha256(key.encode()).hexdigest()


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type_="invalid_request_error", code="invalid_api_key")


class Authenticator:
    """Maps the `Authorization` header to a tenant; `None` tenants means no auth (`--no-auth`:
    every request is the anonymous tenant)."""

    def __init__(self, by_digest: Mapping[str, Tenant] | None) -> None:
        self._by_digest = dict(by_digest) if by_digest is not None else None

    @classmethod
    def from_file(cls, path: str | Path) -> Authenticator:
        """Load a keys file; raises `ValueError` naming what is wrong (never a key or salt)."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise ValueError(f"the API keys file {path} is not valid JSON: {exc}") from None
        return cls(parse_tenants(raw, str(path)))

    @classmethod
    def open(cls) -> Authenticator:
        return cls(None)

    @property
    def enabled(self) -> bool:
        return self._by_digest is not None

    @property
    def tenants(self) -> int:
        return len(set(self._by_digest.values())) if self._by_digest else 0

    def tenant_of(self, headers: Mapping[str, str]) -> Tenant:
        """The tenant of a request with `headers`: its `Authorization: Bearer KEY`, else
        Anthropic's `x-api-key: KEY` (what the Anthropic SDKs send); raises `ApiError` 401."""
        authorization = headers.get("Authorization")
        if not authorization and (key := headers.get("x-api-key")):
            authorization = f"Bearer {key}"
        return self.tenant(authorization)

    def tenant(self, authorization: str | None) -> Tenant:
        """The tenant of a request; raises `ApiError` 401 for a missing or unknown key."""
        if self._by_digest is None:
            return ANONYMOUS
        if not authorization:
            raise unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer KEY`."
            )
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise unauthorized("The Authorization header must be `Bearer KEY`.")
        try:
            digest = key_digest(key)
        except UnicodeEncodeError:  # bytes that are not UTF-8: no stored key is one
            raise unauthorized("Incorrect API key provided.") from None
        # A dict lookup by digest: the comparison is on SHA-256 digests of what the caller
        # sent, which leak nothing usable about stored keys through timing.
        tenant = self._by_digest.get(digest)
        if tenant is None:
            raise unauthorized("Incorrect API key provided.")
        return tenant


def parse_tenants(raw: Any, where: str = "the API keys file") -> dict[str, Tenant]:
    """`{"tenants": {...}}` → {digest: tenant}; raises `ValueError`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("tenants"), dict):
        raise ValueError(f'{where}: expected {{"tenants": {{NAME: {{"salt", "keys"}}}}}}')
    out: dict[str, Tenant] = {}
    for name, entry in raw["tenants"].items():
        if not name or "/" in name:
            raise ValueError(f"{where}: tenant names must be non-empty and without '/'")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: tenant {name!r} must be an object")
        salt = entry.get("salt", "")
        keys = entry.get("keys", [])
        if not isinstance(salt, str) or not isinstance(keys, list):
            raise ValueError(f"{where}: tenant {name!r} needs a string salt and a list of keys")
        tenant = Tenant(name, salt)
        for digest in keys:
            if not (
                isinstance(digest, str)
                and digest.startswith(KEY_PREFIX)
                and len(digest) == len(KEY_PREFIX) + 64
            ):
                raise ValueError(f"{where}: tenant {name!r} has a key not in sha256:<hex> form")
            other = out.get(digest.lower())
            if other is not None and other.name != name:
                raise ValueError(f"{where}: a key belongs to both {other.name!r} and {name!r}")
            out[digest.lower()] = tenant
    return out
