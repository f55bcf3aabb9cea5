"""A change command's ``--json`` verdict carries the error contract of docs/operations.md when it fails:
``ok`` false, ``verdict``, ``reason``, ``message`` (the stderr line) and ``exit_code``, besides what was published."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import typer

from apportion import events
from apportion.cli.common import report_verdict
from apportion.cli.jobs import dispatcher_verdict

NOW = datetime(2026, 1, 5, 12, 0, tzinfo=UTC)
HOLD = events.JobHoldRequested(job_id="j-1", user="alice", ts=NOW, producer="cli")


def test_a_refused_request_names_its_message_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    no = events.JobRejected(
        job_id="j-1",
        budget="lab/a",
        user="alice",
        reason=events.RejectReason.INVALID,
        message="is already held",
        ts=NOW,
    )
    with pytest.raises(typer.Exit) as exit_:
        report_verdict(*dispatcher_verdict(HOLD, no, "held", "refused", 15, "request"), as_json=True)
    assert exit_.value.exit_code == 1
    got = json.loads(capsys.readouterr().out)
    assert {k: got[k] for k in ("ok", "verdict", "reason", "message", "exit_code", "job_id")} == {
        "ok": False,
        "verdict": "refused",
        "reason": "invalid",
        "message": "refused: invalid: is already held",
        "exit_code": 1,
        "job_id": "j-1",
    }
    assert got["published"][0]["type"] == "JobHoldRequested" and got["event"]["type"] == "JobRejected"


def test_no_verdict_is_exit_3_with_its_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as exit_:
        report_verdict(*dispatcher_verdict(HOLD, None, "held", "refused", 15, "request"), as_json=True)
    assert exit_.value.exit_code == 3
    captured = capsys.readouterr()
    got = json.loads(captured.out)  # one object: fail() prints no second one
    assert (got["ok"], got["verdict"], got["exit_code"], got["event"]) == (False, "no_verdict", 3, None)
    assert got["message"] == ("no verdict from the dispatcher within 15 s (is it running?); the request is in the log")
    assert captured.err.strip() == f"error: {got['message']}"


def test_a_rejected_submission_is_an_error_line_and_the_same_object(capsys: pytest.CaptureFixture[str]) -> None:
    from apportion import client

    sub = client.build_submission(budget="lab/a", user="bob", gpus=1, min_runtime="1h", duration="1h", job_id="s-1")
    no = events.JobRejected(
        job_id="s-1", budget="lab/a", user="bob", reason=events.RejectReason.NOT_A_MEMBER, message="not in", ts=NOW
    )
    with pytest.raises(typer.Exit):
        report_verdict(*dispatcher_verdict(sub, no, "queued", "rejected", 10, "submission"), as_json=True)
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert (got["ok"], got["verdict"], got["reason"], got["exit_code"]) == (False, "rejected", "not_a_member", 1)
    assert captured.err.strip() == "error: rejected: not_a_member: not in"


def test_a_done_verdict_has_no_error_fields(capsys: pytest.CaptureFixture[str]) -> None:
    held = events.JobHeld(job_id="j-1", by="alice", ts=NOW)
    report_verdict(*dispatcher_verdict(HOLD, held, "held", "refused", 15, "request"), as_json=True)
    got = json.loads(capsys.readouterr().out)
    assert (got["ok"], got["verdict"], got["reason"]) == (True, "held", "")
    assert "message" not in got and "exit_code" not in got
