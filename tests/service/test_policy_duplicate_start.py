"""A policy started by hand beside a running stack with the stack's own consumer group and instance id refuses to
start (exit 2, one line saying which ids to give it): its static membership would take the place of the stack's
policy and fence it out of its group (`member_id was not recognized`). A stack policy stopped or killed is no
obstacle (a restart with the same ids is what static membership is for), nor ids of its own or another broker."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.policy import __main__ as policy_main
from services.policy.config import PolicySettings

BOOTSTRAP = "127.0.0.1:19092"


@pytest.fixture
def stack_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, str], subprocess.Popen]]:
    """A stack's run directory whose policy (a process named ``services.policy``) runs with the default ids."""
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)
    monkeypatch.delenv("APPORTION_GROUP_ID", raising=False)
    monkeypatch.delenv("APPORTION_INSTANCE_ID", raising=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()", "services.policy"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    # Popen returns once the child's exec has closed its close-on-exec pipe, which the kernel does before it sets
    # the new program's arguments: /proc/PID/cmdline can still read empty then. A line from the child says the
    # exec is done.
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    services = tmp_path / "services"
    services.mkdir()
    (services / "policy.pid").write_text(f"{proc.pid}\n")
    launch = {"args": [sys.executable, "-m", "services.policy"], "env": {"APPORTION_TOPIC_PREFIX": ""}}
    (services / "policy.launch.json").write_text(json.dumps(launch))
    try:
        yield {"RUN_DIR": str(tmp_path), "KAFKA_BOOTSTRAP": BOOTSTRAP}, proc
    finally:
        proc.kill()
        proc.communicate()  # waits, and closes both pipes


def test_a_second_policy_with_the_stacks_ids_is_refused_saying_which_to_give(stack_policy) -> None:
    env, proc = stack_policy
    assert policy_main.stack_policy_in_the_way(PolicySettings(kafka_bootstrap=BOOTSTRAP), env) == (
        f"the stack of {env['RUN_DIR']} runs its policy (pid {proc.pid}) as instance policy-0 of group policy: a "
        "second one with those ids would take its place and fence it out; give this one its own, e.g. "
        "APPORTION_GROUP_ID=policy-2 python -m services.policy --instance-id policy-2"
    )


def test_ids_of_its_own_another_broker_or_a_stopped_stack_policy_let_it_start(stack_policy) -> None:
    env, proc = stack_policy
    way = policy_main.stack_policy_in_the_way
    assert way(PolicySettings(kafka_bootstrap=BOOTSTRAP, instance_id="policy-2", group_id="policy-2"), env) is None
    assert way(PolicySettings(kafka_bootstrap="127.0.0.1:29092"), env) is None
    proc.kill()
    proc.wait()
    assert way(PolicySettings(kafka_bootstrap=BOOTSTRAP), env) is None  # a restart takes the dead member's place


def test_the_stacks_ids_are_read_from_its_launch_flags_and_environment() -> None:
    assert policy_main._launch_ids(["python", "-m", "services.policy"], {}) == ("policy", "policy-0")
    assert policy_main._launch_ids(
        ["python", "-m", "services.policy", "--instance-id", "p-9"],
        {"APPORTION_TOPIC_PREFIX": "t1.", "APPORTION_GROUP_ID": "pol", "APPORTION_INSTANCE_ID": "p-1"},
    ) == ("t1.pol", "p-9")
    assert policy_main._launch_ids(["--instance-id=p-3"], {"APPORTION_INSTANCE_ID": "p-1"}) == ("policy", "p-3")


def _member(instance: str, client: str, host: str = "/10.0.0.5") -> dict[str, str]:
    return {"member_id": f"{client}-1", "group_instance_id": instance, "client_id": client, "client_host": host}


def test_a_member_the_broker_lists_with_its_ids_is_judged_by_where_it_runs_and_whether_it_lives() -> None:
    """:func:`member_in_the_way` over the broker's description of the group (``alive`` answers for this host)."""
    import os

    from services.policy.service import member_client_id

    def way(*members: dict[str, str], alive: bool = True) -> str | None:
        return policy_main.member_in_the_way(list(members), "policy", "policy-0", "login-1", lambda pid: alive)

    own = "APPORTION_GROUP_ID=policy-2 python -m services.policy --instance-id policy-2"
    assert member_client_id(1234, "login-1") == "policy-1234-on-login-1"
    assert way() is None
    assert way(_member("policy-1", "policy-1234-on-login-9")) is None  # another instance id
    assert way(_member("policy-0", "policy-1234-on-login-1"), alive=False) is None  # stopped here: a restart
    assert way(_member("policy-0", member_client_id(os.getpid(), "login-1"))) is None  # this very process
    assert way(_member("policy-0", "policy-1234-on-login-1")) == (
        "a policy (pid 1234) runs on this machine as instance policy-0 of group policy: a second one with those "
        f"ids would take its place and fence it out; give this one its own, e.g. {own}"
    )
    remote = (
        "instance policy-0 of group policy is a member from 10.0.0.5 (client {}): a second one with those ids "
        "would take its place and fence it out. If that one stopped, its membership lapses 60 s after; else give "
        f"this one its own, e.g. {own}"
    )
    for client in ("policy-1234-on-login-9", "faust-0.11.3", "policy-x-on-login-1"):  # elsewhere, or unknown form
        assert way(_member("policy-0", client), alive=False) == remote.format(client)


def test_a_broker_that_does_not_describe_the_group_leaves_the_start_to_the_service() -> None:
    def no_answer(group: str) -> dict:
        raise ConnectionError(f"no broker answered for {group}")

    def refused(group: str) -> dict:
        return {"error": "GroupAuthorizationFailedError", "members": [_member("policy-0", "faust")]}

    settings = PolicySettings(kafka_bootstrap=BOOTSTRAP)
    assert policy_main.group_member_in_the_way(settings, no_answer) is None
    assert policy_main.group_member_in_the_way(settings, refused) is None
