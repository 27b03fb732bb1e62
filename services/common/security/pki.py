"""A small certificate authority for a cluster's identities: an EC P-256 CA, and one
certificate per component signed by it, naming the component's `Identity` as a URI SAN and
loopback as DNS/IP SANs (so clients' hostname checks pass on 127.0.0.1 and localhost).
`kvsched up` makes one per run; `kvsched certs` mints more with the same CA (rotation).

Files are written owner-only (0600) into an owner-only folder (0700)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.security.identity import Identity
from services.common.security.tls import ClientTls, ServerTls

CA_CERT, CA_KEY = "ca.pem", "ca.key"
CA_DAYS = 365
LEAF_DAYS = 90
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_CLOCK_SKEW = datetime.timedelta(minutes=5)  # peers whose clocks lag a little still accept


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Where one identity's certificate and key are, and the CA that signed it (which is
    also the CA its peers' certificates must chain to)."""

    cert: Path
    key: Path
    ca: Path

    def client(self) -> ClientTls:
        """These files as a client's mTLS settings."""
        return ClientTls(str(self.ca), str(self.cert), str(self.key))

    def server(self) -> ServerTls:
        """These files as a server's mTLS settings (clients must chain to the same CA)."""
        return ServerTls(str(self.cert), str(self.key), str(self.ca))


@dataclass(frozen=True)
class Authority:
    """A CA's certificate and private key, in memory."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def new_authority(now: datetime.datetime, name: str = "kvsched local CA") -> Authority:
    """A fresh self-signed CA valid from `now` (less a little skew) for `CA_DAYS`."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _builder(subject, subject, key.public_key(), now, CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue(
    ca: Authority,
    identity: Identity,
    now: datetime.datetime,
    *,
    hosts: Sequence[str] = LOOPBACK_HOSTS,
    days: int = LEAF_DAYS,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for `identity` (a new key), good for serving and for calling (TLS server
    and client auth), with `hosts` (names or IP addresses) as its DNS/IP SANs."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"{identity.role}/{identity.name}")]
    )
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri)]
    sans += [_host_san(host) for host in hosts]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        _builder(subject, ca.cert.subject, key.public_key(), now, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return cert, key


def write_authority(folder: Path, ca: Authority) -> None:
    """Write the CA's certificate and key into `folder` (made owner-only)."""
    _private_dir(folder)
    _write(folder / CA_CERT, ca.cert.public_bytes(serialization.Encoding.PEM))
    _write(folder / CA_KEY, _key_pem(ca.key))


def load_authority(folder: Path) -> Authority:
    """The CA `write_authority` wrote into `folder`. Raises OSError when a file is missing,
    ValueError when one is not what it should be."""
    cert = x509.load_pem_x509_certificate((folder / CA_CERT).read_bytes())
    key = serialization.load_pem_private_key((folder / CA_KEY).read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{folder / CA_KEY} is not an EC private key")
    return Authority(cert, key)


def write_identity(
    folder: Path,
    ca: Authority,
    identity: Identity,
    now: datetime.datetime,
    *,
    hosts: Sequence[str] = LOOPBACK_HOSTS,
    days: int = LEAF_DAYS,
) -> CertFiles:
    """Mint a certificate for `identity` and write it, with its key, into `folder` as
    `<role>-<name>.pem` and `.key` (replacing older ones: this is how a certificate is
    rotated); the CA certificate must already be there (`write_authority`)."""
    _private_dir(folder)
    cert, key = issue(ca, identity, now, hosts=hosts, days=days)
    files = cert_files(folder, identity)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.key, _key_pem(key))
    return files


def cert_files(folder: Path, identity: Identity) -> CertFiles:
    """Where `write_identity` puts `identity`'s files in `folder` (nothing is read)."""
    stem = f"{identity.role}-{identity.name}"
    return CertFiles(folder / f"{stem}.pem", folder / f"{stem}.key", folder / CA_CERT)


def make_cluster_pki(
    folder: Path, identities: Iterable[Identity], now: datetime.datetime
) -> dict[Identity, CertFiles]:
    """A new CA in `folder` and a certificate for each of `identities`."""
    ca = new_authority(now)
    write_authority(folder, ca)
    return {identity: write_identity(folder, ca, identity, now) for identity in identities}


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    now: datetime.datetime,
    days: int,
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _host_san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _private_dir(folder: Path) -> None:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)


def _write(path: Path, data: bytes) -> None:
    """Replace `path` with `data`, readable by its owner only from the first byte on."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
