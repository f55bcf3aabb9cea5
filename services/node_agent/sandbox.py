"""The node boundary: each process replica runs as its user, with a clean environment, in a cgroup of its own.

A real workload is untrusted code (rules D5.node-agent and D10.node-boundary; ``docs/security.md``, "Node boundary").
For
each process replica the agent:

* resolves the Unix account of the job's proven user (:class:`Accounts`: the same name, or the one the
  ops' account map names); none, uid or gid 0, or the agent's own account: the start is refused
  (``no_account``, rule 10a of :mod:`services.node_agent.logic`), never run as the agent;
* gives it only the documented environment (:data:`services.node_agent.logic.JOB_ENV_ALLOWED` and the
  job's own ``env``: :meth:`services.node_agent.logic.Workload.process_env`);
* creates its checkpoint and output directories owned by that account, mode 0700 (:func:`own_dir`);
* creates its cgroup (never joining one that holds another run's processes: :func:`_refuse_occupied`;
  :class:`CgroupV1` where the node mounts the v1 controllers, :class:`CgroupV2` on a
  pure v2 hierarchy: :func:`cgroups`) with a memory limit, CPU weight and process limit from the node
  settings (:class:`Limits`) and device access to its own GPUs' device files, the shared NVIDIA control
  devices present and the usual pseudo devices only (:func:`device_rules`: v1 ``devices.allow``, v2 a BPF
  program, :mod:`services.node_agent.devfilter`), and, in the v2 hierarchy (beside v1 on a hybrid node), the
  control plane's ports on loopback closed to its processes (:mod:`services.node_agent.connfilter`);
* gives it a temporary directory of its own (``TMPDIR``, 0700, its account's, removed when it ends) and,
  where the kernel lets the agent make mount and IPC namespaces, a private ``/tmp``, ``/var/tmp``,
  ``/run/lock`` and ``/dev/shm`` (fresh tmpfs mounts in a mount namespace of its own) and IPC objects of its
  own (System V and POSIX message queues, in an IPC namespace of its own), gone with its last process
  (:class:`PrivateMounts`);
* places the child in that cgroup, enters its namespaces, sets ``no_new_privs`` (a setuid program gains
  nothing), enters a Landlock domain of its own where the kernel has the scopes (Linux 6.12+: abstract Unix
  sockets and signals of processes outside the replica refused, and ``ptrace`` of them:
  :mod:`services.node_agent.landlock`), then drops to the account (supplementary groups, gid, uid; umask 077)
  and gives it a session keyring of its own, in the child between fork and exec (:func:`child_setup`), inside
  a new session;
* limits the disk its job's directories on the node take (checkpoint directory, output and ``TMPDIR``): the agent
  measures them on a period (:func:`disk_use`) and stops the replicas of a job over its limit, and each process may
  write no file beyond its replica's limit (``RLIMIT_FSIZE``, :func:`child_setup`);
* on a stop signals every process of the cgroup, and when the replica ends kills whatever is left of it
  (v1: freeze, SIGKILL each, thaw; v2: ``cgroup.kill``), reads whether the OOM killer struck (reported
  ``oom``), and removes the cgroup.

The agent's own files (node keys, the Kafka password file, the keyring, the stack.env, its state
directory and journal) are made unreadable to others when it starts (:func:`protect_agent_files`).

Where the kernel refuses a v2 device program (no BPF, no privilege) the agent says so at start: fence the
devices with the NVIDIA container runtime or systemd's ``DevicePolicy=closed`` there.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import pwd
import re
import resource
import signal
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from apportion.jobdirs import job_dir_name
from services.node_agent import connfilter, devfilter, landlock
from services.node_agent.logic import Account, RunKey, Unisolated

log = logging.getLogger("apportion.node_agent")

# --------------------------------------------------------------------------- accounts


class Accounts:
    """Which Unix account runs a job of a proven user.

    Args:
        account_map: user -> account name, for users whose account is not named as they are (the ops'
            account map file, :meth:`read_map`); any other user runs as the account of the same name.
        agent_uid: the agent's own uid: never given to a job.
        uid_min, uid_max: the range of login accounts' uids (:func:`login_uid_range`); an account outside it (a
            system account: ``daemon``, ``www-data`` below it, ``nobody`` above it) runs a job only when the
            account map names it.
    """

    def __init__(
        self,
        account_map: Mapping[str, str] | None = None,
        agent_uid: int | None = None,
        uid_min: int | None = None,
        uid_max: int | None = None,
    ) -> None:
        self.account_map = dict(account_map or {})
        self.agent_uid = os.geteuid() if agent_uid is None else agent_uid
        login_min, login_max = login_uid_range()
        self.uid_min = login_min if uid_min is None else uid_min
        self.uid_max = login_max if uid_max is None else uid_max

    @staticmethod
    def read_map(path: Path) -> dict[str, str]:
        """The account map in ``path``: one ``<user> <account>`` per line; blank lines and ``#`` comments skipped.

        Raises:
            OSError: the file cannot be read.
            ValueError: a line is not two names, or a user is mapped twice (line number in the message).
        """
        out: dict[str, str] = {}
        for n, line in enumerate(path.read_text().splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2:
                raise ValueError(f"{path}:{n}: expected '<user> <account>', got {line.strip()!r}")
            if words[0] in out:
                raise ValueError(f"{path}:{n}: user {words[0]!r} is mapped twice")
            out[words[0]] = words[1]
        return out

    def resolve(self, user: str | None) -> Account | str | Unisolated:
        """The account of ``user``, or why there is none (the detail of a ``no_account`` refusal), or why this
        agent can run no job as its user (:class:`~services.node_agent.logic.Unisolated`: ``cannot_isolate``)."""
        if self.agent_uid != 0:
            return Unisolated(f"the node agent is not root (uid {self.agent_uid}): it cannot run a job as its user")
        if not user:
            return "the start names no user"
        name = self.account_map.get(user, user)
        try:
            pw = pwd.getpwnam(name)
        except (KeyError, ValueError):
            return f"no Unix account {name!r} for user {user!r}"
        if pw.pw_uid == 0 or pw.pw_gid == 0:
            return f"account {name!r} of user {user!r} has uid or gid 0"
        if pw.pw_uid == self.agent_uid:
            return f"account {name!r} of user {user!r} is the node agent's own (uid {pw.pw_uid})"
        if not self.uid_min <= pw.pw_uid <= self.uid_max and name not in self.account_map.values():
            where = f"below UID_MIN {self.uid_min}" if pw.pw_uid < self.uid_min else f"above UID_MAX {self.uid_max}"
            return (
                f"account {name!r} of user {user!r} is a system account (uid {pw.pw_uid}, {where}) "
                "that the account map does not name"
            )
        groups = tuple(sorted(set(os.getgrouplist(name, pw.pw_gid))))
        if 0 in groups:
            return f"account {name!r} of user {user!r} is in group 0"
        return Account(name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir or "/")


#: Where the range of login accounts' uids is set (``UID_MIN``, ``UID_MAX``), and its bounds when the file does
#: not say. Above it lie ``nobody`` (65534), the kernel's overflow uid and NFS's anonymous one, which daemons share.
LOGIN_DEFS = Path("/etc/login.defs")
DEFAULT_UID_MIN = 1000
DEFAULT_UID_MAX = 60000


def login_uid_range(path: Path = LOGIN_DEFS) -> tuple[int, int]:
    """``(UID_MIN, UID_MAX)`` of ``path`` (``/etc/login.defs``: the uids ``useradd`` gives login accounts); each
    is :data:`DEFAULT_UID_MIN` or :data:`DEFAULT_UID_MAX` when the file is missing, does not set it or sets it to
    no number (the last setting counts)."""
    defaults = {"UID_MIN": DEFAULT_UID_MIN, "UID_MAX": DEFAULT_UID_MAX}
    bounds = dict(defaults)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) == 2 and words[0] in bounds:
            bounds[words[0]] = int(words[1]) if words[1].isdigit() else defaults[words[0]]
    return bounds["UID_MIN"], bounds["UID_MAX"]


# --------------------------------------------------------------------------- files


def own_dir(path: str, account: Account | None) -> None:
    """Create directory ``path`` (mode 0700) if missing, and hand it to ``account`` (owner uid and gid, 0700).

    The owner and mode are set through one descriptor opened without following links, so a job that swaps
    the name for a link between the check and the change (its own directory holds the name) changes nothing
    but its own directory.

    A directory that already belongs to another account (neither ``account`` nor the agent's, which made
    it) is never handed over: another user's job made it, under an id whose directory name is this job's
    (:func:`apportion.jobdirs.job_dir_name`), so what it holds (files, or hard links to them kept
    elsewhere) would reach into this job's working directory.

    Raises:
        OSError: it cannot be made, it is not a directory (a link planted there is not followed), or
            (``EPERM``) it belongs to another account.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    fd = open_dir(path)
    try:
        if account is not None:
            owner = os.fstat(fd).st_uid
            if owner not in (account.uid, os.geteuid()):
                raise OSError(errno.EPERM, f"belongs to uid {owner}, not to account {account.name!r}", path)
            os.fchown(fd, account.uid, account.gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_dir(path: str) -> int:
    """A descriptor (read-only, close-on-exec) of directory ``path``, opened without following a link at its name.

    Raises:
        NotADirectoryError: a link or anything but a directory lies there (``ENOTDIR``, ``not a directory``).
        OSError: it cannot be opened (missing, ``EACCES``).
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path) from exc
        raise


def private_dir(path: Path) -> None:
    """Make directory ``path`` (mode 0700) unless it exists; one that exists must be a directory (a link at the
    name is not followed) of the agent's own uid that neither group nor others may write.

    For a directory at a name anyone could have taken first (the default state directory in the shared
    temporary directory): a local account that made it, or planted a link there, would otherwise have the
    agent (root) write its journal, or change the mode of its job roots, through links of that account's
    choosing, and could swap the journal for one naming other processes to kill.

    Raises:
        OSError: it cannot be made, it is not a directory, it belongs to another uid, or group or others may
            write it (the message says which, and how to go on).
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a directory (a link there is not followed): remove it", str(path))
    if st.st_uid != os.geteuid():
        raise OSError(
            errno.EPERM,
            f"belongs to uid {st.st_uid}, not to the agent's uid {os.geteuid()}: another account made it; "
            "remove it, or set --state-dir to a directory of the agent's own",
            str(path),
        )
    if st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"mode {stat.S_IMODE(st.st_mode):04o}: group or others may write it", str(path))


