"""Filter options: a value that can match nothing by construction is bad input (exit 2, allowed values named),
checked before the stack is asked (here nothing listens: a check that passes reaches it and exits 3)."""

from __future__ import annotations

import pytest

from tests.kit.cli import run, stackless  # noqa: F401 - autouse: no stack answers


def test_queue_unknown_state_is_exit_2_with_the_allowed_values() -> None:
    res = run("queue", "--state", "bogus")
    assert res.exit_code == 2
    assert "--state: 'bogus'" in res.stderr
    assert "pending, placed, running, stopping, preempting, cancelling, lost, completed, failed" in res.stderr
    assert res.stdout == ""


def test_queue_one_bad_state_among_good_ones_is_named() -> None:
    res = run("queue", "--state", "pending,runing")
    assert (res.exit_code, "'runing'" in res.stderr, "'pending'" in res.stderr) == (2, True, False)


def test_queue_finished_state_without_all_says_add_all() -> None:
    res = run("queue", "--state", "completed")
    assert res.exit_code == 2
    assert "--state completed: finished jobs come from the log: add --all" in res.stderr


def test_queue_good_states_pass_the_check_and_reach_redis() -> None:
    res = run("queue", "--state", "pending,cancelling")
    assert res.exit_code == 3  # past the check: Redis at 127.0.0.1:1 does not answer
    assert "cannot reach Redis" in res.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("queue", "--budget", "lab//x"),
        ("submit", "-b", "lab//x", "-g", "1", "-m", "1h", "--duration", "1h", "--user", "bob", "--dry-run"),
        ("history", "--budget", "/lab"),
        ("audit", "occupancy", "--budget", "lab/"),
    ],
)
def test_malformed_budget_filter_is_exit_2(args: tuple[str, ...]) -> None:
    res = run(*args)
    assert res.exit_code == 2
    assert "--budget: " in res.stderr


def test_deadletter_unknown_topic_is_exit_2_with_the_topics() -> None:
    res = run("deadletter", "--topic", "apportion.jbos")
    assert res.exit_code == 2
    assert "--topic: no topic 'apportion.jbos': use one of " in res.stderr
    assert "apportion.jobs" in res.stderr
