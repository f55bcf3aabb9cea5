"""Input the CLI refuses before it asks the stack: one line on stderr naming the place and the rule, exit 2
(here nothing listens: a check that passed would reach Kafka and exit 3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apportion import client
from tests.kit.cli import run, stackless  # noqa: F401 - autouse: no stack answers

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


def test_submit_checkpoint_interval_takes_a_duration_into_the_event() -> None:
    res = run(
        "submit", "-b", "lab/x", "-g", "1", "-m", "2h", "--duration", "3h", "--checkpoint-interval", "10m",
        "--dry-run", "-u", "carol", "--json",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert (doc["checkpoint_interval_s"], doc["min_runtime_s"]) == (600.0, 7200.0)


def test_submit_without_checkpoint_interval_leaves_the_default() -> None:
    res = run("submit", "-b", "lab/x", "-g", "1", "-m", "2h", "--duration", "3h", "--dry-run", "-u", "carol", "--json")
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["checkpoint_interval_s"] is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "invalid submission: --checkpoint-interval: Input should be greater than 0"),
        ("soon", "bad duration 'soon'"),
    ],
)
def test_submit_bad_checkpoint_interval_is_exit_2(value: str, message: str) -> None:
    res = run(
        "submit", "-b", "lab/x", "-g", "1", "-m", "2h", "--duration", "3h", "--checkpoint-interval", value,
        "--dry-run", "-u", "carol",
    )  # fmt: skip
    assert res.exit_code == 2
    assert message in res.stderr
    assert res.stdout == ""


def test_client_builds_a_submission_with_a_checkpoint_interval() -> None:
    ev = client.build_submission(
        budget="lab/x", user="carol", gpus=1, min_runtime="1h", duration=7200, checkpoint_interval_s=600
    )
    assert (ev.checkpoint_interval_s, ev.checkpoint_every_s) == (600.0, 600.0)


@pytest.mark.parametrize("user", ["", "  "])
def test_an_empty_user_is_refused_not_taken_as_the_default(user: str) -> None:
    res = run("submit", "-b", "lab/x", "-g", "1", "-m", "0", "--duration", "1s", "-u", user, "--dry-run")
    assert res.exit_code == 2
    assert res.stderr.strip() == (
        "error: the user name is empty: give a user, or leave --user out to act as your identity's user"
    )
    assert res.stdout == ""
    with pytest.raises(ValueError, match="the user name is empty"):  # cancel and a signed submit ask this
        client.identity_for(user)


def test_budget_set_nan_share_says_not_a_number() -> None:
    res = run("budget", "set", "lab/x", "-s", "nan")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: --share: share of 'lab/x' is not a number (nan): give a fraction in (0, 1]"


def test_budget_set_share_out_of_range_is_refused_before_the_stack_is_asked() -> None:
    res = run("budget", "set", "lab/x", "-s", "1.5")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: --share: share of 'lab/x' must be in (0, 1], got 1.5"


@pytest.mark.parametrize(
    ("r", "shown"),
    [
        (None, "-"),
        (0.5, "0.500"),
        (999999.9994, "999999.999"),
        (1e6, "1e+06"),
        (1.234e299, "1.23e+299"),
        (float("inf"), "inf"),
    ],
)
def test_share_prints_r_in_bounded_width(r: float | None, shown: str) -> None:
    from apportion.cli.common import _ratio

    assert _ratio(r) == shown


def test_submit_help_says_unallocated_work_is_open_to_non_members() -> None:
    res = run("submit", "--help")
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    assert "Unallocated work (-m 0) charges nothing: any user may run it under any leaf budget, member or not." in text


def test_a_bad_submission_is_exit_2_before_the_stack_is_asked() -> None:
    """Without ``--dry-run`` too: the request's own error, not "cannot reach Kafka" (exit 3)."""
    res = run("submit", "-b", "lab/x", "-g", "1", "-m", "banana", "--duration", "1h")
    assert res.exit_code == 2, res.stderr
    assert "bad duration 'banana'" in res.stderr
    assert "Kafka" not in res.stderr


def test_a_submission_without_work_names_the_rule_without_pydantics_wrapper() -> None:
    res = run("submit", "-b", "lab/x", "-g", "1", "-m", "1h", "--dry-run", "-u", "carol")
    assert res.exit_code == 2
    line = res.stderr.strip()
    assert line.startswith("error: invalid submission: ") and "Value error" not in line, line
