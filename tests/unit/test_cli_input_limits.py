"""Input the CLI refuses before it asks the stack: one line on stderr naming the place and the rule, exit 2
(here nothing listens: a check that passed would reach Kafka and exit 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.cli.main import app


@pytest.fixture(autouse=True)
def _no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


NEG = "budgets:\n  lab: 1.0\n  lab/prior: 0.6\n  lab/prior/language: -0.5\n"


@pytest.mark.parametrize("cmd", [("budget", "apply"), ("whatif", "--budgets")])
def test_negative_share_in_a_budget_file_is_one_line_exit_2_in_apply_and_whatif(
    tmp_path: Path, cmd: tuple[str, ...]
) -> None:
    f = tmp_path / "neg.yaml"
    f.write_text(NEG)
    res = run(*cmd, str(f))
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        f"error: {f}: budgets.lab/prior/language: bad_share: share of 'lab/prior/language' must be in (0, 1], got -0.5"
    )
    assert res.stdout == ""
