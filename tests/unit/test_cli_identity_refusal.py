"""The refusal of a development keyring's enrolment names the key it was registering: the user's, or, for a
request on a node (`drain`, `cordon`, `undrain`), the operator's."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from kafka.errors import TopicAuthorizationFailedError

from apportion import client
from apportion.cli import common


@pytest.mark.parametrize(
    ("ops", "key"),
    [
        pytest.param(True, "the development keyring's operator key", id="a request on a node: the operator's key"),
        pytest.param(False, "your key", id="a job request: the user's key"),
    ],
)
def test_a_refused_enrolment_names_the_key_it_registers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ops: bool, key: str
) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_KAFKA_USER", "researcher")

    def refused(*_: Any, **__: Any) -> Any:
        raise TopicAuthorizationFailedError("apportion.keys")

    monkeypatch.setattr(client, "ops_identity", refused)
    monkeypatch.setattr(client, "identity_for", refused)
    with pytest.raises(typer.Exit) as exited:
        common._identity(None, None, ops=ops)
    assert exited.value.exit_code == 1  # refused by the ACLs: exit 1, not_authorized
    said = " ".join(capsys.readouterr().err.split())
    assert f"the broker's ACLs do not let researcher register {key} " in said, said
