"""The node boundary (rule D10.node-boundary; ``docs/security.md``, "Node boundary"), each threat fed to the real agent.

The agent is built as production builds it (:meth:`NodeAgent.from_settings`: file protection, accounts,
cgroups, the declared inventory's device files) with a list sink for its events and a :class:`ManualClock`.
Its jobs are real processes run as the throwaway accounts of :mod:`tests.kit.node_boundary`, in cgroups under a
parent of the test's own; the fake GPUs are character devices ``c 195:i``. Every wait is bounded.

Needs root and the v1 cgroup controllers of the CI machines (a pure v2 host runs the v2 driver's test only:
it does not filter devices, see :mod:`services.node_agent.sandbox`).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import pwd
import signal
import socket
import stat
import struct
import subprocess
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from apportion.clock import ManualClock
from apportion.events import JobCompleted, JobFailed, JobStarted, StartWorkload, StopWorkload, WorkloadRefused
from apportion.metrics import node_agent_metrics
from services.node_agent import devfilter, landlock, logic
from services.node_agent.config import NodeAgentSettings
from services.node_agent.sandbox import (
    Accounts,
    CgroupV1,
    CgroupV2,
    Limits,
    cgroup_name,
    cgroups,
    child_setup,
    device_rules,
    login_uid_range,
    memory_mb_per_gpu,
    own_dir,
    proc_mounts_have_own_options,
    protect,
)
from services.node_agent.service import NodeAgent, SignedSender, _open_owned, hosted_nodes
from tests.kit.node_agent import WAIT_S, until
from tests.kit.node_boundary import (
    ALICE,
    EVE,
    PROBE,
    PROBE_HELPERS,
    job_accounts,
    make_fake_gpus,
    running,
    shared_dir,
    write_script,
)

__all__ = ["job_accounts", "shared_dir"]  # fixtures used by name

T0 = datetime(2026, 1, 5, tzinfo=UTC)
CGROUPS = Path("/sys/fs/cgroup")

#: The agent's Kafka and Redis where a test names none (its sink publishes nothing): its default closed ports
#: never come from the checkout's stack, running, stopped or absent.
KAFKA, REDIS = "127.0.0.1:9092", "rediss://127.0.0.1:6390/0"

AGENT_SECRETS = {  # variables of the agent's environment a job must never see
    "APPORTION_KAFKA_USER": "node-agent.local",
    "APPORTION_KAFKA_PASSWORD": "hunter2",
    "APPORTION_TEST_AGENT_ONLY": "agent",
}


class _Sent:
    def add_errback(self, *args: Any) -> None:
        return None


class _Producer:
    """What :class:`SignedSender` needs of a producer: the events it was handed, in order."""

    def __init__(self) -> None:
        self.events: list = []

    def send(self, ev: Any, value: bytes) -> _Sent:
        self.events.append(ev)
        return _Sent()

    def flush(self, timeout_s: float) -> None:
        return None

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]


class _Signer:
    def value(self, ev: Any) -> bytes:
        return b""


class Node:
    """A real node of the agent: fake GPUs, the agent's own secret files, its checkpoint and output roots."""

    def __init__(self, base: Path, monkeypatch: pytest.MonkeyPatch, **overrides: Any) -> None:
        self.base = base
        self.gpus = make_fake_gpus(base / "dev", 2)
        keys = base / "keys"
        keys.mkdir(mode=0o755)
        self.node_key = keys / "n1.json"
        self.node_key.write_text('{"private_key": "not for jobs"}')
        self.node_key.chmod(0o644)  # carelessly readable: the agent's start must close it
        self.password = base / "kafka.password"
        self.password.write_text("hunter2")
        self.password.chmod(0o644)
        monkeypatch.setenv("APPORTION_KAFKA_PASSWORD_FILE", str(self.password))
        for k, v in AGENT_SECRETS.items():
            monkeypatch.setenv(k, v)
        self.parent = f"apportion-test/{uuid.uuid4().hex[:12]}"
        settings = NodeAgentSettings(
            node_id="n1",
            force_simulated=True,
            gpus_per_node=2,
            gpu_device_files=self.gpus,
            state_dir=overrides.pop("state_dir", base / "state"),
            kafka_bootstrap=overrides.pop("kafka_bootstrap", KAFKA),
            redis_url=overrides.pop("redis_url", REDIS),
            node_key_dir=keys,
            cgroup_parent=self.parent,
            sandbox_memory_mb_per_gpu=overrides.pop("memory_mb", 512),
            **overrides,
        )
        nodes, prefix = hosted_nodes(settings)
        self.producer = _Producer()
        metrics = node_agent_metrics(CollectorRegistry())
        sender = SignedSender(self.producer, _Signer(), metrics)
        self.clock = ManualClock(T0)
        self.agent = NodeAgent.from_settings(settings, nodes, prefix, sender, self.clock, metrics)
        self.ckpt = settings.checkpoint_root_path()

    def start(self, job: str, user: str | None, command: tuple[str, ...], gpus=(0,), env=None) -> StartWorkload:
        return StartWorkload(
            ts=T0,
            node_id="n1",
            job_id=job,
            attempt=1,
            gpus=gpus,
            command=command,
            env=env or {},
            fencing_token=1,
            user=user,
        )

    async def ended(self, job: str) -> JobCompleted | JobFailed:
        def done() -> list:
            return [e for e in self.producer.of(JobCompleted) + self.producer.of(JobFailed) if e.job_id == job]

        await until(done, f"{job} to end")
        return done()[0]

    def report(self, job: str) -> dict:
        return json.loads((self.ckpt / job / "report.json").read_text())

    def cgroup_dirs(self) -> list[Path]:
        """The replica cgroups left under the agent's parent, in every v1 hierarchy."""
        controllers = ("devices", "memory", "pids", "cpu", "freezer", "unified")
        return [p for c in controllers for p in (CGROUPS / c / self.parent).glob("*") if p.is_dir()]

    async def close(self) -> None:
        await self.agent.shutdown(grace_s=0.0)
        assert not any((CGROUPS / c / self.parent).exists() for c in ("devices", "memory", "unified")), "cgroups left"


@pytest.fixture
async def node(job_accounts, shared_dir, monkeypatch):
    n = Node(shared_dir, monkeypatch)
    await n.agent.start(heartbeats=False, poll_progress=False)
    try:
        yield n
    finally:
        await n.close()


async def test_a_job_runs_as_its_user_with_none_of_the_agents_variables_files_gpus_or_signals(node, job_accounts):
    """Alice's job on GPU 0 probes everything the agent holds: every attempt is refused by the kernel."""
    probe = write_script(node.base, "probe.py", PROBE)
    alice = job_accounts[ALICE]
    environ = f"/proc/{os.getpid()}/environ"  # the agent's environment through /proc
    targets = [
        node.gpus[0],
        node.gpus[1],
        str(node.node_key),
        str(node.password),
        str(node.agent.journal.path),
        environ,
    ]
    agent_proc = f"/proc/{os.getpid()}"
    listed = f"{node.base / 'state'}:{agent_proc}"
    env = {"PROBE_OPEN": ":".join(targets), "PROBE_PID": str(os.getpid()), "PROBE_LIST": listed}
    await node.agent.on_event(node.start("j-alice", ALICE, ("python3", str(probe)), env=env))
    assert isinstance(await node.ended("j-alice"), JobCompleted)

    r = node.report("j-alice")
    assert (r["uid"], r["euid"], r["gid"]) == (alice.pw_uid, alice.pw_uid, alice.pw_gid)
    assert r["groups"] == sorted(set(os.getgrouplist(ALICE, alice.pw_gid)))
    assert set(r["env"]) <= set(logic.JOB_ENV_ALLOWED) | set(env), "a variable the job was not given"
    assert not set(AGENT_SECRETS) & set(r["env"]) and "APPORTION_KAFKA_PASSWORD_FILE" not in r["env"]
    assert (r["env"]["USER"], r["env"]["HOME"]) == (ALICE, "/nonexistent")
    assert r["env"]["CUDA_VISIBLE_DEVICES"] == r["env"]["NVIDIA_VISIBLE_DEVICES"] == "0"
    assert r["open"] == {
        node.gpus[0]: "ENXIO",  # its own GPU: the cgroup lets it through to the driver (absent here)
        node.gpus[1]: "EPERM",  # another replica's GPU: the cgroup refuses the device
        str(node.node_key): "EACCES",
        str(node.password): "EACCES",
        str(node.agent.journal.path): "EACCES",
        environ: "ENOENT",  # the agent's process: not in the job's /proc (hidepid=invisible)
    }
    assert r["list"] == {str(node.base / "state"): "EACCES", agent_proc: "ENOENT"}  # the state directory: 0711
    assert r["kill"] == "EPERM"  # cannot signal the agent
    st = os.stat(node.ckpt / "j-alice")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (alice.pw_uid, alice.pw_gid, 0o700)
    out = node.base / "state" / "job-logs" / "j-alice"
    assert (os.stat(out).st_uid, os.stat(out).st_mode & 0o777) == (alice.pw_uid, 0o700)
    assert not node.cgroup_dirs(), "the replica's cgroup outlived it"


