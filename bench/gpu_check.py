#!/usr/bin/env python3
"""The node agent on a real GPU node: one verdict line per check (``make gpu-check``).

Checks, each printed as ``PASS <check>: ...``, ``FAIL <check>: ...`` or ``SKIP <check>: ...``:

* ``inventory``: the agent's probe (:func:`apportion.gpu.open_probe`) finds the GPUs through NVML, each with
  its device file (``/dev/nvidia<minor>``, a character device);
* ``utilisation``: three samples, half a second apart, report health and utilisation for every GPU;
* ``device isolation``: a child placed in a replica cgroup that allows GPU 0 (the agent's own rules:
  :func:`services.node_agent.sandbox.device_rules`) opens ``/dev/nvidia0``, and one allowing only GPU 0 gets
  EPERM on the second GPU's file (on a one-GPU node: one allowing no GPU gets EPERM on ``/dev/nvidia0``);
  needs root; v1 devices controller or a v2 BPF device program, whichever the node has;
* ``idle report``: the agent, on the real probe, runs a replica on GPU 0 that does no GPU work; its heartbeat
  after ``idle_after_s`` calls it idle exactly when NVML reported GPU 0 below 1% in both samples.

Without an NVIDIA driver (no GPU, no pynvml, the driver not loaded) every line is ``SKIP: no NVIDIA GPU`` with
the reason, and the exit status is 0: a machine without GPUs is not a failure. Exit 1 when a check fails.
Run: ``make gpu-check`` or ``.venv/bin/python bench/gpu_check.py``.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from apportion.clock import ManualClock
from apportion.events import Event, NodeHeartbeat, StartWorkload
from apportion.gpu import GpuProbe, Inventory, control_devices, open_probe
from services.node_agent.logic import NodeSpec
from services.node_agent.sandbox import CgroupDriver, Limits, cgroups, child_setup, device_rules
from services.node_agent.service import NodeAgent

CHECKS = ("inventory", "utilisation", "device isolation", "idle report")
IDLE_AFTER_S = 7200.0

#: Opens each path of argv and prints ``<path> ok`` or ``<path> <errno name>``, one line each.
OPENER = (
    "import errno, os, sys\n"
    "for p in sys.argv[1:]:\n"
    "    try:\n"
    "        os.close(os.open(p, os.O_RDWR)); print(p, 'ok')\n"
    "    except OSError as e:\n"
    "        print(p, errno.errorcode.get(e.errno, e.errno))\n"
)


def check_inventory(inv: Inventory) -> tuple[str, str]:
    files = [inv.device_files.get(g.index) for g in inv.gpus]
    bad = [f"GPU {g.index}: {f}" for g, f in zip(inv.gpus, files) if f is None or not _is_char_device(f)]
    what = f"{inv.gpu_count} GPU(s), model {inv.model}, device files {', '.join(str(f) for f in files)}"
    return ("FAIL", f"{what}; not a character device: {'; '.join(bad)}") if bad else ("PASS", what)


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def check_utilisation(probe: GpuProbe) -> tuple[str, str]:
    rows = []
    for i in range(3):
        if i:
            time.sleep(0.5)  # samples spread over a second: NVML averages utilisation over its own window
        rows.append(probe.sample())
    missing = [g.index for row in rows for g in row if not g.healthy or g.utilization_pct is None]
    last = ", ".join(f"GPU {g.index} {g.utilization_pct}% {g.memory_used_mb} MiB" for g in rows[-1])
    if missing:
        return "FAIL", f"unhealthy or no utilisation on GPU(s) {sorted(set(missing))}; last sample {last}"
    return "PASS", f"3 samples; last {last}"


def check_isolation(inv: Inventory) -> tuple[str, str]:
    """GPU 0 opens from a cgroup that allows it; the second GPU's file (with one GPU: GPU 0's, from a cgroup
    allowing no GPU) gets EPERM."""
    files = [inv.device_files[g.index] for g in inv.gpus if g.index in inv.device_files]
    if not files:
        return "FAIL", "the inventory names no device file"
    if os.geteuid() != 0:
        return "SKIP", "not root: cannot create a cgroup (run as root, as the agent runs)"
    driver = cgroups(Path("/sys/fs/cgroup"), f"apportion-gpu-check/{os.getpid()}")
    if driver is None:
        return "FAIL", "no cgroup hierarchy under /sys/fs/cgroup"
    if not driver.filters_devices:
        driver.release()
        return "FAIL", (
            f"cgroup v{driver.version}: the agent cannot filter devices here (no devices controller, or the "
            "kernel refused its BPF program): fence GPUs with the NVIDIA container runtime or systemd DevicePolicy"
        )
    try:
        own = _open_in_cgroup(driver, "gpu0", files[:1], files[0])
        other, allowed = (files[1], files[:1]) if len(files) > 1 else (files[0], [])
        denied = _open_in_cgroup(driver, "other", allowed, other)
    finally:
        driver.release()
    verdict = "PASS" if (own, denied) == ("ok", "EPERM") else "FAIL"
    return verdict, f"allowed GPU 0: {files[0]} {own}; allowed {allowed or 'no GPU'}: {other} {denied}"


def _open_in_cgroup(driver: CgroupDriver, name: str, allowed: list[str], target: str) -> str:
    """``ok`` or the errno name of opening ``target`` from a child in cgroup ``name`` that allows ``allowed``."""
    cg = driver.create(name, Limits(), device_rules(allowed, control_devices()))
    try:
        out = subprocess.run(
            [sys.executable, "-c", OPENER, target],
            preexec_fn=child_setup(cg.procs_files(), None),
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
    finally:
        cg.kill()
        cg.remove()
    return out[1] if len(out) == 2 else f"no answer ({out})"


def check_idle(probe: GpuProbe, inv: Inventory) -> tuple[str, str]:
    return asyncio.run(_idle(probe, inv))


async def _idle(probe: GpuProbe, inv: Inventory) -> tuple[str, str]:
    events: list[Event] = []

    async def emit(ev: Event) -> None:
        events.append(ev)

    t0 = datetime.now(UTC)
    clock = ManualClock(t0)
    node = NodeSpec("gpu-check", inv.gpus, inv.model, False)
    agent = NodeAgent([(node, probe)], emit, clock, idle_after_s=IDLE_AFTER_S)
    await agent.start(heartbeats=False, poll_progress=False)
    start = StartWorkload(ts=t0, node_id="gpu-check", job_id="idle", attempt=1, gpus=(0,), duration_s=1e9)
    await agent.on_event(start.model_copy(update={"fencing_token": 1}))
    utils = []
    for advance in (0.0, IDLE_AFTER_S):
        clock.advance(advance)
        await agent.heartbeat()
        hb = [e for e in events if isinstance(e, NodeHeartbeat)][-1]
        utils.append(next(g.utilization_pct for g in hb.gpus if g.index == 0))
    await agent.shutdown(grace_s=0.0)
    (run,) = hb.running
    expected = all(u is not None and u < 1.0 for u in utils)
    what = f"GPU 0 at {utils[0]}% then {utils[1]}%: after {run.idle_s} s idle={run.idle}"
    return ("PASS" if run.idle == expected else "FAIL"), what + ("" if expected else " (GPU 0 is in use: not idle)")


def main() -> int:
    probe = open_probe(force_simulated=False)
    inv = probe.inventory
    try:
        if inv.simulated:
            why = inv.source.removeprefix("simulated: ")
            print(f"no NVIDIA GPU found on this machine ({why})")
            for name in CHECKS:
                print(f"SKIP: no NVIDIA GPU ({name})")
            return 0
        verdicts = [
            ("inventory", check_inventory(inv)),
            ("utilisation", check_utilisation(probe)),
            ("device isolation", check_isolation(inv)),
            ("idle report", check_idle(probe, inv)),
        ]
    finally:
        probe.close()
    for name, (verdict, what) in verdicts:
        print(f"{verdict} {name}: {what}")
    return 1 if any(v == "FAIL" for _, (v, _) in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
