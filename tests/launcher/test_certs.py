"""`kvsched certs`: identities minted with a folder's CA, kept across calls (rotation)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from services.common.security.identity import Identity, Role, identity_of
from services.launcher.certs import main, parse_identity


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_mints_with_one_ca_and_keeps_it(tmp_path: Path) -> None:
    folder = tmp_path / "tls"
    assert main(["--dir", str(folder), "messenger/node-3", "admin/alice"]) == 0
    ca = (folder / "ca.pem").read_bytes()
    cert = _cert(folder / "messenger-node-3.pem")
    uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert identity_of(uris.get_values_for_type(x509.UniformResourceIdentifier)) == Identity(
        Role.MESSENGER, "node-3"
    )
    assert main(["--dir", str(folder), "--host", "m3.example", "messenger/node-3"]) == 0
    assert (folder / "ca.pem").read_bytes() == ca  # the same CA: peers still trust it
    again = _cert(folder / "messenger-node-3.pem")
    again.verify_directly_issued_by(_cert(folder / "ca.pem"))
    sans = again.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["m3.example"]
    assert main(["--dir", str(folder), "--new-ca", "admin/alice"]) == 0
    assert (folder / "ca.pem").read_bytes() != ca


@pytest.mark.parametrize("text", ["engine/e0", "router", "router/a/b", "/x"])
def test_bad_identities_are_usage_errors(text: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="ROLE/NAME"):
        parse_identity(text)
    with pytest.raises(SystemExit) as exited:
        main(["--dir", str(tmp_path), text])
    assert exited.value.code == 2