async def test_a_job_cannot_read_another_users_checkpoint_directory(node, job_accounts):
    secret = "open(os.path.join(os.environ['APPORTION_CHECKPOINT_DIR'], 'weights'), 'w').write('alice')\n"
    saver = write_script(node.base, "saver.py", "import os\n" + secret)
    await node.agent.on_event(node.start("j-alice", ALICE, ("python3", str(saver))))
    assert isinstance(await node.ended("j-alice"), JobCompleted)
    probe = write_script(node.base, "probe.py", PROBE)
    alices = node.ckpt / "j-alice"
    env = {"PROBE_OPEN": str(alices / "weights"), "PROBE_LIST": str(alices)}
    await node.agent.on_event(node.start("j-eve", EVE, ("python3", str(probe)), gpus=(1,), env=env))
    assert isinstance(await node.ended("j-eve"), JobCompleted)
    r = node.report("j-eve")
    assert (r["uid"], r["open"], r["list"]) == (
        job_accounts[EVE].pw_uid,
        {str(alices / "weights"): "EACCES"},
        {str(alices): "EACCES"},
    )


async def test_an_id_chosen_equal_to_another_ids_directory_name_gets_a_directory_of_its_own(node, job_accounts):
    """Eve's job takes, as its id, the directory name Alice's id with a ``:`` maps to, and leaves a file anyone may
    write there (and could keep a hard link to it elsewhere). That id looks hashed, so it is hashed again: Eve's
    job runs in a directory of its own, Alice's job runs in hers, and neither sees the other's file."""
    alices_id = "j:alice"
    eves_id = logic.job_dir_name(alices_id)  # a plain file name
    plant = "import os\nopen('weights', 'w').write('eve')\nos.chmod('weights', 0o666)\n"
    await node.agent.on_event(node.start(eves_id, EVE, ("python3", str(write_script(node.base, "plant.py", plant)))))
    assert isinstance(await node.ended(eves_id), JobCompleted)
    write = "open('weights', 'w').write('alice')\n"
    await node.agent.on_event(
        node.start(alices_id, ALICE, ("python3", str(write_script(node.base, "w.py", write))), gpus=(1,))
    )
    assert isinstance(await node.ended(alices_id), JobCompleted)
    eves_dir, alices_dir = logic.job_dir_name(eves_id), eves_id
    assert eves_dir == f"{eves_id}-{hashlib.sha256(eves_id.encode()).hexdigest()[:16]}"
    assert (node.ckpt / eves_dir / "weights").read_text() == "eve"
    assert (node.ckpt / alices_dir / "weights").read_text() == "alice"
    for name, who in ((eves_dir, EVE), (alices_dir, ALICE)):
        for d in (node.ckpt / name, node.base / "state" / "job-logs" / name):
            assert (os.stat(d).st_uid, os.stat(d).st_mode & 0o777) == (job_accounts[who].pw_uid, 0o700)


async def test_a_hard_link_planted_at_the_next_attempts_output_is_refused_before_the_file_is_changed(node):
    """Attempt 1 hard-links a world-writable file of root's at its next attempt's stdout name (its output
    directory is its own): attempt 2 is a spawn failure, and the file keeps its owner, mode and content (handing
    it to the job's account would have given the job root's file)."""
    out_dir = node.base / "state" / "job-logs" / "j-link"
    roots = node.base / "roots-file"
    roots.write_text("root's\n")
    roots.chmod(0o666)
    plant = "import os, sys\nos.link(sys.argv[1], os.path.join(sys.argv[2], 'attempt-2.replica-0.out'))\n"
    script = write_script(node.base, "link.py", plant)
    await node.agent.on_event(node.start("j-link", ALICE, ("python3", str(script), str(roots), str(out_dir))))
    assert isinstance(await node.ended("j-link"), JobCompleted)
    second = node.start("j-link", ALICE, ("echo", "alice")).model_copy(update={"attempt": 2})
    await asyncio.wait_for(node.agent.on_event(second), WAIT_S)
    (failed,) = [e for e in node.producer.of(JobFailed) if e.attempt == 2]
    path = out_dir / "attempt-2.replica-0.out"
    assert failed.reason == f"spawn failed: [Errno 1] has 2 links (a hard link): '{path}'"
    st = os.stat(roots)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777, st.st_nlink) == (0, 0, 0o666, 2)
    assert roots.read_text() == "root's\n"


def test_an_output_file_of_another_account_is_refused_before_it_is_changed(tmp_path, job_accounts):
    """A file at the output's name owned by neither the agent nor the job's account is never handed over nor
    written; the job's own file and the agent's are."""
    alice, eve = job_accounts[ALICE], job_accounts[EVE]
    account = Accounts().resolve(ALICE)
    assert isinstance(account, logic.Account)
    eves = tmp_path / "eves.out"
    eves.write_text("eve\n")
    os.chown(eves, eve.pw_uid, eve.pw_gid)
    with pytest.raises(PermissionError, match=rf"belongs to uid {eve.pw_uid}"):
        _open_owned(str(eves), account)
    assert (os.stat(eves).st_uid, eves.read_text()) == (eve.pw_uid, "eve\n")
    for name, owner in (("alices.out", alice.pw_uid), ("agents.out", 0)):
        (tmp_path / name).write_text("")
        os.chown(tmp_path / name, owner, 0)
        with _open_owned(str(tmp_path / name), account) as f:
            f.write(b"x")
        assert (os.stat(tmp_path / name).st_uid, (tmp_path / name).read_text()) == (alice.pw_uid, "x")


async def test_a_fifo_planted_at_the_next_attempts_output_is_refused_without_blocking_the_agent(node):
    """Attempt 1 makes its next attempt's stdout a FIFO (its output directory is its own): attempt 2 is a spawn
    failure at once, and the agent goes on (a blocking open would have hung it)."""
    out_dir = node.base / "state" / "job-logs" / "j-fifo"
    plant = "import os, sys\nos.mkfifo(os.path.join(sys.argv[1], 'attempt-2.replica-0.out'))\n"
    script = write_script(node.base, "plant.py", plant)
    await node.agent.on_event(node.start("j-fifo", ALICE, ("python3", str(script), str(out_dir))))
    assert isinstance(await node.ended("j-fifo"), JobCompleted)
    second = node.start("j-fifo", ALICE, ("true",)).model_copy(update={"attempt": 2})
    await asyncio.wait_for(node.agent.on_event(second), WAIT_S)
    (failed,) = [e for e in node.producer.of(JobFailed) if e.attempt == 2]
    assert failed.reason == f"spawn failed: [Errno 6] No such device or address: '{out_dir}/attempt-2.replica-0.out'"


DOUBLE_FORK = r"""
import os, signal, time
if os.fork() == 0:
    os.setsid()                      # its own session: out of the replica's process group
    if os.fork() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # and deaf to the stop's SIGTERM
        with open("escaped.pid.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace("escaped.pid.tmp", "escaped.pid")
        while True:
            time.sleep(1)
    os._exit(0)
while True:
    time.sleep(1)
"""


async def test_after_preemption_no_process_of_the_replica_survives(node):
    """A job double-forks a child into its own session that ignores SIGTERM; the stop leaves nothing alive."""
    script = write_script(node.base, "escape.py", DOUBLE_FORK)
    await node.agent.on_event(node.start("j-escape", ALICE, ("python3", str(script))))
    pid_file = node.ckpt / "j-escape" / "escaped.pid"
    await until(pid_file.exists, "the escaped child")
    escaped = int(pid_file.read_text())
    main = node.producer.of(JobStarted)[0].pid
    assert os.getsid(escaped) != os.getsid(main) and running(escaped)

    await node.agent.on_event(StopWorkload(ts=T0, node_id="n1", job_id="j-escape", attempt=1, grace_s=30.0))
    ended = await node.ended("j-escape")
    assert isinstance(ended, JobFailed) and ended.reason == "stopped"
    assert not running(escaped), "a process of the preempted replica survived"
    assert not node.cgroup_dirs()


async def test_a_replica_killed_for_memory_is_reported_oom(job_accounts, shared_dir, monkeypatch):
    node = Node(shared_dir, monkeypatch, memory_mb=64)
    await node.agent.start(heartbeats=False, poll_progress=False)
    try:
        hog = write_script(shared_dir, "hog.py", "x = b'\\x01' * (512 << 20)\n")
        await node.agent.on_event(node.start("j-hog", ALICE, ("python3", str(hog))))
        ended = await node.ended("j-hog")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("oom", -signal.SIGKILL)
    finally:
        await node.close()


async def test_a_fork_bomb_stops_at_the_pids_limit(job_accounts, shared_dir, monkeypatch):
    """A replica with ``sandbox_pids_max`` 8 forks until the kernel refuses: 7 children beside itself, then
    ``EAGAIN``; the agent's stop at its end leaves none of them."""
    node = Node(shared_dir, monkeypatch, sandbox_pids_max=8)
    await node.agent.start(heartbeats=False, poll_progress=False)
    bomb = (
        "import errno, json, os, time\n"
        "children, refused = [], None\n"
        "while refused is None:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as exc:\n"
        "        refused = errno.errorcode[exc.errno]\n"
        "        break\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "json.dump({'forks': len(children), 'refused': refused, 'pids': children}, open('bomb.json', 'w'))\n"
    )
    try:
        script = write_script(shared_dir, "bomb.py", bomb)
        await node.agent.on_event(node.start("j-bomb", ALICE, ("python3", str(script))))
        assert isinstance(await node.ended("j-bomb"), JobCompleted)
        r = json.loads((node.ckpt / "j-bomb" / "bomb.json").read_text())
        assert (r["forks"], r["refused"]) == (7, "EAGAIN")
        await until(lambda: not any(running(p) for p in r["pids"]), "the bomb's children to be killed")
    finally:
        await node.close()


#: A job that writes ``argv[1]`` into ``/tmp``, ``/dev/shm`` and its ``TMPDIR``, reports what it sees there
#: and whether it can open the paths of ``OTHER`` (``:``-separated), and, given ``wait``, stays until a file
#: ``go`` appears in its working directory.
#: The node's shared scratch directories a job gets a fresh one of, in the order a job lists them.
SCRATCH = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")

