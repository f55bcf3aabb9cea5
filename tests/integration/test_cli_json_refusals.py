"""Refusals with `--json` print a verdict object on stdout too, same exit code (issue 13); a pruning dry run
says what would be refused. Real Kafka and Redis, a fresh namespace, no services: every refusal here is decided
by the CLI before it publishes, from the log (budget tree, jobs) and the read models it finds."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def cli(kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from typer.testing import CliRunner

    from apportion.bus.provision import provision
    from apportion.cli.main import app

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"refuse{uuid.uuid4().hex[:8]}.")
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("APPORTION_REDIS_URL", redis_url)
    provision(kafka_bootstrap)
    runner = CliRunner()

    def run(*args: str, code: int = 0) -> Any:
        res = runner.invoke(app, list(args), env={"COLUMNS": "300"})
        assert res.exit_code == code, res.output
        return res

    run("budget", "set", "lab", "--share", "1", "--no-wait")
    run("budget", "set", "lab/a", "--share", "0.6", "--no-wait")
    run("budget", "set", "lab/b", "--share", "0.4", "--no-wait")
    return run


def _verdict(res: Any) -> dict[str, Any]:
    doc = json.loads(res.stdout)
    [line] = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line == "error: " + doc["message"]  # the same refusal on both streams
    return doc


def test_budget_refusals_are_json_verdicts(cli: Any, tmp_path: Path) -> None:
    doc = _verdict(cli("budget", "set", "lab/b", "--share", "0.7", "--json", code=1))
    assert doc == {
        "ok": False,
        "verdict": "refused",
        "reason": "over_allocated",
        "message": "refused: over_allocated: shares under 'lab' would sum to 1.3 > 1",
        "exit_code": 1,
        "path": "lab/b",
    }
    doc = _verdict(cli("budget", "set", "lab/c", "--json", code=2))
    assert (doc["ok"], doc["verdict"], doc["reason"], doc["path"]) == (False, "not_found", "no_budget", "lab/c")
    doc = _verdict(cli("budget", "rm", "lab/nothing", "--json", code=1))
    assert (doc["verdict"], doc["reason"], doc["message"]) == (
        "refused",
        "unknown_budget",
        "refused: unknown_budget: no budget 'lab/nothing'",
    )
    over = tmp_path / "over.yaml"
    over.write_text("budgets:\n  lab/a: {share: 0.7}\n")
    doc = _verdict(cli("budget", "apply", str(over), "--json", code=1))
    assert (doc["ok"], doc["verdict"], doc["reason"], doc["file"]) == (False, "refused", "over_allocated", str(over))


def test_node_and_cancel_refusals_are_json_verdicts(cli: Any) -> None:
    for cmd in ("drain", "cordon", "undrain"):
        doc = _verdict(cli(cmd, "nosuch", "--json", code=1))
        assert doc == {
            "ok": False,
            "verdict": "not_found",
            "reason": "no_node",
            "message": "no node nosuch (none known)",
            "exit_code": 1,
            "node_id": "nosuch",
        }
    doc = _verdict(cli("cancel", "no-such-job", "--json", code=1))
    assert doc == {
        "ok": False,
        "verdict": "not_found",
        "reason": "no_job",
        "message": "no job no-such-job in the log",
        "exit_code": 1,
        "job_id": "no-such-job",
    }


def test_prune_dry_run_reports_that_a_budget_in_use_would_be_refused(cli: Any, redis_url: str, tmp_path: Path) -> None:
    import redis

    from apportion import readmodel

    whole = tmp_path / "whole.yaml"
    whole.write_text("budgets:\n  lab: {share: 1}\n  lab/a: {share: 0.6}\n")
    # without a job in lab/b, the dry run shows the pruning and exits 0
    res = cli("budget", "apply", str(whole), "--prune", "--dry-run")
    assert res.stdout.splitlines() == [
        "  - lab/b: in force, not in the file (removed: --prune)",
        "1 budget change(s) (dry run: nothing published)",
    ]
    # a pending job of lab/b in the dispatcher's jobs read model: the real apply would be refused (in_use)
    from apportion.bus.security import redis_auth

    r = redis.Redis.from_url(redis_url, **redis_auth())
    r.hset(readmodel.jobs_key(), "jb", json.dumps({"job_id": "jb", "budget": "lab/b", "state": "pending"}))
    res = cli("budget", "apply", str(whole), "--prune", "--dry-run", code=1)
    assert res.stdout.splitlines() == ["  - lab/b: in force, not in the file (removed: --prune)"]
    [line] = res.stderr.strip().splitlines()
    assert line == (
        f"error: refused: {whole} against the tree in force: lab/b: in_use: 'lab/b' has queued or running jobs "
        "(dry run: nothing published)"
    )
    doc = _verdict(cli("budget", "apply", str(whole), "--prune", "--dry-run", "--json", code=1))
    assert (doc["ok"], doc["reason"], doc["published"]) == (False, "in_use", [])
    assert [c["path"] for c in doc["diff"]] == ["lab/b"]
    r.delete(readmodel.jobs_key())
