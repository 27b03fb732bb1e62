"""`kvsched certs`: mint component certificates with a cluster's CA, for a cluster started by
hand or to rotate one (`kvsched up` mints its own at each start).

    kvsched certs --dir DIR [--new-ca] [--host H ...] [--days N] ROLE/NAME ...

makes DIR's CA first if it has none (or `--new-ca`), then a certificate and key for each
identity (e.g. `messenger/node-3`, `admin/alice`), valid for the `--host` names and
addresses (default: localhost, 127.0.0.1, ::1). See docs/security.md."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.security.identity import Identity, Role
from services.common.security.pki import (
    CA_CERT,
    LEAF_DAYS,
    LOOPBACK_HOSTS,
    load_authority,
    new_authority,
    write_authority,
    write_identity,
)

DESCRIPTION = "Mint mTLS certificates with a cluster's CA (made when the folder has none)."


def parse_identity(text: str) -> Identity:
    """`ROLE/NAME` as an identity; raises ValueError naming the roles."""
    role, _, name = text.partition("/")
    roles = ", ".join(r.value for r in Role)
    try:
        return Identity(Role(role), name)
    except ValueError as exc:
        raise ValueError(f"{text!r}: want ROLE/NAME with ROLE one of {roles} ({exc})") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvsched certs", description=DESCRIPTION)
    p.add_argument("identities", nargs="+", metavar="ROLE/NAME", help="e.g. messenger/node-3")
    p.add_argument("--dir", type=Path, required=True, help="the CA's folder (made owner-only)")
    p.add_argument("--new-ca", action="store_true", help="replace the folder's CA with a new one")
    p.add_argument("--host", action="append", default=[], help="DNS name or IP the cert serves")
    p.add_argument("--days", type=int, default=LEAF_DAYS, help="validity of each certificate")
    args = p.parse_args(argv)
    try:
        identities = [parse_identity(text) for text in args.identities]
    except ValueError as exc:
        p.error(str(exc))
    if args.days <= 0:
        p.error("--days must be positive")
    now = datetime.datetime.now(datetime.UTC)
    try:
        if args.new_ca or not (args.dir / CA_CERT).exists():
            ca = new_authority(now)
            write_authority(args.dir, ca)
            print(f"new CA: {args.dir / CA_CERT}")
        else:
            ca = load_authority(args.dir)
        hosts = tuple(args.host) or LOOPBACK_HOSTS
        for identity in identities:
            files = write_identity(args.dir, ca, identity, now, hosts=hosts, days=args.days)
            print(f"{identity}: {files.cert} {files.key}")
    except (OSError, ValueError) as exc:
        print(f"kvsched certs: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
