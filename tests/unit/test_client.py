"""Client-side submission checks (no Kafka): job ids, and the CLI's clear error for a bad one."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from apportion import client, events
from apportion.cli.main import app
from apportion.client import InvalidSubmission, build_submission, check_job_id

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 5, tzinfo=UTC)


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


def _docstring_example() -> str:
    """The indented block after ``Example::`` in the module's docstring, dedented."""
    lines = (client.__doc__ or "").split("Example::", 1)[1].splitlines()[1:]
    block = []
    for line in lines:
        if line and not line.startswith("    "):
            break
        block.append(line.removeprefix("    "))
    return "\n".join(block).strip() + "\n"


def test_the_modules_example_is_queued_for_a_newcomer_on_the_example_tree() -> None:
    """The example of the module's docstring, run as written by a user the example tree names nowhere (a newcomer
    after `budget apply infra/budgets/example.yaml`), is admitted: its budget takes anyone."""
    from apportion.budgetfile import load_budget_tree
    from apportion.domain.admission import admit

    calls: list[dict] = []

    def submit(**kw: object) -> SimpleNamespace:
        calls.append(kw)
        return SimpleNamespace(job_id="j")

    example = _docstring_example()
    assert example.startswith("from apportion import client\n") and "client.submit(" in example
    example = example.removeprefix("from apportion import client\n")  # the client below records the call
    fake = SimpleNamespace(submit=submit, events=events)
    exec(compile(example, "client-example", "exec"), {"client": fake, "print": lambda *a: None})
    (kw,) = calls
    kw.pop("wait")
    kw["time_limit_s"] = client._time_limit_s(kw.pop("time_limit"), None)
    job = client.build_submission(user="newcomer", now=T0, **kw)
    tree = load_budget_tree(ROOT / "infra/budgets/example.yaml")
    assert admit(tree, job, node_shapes=()) is None