TMP_JOB = r"""
import ctypes, errno, json, os, sys, time

def outcome(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]

libc = ctypes.CDLL(None, use_errno=True)

def shm():  # System V shared memory under SHM_KEY: made (SHM_MAKE set, mode 0666) or looked up
    flags = 0o1000 | 0o666 if os.environ.get("SHM_MAKE") else 0
    if libc.shmget(int(os.environ["SHM_KEY"]), 4096, flags) < 0:
        raise OSError(ctypes.get_errno(), "shmget")

mark, tmp, scratch = sys.argv[1], os.environ["TMPDIR"], os.environ["SCRATCH"].split(":")
st = os.stat(tmp)
report = {
    "tmpdir": [tmp, st.st_uid, st.st_mode & 0o777],
    "written": {d: outcome(lambda d=d: open(os.path.join(d, mark), "w").write("x")) for d in (*scratch, tmp)},
    "seen": {d: sorted(os.listdir(d)) for d in scratch},
    "other": {p: outcome(lambda p=p: open(p).close()) for p in os.environ.get("OTHER", "").split(":") if p},
    "shm": outcome(shm),
}
json.dump(report, open("tmp.json", "w"))
while sys.argv[2:] == ["wait"] and not os.path.exists("go"):
    time.sleep(0.01)
"""


def _node_shm(key: int) -> str:
    """``ok`` when the node's IPC namespace holds a System V shared memory segment under ``key``, else the errno."""
    import ctypes
    import errno

    libc = ctypes.CDLL(None, use_errno=True)
    return "ok" if libc.shmget(key, 0, 0) >= 0 else errno.errorcode[ctypes.get_errno()]


DEFAULT_STATE_DIRS = [
    # id, how eve (or a careless root) left the default state directory's name, the refusal
    ("eve's directory with links at the journal and the checkpoint root", "eve", "belongs to uid"),
    ("a link at the directory's name to a directory of root's", "link", "not a directory"),
    ("root's, but anyone may write it", "0777", "mode 0777: group or others may write it"),
]  # fmt: skip


@pytest.mark.parametrize("case_id,planted,refusal", DEFAULT_STATE_DIRS, ids=[c[0] for c in DEFAULT_STATE_DIRS])
def test_a_default_state_directory_taken_first_by_another_account_is_refused(
    job_accounts, shared_dir, monkeypatch, case_id, planted, refusal
):
    """Without ``--state-dir`` the agent's state directory is a fixed name in the shared temporary directory,
    where any account can make it first. Eve makes it (mode 0777) with links at the journal's name to a file
    of root's and at the checkpoint root's name to a directory of root's: the agent, root, would write the
    journal into that file and make that directory 0711. It refuses to start instead, and neither changes."""
    import tempfile

    eve = job_accounts[EVE]
    tmp = shared_dir / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    data = NodeAgentSettings(node_id="n1").data_dir()
    assert data.parent == tmp
    victim, target = shared_dir / "victim", shared_dir / "target"
    victim.write_text("root's\n")
    victim.chmod(0o644)
    target.mkdir(mode=0o755)
    if planted == "link":
        data.symlink_to(target)
    else:
        data.mkdir()
        data.chmod(0o777)
        if planted == "eve":
            for name, to in (("n1.journal", victim), ("checkpoints", target)):
                (data / name).symlink_to(to)
                os.lchown(data / name, eve.pw_uid, eve.pw_gid)
            os.chown(data, eve.pw_uid, eve.pw_gid)
    with pytest.raises(OSError, match=refusal):
        Node(shared_dir, monkeypatch, state_dir=None)
    assert victim.read_text() == "root's\n" and (victim.stat().st_mode & 0o777) == 0o644
    assert (target.stat().st_mode & 0o777) == 0o755 and list(target.iterdir()) == []


WORLD_WRITABLE = [
    ("state_dir", "--state-dir"),
    ("checkpoint_root", "--checkpoint-root"),
    ("job_log_dir", "--job-log-dir"),
]


@pytest.mark.parametrize("field,flag", WORLD_WRITABLE, ids=[c[0] for c in WORLD_WRITABLE])
def test_a_shared_scratch_directory_configured_for_the_agent_is_refused_and_left_as_it_is(
    shared_dir, monkeypatch, field, flag
):
    """Ops point a setting at the node's shared scratch (mode 1777, as ``/tmp``): the agent would make it 0700
    or 0711, shutting every other user out of it, and keep its journal or the jobs' directories where anyone
    can take their names first. It refuses to start, the setting named, and the directory keeps its mode."""
    scratch = shared_dir / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    with pytest.raises(OSError, match=f"mode 1777: anyone may write it .*set {flag} to a directory"):
        Node(shared_dir, monkeypatch, **{field: scratch})
    assert oct(scratch.stat().st_mode & 0o7777) == "0o1777"


async def test_a_default_state_directory_is_made_the_agents_own(job_accounts, shared_dir, monkeypatch):
    """Absent, the default state directory is made by the agent: root's, passable by the job accounts only."""
    import tempfile

    tmp = shared_dir / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    node = Node(shared_dir, monkeypatch, state_dir=None)
    try:
        st = (tmp / "apportion-node-agent-n1").lstat()
        assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, "0o711")
        assert node.ckpt == tmp / "apportion-node-agent-n1" / "checkpoints"
    finally:
        await node.close()


async def test_a_jobs_tmp_is_its_own_and_gone_after_it(job_accounts, shared_dir, monkeypatch):
    """Alice's job writes a file to ``/tmp``, ``/var/tmp``, ``/run/lock``, ``/dev/shm`` and its ``TMPDIR``, and
    makes a System V shared memory segment anyone may open; while it runs, eve's job sees none of them
    (``ENOENT``), nor does the node; each sees in each scratch directory only its own file (and in ``/tmp`` the
    way to its own directories: the agent's state directory is under ``/tmp`` here, as by default). When
    alice's job ends its ``TMPDIR`` is removed, and its segment is gone with its IPC namespace."""
    import random
    import shutil
    import tempfile

    state = Path(tempfile.mkdtemp(prefix="apportion-tmp-state-"))  # under /tmp, as the default state directory
    node = Node(shared_dir, monkeypatch, state_dir=state)
    await node.agent.start(heartbeats=False, poll_progress=False)
    assert node.agent.sandbox is not None and node.agent.sandbox.private_mounts is not None, "no mount namespace"
    script = write_script(shared_dir, "tmpjob.py", TMP_JOB)
    a, b = f"mark-{uuid.uuid4().hex[:8]}", f"mark-{uuid.uuid4().hex[:8]}"
    key = random.randrange(1 << 20, 1 << 30)
    assert _node_shm(key) == "ENOENT"
    alice = job_accounts[ALICE]
    tmp_a = state / "job-logs" / "j-a" / "tmp.attempt-1.replica-0"
    env = {"SCRATCH": ":".join(SCRATCH), "SHM_KEY": str(key)}
    try:
        await node.agent.on_event(
            node.start("j-a", ALICE, ("python3", str(script), a, "wait"), env={**env, "SHM_MAKE": "1"})
        )
        await until(lambda: (node.ckpt / "j-a" / "tmp.json").exists(), "alice's job to write")
        other = ":".join(f"{d}/{a}" for d in SCRATCH)
        await node.agent.on_event(
            node.start("j-b", EVE, ("python3", str(script), b), gpus=(1,), env={**env, "OTHER": other})
        )
        assert isinstance(await node.ended("j-b"), JobCompleted)
        ra = json.loads((node.ckpt / "j-a" / "tmp.json").read_text())
        rb = json.loads((node.ckpt / "j-b" / "tmp.json").read_text())
        assert ra["tmpdir"] == [str(tmp_a), alice.pw_uid, 0o700]
        assert ra["written"] == {**dict.fromkeys(SCRATCH, "ok"), str(tmp_a): "ok"}
        assert ra["seen"] == {"/tmp": sorted([a, state.name]), "/var/tmp": [a], "/run/lock": [a], "/dev/shm": [a]}
        assert rb["seen"] == {"/tmp": sorted([b, state.name]), "/var/tmp": [b], "/run/lock": [b], "/dev/shm": [b]}
        assert rb["other"] == {f"{d}/{a}": "ENOENT" for d in SCRATCH}
        assert (ra["shm"], rb["shm"], _node_shm(key)) == ("ok", "ENOENT", "ENOENT")  # alice's, in her namespace
        assert not any(os.path.exists(f"{d}/{m}") for d in SCRATCH for m in (a, b))  # the node's
        assert (tmp_a / a).read_text() == "x"  # alice's TMPDIR while her job runs
        assert not (state / "job-logs" / "j-b" / "tmp.attempt-1.replica-0").exists()  # eve's, gone with her job
        (node.ckpt / "j-a" / "go").touch()
        assert isinstance(await node.ended("j-a"), JobCompleted)
        assert not tmp_a.exists()
        assert _node_shm(key) == "ENOENT"
    finally:
        await node.close()
        shutil.rmtree(state, ignore_errors=True)


#: A job that runs the setuid-root program ``argv[1]`` (a copy of ``id``) and reports the effective uid it
#: printed and its own ``NoNewPrivs``.
SETUID_JOB = r"""
import json, subprocess, sys
euid = subprocess.run([sys.argv[1], "-u"], capture_output=True, text=True).stdout.strip()
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
json.dump({"euid": euid, "no_new_privs": status["NoNewPrivs"].strip()}, open("setuid.json", "w"))
"""


