"""What the node-boundary tests share: throwaway Unix accounts, a directory job accounts can reach, fake GPUs.

Import the fixtures into a test module (``from tests.node_boundary import job_accounts, shared_dir  # noqa``).
The accounts are made with ``useradd --system --no-create-home`` when missing and kept (they cost nothing and
the next run reuses them); the tests need root, and say so plainly when they do not have it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

#: The test accounts: user name on the bus -> Unix account (the same name).
ALICE, EVE = "apportion-t-alice", "apportion-t-eve"

#: NVIDIA's character-device major: fake GPU ``i`` is ``c 195:i``, as ``/dev/nvidia<i>`` is on a real node.
#: Without an NVIDIA driver an open the cgroup lets through fails ENXIO (no driver), one it refuses EPERM.
NVIDIA_MAJOR = 195

#: A job that reports what it can do from inside its sandbox: ``report.json`` in its working directory with its
#: uid, gid, groups and environment, the errno (or ``ok``) of opening each path of ``PROBE_OPEN``
#: (``:``-separated) and of listing each directory of ``PROBE_LIST``, and of ``kill(PROBE_PID, 0)`` (the same
#: permission check as any signal, without the harm of one that is let through).
PROBE = r"""
import errno, json, os, sys

def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def open_close(path):
    os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))

split = lambda name: [p for p in os.environ.get(name, "").split(":") if p]
report = {
    "uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
    "env": dict(os.environ),
    "open": {p: outcome(lambda p=p: open_close(p)) for p in split("PROBE_OPEN")},
    "list": {p: outcome(lambda p=p: os.listdir(p)) for p in split("PROBE_LIST")},
    "kill": outcome(lambda: os.kill(int(os.environ["PROBE_PID"]), 0)) if "PROBE_PID" in os.environ else None,
}
with open("report.json.tmp", "w") as f:
    json.dump(report, f)
os.replace("report.json.tmp", "report.json")
"""


def _account(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                name,
            ],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(name)


@pytest.fixture(scope="session")
def job_accounts() -> dict[str, pwd.struct_passwd]:
    """The accounts ``apportion-t-alice`` and ``apportion-t-eve`` (made when missing): name -> passwd entry."""
    if os.geteuid() != 0:
        pytest.fail(
            "the node-boundary tests run jobs as other Unix accounts and create cgroups: run them as root "
            "(CI does); they are not skipped, since an unchecked boundary is not a passing one"
        )
    if shutil.which("useradd") is None:
        pytest.fail("useradd is missing: the node-boundary tests need it to make their throwaway accounts")
    return {n: _account(n) for n in (ALICE, EVE)}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every account may traverse (mode 0711), under the system's temporary directory: a
    pytest ``tmp_path`` lies inside root's private base, which no job account can enter."""
    d = Path(tempfile.mkdtemp(prefix="apportion-boundary-"))
    d.chmod(0o711)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def make_fake_gpus(directory: Path, count: int) -> list[str]:
    """``count`` character devices ``directory/nvidia<i>`` = ``c 195:i``, mode 0666: file permissions let every
    account open them, so only the cgroup can say no."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    out = []
    for i in range(count):
        path = directory / f"nvidia{i}"
        os.mknod(path, 0o666 | 0o020000, os.makedev(NVIDIA_MAJOR, i))
        path.chmod(0o666)
        out.append(str(path))
    return out


def write_script(directory: Path, name: str, text: str) -> Path:
    """``text`` as ``directory/name``, readable by every account."""
    path = directory / name
    path.write_text(text)
    path.chmod(0o644)
    return path


def running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (an orphan's zombie waits for its reaper: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
