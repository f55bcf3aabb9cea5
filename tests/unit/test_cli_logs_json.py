"""`apportion logs --json`: the job's output file as JSON, and its refusals as a verdict object (no stack needed)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from apportion.cli.main import app


def run(*args: str):
    return CliRunner().invoke(app, list(args), env={"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1"})


def test_logs_json_gives_the_latest_attempt_and_its_text(tmp_path: Path) -> None:
    job = tmp_path / "j1"
    job.mkdir()
    (job / "attempt-1.replica-0.out").write_text("first\n")
    (job / "attempt-2.replica-0.out").write_text("second\n")
    res = run("logs", "j1", "--dir", str(tmp_path), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {
        "ok": True,
        "job_id": "j1",
        "attempt": 2,
        "attempts": [1, 2],
        "replica": 0,
        "stream": "stdout",
        "path": str(job / "attempt-2.replica-0.out"),
        "text": "second\n",
    }


def test_logs_json_refusals_are_verdict_objects_with_exit_1(tmp_path: Path) -> None:
    (tmp_path / "j1").mkdir()
    (tmp_path / "j1" / "attempt-1.replica-0.out").write_text("x\n")
    res = run("logs", "j1", "--dir", str(tmp_path), "--attempt", "3", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "not_found",
        "reason": "no_attempt",
        "message": "job j1 has no attempt 3 here (attempts: 1)",
        "exit_code": 1,
        "job_id": "j1",
        "attempts": [1],
    }
    res = run("logs", "nobody", "--dir", str(tmp_path), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["verdict"], doc["reason"]) == (False, "not_found", "no_output")
    assert res.stderr.strip() == "error: " + doc["message"]
