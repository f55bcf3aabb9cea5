"""The local CA and the servers' certificate (``apportion.bus.tls``), and the clients' TLS settings."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from apportion.bus import security, tls

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


def _names(path: Path) -> set[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
        str(n) for n in san.get_values_for_type(x509.IPAddress)
    }


def test_ensure_makes_a_ca_and_a_server_certificate_for_loopback_readable_by_the_owner_only(tmp_path: Path) -> None:
    files = tls.ensure(tmp_path / "tls", now=NOW)
    for f in (files.ca, files.ca_key, files.cert, files.key, files.keystore):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(files.dir.stat().st_mode) == 0o700
    assert _names(files.cert) == {"127.0.0.1", "localhost"}
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=tls.SERVER_DAYS)
    # Kafka's PEM keystore: the key, then the chain (server, CA)
    assert files.keystore.read_bytes() == files.key.read_bytes() + files.cert.read_bytes()
    assert files.cert.read_bytes().endswith(files.ca.read_bytes())


def test_ensure_keeps_what_fits_and_makes_the_server_certificate_again_for_a_new_name_or_near_expiry(
    tmp_path: Path,
) -> None:
    first = tls.ensure(tmp_path, now=NOW)
    ca, cert = first.ca.read_bytes(), first.cert.read_bytes()
    tls.ensure(tmp_path, now=NOW + dt.timedelta(days=1))
    assert (first.ca.read_bytes(), first.cert.read_bytes()) == (ca, cert)  # nothing to do
    tls.ensure(tmp_path, (*tls.LOCAL_HOSTS, "kafka-1"), now=NOW)
    assert first.ca.read_bytes() == ca and first.cert.read_bytes() != cert
    assert _names(first.cert) == {"127.0.0.1", "localhost", "kafka-1"}
    renewed = first.cert.read_bytes()
    # 30 days before the end (RENEW_DAYS) it is made again, under the same CA
    tls.ensure(tmp_path, (*tls.LOCAL_HOSTS, "kafka-1"), now=NOW + dt.timedelta(days=tls.SERVER_DAYS - 29))
    assert first.cert.read_bytes() != renewed and first.ca.read_bytes() == ca


def test_a_ca_of_ones_own_is_used_as_it_is_and_a_certificate_it_did_not_sign_is_an_error(tmp_path: Path) -> None:
    own = tls.ensure(tmp_path / "own", now=NOW)
    own.ca_key.unlink()  # ops keep their CA's key elsewhere
    cert = own.cert.read_bytes()
    assert tls.ensure(own.dir, now=NOW).cert.read_bytes() == cert
    with pytest.raises(RuntimeError, match="does not name kafka-9.*ca.key is absent"):
        tls.ensure(own.dir, (*tls.LOCAL_HOSTS, "kafka-9"), now=NOW)
    other = tls.ensure(tmp_path / "other", now=NOW)
    own.ca.write_bytes(other.ca.read_bytes())
    with pytest.raises(RuntimeError, match="is not signed by"):
        tls.ensure(own.dir, now=NOW)


def test_compose_files_may_be_world_readable_and_ip_names_are_ip_addresses(tmp_path: Path) -> None:
    files = tls.ensure(tmp_path, ("10.0.0.7", "redis"), mode=0o644, now=NOW)
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o644
    assert stat.S_IMODE(files.ca_key.stat().st_mode) == 0o600  # no server reads it
    san = x509.load_pem_x509_certificate(files.cert.read_bytes()).extensions
    value = san.get_extension_for_class(x509.SubjectAlternativeName).value
    assert value.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert value.get_values_for_type(x509.DNSName) == ["redis"]


def test_clients_verify_the_stacks_ca_and_host_name_through_one_shared_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = tls.ensure(tmp_path, now=NOW)
    monkeypatch.setenv("APPORTION_TLS_CA", str(files.ca))
    monkeypatch.setenv("APPORTION_KAFKA_USER", "dispatcher")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD", "pw")
    monkeypatch.setenv("APPORTION_REDIS_USER", "dispatcher")
    monkeypatch.setenv("APPORTION_REDIS_PASSWORD", "pw")
    auth = security.kafka_auth()
    assert auth["security_protocol"] == "SASL_SSL"
    ctx = auth["ssl_context"]
    assert ctx is security.kafka_auth()["ssl_context"]  # one context per process: the CA is parsed once
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert [c["subject"] for c in ctx.get_ca_certs()] == [
        ((("organizationName", "apportion"),), (("commonName", "apportion local CA"),))
    ]
    tls_kw = {"ssl_ca_certs": str(files.ca), "ssl_cert_reqs": "required", "ssl_check_hostname": True}
    assert security.redis_auth("rediss://127.0.0.1:1/0") == {"username": "dispatcher", "password": "pw", **tls_kw}
    assert security.redis_auth("redis://127.0.0.1:1/0") == {"username": "dispatcher", "password": "pw"}
    assert security.redis_auth() == {"username": "dispatcher", "password": "pw", **tls_kw}


def test_a_development_stack_without_tls_signs_in_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``APPORTION_NO_TLS=1`` (what ``bench_live --no-tls`` starts): SCRAM over SASL_PLAINTEXT, no TLS context."""
    monkeypatch.setenv("APPORTION_NO_TLS", "1")
    monkeypatch.setenv("APPORTION_KAFKA_USER", "ops")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD", "pw")
    assert security.kafka_auth() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "ops",
        "sasl_plain_password": "pw",
    }
    monkeypatch.delenv("APPORTION_NO_TLS")
    assert security.kafka_auth()["security_protocol"] == "SASL_SSL"
