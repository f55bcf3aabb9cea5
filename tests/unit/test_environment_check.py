"""The check that a test leaves the watched environment as it found it (``tests/conftest.py``,
:mod:`tests.kit.environment`), fed a leak directly and through a real pytest run."""

from __future__ import annotations

import os

import pytest

from tests.kit import environment

BEFORE = {"APPORTION_TOPIC_PREFIX": "dev.", "KAFKA_BOOTSTRAP": "127.0.0.1:9092", "TZ": "UTC"}


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        pytest.param(dict(BEFORE), [], id="nothing changed"),
        pytest.param(
            {**BEFORE, "APPORTION_TOPIC_PREFIX": "bench1."},
            ["APPORTION_TOPIC_PREFIX: 'dev.' -> 'bench1.'"],
            id="a value changed",
        ),
        pytest.param(
            {**BEFORE, "REDIS_URL": "rediss://h:1/0"}, ["REDIS_URL: <unset> -> 'rediss://h:1/0'"], id="one added"
        ),
        pytest.param(
            {"APPORTION_TOPIC_PREFIX": "dev.", "TZ": "UTC"},
            ["KAFKA_BOOTSTRAP: '127.0.0.1:9092' -> <unset>"],
            id="one removed",
        ),
        pytest.param(
            {"TZ": "Europe/Paris", "KAFKA_BOOTSTRAP": "127.0.0.1:9092", "COLUMNS": "80"},
            ["APPORTION_TOPIC_PREFIX: 'dev.' -> <unset>", "COLUMNS: <unset> -> '80'", "TZ: 'UTC' -> 'Europe/Paris'"],
            id="several, sorted by name",
        ),
    ],
)
def test_changes_name_each_difference_as_before_and_after(after: dict[str, str], expected: list[str]) -> None:
    assert environment.changes(BEFORE, after) == expected


def test_only_the_watched_variables_are_compared() -> None:
    env = {**BEFORE, "PATH": "/bin", "APPORTION": "x", "XKAFKA_Y": "1", "COLUMNS": "80", "REDIS_URL": "r"}
    assert environment.watched(env) == {**BEFORE, "COLUMNS": "80", "REDIS_URL": "r"}
    assert environment.leak_message(BEFORE, environment.watched({**BEFORE, "PATH": "/usr/bin", "HOME": "/"})) is None


def test_the_message_starts_as_the_failure_says() -> None:
    message = environment.leak_message(BEFORE, {**BEFORE, "TZ": "Asia/Tokyo"})
    assert message is not None
    assert message.startswith("test left the environment changed: TZ: 'UTC' -> 'Asia/Tokyo'")


def test_restore_puts_back_the_watched_variables_and_leaves_the_rest() -> None:
    env = {"APPORTION_TOPIC_PREFIX": "leak.", "APPORTION_NEW": "1", "TZ": "UTC", "PATH": "/bin", "HOME": "/h"}
    environment.restore(BEFORE, env)
    assert env == {**BEFORE, "PATH": "/bin", "HOME": "/h"}


LEAKY_FILE = """
import os

def test_a_leak():
    os.environ["APPORTION_TOPIC_PREFIX"] = "leak."
    os.environ.pop("TZ", None)

def test_the_next_test_is_not_poisoned():
    assert "APPORTION_TOPIC_PREFIX" not in os.environ
    assert os.environ["TZ"] == "UTC"

def test_monkeypatch_is_undone_before_the_comparison(monkeypatch):
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "mine.")
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "elsewhere:9092")
    monkeypatch.delenv("TZ")
"""


def test_a_pytest_run_fails_the_leaking_test_alone_and_restores_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TZ", "UTC")
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)
    pytester.makeconftest("from tests.conftest import environment_unchanged  # noqa: F401\n")
    pytester.makepyfile(test_leaky=LEAKY_FILE)
    result = pytester.runpytest_inprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:asyncio", "-q")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_a_leak*",
            "test left the environment changed: APPORTION_TOPIC_PREFIX: <unset> -> 'leak.'; TZ: 'UTC' -> <unset> *",
        ]
    )
    assert "APPORTION_TOPIC_PREFIX" not in os.environ
    assert os.environ["TZ"] == "UTC"
