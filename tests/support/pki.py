"""A throwaway PKI for TLS tests: a CA, a server certificate for 127.0.0.1/localhost signed
by it, a client certificate, and a second unrelated CA, written as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _cert(subject: str, issuer_key, issuer_name, key, *, ca: bool, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_pki(out: Path) -> dict[str, Path]:
    """PEM files in `out`: ca, other_ca, server (+ server.key), client (+ client.key)."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore test CA")])
    ca = _cert("kvstore test CA", ca_key, ca_name, ca_key, ca=True)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "some other CA")])
    files = {"ca": ca, "other_ca": _cert("some other CA", other_key, other_name, other_key, ca=True)}
    for name, sans in (
        ("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
        ("client", []),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name] = _cert(name, ca_key, ca_name, key, ca=False, sans=sans)
        (out / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )  # fmt: skip
        )
    paths = {}
    for name, cert in files.items():
        paths[name] = out / f"{name}.pem"
        paths[name].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["server.key"] = out / "server.key"
    paths["client.key"] = out / "client.key"
    return paths
