"""The campaign's teardown (``bench/chaos.py``): nothing of a service is left running, every step runs.

A service runs in a process group of its own; ``Stack.stop`` signals the group, so what a service started
goes with it. ``teardown`` runs every step (services, producer, broker, Redis) even when one raises. No
Kafka here: seconds.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_stop_ends_each_service_with_what_it_started(chaos: ModuleType, tmp_path: Path) -> None:
    stack = chaos.Stack(tmp_path, {}, 0, 0)
    pidfile = tmp_path / "child.pid"
    # a "service" that starts a child of its own and ignores nothing: the child must go too
    p = subprocess.Popen(
        ["bash", "-c", f"sleep 300 & echo $! > {pidfile}; wait"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    stack.procs["svc"] = p
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)  # polling for the child's pid file, bounded by the deadline
    child = int(pidfile.read_text())
    assert running(child)
    stack.stop()
    assert p.poll() is not None
    deadline = time.monotonic() + 30
    while running(child):
        assert time.monotonic() < deadline, f"the service's child {child} outlived the teardown"
        time.sleep(0.05)  # polling the process table for the child's exit, bounded by the deadline


def test_teardown_runs_every_step_and_raises_the_first_error(chaos: ModuleType) -> None:
    ran: list[str] = []

    def fail(name: str) -> None:
        ran.append(name)
        raise RuntimeError(name)

    with pytest.raises(RuntimeError, match="producer"):
        chaos.teardown(
            lambda: ran.append("services"), lambda: fail("producer"), lambda: fail("broker"), lambda: ran.append("rm")
        )
    assert ran == ["services", "producer", "broker", "rm"]
