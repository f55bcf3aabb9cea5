"""`apportion forecast --horizon` of no length is bad input (exit 2, one line, JSON under --json), never a
traceback: the forward run needs a horizon above 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.cli.main import app
from tests.kit.audit_history import export
from tests.kit.builders import T0, m
from tests.kit.forecast_history import History


@pytest.fixture(autouse=True)
def _no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # no running stack's namespace comes in
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")


@pytest.mark.parametrize("horizon", ["0", "0s", "0h"])
def test_a_horizon_of_no_length_is_bad_input(tmp_path: Path, horizon: str) -> None:
    log = export(tmp_path / "log.jsonl.gz", History().node("n0", 1).submit("r1", T0).submit("p1", m(10)).log, "")
    res = CliRunner().invoke(app, ["forecast", "p1", "--horizon", horizon, "--from-file", log], terminal_width=80)
    assert res.exception is None or isinstance(res.exception, SystemExit), "a traceback"
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: --horizon {horizon}: a duration above 0"
    res = CliRunner().invoke(app, ["forecast", "p1", "--json", "--horizon", horizon, "--from-file", log])
    got = json.loads(res.stdout)
    assert (res.exit_code, got["exit_code"], got["message"]) == (2, 2, f"--horizon {horizon}: a duration above 0")
