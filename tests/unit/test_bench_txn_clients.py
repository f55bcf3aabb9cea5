"""The transaction benchmark's confluent-kafka clients sign in as the kafka-python ones do (``bench/txn_clients.py``)."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import txn_clients

from apportion.bus import tls


def test_librdkafka_settings_carry_the_principal_the_mechanism_and_the_stacks_ca_with_host_name_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = tls.ensure(tmp_path, now=dt.datetime(2026, 12, 6, tzinfo=dt.UTC))
    monkeypatch.delenv("APPORTION_NO_TLS", raising=False)
    monkeypatch.setenv("APPORTION_TLS_CA", str(files.ca))
    monkeypatch.setenv("APPORTION_KAFKA_USER", "dispatcher")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD", "pw")
    assert txn_clients.rdkafka_settings() == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "dispatcher",
        "sasl.password": "pw",
        "ssl.endpoint.identification.algorithm": "https",
        "ssl.ca.location": str(files.ca),
    }


def test_without_tls_it_signs_in_over_sasl_plaintext_and_without_a_user_in_plaintext(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("APPORTION_NO_TLS", "1")
    monkeypatch.setenv("APPORTION_KAFKA_USER", "ops")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD", "pw")
    assert txn_clients.rdkafka_settings() == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "ops",
        "sasl.password": "pw",
    }
    monkeypatch.setenv("APPORTION_KAFKA_USER", "")
    monkeypatch.setattr("apportion.settings.stack_env", lambda: {})
    assert txn_clients.rdkafka_settings() == {}
