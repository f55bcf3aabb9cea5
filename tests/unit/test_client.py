"""Client-side submission checks (no Kafka): job ids, and the CLI's clear error for a bad one."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from apportion.cli.main import app
from apportion.client import InvalidSubmission, build_submission, check_job_id


@pytest.mark.parametrize("job_id", ["alice-0123abcd", "application_1506638472019_10238", "exp.v2:seed@3+a", "x" * 200])
def test_accepted_job_ids(job_id: str) -> None:
    assert check_job_id(job_id) == job_id
    assert build_submission(budget="lab/a", user="alice", gpus=1, duration=60, job_id=job_id).job_id == job_id


@pytest.mark.parametrize(
    "job_id, why",
    [
        ("my job", "characters ' ' are not allowed"),
        ("a/b\\c", "characters '/\\\\' are not allowed"),
        ("", "it is empty"),
        ("-x", "it must start with a letter or digit"),
        ("x" * 201, "it is longer than 200 characters"),
    ],
)
def test_rejected_job_ids_say_why(job_id: str, why: str) -> None:
    with pytest.raises(ValueError) as exc:
        check_job_id(job_id)
    assert str(exc.value) == f"invalid job id {job_id!r}: {why} (use letters, digits and . _ : @ + -)"


def test_cli_submit_refuses_a_bad_job_id_before_publishing() -> None:
    res = CliRunner().invoke(
        app,
        [
            "submit",
            "-b",
            "lab/a",
            "-g",
            "1",
            "-m",
            "1h",
            "--duration",
            "60",
            "--user",
            "alice",
            "--job-id",
            "my job",
            "--dry-run",
        ],
    )
    assert res.exit_code == 2  # usage errors exit 2 (cli.main.fail)
    assert "error: invalid job id 'my job': characters ' ' are not allowed" in " ".join(res.output.split())


def test_generated_job_id_passes_the_check() -> None:
    ev = build_submission(budget="lab/a", user="alice", gpus=1, duration=60)
    assert check_job_id(ev.job_id) == ev.job_id and ev.job_id.startswith("alice-") and len(ev.job_id) == 18


@pytest.mark.parametrize("command", ["python train.py", b"python train.py"])
def test_a_command_given_as_one_string_is_refused_not_split_into_characters(command: str | bytes) -> None:
    # tuple("python train.py") is ("p", "y", ...): the job would run "p" with one argument per character
    with pytest.raises(InvalidSubmission) as err:
        build_submission(budget="lab/v", user="alice", gpus=1, min_runtime="1h", command=command)  # type: ignore[arg-type]
    assert err.value.field == "command"
    assert "list of arguments" in err.value.message
