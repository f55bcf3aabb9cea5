"""``python -m services.policy``: owns the budget tree, publishes FairShareRanking.

Examples::

    python -m services.policy
    python -m services.policy --metrics-port 9103
    python -m services.policy --faust-dir /var/lib/apportion

Every flag has an ``APPORTION_<NAME>`` environment variable; flags win.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from apportion.bus.principal import start_as
from apportion.bus.service import add_common_flags, flag_overrides, serve
from apportion.settings import stack_env, topic_prefix
from services.policy.config import PolicySettings
from services.policy.service import SESSION_S, pid_on

log = logging.getLogger("apportion.policy")

#: The exit status of a policy that would take the place of the running stack's own (bad input: its ids).
DUPLICATE_EXIT = 2

#: How to give a second policy ids of its own (the refusals' example).
OWN_IDS = "APPORTION_GROUP_ID=policy-2 python -m services.policy --instance-id policy-2"


def _launch_ids(args: Sequence[str], env: Mapping[str, str]) -> tuple[str, str]:
    """The consumer group and instance id of a policy started with ``args`` and ``env`` (flags win)."""
    fields = PolicySettings.model_fields
    group = env.get("APPORTION_TOPIC_PREFIX", "") + env.get("APPORTION_GROUP_ID", fields["group_id"].default)
    instance = env.get("APPORTION_INSTANCE_ID", fields["instance_id"].default)
    for i, arg in enumerate(args):
        if arg == "--instance-id" and i + 1 < len(args):
            instance = args[i + 1]
        elif arg.startswith("--instance-id="):
            instance = arg.split("=", 1)[1]
    return group, instance


def stack_policy_in_the_way(settings: PolicySettings, env: Mapping[str, str] | None = None) -> str | None:
    """Why this policy may not start, or ``None``: the local stack in force (``env``, default its ``stack.env``)
    on the same broker runs its policy, alive (``RUN_DIR/services/policy.pid``, a process of
    ``services.policy``) and not this process, with the same consumer group and instance id. Its membership is
    static (``group.instance.id``): a second member with its id takes its place and fences it out of the group
    (``member_id was not recognized`` in its log). A policy stopped or killed is no obstacle: a restart with the
    same ids is what static membership is for. Another broker, a policy of another stack, or ids of its own: none.
    """
    env = stack_env() if env is None else env
    run_dir = env.get("RUN_DIR")
    if not run_dir or env.get("KAFKA_BOOTSTRAP") != settings.connection().bootstrap:
        return None
    services = Path(run_dir) / "services"
    try:
        pid = int((services / "policy.pid").read_text())
        launch = json.loads((services / "policy.launch.json").read_text())
    except (OSError, ValueError):
        return None
    if pid == os.getpid() or not _runs_policy(pid):
        return None
    group, instance = _launch_ids(launch.get("args", []), launch.get("env", {}))
    if (group, instance) != (topic_prefix() + settings.group_id, settings.instance_id):
        return None
    return (
        f"the stack of {run_dir} runs its policy (pid {pid}) as instance {instance} of group {group}: a second "
        f"one with those ids would take its place and fence it out; give this one its own, e.g. {OWN_IDS}"
    )


def _runs_policy(pid: int) -> bool:
    """Is ``pid`` a live process of ``services.policy`` on this machine?"""
    try:
        return b"services.policy" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def member_in_the_way(
    members: Sequence[Mapping[str, Any]], group: str, instance: str, host: str, alive: Callable[[int], bool]
) -> str | None:
    """Why a policy with ``instance`` may not join ``group`` whose ``members`` the broker described, or ``None``.

    A member with the same instance id, of a process on this ``host`` (its :func:`member_client_id`) that is
    ``alive`` and not this one: it runs, and would be fenced out. Of a process that ended, none: a static
    member stays in the group until its session times out, and a restart with its ids is what static
    membership is for. From another machine (or another form of client id): whether it still runs cannot be
    told from the broker (a stopped static member is listed until its session ends), so it is refused, saying
    when a stopped one lapses.
    """
    for m in members:
        if m.get("group_instance_id") != instance:
            continue
        client, where = str(m.get("client_id", "")), str(m.get("client_host", "")).lstrip("/")
        pid = pid_on(client, host)
        if pid is not None:
            if pid == os.getpid() or not alive(pid):
                return None
            return (
                f"a policy (pid {pid}) runs on this machine as instance {instance} of group {group}: a second one "
                f"with those ids would take its place and fence it out; give this one its own, e.g. {OWN_IDS}"
            )
        return (
            f"instance {instance} of group {group} is a member from {where or 'another machine'} (client "
            f"{client}): a second one with those ids would take its place and fence it out. If that one "
            f"stopped, its membership lapses {SESSION_S:g} s after; else give this one its own, e.g. {OWN_IDS}"
        )
    return None


def group_member_in_the_way(settings: PolicySettings, describe: Callable[[str], Any] | None = None) -> str | None:
    """:func:`member_in_the_way` for the group the broker of ``settings`` describes now (a policy on any
    machine). A broker that does not answer within a few seconds: ``None`` (logged; the service then waits
    for it as on any start, and cannot join the group before it answers either)."""
    group = topic_prefix() + settings.group_id
    try:
        described = (describe or _describe(settings.connection().bootstrap))(group)
    except Exception as exc:  # noqa: BLE001 - no answer: nothing is known against the start
        log.warning("could not ask the broker who is in group %s (%s): starting", group, exc)
        return None
    if described.get("error") is not None:
        log.warning("the broker did not describe group %s (%s): starting", group, described["error"])
        return None
    return member_in_the_way(
        described.get("members") or [], group, settings.instance_id, socket.gethostname(), _runs_policy
    )


def _describe(bootstrap: str) -> Callable[[str], Any]:
    def describe(group: str) -> Any:
        from apportion.bus.clients import kafka_admin
        from apportion.bus.security import kafka_auth

        admin = kafka_admin(
            bootstrap_servers=bootstrap, bootstrap_timeout_ms=5000, request_timeout_ms=5000, **kafka_auth()
        )
        try:
            return admin.describe_groups([group])[group]
        finally:
            admin.close()

    return describe


def parse_args(argv: list[str] | None = None) -> dict:
    """Command-line flags -> settings overrides (only the flags given)."""
    ap = argparse.ArgumentParser(
        prog="python -m services.policy",
        description="apportion policy: validates budget changes (BudgetRejected) "
        "and publishes FairShareRanking on snapshot or budget changes.",
    )
    ap.add_argument("--instance-id", help="static group member id; one per running instance")
    ap.add_argument("--faust-dir", help="parent folder of the per-instance faust data dir (default: system temp)")
    ap.add_argument("--window-s", type=float, help="window W in seconds: older budget events are not folded")
    add_common_flags(ap, PolicySettings)
    return flag_overrides(ap, argv)


def main(argv: list[str] | None = None) -> None:
    """Entry point: settings from flags and environment, then run until SIGTERM."""
    from services.policy.app import run

    args = parse_args(argv)
    start_as("policy")  # its own Kafka principal, or exit 2 saying which to set
    settings = PolicySettings(**args)
    if (why := stack_policy_in_the_way(settings) or group_member_in_the_way(settings)) is not None:
        print(f"error: {why}", file=sys.stderr)
        raise SystemExit(DUPLICATE_EXIT)
    serve("policy", settings, run)


if __name__ == "__main__":
    main()