async def test_a_setuid_root_program_run_by_a_job_gains_nothing(node, job_accounts):
    """A setuid-root copy of ``id`` (owned by root, mode 4755, on a file system without ``nosuid``) prints 0 when
    alice runs it outside the sandbox; run by her job it prints her uid, and the job has ``NoNewPrivs: 1``."""
    import shutil

    alice = job_accounts[ALICE]
    setuid_id = node.base / "setuid-id"
    shutil.copy2("/usr/bin/id", setuid_id)
    os.chown(setuid_id, 0, 0)
    setuid_id.chmod(0o4755)

    def as_alice() -> None:
        os.setgroups([])
        os.setgid(alice.pw_gid)
        os.setuid(alice.pw_uid)

    outside = subprocess.run([str(setuid_id), "-u"], preexec_fn=as_alice, capture_output=True, text=True, check=True)
    assert outside.stdout.strip() == "0", "the file system ignores setuid bits: the attack cannot be fed here"
    script = write_script(node.base, "setuid_job.py", SETUID_JOB)
    await node.agent.on_event(node.start("j-setuid", ALICE, ("python3", str(script), str(setuid_id))))
    assert isinstance(await node.ended("j-setuid"), JobCompleted)
    r = json.loads((node.ckpt / "j-setuid" / "setuid.json").read_text())
    assert r == {"euid": str(alice.pw_uid), "no_new_privs": "1"}


#: A job that connects to ``argv[1]`` (closed) and ``argv[2]`` (open) on each loopback address it may name, and
#: writes ``connect.json``: ``"<address> <port>"`` -> ``ok`` or the errno.
CONNECT_JOB = r"""
import errno, json, socket, sys

def outcome(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
            return "ok"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc))

hosts = ["127.0.0.1", "127.1.2.3", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0"]
args = sys.argv[1:]
if args and args[0].startswith("--hosts="):
    hosts = args.pop(0).split("=", 1)[1].split(",")
ports = [int(p) for p in args]
json.dump({f"{h} {p}": outcome(h, p) for h in hosts for p in ports}, open("connect.json", "w"))
"""

LOOPBACK_FORMS = ("127.0.0.1", "127.1.2.3", "0.0.0.0", "::1", "::", "::ffff:127.0.0.1", "::ffff:0.0.0.0")


def _listener() -> socket.socket:
    """A socket listening on every address, IPv4 and IPv6, at a free port (connections wait in its backlog)."""
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", 0))
    s.listen(64)
    return s


async def test_a_job_cannot_connect_to_the_control_planes_ports_on_loopback(job_accounts, shared_dir, monkeypatch):
    """The agent closes a port (here one of the test's listeners, as the Redis and Kafka ports are by default)
    to its jobs: alice's job connecting to it on each loopback form (127.0.0.1, elsewhere in 127/8, 0.0.0.0,
    ::1, ::, IPv4-mapped) gets ``EPERM``; the same forms reach another listening port, as the agent does the
    closed one."""
    with _listener() as closed, _listener() as opened:
        shut, free = closed.getsockname()[1], opened.getsockname()[1]
        node = Node(shared_dir, monkeypatch, sandbox_closed_ports=[shut])
        await node.agent.start(heartbeats=False, poll_progress=False)
        try:
            assert node.agent.sandbox is not None and node.agent.sandbox.closed_ports == (shut,)
            script = write_script(shared_dir, "connect_job.py", CONNECT_JOB)
            await node.agent.on_event(node.start("j-conn", ALICE, ("python3", str(script), str(shut), str(free))))
            assert isinstance(await node.ended("j-conn"), JobCompleted)
            got = json.loads((node.ckpt / "j-conn" / "connect.json").read_text())
        finally:
            await node.close()
        with socket.create_connection(("127.0.0.1", shut), timeout=5):
            pass  # the agent's side of the node still reaches it
    assert got == {
        **{f"{h} {shut}": "EPERM" for h in LOOPBACK_FORMS},
        **{f"{h} {free}": "ok" for h in LOOPBACK_FORMS},
    }


