"""Every command's errors under ``--json``: one object on stdout besides the stderr line, whatever the exit code
(``docs/operations.md``, exit codes); a change the broker's ACLs refuse is a refusal (exit 1), not an unreachable
stack (exit 3). Nothing listens at the addresses below: a command that gets past its checks exits 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from kafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from apportion.cli import common
from tests.kit.cli import run, stackless  # noqa: F401 - autouse: no stack answers

BAD_SEGMENT = "--budget: bad segment '' in 'lab//x': use 1-64 of [A-Za-z0-9_.-], not starting with . - or _"


def test_bad_input_under_json_is_an_object_on_stdout_and_the_line_on_stderr() -> None:
    res = run("queue", "--budget", "lab//x", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "bad_input",
        "reason": "",
        "message": BAD_SEGMENT,
        "exit_code": 2,
    }
    assert res.stderr == f"error: {BAD_SEGMENT}\n"


def test_without_json_stdout_stays_empty_even_after_a_json_command() -> None:
    run("queue", "--budget", "lab//x", "--json")
    res = run("queue", "--budget", "lab//x")
    assert (res.exit_code, res.stdout, res.stderr) == (2, "", f"error: {BAD_SEGMENT}\n")


@pytest.mark.parametrize(
    ("args", "starts"),
    [
        (("queue", "--json"), "cannot reach Redis at redis://127.0.0.1:1/0: "),
        (("share", "--json"), "cannot reach Redis at redis://127.0.0.1:1/0: "),
    ],
    ids=["queue", "share"],
)
def test_unreachable_stack_under_json_is_an_object_with_exit_3(args: tuple[str, ...], starts: str) -> None:
    res = run(*args)
    assert res.exit_code == 3
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["verdict"], doc["exit_code"]) == (False, "unreachable", 3)
    assert doc["message"].startswith(starts)
    assert res.stderr.startswith(f"error: {starts}")


def _publish_raising(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    from apportion import client

    def publish(*_evts: object, bootstrap: str | None = None) -> list[int]:
        raise exc

    monkeypatch.setattr(client, "publish", publish)


def test_a_publish_the_acls_refuse_exits_1_naming_the_principal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_USER", "alice")
    _publish_raising(monkeypatch, TopicAuthorizationFailedError({"apportion.budgets"}))
    with pytest.raises(typer.Exit) as got:
        common._publish([], None)
    assert got.value.exit_code == 1
    assert capsys.readouterr().err == (
        "error: refused: not authorized: the broker's ACLs do not let alice publish to apportion.budgets "
        "(TopicAuthorizationFailedError); see docs/security.md for who may do what\n"
    )


def test_a_refusal_without_a_kafka_user_names_the_anonymous_principal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from apportion import settings

    monkeypatch.delenv("APPORTION_KAFKA_USER", raising=False)
    monkeypatch.setattr(settings, "stack_env", lambda: {})  # no stack.env names one either
    _publish_raising(monkeypatch, TopicAuthorizationFailedError({"apportion.budgets"}))
    with pytest.raises(typer.Exit):
        common._publish([], None)
    assert (
        "the broker's ACLs do not let the anonymous principal publish to apportion.budgets (" in capsys.readouterr().err
    )


def test_an_acl_refusal_under_json_says_not_authorized(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_USER", "bob")
    _publish_raising(monkeypatch, TopicAuthorizationFailedError({"apportion.nodes"}))
    common.json_errors(True)
    try:
        with pytest.raises(typer.Exit):
            common._publish([], None)
    finally:
        common.json_errors(False)
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["verdict"], doc["reason"], doc["exit_code"]) == (False, "refused", "not_authorized", 1)
    assert "do not let bob publish to apportion.nodes (" in doc["message"]
    assert doc["topics"] == ["apportion.nodes"]


def test_any_other_kafka_error_on_publish_is_unreachable_exit_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_raising(monkeypatch, KafkaTimeoutError("no metadata"))
    with pytest.raises(typer.Exit) as got:
        common._publish([], None)
    assert got.value.exit_code == 3
    assert capsys.readouterr().err.startswith("error: cannot publish to Kafka at 127.0.0.1:1: ")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("budget", "set", "x", "--share", "abc"),
            "Invalid value for '--share' / '-s': Input should be a valid number, unable to parse string as a number; "
            "see `apportion budget set --help`",
        ),
        (
            ("submit", "-g", "0", "-b", "lab", "--", "echo"),
            "Invalid value for '--gpus' / '-g': Input should be greater than or equal to 1; "
            "see `apportion submit --help`",
        ),
        (("queue", "--bogus"), "No such option: --bogus (Possible options: --user); see `apportion queue --help`"),
        (("nosuch",), "No such command 'nosuch'; see `apportion --help`"),
        (("budget", "set"), "Missing argument 'path'; see `apportion budget set --help`"),
    ],
    ids=["bad-float", "out-of-range", "unknown-option", "unknown-command", "missing-argument"],
)
def test_a_usage_error_is_one_error_line_exit_2(args: tuple[str, ...], message: str) -> None:
    res = run(*args)
    assert (res.exit_code, res.stdout, res.stderr) == (2, "", f"error: {message}\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (  # the eager --json is processed before the bad value
            ("submit", "-g", "0", "-b", "lab", "--json", "--", "echo"),
            "Invalid value for '--gpus' / '-g': Input should be greater than or equal to 1; "
            "see `apportion submit --help`",
        ),
        (  # the parser stops at --bogus: --json is never processed
            ("queue", "--bogus", "--json"),
            "No such option: --bogus (Possible options: --user); see `apportion queue --help`",
        ),
    ],
    ids=["bad-value", "unknown-option"],
)
def test_a_usage_error_under_json_is_the_bad_input_object(args: tuple[str, ...], message: str) -> None:
    res = run(*args)
    assert res.exit_code == 2
    assert res.stderr == f"error: {message}\n"
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "bad_input",
        "reason": "",
        "message": message,
        "exit_code": 2,
    }


def test_json_after_the_dashes_is_the_workload_s_argument_not_the_option() -> None:
    res = run("submit", "-g", "0", "-b", "lab", "--", "echo", "--json")
    assert (res.exit_code, res.stdout) == (2, "")


def test_a_group_given_no_command_still_prints_its_help() -> None:
    res = run("budget")
    assert res.exit_code == 2
    assert "Usage: apportion budget [OPTIONS] COMMAND [ARGS]..." in res.stdout + res.stderr
    assert "error:" not in res.stderr


def _topics(monkeypatch: pytest.MonkeyPatch, error_code: int, *listed: str) -> None:
    """A broker that lists only the topics ``listed`` (3 partitions each) and answers ``error_code`` for any
    other asked about alone."""
    monkeypatch.setattr(common, "partitions_of", lambda _bootstrap, topic: 3 if topic in listed else 0)
    monkeypatch.setattr(common, "topic_error", lambda _bootstrap, topic: 0 if topic in listed else error_code)


def test_a_topic_the_acls_hide_is_not_authorized_exit_1_not_unprovisioned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_USER", "researcher")
    _topics(monkeypatch, TopicAuthorizationFailedError.errno, "apportion.submissions")  # the namespace is there
    res = run("deadletter")
    assert (res.exit_code, res.stdout) == (1, "")
    assert res.stderr == (
        "error: refused: not authorized: the broker's ACLs do not let researcher read from apportion.deadletter "
        "(TopicAuthorizationFailedError); see docs/security.md for who may do what\n"
    )
    doc = json.loads(run("deadletter", "--json").stdout)
    assert (doc["verdict"], doc["reason"], doc["exit_code"]) == ("refused", "not_authorized", 1)


@pytest.mark.parametrize(
    "error_code",
    [3, TopicAuthorizationFailedError.errno],  # UNKNOWN_TOPIC_OR_PARTITION; a namespace with no ACLs at all
    ids=["unknown", "namespace-without-acls"],
)
def test_a_topic_of_a_namespace_not_there_is_still_an_unprovisioned_namespace_exit_3(
    monkeypatch: pytest.MonkeyPatch, error_code: int
) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_USER", "researcher")
    _topics(monkeypatch, error_code)
    res = run("deadletter")
    assert (res.exit_code, res.stdout) == (3, "")
    assert res.stderr == (
        "error: topic apportion.deadletter does not exist at 127.0.0.1:1: the default namespace is not provisioned "
        "(`python -m apportion.bus.provision --bootstrap 127.0.0.1:1`, or `apportion stack up`)\n"
    )


def test_a_verdict_already_printed_is_the_only_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    # cancel/hold/release print the dispatcher's verdict object, then exit 1 through fail(): stdout must stay one
    # JSON document (the verdict), not the verdict followed by fail()'s error object
    common.json_errors(True)
    try:
        common._print_json({"ok": False, "verdict": "refused", "reason": "not_owner"})
        with pytest.raises(typer.Exit) as exc:
            common.fail("refused: not_owner: job 'ow1' belongs to 'own1'", 1)
    finally:
        common.json_errors(False)
    assert exc.value.exit_code == 1
    assert json.loads(capsys.readouterr().out) == {"ok": False, "verdict": "refused", "reason": "not_owner"}
    # the next command starts afresh: its own failure prints its error object
    common.json_errors(True)
    try:
        with pytest.raises(typer.Exit):
            common.fail("bad", 2)
    finally:
        common.json_errors(False)
    assert json.loads(capsys.readouterr().out)["verdict"] == "bad_input"


def test_a_refusal_names_the_callers_topic_when_the_error_carries_none() -> None:
    assert common.refused_topics(TopicAuthorizationFailedError(), ["apportion.budgets"]) == ["apportion.budgets"]
    assert common.refused_topics(TopicAuthorizationFailedError({"b.t", "a.t"}), ["c.t"]) == ["a.t", "b.t"]
    assert common.refused_topics(TopicAuthorizationFailedError("apportion.keys")) == ["apportion.keys"]
    assert common.refused_topics(TopicAuthorizationFailedError()) == []


@pytest.mark.parametrize(
    ("budget", "segment"),
    [("lab/[/x]", "["), ("lab/[red]x", "[red]x"), ("lab/[bold]x[/bold]", "[bold]x[")],
    ids=["closing-tag", "opening-tag", "both"],
)
def test_an_error_line_shows_the_input_as_given_never_as_markup(budget: str, segment: str) -> None:
    # The value is part of the message: rich's markup once crashed on a closing tag (a traceback, exit 1)
    # and dropped an opening one (the error named another path than the one given).
    res = run("queue", "--budget", budget)
    message = f"--budget: bad segment '{segment}' in '{budget}': use 1-64 of [A-Za-z0-9_.-], not starting with . - or _"
    assert (res.exit_code, res.stdout, res.stderr) == (2, "", f"error: {message}\n")


def test_keys_init_shows_a_user_and_a_path_with_brackets_as_given(tmp_path: Path) -> None:
    # It wrote the key file, then crashed on the name's "[/y]" as rich markup before printing the public key;
    # run again it refused to overwrite the file, so the key was never shown.
    from apportion.identity.keys import Identity

    path = tmp_path / "[red]" / "id.json"
    path.parent.mkdir()
    res = run("keys", "init", "-u", "x[/y]", "--file", str(path))
    assert res.exit_code == 0, res.output
    key = Identity.load(path).public_key
    assert res.stdout.splitlines() == [
        f"identity of x[/y] (user) written to {path}",
        "give ops this public key to register (`apportion keys register x[/y] PUBKEY`):",
        key,
    ]


def _log_read_raising(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    from apportion.audit import source

    def load_log(**_kw: object) -> list[object]:
        raise exc

    monkeypatch.setattr(source, "load_log", load_log)


@pytest.mark.parametrize(
    "args", [("forecast",), ("audit", "verify"), ("share", "--forecast", "7d")], ids=["forecast", "verify", "share"]
)
def test_a_log_read_the_acls_refuse_exits_1_not_authorized_not_3(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    """docs/operations.md: a read of a topic the ACLs do not let the principal read is refused, exit 1, reason
    ``not_authorized``; only a broker that does not answer is exit 3."""
    monkeypatch.setenv("APPORTION_KAFKA_USER", "researcher")
    _log_read_raising(monkeypatch, TopicAuthorizationFailedError({"apportion.deadletter"}))
    res = run(*args, "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert (doc["verdict"], doc["reason"], doc["exit_code"]) == ("refused", "not_authorized", 1)
    assert res.stderr == (
        "error: refused: not authorized: the broker's ACLs do not let researcher read from apportion.deadletter "
        "(TopicAuthorizationFailedError); see docs/security.md for who may do what\n"
    )


@pytest.mark.parametrize("args", [("forecast",), ("audit", "verify")], ids=["forecast", "verify"])
def test_a_log_read_from_no_broker_exits_3_saying_how_to_start_the_stack(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    _log_read_raising(monkeypatch, KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:1"))
    res = run(*args)
    assert res.exit_code == 3
    assert res.stderr == (
        "error: cannot read from Kafka at 127.0.0.1:1: KafkaTimeoutError: Unable to bootstrap from 127.0.0.1:1 "
        "(is the stack up? `apportion stack up`)\n"
    )


@pytest.mark.parametrize("option", ["--by-user", "--all", "-u"])
def test_share_asked_for_users_by_another_spelling_names_share_users_not_the_nearest_spelling(option: str) -> None:
    """``sshare -a`` is ``apportion share --users`` (``-a``); click's nearest spelling of ``--by-user`` was another."""
    res = run("share", option)
    assert res.exit_code == 2
    assert res.stderr == (
        f"error: No such option: {option}; each budget's users are `apportion share --users` (like sshare -a), one "
        "user's usage `apportion usage --user U`; see `apportion share --help`\n"
    )