def not_world_writable(path: Path, setting: str) -> None:
    """Refuse a configured directory of the agent (``setting`` names it) that everyone may write: a shared
    temporary or scratch directory (``/tmp``, mode 1777). The agent would make it 0700 or 0711 (its state
    directory, a job root), taking it from every other user of the node, and keep its journal or the jobs'
    directories where any account can take their names first. Missing: nothing to check (it is made 0700).

    Raises:
        OSError: ``EPERM``, the mode and the setting to change in the message.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_mode & 0o002:
        raise OSError(
            errno.EPERM,
            f"mode {stat.S_IMODE(st.st_mode):04o}: anyone may write it (a shared temporary directory?); "
            f"set {setting} to a directory of the agent's own",
            str(path),
        )


def protect(path: Path | str | None, dir_mode: int = 0o700) -> None:
    """Take every permission of group and others from ``path`` (a file: 0600 at most; a directory: ``dir_mode``,
    and each file directly in it 0600 at most). Missing: nothing to do. A file that cannot be changed (a
    read-only mount, as a container's secrets are) is left as it is, with a warning when others can read it."""
    if path is None:
        return
    p = Path(path)
    try:
        st = p.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        return
    targets = [(p, dir_mode if stat.S_ISDIR(st.st_mode) else stat.S_IMODE(st.st_mode) & 0o700)]
    if stat.S_ISDIR(st.st_mode):
        for child in p.iterdir():
            cst = child.lstat()
            if stat.S_ISREG(cst.st_mode):
                targets.append((child, stat.S_IMODE(cst.st_mode) & 0o700))
    for target, mode in targets:
        try:
            target.chmod(mode)
        except OSError as exc:
            if target.stat().st_mode & 0o007:
                log.warning("%s stays readable by others (%s): job accounts may read it", target, exc.strerror)


def protect_agent_files(
    secrets: Iterable[Path | str | None], state_dir: Path, job_roots: Sequence[Path], journal: Path | None
) -> None:
    """Make the agent's own files unreadable to job accounts.

    ``secrets`` (key directories, password files, the keyring, the stack.env): 0700 / 0600. The state
    directory: 0700, or 0711 when a job root lies inside it (job accounts must pass through it to their own
    directories, never list it). The job roots (checkpoint root, job output): created if missing, 0711 (each
    job's directory in them is its user's, 0700). The journal: 0600.
    """
    for s in secrets:
        protect(s)
    for root in job_roots:
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o711)
    inside = any(state_dir in r.parents for r in job_roots)
    if state_dir.is_dir():
        state_dir.chmod(0o711 if inside else 0o700)
    protect(journal)


