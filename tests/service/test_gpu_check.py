"""``make gpu-check`` (``bench/gpu_check.py``): plain SKIP lines and exit 0 without a GPU; its isolation and
idle checks judged on fake GPUs (character devices the test makes, a :class:`FakeGpuProbe`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from apportion.gpu import FakeGpuProbe, SimulatedProbe, simulated_inventory
from tests.kit.node_boundary import job_accounts, shared_dir

__all__ = ["job_accounts", "shared_dir"]  # fixtures used by name

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_a_gpu_every_check_says_skip_and_the_exit_is_0(monkeypatch, capsys):
    gpu_check = _load()
    inv = simulated_inventory(8, reason="NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library Not Found")
    monkeypatch.setattr(gpu_check, "open_probe", lambda force_simulated: SimulatedProbe(inv))
    assert gpu_check.main() == 0
    assert capsys.readouterr().out.splitlines() == [
        "no NVIDIA GPU found on this machine (NVML unavailable: NVMLError_LibraryNotFound: NVML Shared Library "
        "Not Found)",
        "SKIP: no NVIDIA GPU (inventory)",
        "SKIP: no NVIDIA GPU (utilisation)",
        "SKIP: no NVIDIA GPU (device isolation)",
        "SKIP: no NVIDIA GPU (idle report)",
    ]


def test_the_script_runs_here():
    """The command itself, as ``make gpu-check`` runs it: exit 0 on a machine without NVIDIA GPUs, one line
    per check (with GPUs: a verdict per check)."""
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    checks = ("inventory", "utilisation", "device isolation", "idle report")
    if lines[0].startswith("no NVIDIA GPU found"):
        assert lines[1:] == [f"SKIP: no NVIDIA GPU ({c})" for c in checks]
    else:
        assert [line.split(":")[0].split(" ", 1)[1] for line in lines] == list(checks)


@pytest.mark.parametrize("util,idle", [(0.0, "idle=True"), (55.0, "idle=False (GPU 0 is in use: not idle)")])
def test_the_idle_check_agrees_with_the_samples(util, idle):
    gpu_check = _load()
    probe = FakeGpuProbe.with_gpus(2)
    probe.utilization.update({0: util, 1: 0.0})
    verdict, what = gpu_check.check_idle(probe, probe.inventory)
    assert (verdict, what) == ("PASS", f"GPU 0 at {util}% then {util}%: after {7200.0 if util == 0 else 0.0} s {idle}")


def test_the_isolation_check_on_fake_gpus(job_accounts, shared_dir):
    """GPU 0 copies ``/dev/full`` (a device that opens), GPU 1 is ``c 195:1``: the check's replica opens the
    first and gets EPERM on the second; with GPU 1 allowed too it would open it and the check would fail."""
    gpu_check = _load()
    dev = shared_dir / "dev"
    dev.mkdir()
    os.mknod(dev / "gpu0", 0o666 | 0o020000, os.makedev(1, 7))
    os.mknod(dev / "gpu1", 0o666 | 0o020000, os.makedev(195, 1))
    files = [str(dev / "gpu0"), str(dev / "gpu1")]
    inv = simulated_inventory(2, device_files=files)
    assert gpu_check.check_isolation(inv) == (
        "PASS",
        f"allowed GPU 0: {files[0]} ok; allowed {files[:1]}: {files[1]} EPERM",
    )
