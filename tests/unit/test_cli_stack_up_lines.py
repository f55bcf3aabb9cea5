"""What `apportion stack up` prints of its state files fits 80 columns: the run directory's `stack.env` and the
per-user one a line each, and what they are for on a line of its own (the three on one line ran to 105)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from apportion.cli import stack
from apportion.cli.main import app


def test_up_prints_each_state_file_on_a_line_of_its_own_within_80_columns(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    run_dir = tmp_path / "src" / "apportion" / ".run"
    state = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))

    def up(*_: Any, **__: Any) -> Any:  # the stack's own lines are not the point here
        return SimpleNamespace(describe=lambda: ["Kafka    127.0.0.1:9092"])

    monkeypatch.setattr(stack, "up", up)
    res = CliRunner().invoke(app, ["stack", "up", "--dir", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines() == [
        "Kafka    127.0.0.1:9092",
        f"state    {run_dir / 'stack.env'}",
        f"         {state / 'apportion' / 'stack.env'}",
        "         (the CLI finds the stack from any folder)",
        "stop with: apportion stack down   (or: make down)",
    ]
    assert [len(line) for line in res.stdout.splitlines() if str(tmp_path) not in line] == [23, 50, 49]
