"""Transport security (rule D10.transport): a CA, the servers' certificate, the clients' TLS context.

A TLS directory holds (:class:`TlsFiles`; mode 0600, or the mode asked for except the CA's key)::

    ca.pem        the CA certificate every client trusts (``APPORTION_TLS_CA`` names it)
    ca.key        the CA's private key: only for a CA made here (ops who bring their own CA keep its key elsewhere)
    server.pem    the servers' certificate (Kafka's listeners, Redis' TLS port), then the CA's
    server.key    its private key (PKCS#8, unencrypted: the file mode protects it)
    keystore.pem  ``server.key`` then ``server.pem``: Kafka's PEM keystore (``ssl.keystore.type=PEM``)

:func:`ensure` makes what is missing, idempotently: a CA (ECDSA P-256, 10 years) when there is no
``ca.pem``, and a server certificate signed by it for the names asked for (``127.0.0.1`` and
``localhost``; compose adds its service names) when there is none, when it does not cover a name, is not
signed by ``ca.pem`` or expires within 30 days. ``apportion stack up``, the test fixtures
(:class:`apportion.bus.stack.LocalStack`) and ``infra/compose-secrets.sh`` call it; with a CA of one's own
(``ca.pem`` without ``ca.key``, and ``server.pem``/``server.key`` it signed) nothing is made and a
certificate that does not fit is an error.

Clients: :func:`client_context` is the one :class:`ssl.SSLContext` of a process per CA file (verifies the
chain and the host name, TLS 1.2 or newer), shared by every Kafka and Redis connection so the CA is parsed
once; :mod:`apportion.bus.security` hands it to the clients.

Command line (``infra/`` scripts, compose)::

    python -m apportion.bus.tls DIR [--host NAME ...] [--mode 0644]
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import ipaddress
import os
import ssl
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from apportion.privatefiles import write_private

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

#: The names every server certificate covers (everything binds loopback by default: rule D10.loopback).
LOCAL_HOSTS = ("127.0.0.1", "localhost")

CA_DAYS = 3650
SERVER_DAYS = 825
#: A server certificate expiring within this is made again.
RENEW_DAYS = 30


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The files of a TLS directory (module docstring)."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def cert(self) -> Path:
        return self.dir / "server.pem"

    @property
    def key(self) -> Path:
        return self.dir / "server.key"

    @property
    def keystore(self) -> Path:
        return self.dir / "keystore.pem"


def _name(common: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "apportion"), x509.NameAttribute(NameOID.COMMON_NAME, common)]
    )


def _san(hosts: Iterable[str]) -> list[x509.GeneralName]:
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _make_ca(files: TlsFiles, now: dt.datetime, mode: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("apportion local CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    # never read by a server, whatever the others' mode
    write_private(files.ca_key, _pem_key(key), mode=0o600, replace_link=True)
    write_private(files.ca, cert.public_bytes(serialization.Encoding.PEM), mode=mode, replace_link=True)


def _server_fits(files: TlsFiles, hosts: Sequence[str], now: dt.datetime) -> str:
    """Why the server certificate must be made again (``""``: it fits)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    if not (files.cert.is_file() and files.key.is_file() and files.keystore.is_file()):
        return "missing"
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        return f"{files.cert} is not signed by {files.ca}"
    try:
        have = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        have = set()
    if missing := [h for h, s in zip(hosts, _san(hosts), strict=True) if s not in have]:
        return f"{files.cert} does not name {', '.join(missing)}"
    if cert.not_valid_after_utc - now < dt.timedelta(days=RENEW_DAYS):
        return f"{files.cert} expires on {cert.not_valid_after_utc:%Y-%m-%d}"
    return ""


def _make_server(files: TlsFiles, hosts: Sequence[str], now: dt.datetime, mode: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    ca_pem = files.ca.read_bytes()
    ca = x509.load_pem_x509_certificate(ca_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
        # serverAuth for the listeners; clientAuth for a broker connecting to its controller and to the others
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    chain = cert.public_bytes(serialization.Encoding.PEM) + ca_pem
    key_pem = _pem_key(key)
    write_private(files.key, key_pem, mode=mode, replace_link=True)
    write_private(files.cert, chain, mode=mode, replace_link=True)
    write_private(files.keystore, key_pem + chain, mode=mode, replace_link=True)


def ensure(
    directory: str | os.PathLike[str],
    hosts: Sequence[str] = LOCAL_HOSTS,
    *,
    mode: int = 0o600,
    now: dt.datetime | None = None,
) -> TlsFiles:
    """Make the CA and the server certificate of ``directory`` where missing or unfit (module docstring).

    Args:
        directory: the TLS directory (made mode 0700).
        hosts: the IP addresses and DNS names the server certificate must cover (the first is its common name).
        mode: the files' mode (compose's are 0644: a container's user reads its bind-mounted file).
        now: the issue time (default: the wall clock; certificates are about real time, not event time).

    Raises:
        RuntimeError: the server certificate does not fit and there is no ``ca.key`` to make one (a CA of
            one's own: give a certificate it signed for ``hosts``).
    """
    files = TlsFiles(Path(directory))
    files.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = now or dt.datetime.now(dt.UTC)
    hosts = tuple(dict.fromkeys(hosts))
    if not files.ca.is_file():
        _make_ca(files, now, mode)
    why = _server_fits(files, hosts, now)
    if why:
        if not files.ca_key.is_file():
            raise RuntimeError(
                f"TLS: {why}, and {files.ca_key} is absent (a CA of your own): put in {files.dir} a server.pem "
                f"(certificate, then its chain) and server.key your CA issued for {', '.join(hosts)}, and "
                "keystore.pem (server.key then server.pem)"
            )
        _make_server(files, hosts, now, mode)
    return files


@functools.lru_cache(maxsize=8)
def client_context(cafile: str) -> ssl.SSLContext:
    """The client TLS context of ``cafile`` (one per process and CA: every connection reuses it).

    It verifies the server's chain against ``cafile`` only (``""``: the system's trust store) and its host
    name (``CERT_REQUIRED``, ``check_hostname``), TLS 1.2 or newer.
    """
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Make a local CA and server certificate (apportion.bus.tls).")
    ap.add_argument("dir")
    ap.add_argument("--host", action="append", default=[], help="a name the server certificate covers (repeat)")
    ap.add_argument("--mode", default="0600", help="the files' mode (default 0600)")
    args = ap.parse_args(argv)
    try:
        files = ensure(args.dir, (*LOCAL_HOSTS, *args.host), mode=int(args.mode, 8))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"APPORTION_TLS_CA={files.ca}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
