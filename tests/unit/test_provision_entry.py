"""`python -m apportion.bus.provision` without a reachable Kafka: one `error:` line, exit 3 (no traceback)."""

from __future__ import annotations

import pytest
from kafka.errors import KafkaTimeoutError

from apportion.bus import provision


def _unreachable(seen: list[str]):
    def admin_client(bootstrap: str) -> None:
        # what kafka-python raises after its bootstrap timeout (30 s) on a port nobody listens on
        seen.append(bootstrap)
        raise KafkaTimeoutError(f"Unable to bootstrap from {bootstrap}")

    return admin_client


def test_unreachable_kafka_is_one_error_line_naming_the_bootstrap_and_exit_3(monkeypatch, capsys) -> None:
    seen: list[str] = []
    monkeypatch.setattr(provision, "admin_client", _unreachable(seen))
    assert provision.main(["--bootstrap", "127.0.0.1:1"]) == 3
    cap = capsys.readouterr()
    assert cap.out == ""
    [line] = cap.err.splitlines()
    assert line.startswith("error: cannot reach Kafka at 127.0.0.1:1: ")
    assert "--bootstrap HOST:PORT" in line and "apportion stack status" in line
    assert seen == ["127.0.0.1:1"]


def test_default_bootstrap_is_the_one_the_cli_resolves(monkeypatch, capsys) -> None:
    seen: list[str] = []
    monkeypatch.setattr(provision, "admin_client", _unreachable(seen))
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:29999")
    assert provision.main([]) == 3
    assert seen == ["127.0.0.1:29999"]
    assert "127.0.0.1:29999" in capsys.readouterr().err


def test_other_errors_are_not_hidden(monkeypatch) -> None:
    def broken(bootstrap: str) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(provision, "admin_client", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        provision.main(["--bootstrap", "127.0.0.1:1"])


def test_register_keys_without_key_files_is_one_error_line_and_exit_2(tmp_path, capsys) -> None:
    """A compose stack whose secrets predate the signing keys: say so before anything is provisioned."""
    assert provision.main(["--bootstrap", "127.0.0.1:1", "--register-keys", str(tmp_path / "keys/public")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"error: no public key files in {tmp_path / 'keys/public'} (infra/compose-secrets.sh makes them)"
