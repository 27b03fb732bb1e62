"""The local CA: certificates that name their identity, chain to the CA and stay private."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from services.common.security.identity import Identity, Role, identity_of
from services.common.security.pki import load_authority, make_cluster_pki, write_identity

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
ROUTER = Identity(Role.ROUTER, "router-0")
NODE = Identity(Role.MESSENGER, "node-0")


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_each_certificate_names_its_identity_and_loopback(tmp_path: Path) -> None:
    files = make_cluster_pki(tmp_path / "tls", (ROUTER, NODE), NOW)
    cert = _cert(files[NODE].cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    assert identity_of(uris) == NODE
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    ca = _cert(files[NODE].ca)
    cert.verify_directly_issued_by(ca)  # raises when it does not chain
    assert cert.not_valid_before_utc <= NOW < cert.not_valid_after_utc


def test_the_files_are_owner_only(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    make_cluster_pki(folder, (ROUTER,), NOW)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
    assert set(modes) == {"ca.pem", "ca.key", "router-router-0.pem", "router-router-0.key"}
    assert set(modes.values()) == {0o600}


def test_rotation_mints_a_new_key_under_the_same_ca(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    old = make_cluster_pki(folder, (ROUTER,), NOW)[ROUTER]
    old_cert = _cert(old.cert)
    new = write_identity(folder, load_authority(folder), ROUTER, NOW + datetime.timedelta(days=1))
    assert new == old  # same paths, replaced
    new_cert = _cert(new.cert)
    assert new_cert.public_key() != old_cert.public_key()
    new_cert.verify_directly_issued_by(_cert(new.ca))