# --------------------------------------------------------------------------- disk

#: What every inode in a job's directories is charged at least, bytes: one block, the least a non-empty file takes on
#: ext4 or xfs. An empty file or a fifo, which takes no block but an inode, costs this much, so a job cannot use up
#: the file system's inodes with files that weigh nothing (a job at its limit L holds at most L / 4096 of them).
ENTRY_FLOOR_BYTES = 4096

#: The share of the free space of the job roots' file system that the default disk limit gives out
#: (:func:`disk_mb_per_gpu`); the rest is the agent's journal's, and the margin for what replicas write between two
#: measurements.
DISK_SHARE = 0.9


def entry_bytes(size: int, blocks: int) -> int:
    """What one inode of a job's directories is charged: the largest of its size, its allocated blocks
    (``st_blocks`` x 512) and :data:`ENTRY_FLOOR_BYTES`. A sparse file is charged its size (the room it may take
    once written), a small file its block."""
    return max(size, blocks * 512, ENTRY_FLOOR_BYTES)


@dataclass(frozen=True, slots=True)
class DiskUse:
    """What :func:`disk_use` found.

    Attributes:
        used_bytes: the bytes charged (:func:`entry_bytes` of each inode, hard links once); the whole tree's when
            :attr:`complete`, else a lower bound (the walk stops once it passes the limit).
        complete: every directory was listed.
        unreadable: the first directory that could not be listed (the job took its permissions away, or the agent
            is not root): ``None`` when none. Counts as over the limit: what it holds cannot be measured.
        entries: the inodes charged.
    """

    used_bytes: int
    complete: bool
    unreadable: str | None = None
    entries: int = 0

    def over(self, limit_bytes: int) -> bool:
        """Over ``limit_bytes``: more than it charged (exactly the limit is within it), or a directory unreadable."""
        return self.unreadable is not None or self.used_bytes > limit_bytes


def disk_use(
    roots: Iterable[str],
    limit_bytes: int,
    *,
    listdir: Callable[[str, tuple[int, int]], Iterator[Any]] | None = None,
    lstat: Callable[[str], os.stat_result] = os.lstat,
) -> DiskUse:
    """Measure the directories ``roots`` of one job: every inode beneath them charged :func:`entry_bytes` once
    (a hard link's other names, within or across the roots, are the same inode: ``(st_dev, st_ino)``); links are
    never followed (a symbolic link is charged as the link it is, and a directory is listed only while its name
    still leads, without a link, to the inode its parent listed: :func:`list_dir`); a root that is missing is
    charged nothing, a name removed or moved during the walk is passed over (found where it went, if in the roots).

    The walk stops as soon as the charge passes ``limit_bytes`` (the job is over, the rest needs no look) or a
    directory cannot be listed (``EACCES``: over too): since every inode costs at least :data:`ENTRY_FLOOR_BYTES`,
    one pass looks at no more than ``limit_bytes / 4096 + 1`` inodes, whatever the job made. ``listdir`` and
    ``lstat``: the file system's (tests give a tree of their own).
    """
    listing = list_dir if listdir is None else listdir
    seen: set[tuple[int, int]] = set()
    used = 0
    todo: list[tuple[str, tuple[int, int]]] = []

    def charge(st: os.stat_result) -> bool:
        nonlocal used
        key = (st.st_dev, st.st_ino)
        if key in seen:
            return False
        seen.add(key)
        used += entry_bytes(st.st_size, getattr(st, "st_blocks", 0))
        return True

    for root in roots:
        try:
            st = lstat(root)
        except FileNotFoundError:
            continue
        if charge(st) and stat.S_ISDIR(st.st_mode):
            todo.append((root, (st.st_dev, st.st_ino)))
    if used > limit_bytes:
        return DiskUse(used, False, None, len(seen))
    while todo:
        directory, key = todo.pop()
        entries = listing(directory, key)
        try:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not charge(st):
                    continue
                if used > limit_bytes:
                    return DiskUse(used, False, None, len(seen))
                if stat.S_ISDIR(st.st_mode):
                    todo.append((os.path.join(directory, entry.name), (st.st_dev, st.st_ino)))
        except FileNotFoundError:
            continue
        except OSError:  # EACCES (a directory made unreadable, an agent that is not root), EIO
            return DiskUse(used, False, directory, len(seen))
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()
    return DiskUse(used, True, None, len(seen))


def list_dir(path: str, key: tuple[int, int]) -> Iterator[os.DirEntry[str]]:
    """The entries of directory ``path`` (each ``stat`` relative to the directory opened, never through its name
    again), when ``path`` still leads to the inode ``key`` (``(st_dev, st_ino)``) its parent's listing gave it.

    Opened without following a link at its last component, and checked on the descriptor: a job that swapped the
    directory, or one of the directories above it, for a link (to ``/``, to another user's files) between the
    parent's listing and this one makes the agent list nothing of where the link leads.

    Raises:
        FileNotFoundError: ``path`` is gone, or is no longer that directory (moved, or swapped for a link or a
            file): passed over by :func:`disk_use`.
        PermissionError: it cannot be opened for listing.
    """
    try:
        fd = open_dir(path)
    except NotADirectoryError as exc:
        raise FileNotFoundError(errno.ENOENT, "no longer a directory", path) from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != key:
            raise FileNotFoundError(errno.ENOENT, "no longer the directory listed", path)
        with os.scandir(fd) as it:
            yield from it
    finally:
        os.close(fd)


