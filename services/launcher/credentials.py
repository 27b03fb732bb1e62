"""What `kvsched up` authenticates its cluster with, unless `--insecure`: a local CA and one
certificate per component (`pki`) in `<run dir>/tls`, an admin certificate for the operator,
and the admin HTTP token in `<run dir>/admin-token`. The paths are decided when the cluster
is planned (pure); `write` mints the files, just before the processes start."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.security.admin_token import new_admin_token
from services.common.security.identity import Identity, Role
from services.common.security.pki import CertFiles, cert_files, make_cluster_pki

ADMIN = Identity(Role.ADMIN, "operator")
ETCD = Identity(Role.ETCD, "etcd")


@dataclass(frozen=True)
class ClusterCredentials:
    """The cluster's identities and where their files go."""

    folder: Path  # the CA and every certificate and key
    admin_token_file: Path
    identities: tuple[Identity, ...]  # ADMIN and ETCD among them

    @classmethod
    def for_run(cls, run_dir: Path, components: tuple[Identity, ...]) -> ClusterCredentials:
        """Credentials in `run_dir` for `components`, the operator and etcd."""
        return cls(run_dir / "tls", run_dir / "admin-token", (ADMIN, ETCD, *components))

    def files(self, identity: Identity) -> CertFiles:
        """Where `identity`'s certificate and key are (raises KeyError for a stranger)."""
        if identity not in self.identities:
            raise KeyError(f"{identity} is not an identity of this cluster")
        return cert_files(self.folder, identity)

    @property
    def admin(self) -> CertFiles:
        return self.files(ADMIN)

    def server_flags(self, prefix: str, identity: Identity) -> list[str]:
        """`--<prefix>cert/key/client-ca`: serve mutual TLS as `identity`."""
        f = self.files(identity)
        pairs = (("cert", f.cert), ("key", f.key), ("client-ca", f.ca))
        return [arg for name, path in pairs for arg in (f"--{prefix}{name}", str(path))]

    def client_flags(self, prefix: str, identity: Identity) -> list[str]:
        """`--<prefix>ca/cert/key`: call mutual-TLS servers as `identity`."""
        f = self.files(identity)
        pairs = (("ca", f.ca), ("cert", f.cert), ("key", f.key))
        return [arg for name, path in pairs for arg in (f"--{prefix}{name}", str(path))]

    def etcd_env(self, identity: Identity) -> dict[str, str]:
        """The `KVSCHED_ETCD_*` files for a client of etcd calling as `identity`."""
        f = self.files(identity)
        return {
            "KVSCHED_ETCD_CA_FILE": str(f.ca),
            "KVSCHED_ETCD_CERT_FILE": str(f.cert),
            "KVSCHED_ETCD_KEY_FILE": str(f.key),
        }

    def endpoint(self) -> dict[str, Any]:
        """The endpoints file's `admin` entry: what an operator calls the cluster with."""
        f = self.admin
        return {
            "ca": str(f.ca),
            "cert": str(f.cert),
            "key": str(f.key),
            "token_file": str(self.admin_token_file),
        }

    def write(self, now: datetime.datetime) -> None:
        """Mint a new CA and every certificate, and a new admin token (replacing old ones)."""
        make_cluster_pki(self.folder, self.identities, now)
        new_admin_token(self.admin_token_file)