def _node_addresses() -> tuple[str, str]:
    """The node's own non-loopback IPv4 and IPv6 addresses (``ip -o addr show scope global``), one of each."""
    out = subprocess.run(["ip", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True, check=True)
    found: dict[str, list[str]] = {"inet": [], "inet6": []}
    for line in out.stdout.splitlines():
        fields = line.split()
        found[fields[2]].append(fields[3].split("/")[0])
    if not found["inet"] or not found["inet6"]:
        pytest.fail(f"this node needs a global IPv4 and IPv6 address: {found}", pytrace=False)
    return found["inet"][0], found["inet6"][0]


async def test_a_job_cannot_connect_to_the_control_planes_ports_on_its_own_addresses(
    job_accounts, shared_dir, monkeypatch
):
    """A control plane on the node's own non-loopback address (or another machine's, the real deployment) is
    closed to jobs on its ports too: the agent's Kafka bootstrap server names the node's IPv4 address and its Redis
    URL the node's IPv6 address, both at a closed port; alice's job connecting there (and to the IPv4-mapped form)
    gets ``EPERM``, and reaches another listening port on the same addresses; the agent's side still reaches the
    closed one."""
    v4, v6 = _node_addresses()
    with _listener() as closed, _listener() as opened:
        shut, free = closed.getsockname()[1], opened.getsockname()[1]
        node = Node(
            shared_dir,
            monkeypatch,
            kafka_bootstrap=f"{v4}:{shut}",
            redis_url=f"rediss://[{v6}]:{shut}/0",
            sandbox_closed_ports=[shut],
        )
        await node.agent.start(heartbeats=False, poll_progress=False)
        try:
            assert node.agent.sandbox is not None and node.agent.sandbox.closed_addresses == (v4, v6)
            script = write_script(shared_dir, "connect_job.py", CONNECT_JOB)
            hosts = f"--hosts={v4},{v6},::ffff:{v4}"
            await node.agent.on_event(
                node.start("j-addr", ALICE, ("python3", str(script), hosts, str(shut), str(free)))
            )
            assert isinstance(await node.ended("j-addr"), JobCompleted)
            got = json.loads((node.ckpt / "j-addr" / "connect.json").read_text())
        finally:
            await node.close()
        for host in (v4, v6):
            with socket.create_connection((host, shut), timeout=5):
                pass  # the agent's side of the node still reaches it
    assert got == {
        **{f"{h} {shut}": "EPERM" for h in (v4, v6, f"::ffff:{v4}")},
        **{f"{h} {free}": "ok" for h in (v4, v6, f"::ffff:{v4}")},
    }


def test_the_closed_addresses_are_the_control_planes_hosts_resolved_but_loopback():
    """Every address of the bootstrap servers' and the Redis URL's hosts, loopback left out (always closed)."""
    from apportion.settings import Connection
    from services.node_agent import connfilter

    conn = Connection("192.0.2.7:9092,[fd00::7]:9093,localhost:9094", "rediss://[::ffff:198.51.100.3]:6390/0")
    assert conn.hosts() == {"192.0.2.7", "fd00::7", "localhost", "::ffff:198.51.100.3"}
    assert connfilter.resolve(conn.hosts()) == ("192.0.2.7", "198.51.100.3", "fd00::7")
    assert connfilter.resolve(["no-such-host.invalid", "127.0.0.2"]) == ()


def test_the_closed_ports_default_to_the_control_planes():
    """Unset, the ports of the agent's Kafka bootstrap servers and Redis URL (6379 when it names none)."""
    s = NodeAgentSettings(kafka_bootstrap="127.0.0.1:9092,localhost:19093", redis_url="rediss://127.0.0.1:6390/0")
    assert s.closed_ports() == (6390, 9092, 19093)
    s = NodeAgentSettings(kafka_bootstrap="[::1]:9092", redis_url="redis://localhost")
    assert s.closed_ports() == (6379, 9092)
    assert (
        NodeAgentSettings(sandbox_closed_ports=[], kafka_bootstrap="h:1", redis_url="redis://h:2").closed_ports() == ()
    )
    with pytest.raises(ValueError, match=r"\[70000\] outside 1-65535"):
        NodeAgentSettings(sandbox_closed_ports=[70000]).closed_ports()


#: Run as root: joins a session keyring of its own, adds a ``user`` key to it, then runs the sandbox's child
#: setup for the account ``argv[1]`` (uid, gid) and prints whether it still holds that session keyring and the
#: errno (or ``ok``) of reading the key.
KEYRING_CHILD = r"""
import ctypes, errno, json, platform, sys
from services.node_agent.logic import Account
from services.node_agent.sandbox import child_setup

libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 250, "aarch64": 219}[platform.machine()]
JOIN, GET_ID, READ, SESSION = 1, 0, 11, -3

def keyctl(*args):
    r = libc.syscall(nr, *args)
    if r < 0:
        raise OSError(ctypes.get_errno(), "keyctl")
    return r

keyctl(JOIN, b"apportion-agent-session")
ring = keyctl(GET_ID, SESSION, 0)
add_key = {"x86_64": 248, "aarch64": 217}[platform.machine()]
secret = libc.syscall(add_key, b"user", b"agent-secret", b"hunter2", 7, SESSION)
assert secret > 0, ctypes.get_errno()
uid, gid = int(sys.argv[1]), int(sys.argv[2])
child_setup((), Account("job", uid, gid, (gid,), "/"))()
buf = ctypes.create_string_buffer(64)
try:
    keyctl(READ, secret, buf, 64)
    read = "ok"
except OSError as exc:
    read = errno.errorcode[exc.errno]
print(json.dumps({"same_session": keyctl(GET_ID, SESSION, 0) == ring, "read": read}))
"""


def test_a_job_does_not_possess_the_agents_session_keyring(job_accounts):
    """The agent's session keyring holds a key only its possessors may read; a child set up for alice holds a
    session keyring of its own, and reading the agent's key is refused (``EACCES``)."""
    import sys

    alice = job_accounts[ALICE]
    argv = [sys.executable, "-c", KEYRING_CHILD, str(alice.pw_uid), str(alice.pw_gid)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    assert json.loads(out.stdout) == {"same_session": False, "read": "EACCES"}


#: A job that waits to be attacked: it binds the abstract Unix socket ``@argv[1]``, writes ``victim.json`` (its pid)
#: and runs until ``go`` appears in its working directory.
VICTIM_JOB = r"""
import json, os, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(b"\0" + sys.argv[1].encode())
s.listen(8)
json.dump({"pid": os.getpid()}, open("victim.json.tmp", "w"))
os.replace("victim.json.tmp", "victim.json")
while not os.path.exists("go"):
    time.sleep(0.01)
"""

#: A job (or a login: run outside the agent) that reaches for processes and abstract Unix sockets and writes
#: ``argv[1]`` (default ``scope.json`` in its working directory): for each pid of ``PROBE_PIDS`` whether its
#: ``/proc`` lists it, and the errno (or ``ok``) of ``kill(pid, 0)`` (the permission check of every signal), of
#: ``ptrace(PTRACE_SEIZE)`` (the tracee is let go when its tracer exits) and of opening ``/proc/<pid>/environ``;
#: for each abstract name of
#: ``PROBE_STREAM`` a stream ``connect``, of ``PROBE_DGRAM`` a datagram ``sendto``; with ``OWN_SOCKET``, ``own``:
#: a socket it binds at that name reached from a process it starts.
SCOPE_JOB = (
    PROBE_HELPERS
    + r"""
import ctypes, socket, subprocess

libc = ctypes.CDLL(None, use_errno=True)
PTRACE_SEIZE = 0x4206

def seize(pid):
    if libc.ptrace(PTRACE_SEIZE, int(pid), None, None) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")

def unix(name, kind):
    with socket.socket(socket.AF_UNIX, kind) as s:
        if kind == socket.SOCK_STREAM:
            s.connect(b"\0" + name.encode())
        else:
            s.sendto(b"x", b"\0" + name.encode())

pids = split("PROBE_PIDS")
report = {
    "listed": {p: p in os.listdir("/proc") for p in pids},
    "kill": {p: outcome(lambda p=p: os.kill(int(p), 0)) for p in pids},
    "ptrace": {p: outcome(lambda p=p: seize(p)) for p in pids},
    "environ": {p: outcome(lambda p=p: open(f"/proc/{p}/environ", "rb").close()) for p in pids},
    "stream": {n: outcome(lambda n=n: unix(n, socket.SOCK_STREAM)) for n in split("PROBE_STREAM")},
    "dgram": {n: outcome(lambda n=n: unix(n, socket.SOCK_DGRAM)) for n in split("PROBE_DGRAM")},
}
if "OWN_SOCKET" in os.environ:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as own:
        own.bind(b"\0" + os.environ["OWN_SOCKET"].encode())
        own.listen(1)
        code = "import socket, sys; socket.socket(socket.AF_UNIX).connect(b'\\0' + sys.argv[1].encode())"
        done = subprocess.run([sys.executable, "-c", code, os.environ["OWN_SOCKET"]], capture_output=True, text=True)
        report["own"] = "ok" if done.returncode == 0 else done.stderr.strip().splitlines()[-1]
out = sys.argv[1] if len(sys.argv) > 1 else "scope.json"
json.dump(report, open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
"""
)


def _as(account: pwd.struct_passwd):
    """A ``preexec_fn`` that drops a child of the test to ``account`` with no domain: one of its user's logins."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(account.pw_gid)
        os.setuid(account.pw_uid)

    return drop


def _abstract(name: str, kind: int) -> socket.socket:
    """A socket of ``kind`` bound at the abstract name ``@name`` (listening, for a stream)."""
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(b"\0" + name.encode())
    if kind == socket.SOCK_STREAM:
        s.listen(8)
    return s


async def test_a_job_reaches_no_process_or_abstract_socket_outside_its_replica(
    job_accounts, shared_dir, monkeypatch, caplog
):
    """Alice runs two jobs and is logged in (a ``sleep`` of her account). Her second job, in a Landlock domain of
    its own, cannot signal or trace her first job, her login or the agent (``EPERM``), nor see them: its
    ``/proc`` (``hidepid=invisible``) shows only the processes it may trace; nor can it connect or send to an abstract Unix socket
    that the test (outside every job) or her first job bound (``EPERM``); a socket it binds itself is reached
    by a process it starts. Her login, outside any domain, does all of it to the same targets (``ok``): without
    the domain the same account could. The agent's start says its jobs are scoped."""
    caplog.set_level(logging.INFO, "apportion.node_agent")
    assert landlock.abi_version() >= landlock.SCOPES_ABI, (
        f"Landlock ABI {landlock.abi_version()} here: the scopes need ABI {landlock.SCOPES_ABI} (Linux 6.12), which "
        "the CI machines have; this test fails rather than skips, since an unchecked boundary is not a passing one"
    )
    alice = job_accounts[ALICE]
    tag = f"apportion-test-{uuid.uuid4().hex[:12]}"
    outside_s, outside_d, theirs, own = f"{tag}-s", f"{tag}-d", f"{tag}-victim", f"{tag}-own"
    node = Node(shared_dir, monkeypatch)
    await node.agent.start(heartbeats=False, poll_progress=False)
    login = subprocess.Popen(["sleep", "60"], preexec_fn=_as(alice))
    stream, dgram = _abstract(outside_s, socket.SOCK_STREAM), _abstract(outside_d, socket.SOCK_DGRAM)
    try:
        assert node.agent.sandbox is not None
        assert node.agent.sandbox.landlock_scopes == landlock.SCOPE_ABSTRACT_UNIX_SOCKET | landlock.SCOPE_SIGNAL
        assert ", a Landlock domain each scoping abstract Unix sockets and signals" in caplog.text
        victim_job = write_script(shared_dir, "victim_job.py", VICTIM_JOB)
        scope_job = write_script(shared_dir, "scope_job.py", SCOPE_JOB)
        await node.agent.on_event(node.start("j-victim", ALICE, ("python3", str(victim_job), theirs)))
        await until(lambda: (node.ckpt / "j-victim" / "victim.json").exists(), "alice's first job to bind")
        victim = json.loads((node.ckpt / "j-victim" / "victim.json").read_text())["pid"]
        agent = os.getpid()
        env = {
            "PROBE_PIDS": f"{victim}:{login.pid}:{agent}",
            "PROBE_STREAM": f"{outside_s}:{theirs}",
            "PROBE_DGRAM": outside_d,
            "OWN_SOCKET": own,
        }
        await node.agent.on_event(node.start("j-attack", ALICE, ("python3", str(scope_job)), gpus=(1,), env=env))
        assert isinstance(await node.ended("j-attack"), JobCompleted)
        inside = json.loads((node.ckpt / "j-attack" / "scope.json").read_text())
        homes = shared_dir / "login"
        homes.mkdir()
        os.chown(homes, alice.pw_uid, alice.pw_gid)
        env = {**env, "PROBE_PIDS": f"{victim}:{login.pid}", "PATH": os.environ["PATH"]}
        del env["OWN_SOCKET"]
        argv = ["python3", str(scope_job), str(homes / "scope.json")]
        subprocess.run(argv, env=env, preexec_fn=_as(alice), cwd=homes, check=True, timeout=WAIT_S)
        outside = json.loads((homes / "scope.json").read_text())
        (node.ckpt / "j-victim" / "go").touch()
        assert isinstance(await node.ended("j-victim"), JobCompleted)
    finally:
        login.kill()
        login.wait()
        stream.close()
        dgram.close()
        await node.close()
    v, lg, ag = str(victim), str(login.pid), str(agent)
    assert inside == {
        "listed": {v: False, lg: False, ag: False},
        "kill": {v: "EPERM", lg: "EPERM", ag: "EPERM"},
        "ptrace": {v: "EPERM", lg: "EPERM", ag: "EPERM"},
        "environ": {v: "ENOENT", lg: "ENOENT", ag: "ENOENT"},
        "stream": {outside_s: "EPERM", theirs: "EPERM"},
        "dgram": {outside_d: "EPERM"},
        "own": "ok",
    }
    assert outside == {
        "listed": {v: True, lg: True},
        "kill": {v: "ok", lg: "ok"},
        "ptrace": {v: "ok", lg: "ok"},
        "environ": {v: "ok", lg: "ok"},
        "stream": {outside_s: "ok", theirs: "ok"},
        "dgram": {outside_d: "ok"},
    }


def _refused(scopes: int) -> None:
    raise OSError(errno.EPERM, "landlock_restrict_self: Operation not permitted")


NO_SCOPES = [
    # id, the ABI the probe tells, whether a child can enter a domain, what the agent says at start
    ("no Landlock", 0, True, "no Landlock here (a kernel before Linux 5.13, not enabled at boot: lsm=, or a seccomp filter): jobs are not scoped"),
    ("ABI 5", 5, True, "Landlock ABI 5, scopes need ABI 6 (Linux 6.12): jobs are not scoped"),
    ("ABI 6, a child refused", 6, False, "Landlock ABI 6, but a child of the agent cannot enter a scoped domain: jobs are not scoped"),
]  # fmt: skip


@pytest.mark.parametrize("case_id,abi,enters,said", NO_SCOPES, ids=[c[0] for c in NO_SCOPES])
async def test_an_agent_on_a_kernel_without_the_scopes_starts_says_so_and_runs_jobs(
    job_accounts, shared_dir, monkeypatch, caplog, case_id, abi, enters, said
):
    """The probe tells an older ABI (or none), or a child of the agent cannot enter a domain: the agent starts,
    says what jobs then reach, and runs them with no domain (alice's job sees and signals her login)."""
    monkeypatch.setattr(landlock, "abi_version", lambda: abi)
    if not enters:
        monkeypatch.setattr(landlock, "restrict_self", _refused)
    node = Node(shared_dir, monkeypatch)
    await node.agent.start(heartbeats=False, poll_progress=False)
    login = subprocess.Popen(["sleep", "60"], preexec_fn=_as(job_accounts[ALICE]))
    try:
        assert node.agent.sandbox is not None and node.agent.sandbox.landlock_scopes == 0
        assert said in caplog.text
        scope_job = write_script(shared_dir, "scope_job.py", SCOPE_JOB)
        env = {"PROBE_PIDS": str(login.pid)}
        await node.agent.on_event(node.start("j-plain", ALICE, ("python3", str(scope_job)), env=env))
        assert isinstance(await node.ended("j-plain"), JobCompleted)
        got = json.loads((node.ckpt / "j-plain" / "scope.json").read_text())
        assert (got["listed"], got["kill"]) == ({str(login.pid): True}, {str(login.pid): "ok"})
    finally:
        login.kill()
        login.wait()
        await node.close()


async def test_a_cgroup_holding_another_runs_processes_is_never_joined(job_accounts, shared_dir, monkeypatch):
    """Two agents on one machine under one cgroup parent (two local stacks, agent name and topic prefix alike)
    name a replica's cgroup alike when node, job id, attempt and replica are alike, and a job id is its
    submitter's choice. The second start (here the same sandbox asked again, for the other GPU) must not join
    the first's cgroup: it would rewrite its device rules and limits, and its end would kill the first's
    processes. It is refused; alice's process and limit stay as they were."""
    node = Node(shared_dir, monkeypatch)  # 512 MiB per GPU
    await node.agent.start(heartbeats=False, poll_progress=False)
    key = ("n1", "j-same", 1, 0)
    try:
        await node.agent.on_event(node.start("j-same", ALICE, ("sleep", "60")))
        assert node.agent.sandbox is not None
        cg = node.agent.sandbox.reopen(key)
        assert cg is not None
        await until(lambda: bool(cg.pids()), "alice's process in its cgroup")
        pids = cg.pids()
        if isinstance(cg, CgroupV1):
            limit = cg.dirs["memory"] / "memory.limit_in_bytes"
        else:
            assert isinstance(cg, CgroupV2)
            limit = cg.path / "memory.max"
        with pytest.raises(OSError, match=r"cgroup n1\.j-same\.1\.0 already holds processes \[\d+\] of another run"):
            node.agent.sandbox.cgroup_for(key, 1, node.gpus[1:])
        assert cg.pids() == pids and all(running(p) for p in pids)
        assert limit.read_text().strip() == str(512 * 1024 * 1024)
    finally:
        await node.close()


#: A unified hierarchy's files as the kernel shows them at its root (every controller offered).
V2_CONTROLLERS = "cpuset cpu io memory hugetlb pids rdma misc"

V2_LIMITS = [
    # id, GPUs of the replica, node settings (MiB per GPU, CPU weight per GPU, pids max), the replica's files
    ("one GPU", 1, (1024, 100, 4096),
     {"memory.max": "1073741824", "memory.swap.max": "0", "cpu.weight": "100", "pids.max": "4096"}),
    ("four GPUs: memory and weight x 4", 4, (1024, 150, 512),
     {"memory.max": "4294967296", "memory.swap.max": "0", "cpu.weight": "600", "pids.max": "512"}),
    ("eight GPUs: weight capped at v2's 10000", 8, (2048, 2000, 64),
     {"memory.max": "17179869184", "memory.swap.max": "0", "cpu.weight": "10000", "pids.max": "64"}),
]  # fmt: skip


@pytest.mark.parametrize("case_id,gpus,node,files", V2_LIMITS, ids=[c[0] for c in V2_LIMITS])
def test_the_v2_limits_written_from_the_node_settings(tmp_path, case_id, gpus, node, files):
    """On a unified hierarchy offering every controller (a cgroupfs laid out in a directory): memory, cpu and
    pids are enabled in ``cgroup.subtree_control`` from the root down to the agent's cgroup, and each replica's
    cgroup gets ``memory.max`` (GPUs x MiB per GPU), ``memory.swap.max`` 0, ``cpu.weight`` (GPUs x weight per GPU)
    and ``pids.max`` from the node settings. ``memory.events``' ``oom_kill`` is what reports ``oom``."""
    from services.node_agent.service import sandbox_of

    (tmp_path / "cgroup.controllers").write_text(V2_CONTROLLERS + "\n")
    memory_mb, weight, pids = node
    settings = NodeAgentSettings(
        node_id="n1",
        cgroup_root=tmp_path,
        cgroup_version="2",
        cgroup_parent="apportion/agent-1",
        sandbox_memory_mb_per_gpu=memory_mb,
        sandbox_cpu_weight_per_gpu=weight,
        sandbox_pids_max=pids,
        kafka_bootstrap=KAFKA,
        redis_url=REDIS,
    )
    box = sandbox_of(settings, [])
    assert box is not None and box.driver is not None and box.driver.version == 2
    box.driver.filters_devices = False  # a directory takes no BPF program (the fences: the tests above)
    box.driver.closes_ports = False
    name = cgroup_name(("n1", "j", 1, 0))
    replica = tmp_path / "apportion" / "agent-1" / name
    replica.mkdir()
    (replica / "memory.swap.max").write_text("max\n")  # the kernel makes it where swap is accounted
    cg = box.cgroup_for(("n1", "j", 1, 0), gpus, [])
    assert cg is not None and cg.procs_files() == (str(replica / "cgroup.procs"),)
    assert {f.name: f.read_text() for f in replica.iterdir()} == files
    for level in (tmp_path, tmp_path / "apportion", tmp_path / "apportion" / "agent-1"):
        assert (level / "cgroup.subtree_control").read_text() == "+memory +cpu +pids"
    assert cg.oom_kills() == 0
    (replica / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    assert cg.oom_kills() == 1


def test_a_v2_hierarchy_without_the_controllers_writes_no_limit_and_says_so(tmp_path, caplog):
    """The v2 hierarchy of the CI machines offers only ``hugetlb`` (memory, cpu and pids are bound to v1): no
    limit file is written, none is enabled, and the log says which limits are not enforced."""
    (tmp_path / "cgroup.controllers").write_text("hugetlb\n")
    driver = cgroups(tmp_path, "apportion/agent-1", "2")
    assert driver is not None
    driver.filters_devices = False
    cg = driver.create("r", Limits.per_gpu(2, 1024, 100, 64), ())
    assert list((tmp_path / "apportion" / "agent-1" / "r").iterdir()) == []
    assert not list(tmp_path.rglob("cgroup.subtree_control"))
    assert "no memory, cpu, pids controller: those limits are not enforced" in caplog.text
    assert cg.pids() == set()


REFUSALS = [
    # id, user on the bus, the refusal's reason
    ("no user named", None, "no_account: the start names no user on node n1"),
    ("no such account", "apportion-u-nobody", "no_account: no Unix account 'apportion-u-nobody' for user 'apportion-u-nobody' on node n1"),
    ("root", "root", "no_account: account 'root' of user 'root' has uid or gid 0 on node n1"),
    ("system account", "daemon", f"no_account: account 'daemon' of user 'daemon' is a system account (uid {pwd.getpwnam('daemon').pw_uid}, below UID_MIN {login_uid_range()[0]}) that the account map does not name on node n1"),
    ("above UID_MAX", "nobody", f"no_account: account 'nobody' of user 'nobody' is a system account (uid 65534, above UID_MAX {login_uid_range()[1]}) that the account map does not name on node n1"),
]  # fmt: skip


@pytest.mark.parametrize("case_id,user,reason", REFUSALS, ids=[c[0] for c in REFUSALS])
async def test_a_start_without_a_proper_account_is_refused_and_never_runs_as_the_agent(node, case_id, user, reason):
    await node.agent.on_event(node.start("j-x", user, ("true",)))
    assert [(type(e), e.reason) for e in node.producer.events if e.type != "NodeRegistered"] == [
        (WorkloadRefused, reason)
    ]


async def test_an_agent_that_cannot_switch_accounts_refuses_as_its_own_fault_not_the_jobs(node):
    """Not root (here: accounts resolved as by uid 4242), the agent refuses every process ``cannot_isolate``
    (a node fault the dispatcher counts toward cordoning it), not ``no_account`` (which fails the job)."""
    assert node.agent.sandbox is not None
    node.agent.sandbox.accounts = Accounts({}, agent_uid=4242)
    await node.agent.on_event(node.start("j-x", ALICE, ("true",)))
    assert [(type(e), e.reason) for e in node.producer.events if e.type != "NodeRegistered"] == [
        (WorkloadRefused, "cannot_isolate: the node agent is not root (uid 4242): it cannot run a job as its user")
    ]


def test_the_agents_own_account_and_the_account_map(tmp_path, job_accounts):
    alice = job_accounts[ALICE]
    path = tmp_path / "accounts"
    path.write_text("# ops' map\nalice apportion-u-alice\n\nmallory root  # never\n")
    accounts = Accounts(Accounts.read_map(path), agent_uid=0)
    got = accounts.resolve("alice")
    assert isinstance(got, logic.Account) and (got.name, got.uid) == (ALICE, alice.pw_uid)
    assert accounts.resolve("mallory") == "account 'root' of user 'mallory' has uid or gid 0"
    assert Accounts({}, agent_uid=alice.pw_uid).resolve(ALICE) == logic.Unisolated(
        f"the node agent is not root (uid {alice.pw_uid}): it cannot run a job as its user"
    )
    path.write_text("alice\n")
    with pytest.raises(ValueError, match="accounts:1: expected '<user> <account>'"):
        Accounts.read_map(path)


def test_a_system_account_runs_jobs_only_when_the_account_map_names_it():
    """``daemon`` (uid below UID_MIN) is refused under its own name, and runs a job once ops map a user to it."""
    daemon = pwd.getpwnam("daemon")
    refusal = f"account 'daemon' of user 'daemon' is a system account (uid {daemon.pw_uid}, below UID_MIN 1000) that the account map does not name"
    assert Accounts({}, agent_uid=0, uid_min=1000).resolve("daemon") == refusal
    for mapped in ({"svc": "daemon"}, {"daemon": "daemon"}):
        got = Accounts(mapped, agent_uid=0, uid_min=1000).resolve(next(iter(mapped)))
        assert isinstance(got, logic.Account) and (got.name, got.uid) == ("daemon", daemon.pw_uid)
    assert isinstance(Accounts({}, agent_uid=0, uid_min=daemon.pw_uid).resolve("daemon"), logic.Account)


def test_nobody_above_uid_max_runs_jobs_only_when_the_account_map_names_it():
    """``nobody`` (uid 65534, above UID_MAX: the overflow and NFS anonymous uid that daemons run as) is a
    system account too: a user named ``nobody`` does not get its uid (a job there could signal or read what
    those daemons own); ops may still map a user to it."""
    nobody = pwd.getpwnam("nobody")
    assert nobody.pw_uid == 65534
    refusal = "account 'nobody' of user 'nobody' is a system account (uid 65534, above UID_MAX 60000) that the account map does not name"
    assert Accounts({}, agent_uid=0, uid_min=1000, uid_max=60000).resolve("nobody") == refusal
    got = Accounts({"anon": "nobody"}, agent_uid=0, uid_min=1000, uid_max=60000).resolve("anon")
    assert isinstance(got, logic.Account) and (got.name, got.uid) == ("nobody", 65534)
    assert isinstance(Accounts({}, agent_uid=0, uid_min=1000, uid_max=65534).resolve("nobody"), logic.Account)


LOGIN_DEFS = [
    # id, /etc/login.defs text (None: no file), (UID_MIN, UID_MAX)
    ("set", "UID_MIN\t\t\t 500\nUID_MAX 60000\n", (500, 60000)),
    ("max set", "UID_MAX\t\t29999\n", (1000, 29999)),
    ("commented out", "#UID_MIN 500\n#UID_MAX 100\n", (1000, 60000)),
    ("last one counts", "UID_MIN 500\nUID_MIN 2000 # later\nUID_MAX 7\nUID_MAX 9000\n", (2000, 9000)),
    ("not a number", "UID_MIN lots\nUID_MAX -1\n", (1000, 60000)),
    ("not set", "SYS_UID_MIN 100\nSYS_UID_MAX 999\n", (1000, 60000)),
    ("no file", None, (1000, 60000)),
]


@pytest.mark.parametrize("case_id,text,uids", LOGIN_DEFS, ids=[c[0] for c in LOGIN_DEFS])
def test_login_uid_range(tmp_path, case_id, text, uids):
    path = tmp_path / "login.defs"
    if text is not None:
        path.write_text(text)
    assert login_uid_range(path) == uids


@pytest.mark.parametrize(
    "release,own", [("6.18.44-fc-v1300", True), ("5.8.0", True), ("5.7.19", False), ("4.19.0-26-amd64", False)]
)
def test_a_proc_mount_of_its_own_is_made_only_where_its_options_are_its_own(release, own):
    assert proc_mounts_have_own_options(release) is own


def test_limits_per_gpu():
    assert Limits.per_gpu(2, 1024, 100, 4096) == Limits(2 * 1024 * 1024 * 1024, 200, 4096)
    assert Limits.per_gpu(0, None, 9_000, None) == Limits(None, 9_000, None)  # at least one GPU
    assert Limits.per_gpu(8, None, 2_000, None).cpu_weight == 10_000  # v2's maximum


MEMORY_DEFAULTS = [
    # id, the machine's MiB, GPUs of each node the agent hosts, MiB per GPU (MiB // all the GPUs)
    ("one node of 8 GPUs", 24_105, [8], 3_013),
    ("8 simulated nodes of 8 GPUs share the machine", 24_105, [8] * 8, 376),
    ("nodes of different sizes", 16_384, [8, 4, 4], 1_024),
    ("no GPU: the whole machine", 4_096, [], 4_096),
    ("more GPUs than MiB: at least 1", 10, [8, 8], 1),
]  # fmt: skip


@pytest.mark.parametrize("case_id,total_mb,gpus,per_gpu", MEMORY_DEFAULTS, ids=[c[0] for c in MEMORY_DEFAULTS])
def test_the_default_memory_per_gpu_divides_the_machine_among_every_gpu_it_hosts(case_id, total_mb, gpus, per_gpu):
    assert memory_mb_per_gpu(total_mb, gpus) == per_gpu


def test_an_agent_hosting_eight_nodes_limits_their_replicas_to_the_machines_memory_together(tmp_path):
    """The attack: 64 one-GPU replicas of an agent hosting 8 simulated 8-GPU nodes, each asking for its whole
    limit. With the memory shared by one node's GPUs each could hold an eighth of the machine, 8 times what
    the machine has; the default divides it by all 64."""
    from types import SimpleNamespace

    from services.node_agent.service import sandbox_of

    probes = [SimpleNamespace(inventory=SimpleNamespace(gpu_count=8)) for _ in range(8)]
    settings = NodeAgentSettings(
        node_id="n1", cgroup_root=tmp_path, cgroup_parent="apportion/agent-1", kafka_bootstrap=KAFKA, redis_url=REDIS
    )
    box = sandbox_of(settings, probes)  # type: ignore[arg-type] # only the inventories' GPU counts are read
    total_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    assert box is not None and box.memory_mb_per_gpu == total_mb // 64
    assert 64 * box.memory_mb_per_gpu <= total_mb


async def test_the_v2_driver_fences_devices_places_kills_and_removes_on_a_unified_hierarchy(shared_dir):
    """On the unified hierarchy (pure v2 at /sys/fs/cgroup, or the v2 mount beside v1 on the CI machines): the
    replica's BPF device program lets its GPU through (ENXIO: no driver here) and refuses another (EPERM) and
    /dev/zero (not in the rules); ``cgroup.kill`` kills the process and its child in a session of its own; the
    cgroup is removed. A closed port on loopback is refused (EPERM)."""
    root = CGROUPS if (CGROUPS / "cgroup.controllers").exists() else CGROUPS / "unified"
    assert (root / "cgroup.controllers").exists(), "no cgroup v2 hierarchy on this machine"
    gpus = make_fake_gpus(shared_dir / "dev", 2)
    parent = f"apportion-test/{uuid.uuid4().hex[:12]}"
    driver = cgroups(root, parent, "2")
    assert driver is not None and (driver.version, driver.filters_devices, driver.closes_ports) == (2, True, True)
    rules = tuple(r for r in device_rules(gpus[:1], ()) if r != "c 1:5 rwm")  # /dev/zero left out, to be refused
    listener = _listener()
    port = listener.getsockname()[1]
    cg = driver.create(cgroup_name(("n1", "j", 1, 0)), Limits(pids_max=64), rules, (port,))
    opener = (
        "import errno, os, socket, sys, time\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        if p.isdigit():\n"
        "            socket.create_connection(('127.0.0.1', int(p)), timeout=5).close()\n"
        "        else:\n"
        "            os.close(os.open(p, os.O_RDONLY))\n"
        "        print(p, 'ok', flush=True)\n"
        "    except OSError as e:\n"
        "        print(p, errno.errorcode[e.errno], flush=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)\n"
    )
    argv = ["python3", "-c", opener, gpus[0], gpus[1], "/dev/zero", "/dev/null", str(port)]
    proc = subprocess.Popen(argv, preexec_fn=child_setup(cg.procs_files(), None), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), WAIT_S) for _ in range(5)]
        assert lines == [
            f"{gpus[0]} ENXIO\n",
            f"{gpus[1]} EPERM\n",
            "/dev/zero EPERM\n",
            "/dev/null ok\n",
            f"{port} EPERM\n",
        ]
        await until(lambda: len(cg.pids()) == 2, "the child's fork")
        assert proc.pid in cg.pids()
        cg.kill()
        assert await asyncio.to_thread(proc.wait, WAIT_S) == -signal.SIGKILL
        assert cg.remove() and not (root / parent / cg.name).exists()
    finally:
        proc.kill()
        cg.kill()
        cg.remove()
        driver.release()
        listener.close()
    assert not (root / parent).exists()


DEVICE_RULES = [
    # id, rule, (type, major, minor, access): type 1 block, 2 char; access 1 mknod, 2 read, 4 write
    ("one char device", "c 195:0 rwm", (2, 195, 0, 7)),
    ("any block device, mknod only", "b *:* m", (1, None, None, 1)),
    ("every minor of a major, read", "c 136:* r", (2, 136, None, 2)),
    ("everything", "a", (None, None, None, 7)),
]


@pytest.mark.parametrize("case_id,rule,parsed", DEVICE_RULES, ids=[c[0] for c in DEVICE_RULES])
def test_device_rules_parse(case_id, rule, parsed):
    assert devfilter.parse(rule) == parsed


@pytest.mark.parametrize("bad", ["", "x 1:3 rwm", "c 1:3", "c 13 rwm", "c 1:3 rwx"])
def test_a_bad_device_rule_is_an_error(bad):
    with pytest.raises(ValueError, match="not a device rule"):
        devfilter.parse(bad)


def test_the_device_program_has_one_block_per_rule():
    """6 loads and shifts; ``c 195:0 rwm``: type, major, minor tests and ``r0 = 1; exit`` (5); ``c *:* m``:
    the type test, 3 for the access and the return (6); ``r0 = 0; exit`` (2): 19 instructions of 8 bytes.
    Each test jumps past the rest of its block: the first block's type test by 4."""
    code = devfilter.program(["c 195:0 rwm", "c *:* m"])
    assert len(code) == 19 * 8
    opcode, regs, off, imm = struct.unpack("<BBhi", code[6 * 8 : 7 * 8])
    assert (opcode, regs, off, imm) == (0x55, 2, 4, 2)  # if r2 != 2 (char) skip the 4 left of this block


def test_a_secret_the_agent_cannot_change_is_left_with_a_warning(shared_dir, caplog):
    """A read-only secret (as a container's mounted secrets are; here an immutable file) does not stop the agent:
    it is left as it is, and the log says that job accounts may read it."""
    secret = shared_dir / "kafka.password"
    secret.write_text("hunter2")
    secret.chmod(0o644)
    subprocess.run(["chattr", "+i", str(secret)], check=True)
    try:
        protect(secret)
        assert secret.stat().st_mode & 0o777 == 0o644
        assert f"{secret} stays readable by others (Operation not permitted): job accounts may read it" in caplog.text
    finally:
        subprocess.run(["chattr", "-i", str(secret)], check=True)


def test_a_directory_swapped_for_a_link_while_it_is_handed_over_changes_nothing_else(tmp_path, monkeypatch):
    # The job owns the folder that holds a later attempt's TMPDIR, so it can swap that name for a link to a
    # directory it does not own at any moment: here, just after the agent has looked at it.
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    target = tmp_path / "job" / "tmp.attempt-2.replica-0"
    real_lstat, real_fstat = os.lstat, os.fstat

    def swap() -> None:
        if target.is_dir() and not target.is_symlink():
            target.rmdir()
            target.symlink_to(victim)

    def lstat_then_swap(path: Any, *a: Any, **kw: Any) -> os.stat_result:
        st = real_lstat(path, *a, **kw)
        if str(path) == str(target):
            swap()
        return st

    def fstat_then_swap(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        swap()
        return st

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    monkeypatch.setattr(os, "fstat", fstat_then_swap)
    own_dir(str(target), None)
    assert real_lstat(victim).st_mode & 0o777 == 0o755


#: A job that fills its directories as ``argv[1]`` says, then writes ``ready`` and stays until ``go`` appears in its
#: working directory: ``small`` 200 files of 8 KiB in its checkpoint directory and 200 in its ``TMPDIR`` (3.2 MiB);
#: ``big`` one file of 2 MiB in 64 KiB writes (Python ignores ``SIGXFSZ``: the write past the file size limit fails
#: ``EFBIG``, which it writes to ``big.err``); ``hidden`` 300 files of 8 KiB in a directory it then makes mode 000;
#: ``links`` one file of 600,000 bytes with four more names (600,000 bytes on disk, 3,000,000 by name).
DISK_FILLER = r"""
import errno, os, sys, time
mode = sys.argv[1]
if mode == "small":
    for where in (".", os.environ["TMPDIR"]):
        for i in range(200):
            with open(os.path.join(where, f"f{i}"), "wb") as f:
                f.write(b"x" * 8192)
elif mode == "big":
    try:
        with open("big", "wb", buffering=0) as f:
            for _ in range(32):
                f.write(b"x" * 65536)
    except OSError as exc:
        open("big.err", "w").write(errno.errorcode[exc.errno])
elif mode == "hidden":
    os.mkdir("hidden")
    for i in range(300):
        with open(f"hidden/f{i}", "wb") as f:
            f.write(b"x" * 8192)
    os.chmod("hidden", 0)
elif mode == "links":
    with open("w", "wb") as f:
        f.write(b"x" * 600_000)
    for i in range(4):
        os.link("w", f"w{i}")
open("ready", "w").close()
while not os.path.exists("go"):
    time.sleep(0.02)
"""


async def test_a_job_over_its_disk_limit_is_stopped_and_one_under_it_with_hard_links_runs_on(
    job_accounts, shared_dir, monkeypatch
):
    """1 MiB per GPU. Alice's job writes 3.2 MiB of small files (checkpoint directory and TMPDIR); Eve's writes
    600,000 bytes under five names. One measuring pass stops Alice's alone (SIGTERM: exit -15, ``disk_quota``);
    Eve's, under its limit once its hard links count once, runs on and completes when told to."""
    node = Node(shared_dir, monkeypatch, sandbox_disk_mb_per_gpu=1)
    await node.agent.start(heartbeats=False, poll_progress=False, watch_disk=False)
    try:
        filler = write_script(shared_dir, "fill.py", DISK_FILLER)
        await node.agent.on_event(node.start("j-small", ALICE, ("python3", str(filler), "small")))
        await node.agent.on_event(node.start("j-links", EVE, ("python3", str(filler), "links"), gpus=(1,)))
        await until(lambda: all((node.ckpt / j / "ready").exists() for j in ("j-small", "j-links")), "both written")
        assert await node.agent.check_disk() == ["j-small"]
        ended = await node.ended("j-small")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("disk_quota", -signal.SIGTERM)
        assert await node.agent.check_disk() == []
        (node.ckpt / "j-links" / "go").touch()
        assert isinstance(await node.ended("j-links"), JobCompleted)
    finally:
        await node.close()


async def test_one_file_stops_at_the_limit_and_its_writer_is_reported_disk_quota(job_accounts, shared_dir, monkeypatch):
    """A 2 MiB file under a 1 MiB limit stops at exactly 1,048,576 bytes (``RLIMIT_FSIZE``), whatever the
    measuring period. A program that keeps the default ``SIGXFSZ`` (``head``) is killed by it: ``disk_quota``, exit
    -25, before any measurement. Python ignores the signal: its write fails ``EFBIG``, and the next measurement
    stops it, ``disk_quota``."""
    node = Node(shared_dir, monkeypatch, sandbox_disk_mb_per_gpu=1)
    await node.agent.start(heartbeats=False, poll_progress=False, watch_disk=False)
    try:
        head = ("sh", "-c", "exec head -c 2097152 /dev/zero > big")
        await node.agent.on_event(node.start("j-head", ALICE, head))
        ended = await node.ended("j-head")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("disk_quota", -signal.SIGXFSZ)
        assert os.path.getsize(node.ckpt / "j-head" / "big") == 1 << 20
        filler = write_script(shared_dir, "fill.py", DISK_FILLER)
        await node.agent.on_event(node.start("j-big", ALICE, ("python3", str(filler), "big"), gpus=(1,)))
        await until(lambda: (node.ckpt / "j-big" / "ready").exists(), "the file written")
        assert (node.ckpt / "j-big" / "big.err").read_text() == "EFBIG"
        assert os.path.getsize(node.ckpt / "j-big" / "big") == 1 << 20
        assert await node.agent.check_disk() == ["j-big"]
        ended = await node.ended("j-big")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("disk_quota", -signal.SIGTERM)
    finally:
        await node.close()


async def test_files_in_a_directory_the_job_made_unreadable_still_count(job_accounts, shared_dir, monkeypatch):
    """2.4 MiB of small files in a directory the job then makes mode 000: counted all the same (the agent, root,
    lists it), so the job is stopped."""
    node = Node(shared_dir, monkeypatch, sandbox_disk_mb_per_gpu=1)
    await node.agent.start(heartbeats=False, poll_progress=False, watch_disk=False)
    try:
        filler = write_script(shared_dir, "fill.py", DISK_FILLER)
        await node.agent.on_event(node.start("j-hidden", ALICE, ("python3", str(filler), "hidden")))
        await until(lambda: (node.ckpt / "j-hidden" / "ready").exists(), "the files written")
        assert await node.agent.check_disk() == ["j-hidden"]
        ended = await node.ended("j-hidden")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("disk_quota", -signal.SIGTERM)
        assert stat.S_IMODE(os.stat(node.ckpt / "j-hidden" / "hidden").st_mode) == 0
    finally:
        await node.close()


async def test_the_agents_own_period_stops_a_job_writing_without_end(job_accounts, shared_dir, monkeypatch):
    """No pass is called by hand: the agent measures every 0.05 s on its own (``sandbox_disk_poll_wall_s``) and
    stops a job that writes 8 KiB files without end; what it had written when stopped is bounded by the period."""
    node = Node(shared_dir, monkeypatch, sandbox_disk_mb_per_gpu=1, sandbox_disk_poll_wall_s=0.05)
    await node.agent.start(heartbeats=False, poll_progress=False)
    try:
        endless = "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * 8192)\n    i += 1\n"
        await node.agent.on_event(node.start("j-endless", ALICE, ("python3", "-c", endless)))
        ended = await node.ended("j-endless")
        assert isinstance(ended, JobFailed) and (ended.reason, ended.exit_code) == ("disk_quota", -signal.SIGTERM)
    finally:
        await node.close()
