"""`python -m services.router.api_keys new --tenant NAME [--file PATH]`: add an API key.

Creates the keys file (owner read/write only) or extends it: a new tenant gets a random salt,
an existing one keeps its salt and gains a key. Only the key's SHA-256 digest is stored; the
key itself is printed once, on stdout, and cannot be recovered afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.security.files import write_private
from services.router.auth import key_digest, parse_tenants

DEFAULT_FILE = "api-keys.json"
KEY_PREFIX = "kvs-"


def new_key(path: Path, tenant: str) -> str:
    """Add a fresh key for `tenant` to the file at `path` (created if missing); returns it."""
    if not tenant or "/" in tenant:
        raise ValueError("the tenant name must be non-empty and without '/'")
    data: dict[str, Any] = {"tenants": {}}
    if path.exists():
        data = json.loads(path.read_text(encoding="utf-8"))
        parse_tenants(data, str(path))  # refuse to extend a file the Router would refuse
    entry = data["tenants"].setdefault(tenant, {"salt": secrets.token_hex(16), "keys": []})
    entry.setdefault("keys", [])
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry["keys"].append(key_digest(key))
    write_private(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return key


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.router.api_keys", description="Manage the Router's API keys."
    )
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="create a key for a tenant (printed once)")
    new.add_argument("--tenant", required=True, help="tenant name")
    new.add_argument(
        "--file",
        default=os.environ.get("KVSCHED_ROUTER_API_KEYS") or DEFAULT_FILE,
        help=f"keys file (env KVSCHED_ROUTER_API_KEYS; default {DEFAULT_FILE})",
    )
    a = p.parse_args(argv)
    try:
        key = new_key(Path(a.file), a.tenant)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(key)
    print(f"added a key for tenant {a.tenant!r} to {a.file}; it is shown only now", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
