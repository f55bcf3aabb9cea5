"""`apportion budget` on a real broker: one file reader, and `budget set` changes only the fields given.

No policy runs here, so changes are published with `--no-wait` (verdicts: test_cli_truth.py)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cli(kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from typer.testing import CliRunner

    from apportion.bus.provision import provision
    from apportion.cli.main import app

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"cli{uuid.uuid4().hex[:8]}.")
    provision(kafka_bootstrap)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Any:
        res = runner.invoke(app, [*args, "--bootstrap", kafka_bootstrap])
        assert res.exit_code == code, res.output
        return res

    return run


def _show(cli: Any) -> dict[str, dict[str, Any]]:
    return {row["path"]: row for row in json.loads(cli("budget", "show", "--json").stdout)}


def test_budget_set_changes_only_the_fields_given(cli: Any) -> None:
    cli("budget", "apply", str(ROOT / "infra/budgets/example.yaml"), "--no-wait", "--json")
    before = _show(cli)
    # the file's limits survive `budget apply` (the one reader, apportion.budgetfile)
    assert before["lab/vision"]["max_min_runtime_s"] == 8 * 3600.0
    assert before["lab/prior/robotics"]["members"] == ["alice", "bob"]

    cli("budget", "set", "lab/prior/robotics", "--share", "0.4", "--no-wait", "--json")
    cli("budget", "set", "lab/vision", "--members", "carol", "--no-wait", "--json")
    after = _show(cli)
    assert after["lab/prior/robotics"]["share"] == 0.4
    assert after["lab/prior/robotics"]["members"] == ["alice", "bob"]  # kept, not reset to inherit
    assert after["lab/vision"]["max_min_runtime_s"] == 8 * 3600.0  # kept
    assert after["lab/vision"]["members"] == ["carol"]
    assert after["lab/vision"]["share"] == 0.4

    cli("budget", "set", "lab/prior/robotics", "--inherit-members", "--no-wait", "--json")
    assert _show(cli)["lab/prior/robotics"]["members"] is None


def test_budget_set_of_a_new_budget_needs_a_share(cli: Any) -> None:
    res = cli("budget", "set", "lab/nothing", code=2)
    assert "does not exist: give --share" in res.output