def disk_mb_per_gpu(free_bytes: int, gpus_per_node: Iterable[int]) -> int:
    """The default disk limit per GPU (``sandbox_disk_mb_per_gpu`` unset): :data:`DISK_SHARE` of the ``free_bytes``
    of the job roots' file system when the agent starts, over every GPU the agent hosts, at least 1 MiB; so the
    replicas of all its nodes at their limits together leave a tenth of it to the agent."""
    return max(1, int(free_bytes * DISK_SHARE) // (1 << 20) // max(1, sum(gpus_per_node)))


def free_bytes(paths: Iterable[Path]) -> int:
    """The least space free to an unprivileged writer (``f_bavail``) on the file systems of ``paths`` (of the
    nearest directory that exists above one that does not yet)."""
    free = []
    for p in paths:
        where = p.absolute()
        while not where.exists() and where != where.parent:
            where = where.parent
        st = os.statvfs(where)
        free.append(st.f_bavail * st.f_frsize)
    return min(free) if free else 0


# --------------------------------------------------------------------------- devices

#: Pseudo devices every process may use (the OCI runtime's default set): mknod of anything (opening it is
#: what the rules decide), null, zero, full, random, urandom, tty, ptmx and the pseudo terminals.
BASE_DEVICE_RULES = (
    "c *:* m",
    "b *:* m",
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:7 rwm",
    "c 1:8 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 5:2 rwm",
    "c 136:* rwm",
)


def device_rule(path: str) -> str | None:
    """The v1 ``devices.allow`` rule of the device file ``path`` (``c 195:0 rwm``); ``None`` when it is missing or
    not a device."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
    if kind is None:
        return None
    return f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)} rwm"


def device_rules(gpu_files: Iterable[str], shared_files: Iterable[str]) -> tuple[str, ...]:
    """What a replica may open: :data:`BASE_DEVICE_RULES`, its own GPUs' device files and the shared control
    devices present (any other GPU of the node is denied)."""
    extra = [r for r in (device_rule(p) for p in (*gpu_files, *shared_files)) if r is not None]
    return BASE_DEVICE_RULES + tuple(dict.fromkeys(extra))


# --------------------------------------------------------------------------- cgroups


@dataclass(frozen=True, slots=True)
class Limits:
    """What one replica's cgroup allows (``None``: no limit).

    Attributes:
        memory_bytes: memory (and, on v1, memory plus swap) limit.
        cpu_weight: CPU weight, cgroup v2 scale (1-10000, 100 = a default process); v1 ``cpu.shares`` is
            ``weight * 1024 / 100``.
        pids_max: processes and threads.
    """

    memory_bytes: int | None = None
    cpu_weight: int | None = None
    pids_max: int | None = None

    @classmethod
    def per_gpu(cls, gpus: int, memory_mb: int | None, cpu_weight: int | None, pids_max: int | None) -> Limits:
        """A replica of ``gpus`` GPUs: ``gpus * memory_mb`` MiB, weight ``gpus * cpu_weight`` (capped at 10000),
        ``pids_max`` processes (node settings ``sandbox_memory_mb_per_gpu``, ``sandbox_cpu_weight_per_gpu``,
        ``sandbox_pids_max``). A replica always holds at least one GPU."""
        n = max(1, gpus)
        return cls(
            memory_bytes=None if memory_mb is None else n * memory_mb * 1024 * 1024,
            cpu_weight=None if cpu_weight is None else max(1, min(10_000, n * cpu_weight)),
            pids_max=pids_max,
        )


def memory_mb_per_gpu(total_mb: int, gpus_per_node: Iterable[int]) -> int:
    """The default memory limit per GPU (``sandbox_memory_mb_per_gpu`` unset): the machine's ``total_mb`` over
    every GPU the agent hosts on it, at least 1 MiB. An agent hosting several nodes on one machine (simulated
    nodes) gives out their GPUs from the same memory: 8 nodes of 8 GPUs on 24,105 MiB get 376 MiB per GPU, so
    64 one-GPU replicas fit in the machine together, where a share of one node's 8 GPUs (3,013 MiB) would let
    them ask for eight times what it has."""
    return max(1, total_mb // max(1, sum(gpus_per_node)))


class Cgroup(Protocol):
    """One replica's cgroup."""

    name: str

    def procs_files(self) -> tuple[str, ...]:
        """The ``cgroup.procs`` files a child writes its pid to (one per hierarchy)."""
        ...

    def pids(self) -> set[int]:
        """The processes in it now."""
        ...

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process in it."""
        ...

    def kill(self) -> None:
        """SIGKILL every process in it, including any forking meanwhile."""
        ...

    def oom_kills(self) -> int:
        """How many processes the OOM killer killed in it."""
        ...

    def remove(self) -> bool:
        """Remove it once empty; ``False`` while processes remain."""
        ...


class CgroupDriver(Protocol):
    """Makes replica cgroups under the agent's parent cgroup."""

    version: int
    #: whether :meth:`create` fences devices (v1: the devices controller is mounted; v2: a BPF program loads)
    filters_devices: bool
    #: whether :meth:`create` closes ports (a v2 hierarchy, beside v1 on a hybrid node, where the connect
    #: filter loads: :mod:`services.node_agent.connfilter`)
    closes_ports: bool

    def create(
        self,
        name: str,
        limits: Limits,
        devices: Sequence[str],
        closed_ports: Sequence[int] = (),
        closed_addresses: Sequence[str] = (),
    ) -> Cgroup:
        """A new (or the existing) cgroup ``name`` with ``limits``, device rules, and ``closed_ports`` on loopback
        and on ``closed_addresses`` closed to its processes (where :attr:`closes_ports`)."""
        ...

    def open(self, name: str) -> Cgroup | None:
        """The existing cgroup ``name`` (an adopted replica's), or ``None``."""
        ...

    def release(self) -> None:
        """Remove the agent's parent cgroup and its ancestors that are empty (the agent's shutdown)."""
        ...


def _connect_filter_loads(where: Path) -> bool:
    """Whether the kernel takes the connect filter (:mod:`services.node_agent.connfilter`) for the v2 hierarchy
    at ``where``; when not, the error log says why, once."""
    try:
        for fd in connfilter.load([1]):
            os.close(fd)
        return True
    except OSError as exc:
        log.warning("cgroup v2 at %s: cannot load a BPF connect filter: %s", where, exc)
        return False


def _rmdirs(base: Path, parent: str) -> None:
    """``rmdir`` ``base/parent`` and each of its ancestors below ``base`` until one is not empty."""
    parts = parent.split("/") if parent else []
    while parts:
        try:
            (base / "/".join(parts)).rmdir()
        except OSError:
            return
        parts.pop()


def _refuse_occupied(name: str, pids: set[int], where: Path) -> None:
    """A new replica's cgroup holds no process yet; one that does belongs to another run: a second agent on this
    machine under the same parent (two local stacks with the same agent name and topic prefix) whose replica has
    the same name (node, job id, attempt and replica alike; a job id is its submitter's choice). Joining it
    would rewrite that run's limits, and the end of this one would kill its processes.

    Raises:
        OSError: ``EEXIST``, the cgroup and some of its processes named (the start fails; nothing joined it).
    """
    if pids:
        raise OSError(
            errno.EEXIST, f"cgroup {name} already holds processes {sorted(pids)[:8]} of another run", str(where)
        )


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in path.read_text().split()}
    except FileNotFoundError:
        return set()


