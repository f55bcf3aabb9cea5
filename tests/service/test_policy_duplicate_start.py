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
        [sys.executable, "-c", "import sys; sys.stdin.read()", "services.policy"], stdin=subprocess.PIPE
    )
    services = tmp_path / "services"
    services.mkdir()
    (services / "policy.pid").write_text(f"{proc.pid}\n")
    launch = {"args": [sys.executable, "-m", "services.policy"], "env": {"APPORTION_TOPIC_PREFIX": ""}}
    (services / "policy.launch.json").write_text(json.dumps(launch))
    try:
        yield {"RUN_DIR": str(tmp_path), "KAFKA_BOOTSTRAP": BOOTSTRAP}, proc
    finally:
        proc.kill()
        proc.wait()


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