def _counter(path: Path, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (``memory.events``, ``memory.oom_control``); 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (FileNotFoundError, ValueError):
        pass
    return 0


def _kill_each(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_for(check: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``check`` (every millisecond) for at most ``timeout_s`` wall seconds: the kernel's freezer and
    process teardown finish on their own time, with nothing to wait on but the files."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.001)
    return True


class CgroupV1:
    """A replica's cgroup in each v1 hierarchy (:data:`CgroupV1Driver.CONTROLLERS`)."""

    def __init__(self, name: str, dirs: Mapping[str, Path]) -> None:
        self.name = name
        self.dirs = dict(dirs)

    def procs_files(self) -> tuple[str, ...]:
        return tuple(str(d / "cgroup.procs") for d in self.dirs.values())

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            out |= _read_pids(d / "cgroup.procs")
        return out

    def signal(self, sig: int) -> None:
        _kill_each(self.pids(), sig)

    def kill(self) -> None:
        """Freeze (no fork can escape), SIGKILL every process, thaw (they die). Removed already: nothing to do."""
        freezer = self.dirs.get("freezer")
        if freezer is not None and not freezer.is_dir():
            return
        if freezer is not None:
            _write(freezer / "freezer.state", "FROZEN")
            _wait_for(lambda: (freezer / "freezer.state").read_text().strip() == "FROZEN", 2.0)
        try:
            _kill_each(self.pids(), signal.SIGKILL)
        finally:
            if freezer is not None:
                _write(freezer / "freezer.state", "THAWED")
        if freezer is None:  # without a freezer a fork may race the kill: repeat until none is left

            def none_left() -> bool:
                left = self.pids()
                _kill_each(left, signal.SIGKILL)
                return not left

            _wait_for(none_left, 2.0)

    def oom_kills(self) -> int:
        mem = self.dirs.get("memory")
        return 0 if mem is None else _counter(mem / "memory.oom_control", "oom_kill")

    def remove(self) -> bool:
        if not _wait_for(lambda: not self.pids(), 5.0):
            return False
        for d in self.dirs.values():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
        return True


class CgroupV1Driver:
    """Replica cgroups ``<root>/<controller>/<parent>/<name>`` on a node with the v1 controllers mounted.

    Args:
        root: where the hierarchies are mounted (``/sys/fs/cgroup``).
        parent: the agent's cgroup path under each (``apportion/<agent>``).
    """

    version = 1
    #: ``unified``: the v2 hierarchy a hybrid node mounts beside the v1 controllers (``<root>/unified``),
    #: where the connect filter is attached (:mod:`services.node_agent.connfilter`).
    CONTROLLERS = ("devices", "memory", "pids", "cpu", "freezer", "unified")

    def __init__(self, root: Path, parent: str) -> None:
        self.root = root
        self.parent = parent.strip("/")
        self.controllers = tuple(c for c in self.CONTROLLERS if (root / c / "cgroup.procs").exists())
        self.filters_devices = "devices" in self.controllers
        self.closes_ports = _connect_filter_loads(root / "unified") if "unified" in self.controllers else False

    def _dirs(self, name: str) -> dict[str, Path]:
        return {c: self.root / c / self.parent / name for c in self.controllers}

    def create(
        self,
        name: str,
        limits: Limits,
        devices: Sequence[str],
        closed_ports: Sequence[int] = (),
        closed_addresses: Sequence[str] = (),
    ) -> CgroupV1:
        dirs = self._dirs(name)
        _refuse_occupied(name, CgroupV1(name, dirs).pids(), self.root / "<controller>" / self.parent / name)
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        if "devices" in dirs:
            d = dirs["devices"]
            _write(d / "devices.deny", "a")
            for rule in devices:
                _write(d / "devices.allow", rule)
        if "memory" in dirs and limits.memory_bytes is not None:
            d = dirs["memory"]
            _write(d / "memory.limit_in_bytes", str(limits.memory_bytes))
            if (d / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                _write(d / "memory.memsw.limit_in_bytes", str(limits.memory_bytes))
        if "cpu" in dirs and limits.cpu_weight is not None:
            _write(dirs["cpu"] / "cpu.shares", str(max(2, limits.cpu_weight * 1024 // 100)))
        if "pids" in dirs and limits.pids_max is not None:
            _write(dirs["pids"] / "pids.max", str(limits.pids_max))
        if closed_ports and self.closes_ports:
            connfilter.attach(str(dirs["unified"]), closed_ports, closed_addresses)
        return CgroupV1(name, dirs)

    def open(self, name: str) -> CgroupV1 | None:
        dirs = {c: d for c, d in self._dirs(name).items() if d.is_dir()}
        return CgroupV1(name, dirs) if dirs else None

    def release(self) -> None:
        for c in self.controllers:
            _rmdirs(self.root / c, self.parent)


class CgroupV2:
    """A replica's cgroup in the unified (v2) hierarchy."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path

    def procs_files(self) -> tuple[str, ...]:
        return (str(self.path / "cgroup.procs"),)

    def pids(self) -> set[int]:
        return _read_pids(self.path / "cgroup.procs")

    def signal(self, sig: int) -> None:
        _kill_each(self.pids(), sig)

    def kill(self) -> None:
        """``cgroup.kill`` (Linux 5.14+); else freeze, SIGKILL each, thaw. Removed already: nothing to do."""
        if not self.path.is_dir():
            return
        if (self.path / "cgroup.kill").exists():
            _write(self.path / "cgroup.kill", "1")
            return
        _write(self.path / "cgroup.freeze", "1")
        try:
            _kill_each(self.pids(), signal.SIGKILL)
        finally:
            _write(self.path / "cgroup.freeze", "0")

    def oom_kills(self) -> int:
        return _counter(self.path / "memory.events", "oom_kill")

    def remove(self) -> bool:
        if not _wait_for(lambda: not self.pids(), 5.0):
            return False
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        return True


class CgroupV2Driver:
    """Replica cgroups ``<root>/<parent>/<name>`` in a unified (v2) hierarchy.

    The memory, cpu and pids controllers the hierarchy offers are enabled down to the agent's parent; a
    limit whose controller is missing is not enforced (said once in the log). Devices are filtered by a BPF
    program attached to each replica's cgroup (:mod:`services.node_agent.devfilter`); where the kernel
    refuses to load one (no BPF, no privilege) they are not, which the log says at start.
    """

    version = 2
    WANTED = ("memory", "cpu", "pids")

    def __init__(self, root: Path, parent: str) -> None:
        self.root = root
        self.parent = parent.strip("/")
        offered = set((root / "cgroup.controllers").read_text().split())
        self.controllers = tuple(c for c in self.WANTED if c in offered)
        missing = [c for c in self.WANTED if c not in offered]
        if missing:
            log.warning("cgroup v2 at %s: no %s controller: those limits are not enforced", root, ", ".join(missing))
        self.closes_ports = _connect_filter_loads(root)
        try:
            os.close(devfilter.load(BASE_DEVICE_RULES))
            self.filters_devices = True
        except OSError as exc:
            self.filters_devices = False
            log.error(
                "cgroup v2 at %s: cannot load a BPF device filter (%s): device access is not filtered (fence GPUs "
                "with the NVIDIA container runtime or systemd DevicePolicy=closed)",
                root,
                exc,
            )
        enable = " ".join(f"+{c}" for c in self.controllers)
        path = root
        for part in self.parent.split("/") if self.parent else []:
            if enable:
                _write(path / "cgroup.subtree_control", enable)
            path = path / part
            path.mkdir(exist_ok=True)
        if enable:
            _write(path / "cgroup.subtree_control", enable)

    def create(
        self,
        name: str,
        limits: Limits,
        devices: Sequence[str],
        closed_ports: Sequence[int] = (),
        closed_addresses: Sequence[str] = (),
    ) -> CgroupV2:
        path = self.root / self.parent / name
        _refuse_occupied(name, CgroupV2(name, path).pids(), path)
        path.mkdir(exist_ok=True)
        if "memory" in self.controllers and limits.memory_bytes is not None:
            _write(path / "memory.max", str(limits.memory_bytes))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
        if "cpu" in self.controllers and limits.cpu_weight is not None:
            _write(path / "cpu.weight", str(limits.cpu_weight))
        if "pids" in self.controllers and limits.pids_max is not None:
            _write(path / "pids.max", str(limits.pids_max))
        if self.filters_devices:
            devfilter.attach(str(path), devices)
        if closed_ports and self.closes_ports:
            connfilter.attach(str(path), closed_ports, closed_addresses)
        return CgroupV2(name, path)

    def open(self, name: str) -> CgroupV2 | None:
        path = self.root / self.parent / name
        return CgroupV2(name, path) if path.is_dir() else None

    def release(self) -> None:
        _rmdirs(self.root, self.parent)


def cgroups(root: Path, parent: str, version: str = "auto") -> CgroupDriver | None:
    """The cgroup driver of this node: v2 when ``root`` is a unified hierarchy (``cgroup.controllers`` there),
    v1 when the v1 devices controller is mounted under it; ``version`` ``"1"`` or ``"2"`` forces one. ``None``:
    neither (the agent refuses to isolate without one: :class:`Sandbox`)."""
    if version == "2" or (version == "auto" and (root / "cgroup.controllers").exists()):
        return CgroupV2Driver(root, parent)
    if version == "1" or (version == "auto" and (root / "devices" / "devices.allow").exists()):
        return CgroupV1Driver(root, parent)
    return None


def cgroup_name(key: RunKey) -> str:
    """The cgroup of a replica: ``<node>.<job>.<attempt>.<replica>``, each name made safe
    (:func:`apportion.jobdirs.job_dir_name`), the same after an agent restart (adoption)."""
    node, job, attempt, replica = key
    return f"{job_dir_name(node)}.{job_dir_name(job)}.{attempt}.{replica}"


# --------------------------------------------------------------------------- the child


def child_setup(
    procs_files: Sequence[str],
    account: Account | None,
    mounts: Callable[[], None] | None = None,
    scopes: int = 0,
    file_size_bytes: int | None = None,
) -> Callable[[], None]:
    """What the child runs between fork and exec (``preexec_fn``, after ``setsid``): join the cgroup while
    still privileged, enter its own mount and IPC namespaces (``mounts``: :meth:`PrivateMounts.setup`), set
    ``no_new_privs`` (no ``exec`` of a setuid or setgid program, nor of one with file capabilities, gives it
    more than it has: :func:`no_new_privs`), enter a Landlock domain of its own scoped to ``scopes`` (0: none;
    :func:`services.node_agent.landlock.restrict_self`: abstract Unix sockets, signals and ``ptrace`` of
    processes outside the replica refused), then umask 077, drop to ``account`` (supplementary groups, gid,
    uid: real, effective and saved) and join a new session keyring of that account's (the agent's, and the
    keys it reaches, are out of the job's possession: :func:`new_session_keyring`). With ``file_size_bytes``, no
    process of the replica may write a file beyond that size (``RLIMIT_FSIZE``, soft and hard, set while still
    privileged: the kernel sends ``SIGXFSZ`` to a write past it), so one file cannot pass the replica's disk limit
    between two measurements. Nothing here allocates a lock another thread could hold (no NSS lookups: the groups
    were resolved before the fork)."""
    targets = tuple(procs_files)

    def setup() -> None:
        pid = str(os.getpid()).encode()
        for f in targets:
            fd = os.open(f, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        if mounts is not None:
            mounts()
        if file_size_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_bytes, file_size_bytes))
        no_new_privs()
        if scopes:
            landlock.restrict_self(scopes)
        os.umask(0o077)
        if account is not None:
            os.setgroups(list(account.groups))
            os.setgid(account.gid)
            os.setuid(account.uid)
            new_session_keyring()

    return setup


_PR_SET_NO_NEW_PRIVS = 38
_KEYCTL_JOIN_SESSION_KEYRING = 1
_KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219}


def no_new_privs() -> None:
    """``prctl(PR_SET_NO_NEW_PRIVS, 1)`` on the calling process, inherited by every child and kept across
    ``exec``: a setuid-root program runs with the caller's uid, file capabilities are not granted.

    Raises:
        OSError: the kernel refused (Linux before 3.5).
    """
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


def new_session_keyring() -> None:
    """Join a new anonymous session keyring (``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``, as ``pam_keyinit``
    does for a login), owned by the calling account. A child otherwise keeps its parent's session keyring, and
    possesses it and every key linked from it (root's user keyring among them) whatever its uid. A kernel or
    container that refuses keyrings altogether (``ENOSYS``, ``EPERM``, ``EACCES``: no keyring to inherit
    either) is left as it is.

    Raises:
        OSError: any other refusal (``EDQUOT``: the account's key quota is spent).
    """
    nr = _KEYCTL_SYSCALL.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"keyctl: no system call number known for {platform.machine()}")
    if _libc.syscall(nr, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
            raise OSError(err, f"keyctl(KEYCTL_JOIN_SESSION_KEYRING): {os.strerror(err)}")


# --------------------------------------------------------------------------- mount namespaces

_CLONE_NEWNS, _CLONE_NEWIPC = 0x00020000, 0x08000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

#: Where a replica gets a fresh file system of its own (those present on the node): a tmpfs on each shared
#: scratch directory, and the POSIX message queues of its own IPC namespace on ``/dev/mqueue``.
PRIVATE_TARGETS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm", "/dev/mqueue")

#: The targets that are not a tmpfs: the file system mounted there.
_FSTYPES = {"/dev/mqueue": b"mqueue"}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True, slots=True)
class PrivateMounts:
    """A replica's own ``/tmp``, ``/var/tmp``, ``/run/lock``, ``/dev/shm`` and IPC objects: in a new mount
    namespace (nothing propagates back to the node's), a fresh tmpfs (mode 1777, ``nosuid``, ``nodev``) on each
    of ``targets``; in a new IPC namespace, so its System V shared memory, semaphores and message queues and its
    POSIX message queues (``/dev/mqueue``, remounted for that namespace) are its own. The tmpfs pages are charged
    to the replica's memory cgroup, and all of it is gone with the namespaces' last process.

    The replica's own directories that lie under a target (``keep``: its working directory and ``TMPDIR`` on
    an agent whose state directory is under ``/tmp``) are bind-mounted back at their paths; nothing else of
    the node's ``/tmp`` is in its reach.

    With ``hide_pids`` (Linux 5.8+, where each proc mount has options of its own) its ``/proc`` is a proc mount
    of its own with ``hidepid=invisible``: it sees only the processes of its own account, never the agent's or
    other users' (their command lines, their ``/proc/<pid>`` files).
    """

    targets: tuple[str, ...] = PRIVATE_TARGETS
    keep: tuple[str, ...] = ()
    hide_pids: bool = False

    def for_dirs(self, dirs: Iterable[str]) -> PrivateMounts:
        """These mounts, keeping those of ``dirs`` (real paths) that lie under a target."""
        real = [os.path.realpath(d) for d in dirs]
        keep = tuple(d for d in real if any(d.startswith(t.rstrip("/") + "/") for t in self.targets))
        return PrivateMounts(self.targets, keep, self.hide_pids)

    def setup(self) -> None:
        """In the child, still root: unshare the mount and IPC namespaces, make every mount private to them,
        mount the fresh file systems, bind the kept directories back (opened before the tmpfs hides them).

        Raises:
            OSError: the kernel refused one step (the start fails; nothing ran).
        """
        _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC), "unshare(CLONE_NEWNS | CLONE_NEWIPC)")
        _check(_libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        held = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in self.keep]
        for t in self.targets:
            fstype = _FSTYPES.get(t, b"tmpfs")
            flags = _MS_NOSUID | _MS_NODEV | (_MS_NOEXEC if fstype != b"tmpfs" else 0)
            data = b"mode=1777" if fstype == b"tmpfs" else None
            _check(_libc.mount(fstype, t.encode(), fstype, flags, data), f"{fstype.decode()} {t}")
        if self.hide_pids:
            flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
            _check(_libc.mount(b"proc", b"/proc", b"proc", flags, b"hidepid=invisible"), "proc /proc hidepid")
        os.umask(0o022)  # the path down to a kept directory: passable by the replica's account
        for d, fd in zip(self.keep, held):
            os.makedirs(d, mode=0o755, exist_ok=True)
            _check(_libc.mount(f"/proc/self/fd/{fd}".encode(), d.encode(), None, _MS_BIND | _MS_REC, None), d)
            os.close(fd)

    @classmethod
    def available(cls) -> PrivateMounts | None:
        """The mounts of this node's targets present (``/dev/shm``, ``/run/lock``, ``/dev/mqueue`` may be missing
        in a container), when a child of the agent can make them (root, a kernel and runtime that allow mount and
        IPC namespaces); else ``None``."""
        mounts = cls(tuple(t for t in PRIVATE_TARGETS if os.path.isdir(t)), hide_pids=proc_mounts_have_own_options())
        if not mounts.targets:
            return None
        return mounts if _child_succeeds(mounts.setup) else None


def _child_succeeds(setup: Callable[[], None]) -> bool:
    """Whether ``setup`` returns in a forked child of the agent (as a replica's setup runs, before its exec)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its exit status is the answer
        try:
            setup()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - a forked child: any failure is the answer "no", never a traceback
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def landlock_scopes() -> int:
    """The scopes of the Landlock domain each replica enters on this kernel
    (:func:`services.node_agent.landlock.scopes_for` of its ABI), once a child of the agent has entered such a
    domain (a forked child, as a replica's); before ABI 6 (Linux 6.12), or when that child cannot, none, and the
    log says what a job then reaches."""
    abi = landlock.abi_version()
    scopes = landlock.scopes_for(abi)
    why = (
        f"Landlock ABI {abi}, scopes need ABI {landlock.SCOPES_ABI} (Linux 6.12)"
        if abi
        else "no Landlock here (a kernel before Linux 5.13, not enabled at boot: lsm=, or a seccomp filter)"
    )

    def enter() -> None:
        no_new_privs()
        landlock.restrict_self(scopes)

    if scopes and not _child_succeeds(enter):
        scopes, why = 0, f"Landlock ABI {abi}, but a child of the agent cannot enter a scoped domain"
    if not scopes:
        log.warning(
            "%s: jobs are not scoped: a job reaches the abstract Unix sockets of every process of the node, and "
            "signals and traces its account's other processes (its user's other jobs and logins)",
            why,
        )
    return scopes


def proc_mounts_have_own_options(release: str | None = None) -> bool:
    """Whether the kernel (``release``, default this one's) gives each proc mount options of its own (Linux 5.8+).
    Before, a proc mount's ``hidepid`` would be the option of every proc mount of the PID namespace, the node's
    ``/proc`` included."""
    m = re.match(r"(\d+)\.(\d+)", release if release is not None else os.uname().release)
    return m is not None and (int(m[1]), int(m[2])) >= (5, 8)


# --------------------------------------------------------------------------- the sandbox


@dataclass
class Sandbox:
    """How the agent isolates its process replicas (built by :meth:`NodeAgent.from_settings` from the node
    settings; service tests build it with their own cgroup parent and accounts).

    Attributes:
        accounts: who runs what.
        driver: the cgroup driver; ``None``: no cgroups (only where the node has none: said at start).
        memory_mb_per_gpu, cpu_weight_per_gpu, pids_max: the per-replica limits (:meth:`Limits.per_gpu`).
        job_path, job_lang: ``PATH`` and ``LANG`` of a process.
        shared_devices: device files every replica with a GPU may open (the NVIDIA control devices present).
        private_mounts: a private ``/tmp``, ``/var/tmp``, ``/run/lock``, ``/dev/shm`` and IPC namespace per
            replica; ``None`` where the node cannot make mount and IPC namespaces (said at start): the replicas
            share the node's.
        closed_ports: ports on loopback no process of a replica may connect to (the control plane's: node
            setting ``sandbox_closed_ports``), where the driver :attr:`~CgroupDriver.closes_ports`.
        closed_addresses: the control plane's own addresses (its hosts resolved at start,
            :func:`services.node_agent.connfilter.resolve`), closed on ``closed_ports`` as loopback is.
        landlock_scopes: the scopes of the Landlock domain each replica enters (:func:`landlock_scopes`); 0: none
            (a kernel before Linux 6.12, said at start).
        disk_mb_per_gpu: the disk limit of a job's directories on the node per GPU its replicas here hold, MiB
            (measured by the agent: :func:`disk_use`; each file of a replica at most its own limit:
            ``RLIMIT_FSIZE``); ``None``: no limit.
        disk_poll_wall_s: wall seconds between two measurements (the agent's ``check_disk``).
    """

    accounts: Accounts
    driver: CgroupDriver | None
    memory_mb_per_gpu: int | None = None
    cpu_weight_per_gpu: int | None = 100
    pids_max: int | None = 4096
    job_path: str = "/usr/local/bin:/usr/bin:/bin"
    job_lang: str = "C.UTF-8"
    shared_devices: tuple[str, ...] = ()
    private_mounts: PrivateMounts | None = None
    closed_ports: tuple[int, ...] = ()
    closed_addresses: tuple[str, ...] = ()
    landlock_scopes: int = 0
    disk_mb_per_gpu: int | None = None
    disk_poll_wall_s: float = 5.0

    def cgroup_for(self, key: RunKey, gpus: int, gpu_files: Sequence[str]) -> Cgroup | None:
        """Create the cgroup of replica ``key`` holding ``gpus`` GPUs whose device files are ``gpu_files``."""
        if self.driver is None:
            return None
        limits = Limits.per_gpu(gpus, self.memory_mb_per_gpu, self.cpu_weight_per_gpu, self.pids_max)
        devices = device_rules(gpu_files, self.shared_devices)
        return self.driver.create(cgroup_name(key), limits, devices, self.closed_ports, self.closed_addresses)

    def reopen(self, key: RunKey) -> Cgroup | None:
        """The cgroup of an adopted replica, if it still exists."""
        return None if self.driver is None else self.driver.open(cgroup_name(key))
