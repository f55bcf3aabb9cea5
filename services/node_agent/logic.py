"""Node agent decisions: which commands to accept and which events to emit.

Pure: no I/O, no wall clock. Event time (``now``, aware UTC) is passed in.
``app.py`` turns the :class:`Action` values into processes, timers and
published events.

Rules for ``StartWorkload`` (checked in this order; the first that applies wins).
Fencing rules 2-4 and the event-time rules 6-8 are in ``docs/leadership.md``:

1. **not hosted** - the node is not one of this agent's. If the id carries
   this agent's claimed prefix (``sim-7`` for prefix ``sim-``) it is refused
   (``unknown_node``): nobody else will answer. Otherwise it belongs to
   another agent sharing the commands topic and is ignored silently.
2. **no fencing token** - only a leading dispatcher may start work, and it
   always stamps its token: refused (``missing_fencing_token``).
3. **token out of range** - not in ``[1, 2**53]`` (:data:`TOKEN_MIN`,
   :data:`TOKEN_MAX`): refused (``fencing_token_out_of_range``), and never
   remembered, so a forged ``2**62`` cannot lock later leaders out.
4. **stale fencing token** - a token lower than the highest seen from the
   dispatcher (a deposed leader) is refused (``stale_fencing_token``).
5. **duplicate** - the run replica ``(job_id, attempt, replica)`` is running,
   waiting or ended here (within the retention window): refused
   (``duplicate_start``). A redelivery after a restart lands here: the
   replica's own events (adopted, lost or ended) tell its fate, so the
   dispatcher must not undo a placement for this reason.
6. **run lost** - the run ``(job_id, attempt)`` was declared lost here (its
   node was fenced by ``NodeLost``, or the agent reported ``JobLost`` after a
   restart): refused (``run_lost``); the dispatcher has a newer attempt.
7. **before registration** - the command's event time is before the node's
   latest registration (a command for the node's previous incarnation,
   queued while it was lost or while the agent was down): refused
   (``before_registration``), never executed late.
8. **expired** - older than the retention window ``retention_s`` (the time
   ended replicas are remembered for rule 5): refused (``expired_command``).
9. **unknown GPUs** - an index the node does not have, a repeated index, or
   no GPU at all: refused (``unknown_gpus``).
10. **no workload** - neither ``command`` nor ``duration_s``: refused (``no_workload``).
10a. **no account** - a process (not a simulated workload) on an agent that isolates jobs, whose proven
    user (``StartWorkload.user``) has no Unix account it may run as (none named, none on the node, uid 0,
    the agent's own account, a system account the ops' account map does not name: :func:`services.node_agent.sandbox.Accounts.resolve`): refused
    (``no_account``), a cause the job cannot outrun (the dispatcher fails it). An agent that cannot switch
    accounts at all (not root: :class:`Unisolated`) refuses every process (``cannot_isolate``): the node's
    fault, not the job's. It never runs as the agent (``docs/security.md``, "Node boundary").
11. **GPUs busy** - a GPU is held by a replica that is being stopped: the
    start waits (:class:`Defer`) and runs when that replica exits (rule D3.victims: the victim's GPUs are reserved for
    the preemptor after its
    grace period). Held by a replica that is *not* stopping: refused
    (``gpus_busy``).

Otherwise the replica is launched (:class:`Launch`): as a process with
``CUDA_VISIBLE_DEVICES`` when it has a ``command`` (and the node is real or
has no ``duration_s``), else as a simulated workload sleeping ``duration_s``
of event time, less the ``progress_s`` it resumes from, and checkpointing
at its ``checkpoint_interval_s`` (:func:`sim_checkpoint_k`, ``docs/checkpoints.md``).

``StopWorkload`` stops every replica of ``(job_id, attempt)`` on the node:
running ones get SIGTERM then SIGKILL after ``grace_s`` (:class:`Stop`),
waiting ones are dropped with ``JobFailed(reason="stopped")``. A stop with
a token out of range or older than the newest seen is **ignored** (logged
and counted, nothing published: a stale leader's stop must not kill the
current leader's work, and a ``WorkloadRefused`` would read as a refused
start). A stop without a token is obeyed (operators' tools). A stop for a
run that already ended is ignored (idempotent); for a run never seen it is
refused (``unknown_run``).

``NodeLost`` for a hosted node (the dispatcher missed its heartbeats, e.g.
a network partition or a stalled host, and has already requeued its runs
elsewhere and charged them to the last heartbeat): the node is **fenced and
rejoins** (:func:`decide_lost`). Every replica on it is stopped (SIGTERM,
SIGKILL after the grace period; waiting ones dropped), because the same run
now has a newer attempt and two copies must not both write results; once
the last one has exited, the node registers again (``NodeRegistered``), which
every reader folds to ``ready`` with all GPUs free. Ignored: another agent's
node; a loss whose ``fencing_token`` is out of range or older than the
newest token seen (a resumed ex-leader's stale loss); a loss without a token
when ``require_fenced_lost`` is set; and a loss declared before the node's
latest registration, unless replicas started before the loss still run
(adopted after an agent restart while the loss was declared): those are
stopped, the node does not register again.

Exit reporting (:func:`exit_event`): exit code 0 without a stop ->
``JobCompleted``; a stopped replica -> ``JobFailed(reason="stopped")`` with
its exit code; otherwise ``JobFailed`` with the code (negative = killed by
that signal, as :mod:`subprocess` reports it).

Checkpoints (:func:`observe_progress`, protocol in ``docs/checkpoints.md``):
a process reports its progress seconds in its progress file
(:func:`job_files`); each look at the file whose stamp (inode, size, mtime)
changed is parsed (:func:`parse_progress`), and a value larger than the last
one published for that replica and attempt becomes one ``JobCheckpointed``.
Invalid content, and a value smaller than one already published, are
problems to log, never exceptions. The stamp at launch is the baseline, so an
earlier attempt's report is not published again for the new attempt.

Event ids are deterministic (:func:`apportion.events.det_id`) so an event
re-emitted after a crash is de-duplicated by readers.
"""

from __future__ import annotations

import hashlib
import json
import math
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, TypeGuard

from apportion.events import (
    DEFAULT_GRACE_S,
    GpuInfo,
    GpuStatus,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobStarted,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    RunningWorkload,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
    det_id,
)
from apportion.jobdirs import job_dir_name

PRODUCER = "node-agent"

#: Refusal reasons (the ``reason`` prefix of WorkloadRefused; details follow ": ").
UNKNOWN_NODE = "unknown_node"
STALE_TOKEN = "stale_fencing_token"
DUPLICATE_START = "duplicate_start"
UNKNOWN_GPUS = "unknown_gpus"
NO_WORKLOAD = "no_workload"
GPUS_BUSY = "gpus_busy"
UNKNOWN_RUN = "unknown_run"
MISSING_TOKEN = "missing_fencing_token"
TOKEN_OUT_OF_RANGE = "fencing_token_out_of_range"
RUN_LOST = "run_lost"
BEFORE_REGISTRATION = "before_registration"
EXPIRED = "expired_command"
NO_ACCOUNT = "no_account"
CANNOT_ISOLATE = "cannot_isolate"

#: Valid fencing tokens are integers in [TOKEN_MIN, TOKEN_MAX] (the dispatcher lease's range,
#: ``services.dispatcher.lease``; repeated here because services do not import each other).
TOKEN_MIN = 1
TOKEN_MAX = 2**53

#: Default event seconds an ended replica is remembered (duplicate starts) and a command stays executable.
RETENTION_S = 24 * 3600.0

STOPPED = "stopped"

#: ``JobFailed.reason`` of a replica the agent stopped at its time limit (``StartWorkload.time_limit_s``).
TIME_LIMIT = "time_limit"

#: ``JobFailed.reason`` of a replica the agent stopped because its job's files on the node passed its disk limit
#: (node setting ``sandbox_disk_mb_per_gpu``), or that the kernel killed for a file beyond it (``SIGXFSZ``).
DISK_QUOTA = "disk_quota"


# --------------------------------------------------------------------------- the account and environment of a process


@dataclass(frozen=True, slots=True)
class Account:
    """The Unix account a process runs as (resolved from the job's proven user by
    :class:`services.node_agent.sandbox.Accounts`).

    Attributes:
        name: the account's name (``USER``).
        uid, gid: its user and primary group ids (never 0).
        groups: its supplementary group ids (``getgrouplist``).
        home: its home directory (``HOME``).
    """

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str = "/"


#: Every variable a process gets that is not of its job's own ``env``: the documented allow-list
#: (``docs/checkpoints.md``, "What a process gets"). Nothing of the agent's environment is passed on.
JOB_ENV_ALLOWED = (
    "PATH",
    "LANG",
    "HOME",
    "USER",
    "APPORTION_JOB_ID",
    "APPORTION_ATTEMPT",
    "APPORTION_REPLICA",
    "APPORTION_NODE_ID",
    "APPORTION_CHECKPOINT_DIR",
    "APPORTION_PROGRESS_FILE",
    "TMPDIR",
    "APPORTION_ARRAY_ID",  # an array element's, from its StartWorkload.env (the dispatcher sets them)
    "APPORTION_ARRAY_INDEX",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
)

#: The order in which CUDA numbers the GPUs ``CUDA_VISIBLE_DEVICES`` names: the PCI bus order, NVML's, in which
#: the agent counts them. CUDA's default (``FASTEST_FIRST``) would give the indices to other GPUs of the node.
CUDA_DEVICE_ORDER = "PCI_BUS_ID"

#: ``PATH`` and ``LANG`` of a process unless its job's ``env`` sets them (node settings ``job_path``, ``job_lang``).
DEFAULT_JOB_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_JOB_LANG = "C.UTF-8"


# --------------------------------------------------------------------------- job files and checkpoints


@dataclass(frozen=True, slots=True)
class JobFiles:
    """Where one replica's files live (absolute paths; layout in ``docs/checkpoints.md``).

    Attributes:
        checkpoint_dir: the job's persistent directory, the same for every
            attempt and replica of the job on this root; also the process's
            working directory.
        progress_file: the file the replica writes its progress seconds to.
        stdout, stderr: files the process's output is appended to, or ``None``
            to inherit the agent's.
        tmp_dir: the replica's own temporary directory (``TMPDIR``), removed when it ends.
    """

    checkpoint_dir: str
    progress_file: str
    stdout: str | None = None
    stderr: str | None = None
    tmp_dir: str | None = None


def progress_file_name(replica: int) -> str:
    """``progress`` for replica 0, ``progress.<replica>`` for the others (one writer per file)."""
    return "progress" if replica == 0 else f"progress.{replica}"


def job_files(checkpoint_root: str, log_dir: str | None, w: Workload) -> JobFiles:
    """The files of replica ``w`` under ``checkpoint_root`` (and ``log_dir`` for its output).

    Layout::

        <checkpoint_root>/<job>/                          checkpoint dir and working directory
        <checkpoint_root>/<job>/progress[.<replica>]      progress report
        <log_dir>/<job>/attempt-<a>.replica-<r>.out|.err  stdout, stderr
        <log_dir>/<job>/tmp.attempt-<a>.replica-<r>/      TMPDIR (:func:`tmp_dir`)

    ``<job>`` is :func:`job_dir_name` of the job id.
    """
    name = job_dir_name(w.job_id)
    ckpt = posixpath.join(checkpoint_root, name)
    out = err = None
    if log_dir is not None:
        stem = posixpath.join(log_dir, name, f"attempt-{w.attempt}.replica-{w.replica}")
        out, err = f"{stem}.out", f"{stem}.err"
    tmp = tmp_dir(checkpoint_root, log_dir, w.key)
    return JobFiles(ckpt, posixpath.join(ckpt, progress_file_name(w.replica)), out, err, tmp)


def tmp_dir(checkpoint_root: str, log_dir: str | None, key: RunKey) -> str:
    """The temporary directory of replica ``key``: ``<log_dir>/<job>/tmp.attempt-<a>.replica-<r>``, under the
    checkpoint root's ``<job>`` when there is no ``log_dir`` (the node's local output, not a checkpoint root
    that may be shared)."""
    _, job_id, attempt, replica = key
    return posixpath.join(log_dir or checkpoint_root, job_dir_name(job_id), f"tmp.attempt-{attempt}.replica-{replica}")


#: Largest progress file read, bytes; a bigger one is rejected unread beyond this.
MAX_PROGRESS_BYTES = 4096

_NUMBER = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class ProgressError(ValueError):
    """The progress file's content is not a valid report; ``str(exc)`` is the reason."""


def parse_progress(raw: bytes) -> float:
    """Progress seconds from the content of a progress file.

    Accepted (surrounding white space ignored): a non-negative decimal number
    (``120``, ``120.5``, ``1.2e3``), or a JSON object with a numeric
    ``progress_s`` (``{"progress_s": 120.5}``; other keys are ignored).

    Raises:
        ProgressError: empty, larger than :data:`MAX_PROGRESS_BYTES`, not
            UTF-8, not a number or such an object, negative, or not finite.
    """
    if len(raw) > MAX_PROGRESS_BYTES:
        raise ProgressError(f"larger than {MAX_PROGRESS_BYTES} bytes")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ProgressError("not UTF-8") from None
    if not text:
        raise ProgressError("empty")
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ProgressError(f"invalid JSON: {exc}") from None
        if not isinstance(obj, dict) or "progress_s" not in obj:
            raise ProgressError('JSON object without "progress_s"')
        value = obj["progress_s"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProgressError(f'"progress_s" is not a number: {value!r:.40}')
        value = float(value)
    elif _NUMBER.fullmatch(text):
        value = float(text)
    elif text.startswith("-") and _NUMBER.fullmatch(text[1:]):
        raise ProgressError(f"negative: {text}")
    else:
        raise ProgressError(f"not a number: {text!r:.40}")
    if not math.isfinite(value):
        raise ProgressError(f"not finite: {value}")
    if value < 0:
        raise ProgressError(f"negative: {value}")
    return value


FileStamp = tuple[int, int, int]
"""``(inode, size, mtime_ns)`` of a file: a new value means it may have new content."""


@dataclass(frozen=True, slots=True)
class ProgressWatch:
    """What the agent knows of one replica's progress file.

    Attributes:
        stamp: :data:`FileStamp` of the content last read (or present at launch:
            a previous attempt's report is not this attempt's), ``None`` when
            there was no file.
        published: the largest ``progress_s`` published for this replica of
            this attempt, ``None`` before the first.
    """

    stamp: FileStamp | None = None
    published: float | None = None


def checkpointed_event(key: RunKey, progress_s: float, now: datetime) -> JobCheckpointed:
    """``JobCheckpointed`` of replica ``key`` at ``progress_s`` seconds, stamped ``now`` (UTC).

    The event id is :func:`~apportion.events.det_id` of the replica and the
    value (not the time), so the same checkpoint published again, by this
    agent or by it after a restart, is de-duplicated by readers.
    """
    node_id, job_id, attempt, replica = key
    return JobCheckpointed(
        event_id=det_id("JobCheckpointed", node_id, job_id, attempt, replica, repr(progress_s)),
        ts=now,
        producer=PRODUCER,
        job_id=job_id,
        attempt=attempt,
        progress_s=progress_s,
        replica=replica,
        node_id=node_id,
    )


@dataclass(frozen=True, slots=True)
class ProgressSeen:
    """Outcome of :func:`observe_progress`.

    Attributes:
        watch: the new watch state.
        event: the ``JobCheckpointed`` to publish, or ``None``.
        problem: why the content was ignored (for the log), or ``None``.
    """

    watch: ProgressWatch
    event: JobCheckpointed | None = None
    problem: str | None = None


def observe_progress(
    watch: ProgressWatch, key: RunKey, stamp: FileStamp | None, raw: bytes | None, now: datetime
) -> ProgressSeen:
    """Fold one look at the progress file of replica ``key`` into its watch.

    Args:
        watch: the state before this look.
        key: the replica.
        stamp: the file's stamp now, ``None`` when it does not exist.
        raw: its content (read only when ``stamp`` differs from ``watch.stamp``;
            ``None`` otherwise, or when it could not be read).
        now: event time (UTC) stamped on the event.

    Returns:
        A :class:`ProgressSeen`. An event is produced once per new value: when
        the stamp changed, the content parses, and the value is larger than the
        last one published for this replica and attempt. A value not larger is
        ignored (equal: silently; smaller: as a problem, since a checkpoint
        already reported cannot be taken back). Invalid content is a problem,
        never an exception.
    """
    if stamp is None or stamp == watch.stamp:
        return ProgressSeen(replace(watch, stamp=stamp))
    seen = replace(watch, stamp=stamp)
    if raw is None:
        return ProgressSeen(seen, problem="could not be read")
    try:
        value = parse_progress(raw)
    except ProgressError as exc:
        return ProgressSeen(seen, problem=str(exc))
    if watch.published is not None and value <= watch.published:
        if value == watch.published:
            return ProgressSeen(seen)
        return ProgressSeen(seen, problem=f"went backwards: {value:g} after {watch.published:g}")
    return ProgressSeen(replace(seen, published=value), checkpointed_event(key, value, now))


# --------------------------------------------------------------------------- simulated checkpoints

#: Tolerance of the "progress reached k intervals" test, in intervals (float progress from µs event times).
_SIM_EPS = 1e-9


def sim_remaining_s(w: Workload) -> float:
    """Event seconds simulated workload ``w`` runs from its start: ``duration_s - progress_s`` (never < 0).

    The simulator's rule (``apportion.sim.core``): an attempt resumes from the
    job's last saved progress. Without ``progress_s`` (an older command) the
    whole ``duration_s``.
    """
    total = w.duration_s or 0.0
    return max(0.0, total - (w.progress_s or 0.0))


def sim_checkpoint_k(w: Workload, elapsed_s: float) -> int:
    """How many whole intervals of progress ``w`` has saved after ``elapsed_s`` event seconds of its run.

    Checkpoint ``k`` saves progress ``k * checkpoint_interval_s``; there is
    none at or past the job's duration (it completes instead, as in the
    simulator). 0 when ``w`` has no interval (or no ``progress_s``). The
    resume point itself counts: ``sim_checkpoint_k(w, 0)`` is the last
    checkpoint already saved (not published again).
    """
    every = w.checkpoint_interval_s
    if w.progress_s is None or not every:
        return 0
    total = w.duration_s or 0.0
    progress = min(total, w.progress_s + max(0.0, elapsed_s))
    last = math.ceil(total / every - _SIM_EPS) - 1  # the largest k with k * every < total
    return max(0, min(math.floor(progress / every + _SIM_EPS), last))


def sim_next_wake_s(w: Workload, elapsed_s: float) -> float | None:
    """Event seconds into ``w``'s run of its next happening: the next checkpoint, else the end.

    ``None`` once the run's time (:func:`sim_remaining_s`) is up.
    """
    end = sim_remaining_s(w)
    if elapsed_s >= end:
        return None
    every = w.checkpoint_interval_s
    if w.progress_s is None or not every:
        return end
    k = sim_checkpoint_k(w, elapsed_s) + 1
    return min(end, k * every - w.progress_s)


def sim_stop_progress_s(w: Workload, elapsed_s: float) -> float | None:
    """Progress simulated workload ``w`` saves when SIGTERM reaches it ``elapsed_s`` into its run.

    The simulator's ``checkpoint_on_stop="all"`` model: every simulated
    workload started with ``progress_s`` writes its progress on SIGTERM when it
    has a grace period (``grace_s > 0``; a SIGKILL at once saves nothing).
    ``None``: it saves nothing (an older command, or no grace).
    """
    if w.progress_s is None or w.grace_s <= 0:
        return None
    total = w.duration_s or 0.0
    return min(total, w.progress_s + max(0.0, elapsed_s))


# --------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node hosted by the agent.

    Attributes:
        node_id: its id on the bus.
        gpus: its GPU inventory (indices 0..n-1 normally).
        model: GPU model name, or ``None`` when mixed or unknown.
        simulated: True for a declared inventory (no NVML).
    """

    node_id: str
    gpus: tuple[GpuInfo, ...]
    model: str | None = None
    simulated: bool = True

    @property
    def indices(self) -> frozenset[int]:
        """GPU indices the node has."""
        return frozenset(g.index for g in self.gpus)


RunKey = tuple[str, str, int, int]
"""``(node_id, job_id, attempt, replica)``: one replica of one run on one node."""


@dataclass(frozen=True, slots=True)
class Workload:
    """A replica this agent runs (or will run).

    Attributes:
        node_id, job_id, attempt, replica: which replica of which run.
        gpus: GPU indices it holds.
        command: argv to run as a process, or ``None`` for a simulated workload.
        duration_s: event-time seconds a simulated workload runs.
        env: extra environment for a process.
        stopping: a StopWorkload was received for it.
        grace_s: grace period of that stop.
        files: its checkpoint directory, progress file and output files
            (:func:`job_files`), set when a process is launched with a
            checkpoint root configured; ``None`` for simulated workloads.
        started_at: event time it started (``None`` while waiting).
        adopted: a process found alive after an agent restart (not the
            agent's child: its exit code cannot be known).
        progress_s: for a simulated workload, the job's progress (seconds of
            its work) this attempt resumed from (``StartWorkload.progress_s``);
            ``None``: the command predates checkpoints, the workload runs
            ``duration_s`` whole and saves nothing (:func:`sim_remaining_s`).
        checkpoint_interval_s: the job's interval in force
            (``StartWorkload.checkpoint_interval_s``), ``None``: no interval checkpoints.
        account: the Unix account a process runs as; ``None``: the agent does not isolate jobs (it runs
            processes as itself, a development mode: ``docs/security.md``).
        time_limit_s: event seconds from its start after which the agent stops it (SIGTERM, the grace, SIGKILL)
            and reports ``JobFailed`` reason :data:`TIME_LIMIT` (``StartWorkload.time_limit_s``); ``None``: none.
        limit_reached: the limit the agent is stopping it at (:data:`TIME_LIMIT`, :data:`DISK_QUOTA`): the reason
            its exit is reported with; ``None``: none.
    """

    node_id: str
    job_id: str
    attempt: int
    replica: int
    gpus: tuple[int, ...]
    command: tuple[str, ...] | None
    duration_s: float | None
    env: Mapping[str, str] = field(default_factory=dict)
    stopping: bool = False
    grace_s: float = DEFAULT_GRACE_S
    files: JobFiles | None = None
    started_at: datetime | None = None
    adopted: bool = False
    progress_s: float | None = None
    checkpoint_interval_s: float | None = None
    account: Account | None = None
    time_limit_s: float | None = None
    limit_reached: str | None = None

    @property
    def key(self) -> RunKey:
        """Its :data:`RunKey`."""
        return (self.node_id, self.job_id, self.attempt, self.replica)

    @property
    def simulated(self) -> bool:
        """True when no process runs: it sleeps ``duration_s``."""
        return self.command is None

    def process_env(self, path: str = DEFAULT_JOB_PATH, lang: str = DEFAULT_JOB_LANG) -> dict[str, str]:
        """The whole environment of the process: :data:`JOB_ENV_ALLOWED` and the job's own ``env``, nothing else.

        ``PATH`` and ``LANG`` (``path``, ``lang``) first, then the job's ``env`` (``LANG`` and anything of its own;
        the event contract refuses ``PATH`` in it, ``apportion.events.RESERVED_ENV``), then the agent's values, which win over a submitted variable of the same name:
        ``HOME`` and ``USER`` of its :attr:`account` (left out without one), the job variables, the GPU
        indices and :data:`CUDA_DEVICE_ORDER`. The variables are documented in ``docs/checkpoints.md``.
        """
        env = {"PATH": path, "LANG": lang}
        env.update(self.env)
        if self.account is not None:
            env["HOME"] = self.account.home
            env["USER"] = self.account.name
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        env["CUDA_DEVICE_ORDER"] = CUDA_DEVICE_ORDER  # a job's own value would renumber its GPUs
        env["NVIDIA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
        env["APPORTION_JOB_ID"] = self.job_id
        env["APPORTION_ATTEMPT"] = str(self.attempt)
        env["APPORTION_REPLICA"] = str(self.replica)
        env["APPORTION_NODE_ID"] = self.node_id
        if self.files is not None:
            env["APPORTION_CHECKPOINT_DIR"] = self.files.checkpoint_dir
            env["APPORTION_PROGRESS_FILE"] = self.files.progress_file
            if self.files.tmp_dir is not None:
                env["TMPDIR"] = self.files.tmp_dir
        return env


@dataclass(frozen=True, slots=True)
class AgentState:
    """What the agent knows; replaced (never mutated) by :func:`evolve`-style helpers.

    Attributes:
        nodes: hosted nodes by id.
        claim_prefix: node ids with this prefix belong to this agent (``""``: claim only hosted ids).
        running: replicas running (or being stopped) by key.
        waiting: replicas accepted but waiting for GPUs held by stopping replicas.
        ended: keys of replicas that have ended here (for duplicate detection).
        fencing_token: highest dispatcher fencing token seen, or ``None``.
        registered_at: node id -> event time (UTC) of its latest ``NodeRegistered``.
        rejoining: nodes declared lost whose replicas are being stopped; each
            registers again when its last replica has exited.
        lost_runs: ``(job_id, attempt)`` of runs declared lost here (rule 6).
        retention_s: event seconds ended replicas are remembered and commands
            stay executable (rules 5 and 8).
        require_fenced_lost: ignore a ``NodeLost`` without a fencing token.
        by_node: node id -> keys of its replicas in ``running``, in the order
            they were added: an index kept by :func:`with_launched` and
            :func:`with_exited` (the helpers that add or remove running keys),
            so :meth:`held` and heartbeats cost the node's replicas, not all
            of the agent's (one agent hosts hundreds of simulated nodes).
    """

    nodes: Mapping[str, NodeSpec]
    claim_prefix: str = ""
    running: Mapping[RunKey, Workload] = field(default_factory=dict)
    waiting: Mapping[RunKey, Workload] = field(default_factory=dict)
    ended: frozenset[RunKey] = frozenset()
    fencing_token: int | None = None
    registered_at: Mapping[str, datetime] = field(default_factory=dict)
    rejoining: frozenset[str] = frozenset()
    by_node: Mapping[str, tuple[RunKey, ...]] = field(default_factory=dict)
    lost_runs: frozenset[tuple[str, int]] = frozenset()
    retention_s: float = RETENTION_S
    require_fenced_lost: bool = False

    def claims(self, node_id: str) -> bool:
        """True when ``node_id`` is this agent's to answer for."""
        return node_id in self.nodes or bool(self.claim_prefix) and node_id.startswith(self.claim_prefix)

    def held(self, node_id: str) -> dict[int, Workload]:
        """GPU index -> running replica holding it, on ``node_id``."""
        out: dict[int, Workload] = {}
        for k in self.by_node.get(node_id, ()):
            w = self.running[k]
            for g in w.gpus:
                out[g] = w
        return out

    def known(self, key: RunKey) -> bool:
        """The replica is running, waiting or ended here."""
        return key in self.running or key in self.waiting or key in self.ended


def ended_key(ev: JobCompleted | JobFailed) -> RunKey:
    """The run key of a replica's end this agent reported (:func:`exit_event`: it names node and replica)."""
    assert ev.node_id is not None and ev.replica is not None, "an agent's own end report names node and replica"
    return (ev.node_id, ev.job_id, ev.attempt, ev.replica)


def valid_token(token: object) -> TypeGuard[int]:
    """True for an ``int`` (not ``bool``) in ``[TOKEN_MIN, TOKEN_MAX]``."""
    return isinstance(token, int) and not isinstance(token, bool) and TOKEN_MIN <= token <= TOKEN_MAX


def initial_state(
    nodes: list[NodeSpec] | tuple[NodeSpec, ...],
    claim_prefix: str = "",
    ended: frozenset[RunKey] = frozenset(),
    *,
    fencing_token: int | None = None,
    lost_runs: frozenset[tuple[str, int]] = frozenset(),
    retention_s: float = RETENTION_S,
    require_fenced_lost: bool = False,
) -> AgentState:
    """State of a freshly started agent (``ended``, ``fencing_token``, ``lost_runs``: from its journal)."""
    return AgentState(
        {n.node_id: n for n in nodes},
        claim_prefix,
        ended=ended,
        fencing_token=fencing_token if valid_token(fencing_token) else None,
        lost_runs=lost_runs,
        retention_s=retention_s,
        require_fenced_lost=require_fenced_lost,
    )


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Ignore:
    """Nothing to do (another agent's node, an idempotent repeat, or a fenced-off command).

    Attributes:
        why: for the log.
        reason: set for a command disregarded for a rule (logged as a warning
            and counted with this reason), ``None`` for a harmless repeat.
    """

    why: str
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Refuse:
    """Publish ``event`` (a WorkloadRefused) and change nothing."""

    event: WorkloadRefused


@dataclass(frozen=True, slots=True)
class Launch:
    """Start ``workload`` now; then publish :func:`started_event`."""

    workload: Workload


@dataclass(frozen=True, slots=True)
class Defer:
    """Keep ``workload`` waiting until the stopping replicas holding its GPUs exit."""

    workload: Workload
    blocked_by: tuple[RunKey, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """SIGTERM ``workloads`` now and SIGKILL them ``grace_s`` later; drop ``dropped`` (publish ``events``)."""

    workloads: tuple[Workload, ...]
    grace_s: float
    events: tuple[JobCompleted | JobFailed, ...] = ()


Action = Ignore | Refuse | Launch | Defer | Stop


def _refuse(cmd: StartWorkload | StopWorkload, now: datetime, reason: str, detail: str = "") -> Refuse:
    return Refuse(
        WorkloadRefused(
            event_id=det_id("WorkloadRefused", cmd.event_id),
            ts=now,
            producer=PRODUCER,
            node_id=cmd.node_id,
            job_id=cmd.job_id,
            attempt=cmd.attempt,
            reason=f"{reason}: {detail}" if detail else reason,
        )
    )


def token_problem(state: AgentState, token: int | None) -> tuple[str, str] | None:
    """Why ``token`` may not command this agent, as ``(reason, detail)``; ``None`` when it may.

    No token (``missing_fencing_token``), out of ``[1, 2**53]``
    (``fencing_token_out_of_range``), or below the newest seen
    (``stale_fencing_token``).
    """
    if token is None:
        return MISSING_TOKEN, "a command without a leader's token"
    if not valid_token(token):
        return TOKEN_OUT_OF_RANGE, f"token {token} not in [{TOKEN_MIN}, 2**53]"
    if state.fencing_token is not None and token < state.fencing_token:
        return STALE_TOKEN, f"token {token} < {state.fencing_token}"
    return None


@dataclass(frozen=True, slots=True)
class Unisolated:
    """Why an agent that isolates jobs cannot run any process as its user (rule 10a: it is not root)."""

    detail: str


def decide_start(
    state: AgentState, cmd: StartWorkload, now: datetime, account: Account | str | Unisolated | None = None
) -> Action:
    """What to do with a StartWorkload (rules in the module docstring).

    Args:
        state: the agent's state before the command.
        cmd: the command.
        now: event time for any event emitted.
        account: the account its process would run as; a string: why the job's user has none, an
            :class:`Unisolated`: why the agent can run no process as its user (rule 10a); ``None``:
            the agent does not isolate jobs.

    Returns:
        :class:`Ignore`, :class:`Refuse`, :class:`Launch` or :class:`Defer`.
    """
    node = state.nodes.get(cmd.node_id)
    if node is None:
        if state.claims(cmd.node_id):
            return _refuse(cmd, now, UNKNOWN_NODE, f"{cmd.node_id!r} is not hosted by this agent")
        return Ignore("another agent's node")
    if (p := token_problem(state, cmd.fencing_token)) is not None:
        return _refuse(cmd, now, *p)
    key: RunKey = (cmd.node_id, cmd.job_id, cmd.attempt, cmd.replica)
    if state.known(key):
        return _refuse(
            cmd, now, DUPLICATE_START, f"{cmd.job_id} attempt {cmd.attempt} replica {cmd.replica} already started here"
        )
    if (cmd.job_id, cmd.attempt) in state.lost_runs:
        return _refuse(cmd, now, RUN_LOST, f"{cmd.job_id} attempt {cmd.attempt} was declared lost on this agent")
    reg = state.registered_at.get(cmd.node_id)
    if reg is not None and cmd.ts < reg:
        return _refuse(cmd, now, BEFORE_REGISTRATION, f"sent {cmd.ts.isoformat()}, node registered {reg.isoformat()}")
    if (now - cmd.ts).total_seconds() > state.retention_s:
        return _refuse(cmd, now, EXPIRED, f"sent {cmd.ts.isoformat()}, older than {state.retention_s:g} s")
    have = node.indices
    bad = sorted(set(cmd.gpus) - have)
    if not cmd.gpus or bad or len(set(cmd.gpus)) != len(cmd.gpus):
        return _refuse(cmd, now, UNKNOWN_GPUS, f"asked for {list(cmd.gpus)}, node has {sorted(have)}")
    if cmd.command is None and cmd.duration_s is None:
        return _refuse(cmd, now, NO_WORKLOAD, "neither command nor duration_s")
    simulate = cmd.duration_s is not None and (node.simulated or not cmd.command)
    if not simulate and isinstance(account, Unisolated):
        return _refuse(cmd, now, CANNOT_ISOLATE, account.detail)
    if not simulate and isinstance(account, str):
        return _refuse(cmd, now, NO_ACCOUNT, f"{account} on node {cmd.node_id}")
    w = Workload(
        cmd.node_id,
        cmd.job_id,
        cmd.attempt,
        cmd.replica,
        tuple(cmd.gpus),
        None if simulate else tuple(cmd.command or ()),
        cmd.duration_s,
        dict(cmd.env),
        progress_s=cmd.progress_s if simulate else None,
        checkpoint_interval_s=cmd.checkpoint_interval_s if simulate else None,
        account=account if not simulate and isinstance(account, Account) else None,
        time_limit_s=cmd.time_limit_s,
    )
    held = state.held(cmd.node_id)
    holders = {held[g].key: held[g] for g in cmd.gpus if g in held}
    waiting_holders = {
        o.key: o for o in state.waiting.values() if o.node_id == cmd.node_id and set(o.gpus) & set(cmd.gpus)
    }
    if any(not h.stopping for h in holders.values()):
        busy = sorted(g for g in cmd.gpus if g in held and not held[g].stopping)
        return _refuse(cmd, now, GPUS_BUSY, f"GPUs {busy} are held by running work")
    if waiting_holders:
        return _refuse(cmd, now, GPUS_BUSY, "GPUs are promised to a waiting start")
    if holders:
        return Defer(w, tuple(sorted(holders)))
    return Launch(w)


def decide_stop(state: AgentState, cmd: StopWorkload, now: datetime) -> Action:
    """What to do with a StopWorkload (rules in the module docstring).

    Returns:
        :class:`Ignore`, :class:`Refuse` or :class:`Stop`.
    """
    if cmd.node_id not in state.nodes:
        if state.claims(cmd.node_id):
            return _refuse(cmd, now, UNKNOWN_NODE, f"{cmd.node_id!r} is not hosted by this agent")
        return Ignore("another agent's node")
    tok = cmd.fencing_token
    if tok is not None and (p := token_problem(state, tok)) is not None:
        return Ignore(f"stop of {cmd.job_id} attempt {cmd.attempt}: {p[1]}", p[0])

    def mine(k: RunKey) -> bool:
        return k[0] == cmd.node_id and k[1] == cmd.job_id and k[2] == cmd.attempt

    run = tuple(w for k, w in sorted(state.running.items()) if mine(k) and not w.stopping)
    wait = tuple(w for k, w in sorted(state.waiting.items()) if mine(k))
    if not run and not wait:
        if any(mine(k) for k in state.running) or any(mine(k) for k in state.ended):
            return Ignore("already stopping or ended")
        return _refuse(cmd, now, UNKNOWN_RUN, f"no {cmd.job_id} attempt {cmd.attempt} on this node")
    dropped = tuple(exit_event(replace(w, stopping=True), None, now, never_started=True) for w in wait)
    return Stop(tuple(replace(w, stopping=True, grace_s=cmd.grace_s) for w in run), cmd.grace_s, dropped)


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Fence a node declared lost: stop everything on it, then register it again.

    Attributes:
        node_id: the hosted node.
        stop: its replicas to stop and the ``JobFailed`` of waiting ones dropped.
        register: register the node again once they exited (``False`` for a
            loss declared before the latest registration: only the replicas it
            covers are stopped).
    """

    node_id: str
    stop: Stop
    register: bool = True


def decide_lost(state: AgentState, ev: NodeLost, now: datetime, grace_s: float) -> Ignore | Rejoin:
    """What to do with a ``NodeLost`` (rules in the module docstring).

    Args:
        state: the agent state.
        ev: the loss, as the dispatcher (or an operator) published it.
        now: event time (UTC).
        grace_s: event seconds between SIGTERM and SIGKILL for its replicas.

    Returns:
        :class:`Ignore` (not hosted here, fenced off, or declared before the
        node's latest registration with nothing it covers), else :class:`Rejoin`.
    """
    if ev.node_id not in state.nodes:
        return Ignore("another agent's node")
    tok = ev.fencing_token
    if tok is None and state.require_fenced_lost:
        return Ignore(f"loss of {ev.node_id} without a fencing token", MISSING_TOKEN)
    if tok is not None and (p := token_problem(state, tok)) is not None:
        return Ignore(f"loss of {ev.node_id}: {p[1]}", p[0])
    reg = state.registered_at.get(ev.node_id)
    before_reg = reg is not None and ev.ts < reg

    def covered(w: Workload) -> bool:  # a loss before the registration covers only replicas started before it
        return not before_reg or (w.started_at is not None and w.started_at < ev.ts)

    run = tuple(
        replace(w, stopping=True, grace_s=grace_s)
        for _, w in sorted(state.running.items())
        if w.node_id == ev.node_id and not w.stopping and covered(w)
    )
    if before_reg and not run:
        return Ignore("loss declared before the node's latest registration")
    if ev.node_id in state.rejoining:
        return Ignore("already rejoining")
    dropped = tuple(
        exit_event(replace(w, stopping=True), None, now, never_started=True)
        for _, w in sorted(state.waiting.items())
        if w.node_id == ev.node_id and not before_reg
    )
    return Rejoin(ev.node_id, Stop(run, grace_s, dropped), register=not before_reg)


def ready_to_rejoin(state: AgentState) -> tuple[str, ...]:
    """Rejoining nodes with no replica left running or waiting, in id order.

    Called after every replica exit, so it costs nothing while no node is
    rejoining and reads running replicas through the ``by_node`` index.
    """
    if not state.rejoining:
        return ()
    waiting = {w.node_id for w in state.waiting.values()}
    return tuple(sorted(n for n in state.rejoining if not state.by_node.get(n) and n not in waiting))


# --------------------------------------------------------------------------- evolve


def with_launched(state: AgentState, w: Workload) -> AgentState:
    """State after ``w`` started (removed from waiting, added to running)."""
    waiting = {k: v for k, v in state.waiting.items() if k != w.key} if w.key in state.waiting else state.waiting
    keys = state.by_node.get(w.node_id, ())
    by_node = state.by_node if w.key in state.running else {**state.by_node, w.node_id: (*keys, w.key)}
    return replace(state, running={**state.running, w.key: w}, waiting=waiting, by_node=by_node)


def with_limit_reached(state: AgentState, key: RunKey, limit: str) -> tuple[AgentState, Workload | None]:
    """State after replica ``key`` reached a limit (:data:`TIME_LIMIT`, :data:`DISK_QUOTA`): it is stopping with the
    default grace, :attr:`Workload.limit_reached` ``limit``. ``None`` (state unchanged) when it no longer runs or is
    already stopping for another reason."""
    w = state.running.get(key)
    if w is None or w.stopping:
        return state, None
    w = replace(w, stopping=True, limit_reached=limit, grace_s=DEFAULT_GRACE_S)
    return replace(state, running={**state.running, key: w}), w


def job_roots(checkpoint_root: str, log_dir: str | None, job_id: str) -> tuple[str, ...]:
    """The directories of job ``job_id`` on this node that its disk limit counts: its checkpoint directory, and its
    output directory (``<log_dir>/<job>``, where its replicas' ``TMPDIR`` also lie: :func:`job_files`)."""
    name = job_dir_name(job_id)
    ckpt = posixpath.join(checkpoint_root, name)
    return (ckpt,) if log_dir is None else (ckpt, posixpath.join(log_dir, name))


@dataclass(frozen=True, slots=True)
class DiskCheck:
    """One job's share of a disk-measuring pass (:func:`disk_checks`).

    Attributes:
        job_id: the job.
        roots: its directories (:func:`job_roots`).
        replicas: its process replicas running here and not stopping, in key order: stopped together when over.
        limit_bytes: its limit: the GPUs of those replicas times the limit per GPU.
    """

    job_id: str
    roots: tuple[str, ...]
    replicas: tuple[RunKey, ...]
    limit_bytes: int


def disk_limit_bytes(gpus: int, mb_per_gpu: int) -> int:
    """The disk limit of ``gpus`` GPUs (at least one: a replica always holds one) at ``mb_per_gpu`` MiB each."""
    return max(1, gpus) * mb_per_gpu * 1024 * 1024


def disk_checks(state: AgentState, checkpoint_root: str, log_dir: str | None, mb_per_gpu: int) -> list[DiskCheck]:
    """What one disk-measuring pass looks at: each job with a process replica running here (adopted ones too) and
    none of them stopping, in job order. Its replicas share its directories, so the limit is theirs together."""
    by_job: dict[str, list[Workload]] = {}
    for key in sorted(state.running):
        w = state.running[key]
        if not w.simulated:
            by_job.setdefault(w.job_id, []).append(w)
    return [
        DiskCheck(
            job,
            job_roots(checkpoint_root, log_dir, job),
            tuple(w.key for w in ws),
            disk_limit_bytes(sum(max(1, len(w.gpus)) for w in ws), mb_per_gpu),
        )
        for job, ws in sorted(by_job.items())
        if not any(w.stopping for w in ws)
    ]


def with_deferred(state: AgentState, w: Workload) -> AgentState:
    """State after ``w`` was put to wait for GPUs."""
    return replace(state, waiting={**state.waiting, w.key: w})


def with_stopping(state: AgentState, stop: Stop) -> AgentState:
    """State after a :class:`Stop`: its replicas marked stopping, waiting ones ended."""
    running = dict(state.running)
    for w in stop.workloads:
        running[w.key] = w
    dropped = {ended_key(e) for e in stop.events if isinstance(e, JobFailed)}
    waiting = {k: v for k, v in state.waiting.items() if k not in dropped}
    return replace(state, running=running, waiting=waiting, ended=state.ended | dropped)


def with_rejoining(state: AgentState, rejoin: Rejoin) -> AgentState:
    """State after a :class:`Rejoin`: its replicas stopping and their runs lost, the node waiting to register again."""
    lost = {(w.job_id, w.attempt) for w in rejoin.stop.workloads} | {(e.job_id, e.attempt) for e in rejoin.stop.events}
    state = with_stopping(state, rejoin.stop)
    rejoining = state.rejoining | {rejoin.node_id} if rejoin.register else state.rejoining
    return replace(state, rejoining=rejoining, lost_runs=state.lost_runs | lost)


def with_lost_runs(state: AgentState, runs: set[tuple[str, int]] | frozenset[tuple[str, int]]) -> AgentState:
    """State after the agent reported ``runs`` lost (``JobLost``): later starts for them are refused."""
    return replace(state, lost_runs=state.lost_runs | frozenset(runs)) if runs else state


def forgotten(state: AgentState, keys: list[RunKey] | tuple[RunKey, ...]) -> AgentState:
    """State without ``keys`` in ``ended`` (pruned after the retention window), nor their lost runs."""
    if not keys:
        return state
    gone = frozenset(keys)
    runs = {(k[1], k[2]) for k in gone}
    still = {(k[1], k[2]) for k in state.running} | {(k[1], k[2]) for k in state.waiting}
    return replace(state, ended=state.ended - gone, lost_runs=state.lost_runs - (runs - still))


def with_registered(state: AgentState, regs: list[NodeRegistered]) -> AgentState:
    """State after publishing ``regs``: registration times recorded, those nodes no longer rejoining."""
    done = {r.node_id for r in regs}
    return replace(
        state,
        registered_at={**state.registered_at, **{r.node_id: r.ts for r in regs}},
        rejoining=state.rejoining - done,
    )


def with_exited(state: AgentState, key: RunKey) -> AgentState:
    """State after the replica ``key`` exited."""
    running = {k: v for k, v in state.running.items() if k != key}
    by_node = dict(state.by_node)
    left = tuple(k for k in by_node.get(key[0], ()) if k != key)
    if left:
        by_node[key[0]] = left
    else:
        by_node.pop(key[0], None)
    return replace(state, running=running, ended=state.ended | {key}, by_node=by_node)


def with_token(state: AgentState, token: int | None) -> AgentState:
    """Remember the highest fencing token seen (tokens out of range are never remembered)."""
    if not valid_token(token) or (state.fencing_token is not None and token <= state.fencing_token):
        return state
    return replace(state, fencing_token=token)


def ready_to_launch(state: AgentState) -> tuple[Workload, ...]:
    """Waiting replicas whose GPUs are now all free, in key order."""
    out = []
    for _key, w in sorted(state.waiting.items()):
        held = state.held(w.node_id)
        if not any(g in held for g in w.gpus):
            out.append(w)
    return tuple(out)


# --------------------------------------------------------------------------- events


def started_event(w: Workload, now: datetime, pid: int | None = None) -> JobStarted:
    """``JobStarted`` for a launched replica."""
    return JobStarted(
        event_id=det_id("JobStarted", w.node_id, w.job_id, w.attempt, w.replica),
        ts=now,
        producer=PRODUCER,
        job_id=w.job_id,
        attempt=w.attempt,
        replica=w.replica,
        node_id=w.node_id,
        gpus=w.gpus,
        pid=pid,
    )


def exit_event(
    w: Workload, exit_code: int | None, now: datetime, *, never_started: bool = False, reason: str | None = None
) -> JobCompleted | JobFailed:
    """The event reporting that replica ``w`` ended.

    Args:
        w: the replica (``stopping`` tells whether a stop was asked for).
        exit_code: process exit code; negative = killed by that signal;
            ``None`` when there was no process or it could not start.
        now: event time.
        never_started: the replica was dropped before it started.
        reason: override the reason (e.g. ``"spawn failed: ..."``).
    """
    eid = det_id("WorkloadEnded", w.node_id, w.job_id, w.attempt, w.replica)
    common: dict[str, Any] = dict(
        event_id=eid,
        ts=now,
        producer=PRODUCER,
        job_id=w.job_id,
        attempt=w.attempt,
        replica=w.replica,
        node_id=w.node_id,
    )
    if reason is None and exit_code == 0 and not w.stopping:
        return JobCompleted(**common, exit_code=0)
    if reason is None and w.limit_reached is not None:
        reason = w.limit_reached
    if reason is None:
        if w.stopping:
            reason = STOPPED if not never_started else f"{STOPPED} before start"
        elif exit_code is not None and exit_code < 0:
            reason = f"killed by signal {-exit_code}"
        else:
            reason = f"exit code {exit_code}"
    return JobFailed(**common, exit_code=exit_code, reason=reason)


def lost_event(node_id: str, job_id: str, attempt: int, now: datetime) -> JobLost:
    """``JobLost`` of run ``(job_id, attempt)`` on ``node_id``, reported by the agent itself.

    For a replica whose fate the agent cannot know: it was running when the
    agent died and is gone (or cannot be verified) after the restart, or it
    was adopted and its exit code is not the agent's to read. The dispatcher
    requeues the run; the failure is the agent's, not the workload's, so it is
    never a ``JobFailed``. Charged up to ``now`` (the agent cannot know when
    the process died; the last heartbeat it sent was at most a heartbeat
    interval before it died). One per ``(node, job, attempt)``: the id is
    deterministic and distinct from the dispatcher's own ``JobLost``.
    """
    return JobLost(
        event_id=det_id("JobLost", PRODUCER, node_id, job_id, attempt),
        ts=now,
        producer=PRODUCER,
        job_id=job_id,
        attempt=attempt,
        node_id=node_id,
        charged_until=now,
    )


def registered_events(state: AgentState, now: datetime, only: tuple[str, ...] | None = None) -> list[NodeRegistered]:
    """One ``NodeRegistered`` per hosted node (or per node of ``only``), in node order."""
    return [
        NodeRegistered(
            ts=now,
            producer=PRODUCER,
            node_id=n.node_id,
            gpu_count=len(n.gpus),
            gpu_model=n.model,
            gpus=n.gpus,
            simulated=n.simulated,
        )
        for _, n in sorted(state.nodes.items())
        if only is None or n.node_id in only
    ]


#: Fraction of simulated workloads that hold their GPUs without using them (``audit squatting`` finds them).
SIM_IDLE_FRACTION = 0.05


def simulated_utilisation(seed: int, job_id: str) -> float:
    """GPU utilisation (%) a simulated workload of ``job_id`` reports on each of its GPUs, at every heartbeat.

    A simulated workload does no work, so its utilisation is drawn, not
    measured: deterministic in ``(seed, job_id)`` (the same for every attempt
    and replica of the job, on any agent with the same seed). With ``x`` the
    first 8 bytes of ``sha256(f"{seed}:{job_id}")`` as an unsigned
    big-endian integer and ``u = x / 2**64`` (uniform on [0, 1)): ``0.0``
    (idle: a squatter) when ``u < SIM_IDLE_FRACTION``, else
    ``40 + 60 * (u - f) / (1 - f)`` with ``f = SIM_IDLE_FRACTION``, rounded to
    0.1 (40-100%, busy).
    """
    x = int.from_bytes(hashlib.sha256(f"{seed}:{job_id}".encode()).digest()[:8], "big")
    u = x / 2**64
    f = SIM_IDLE_FRACTION
    return 0.0 if u < f else round(40.0 + 60.0 * (u - f) / (1.0 - f), 1)


#: GPU utilisation (%) below which a GPU counts as idle in a sample.
IDLE_UTIL_PCT = 1.0

#: Default event seconds a run's GPUs stay idle before its heartbeat calls it ``idle`` (node setting ``idle_after_s``).
IDLE_AFTER_S = 2 * 3600.0


def sampled_gpus(
    state: AgentState, node_id: str, gpus: tuple[GpuStatus, ...], sim_util_seed: int | None = None
) -> tuple[GpuStatus, ...]:
    """The probe's samples of ``node_id`` as the heartbeat reports them.

    With ``sim_util_seed`` given, on a simulated node, a GPU sample without a utilisation that a simulated
    workload holds reports :func:`simulated_utilisation` of its job (GPUs held by a process, or by nobody,
    keep what the probe said).
    """
    node = state.nodes.get(node_id)
    if sim_util_seed is None or node is None or not node.simulated:
        return gpus
    held = [state.running[k] for k in state.by_node.get(node_id, ())]
    util = {g: simulated_utilisation(sim_util_seed, w.job_id) for w in held if w.simulated for g in w.gpus}
    return tuple(
        g.model_copy(update={"utilization_pct": util[g.index]}) if g.utilization_pct is None and g.index in util else g
        for g in gpus
    )


def idle_since(
    state: AgentState,
    node_id: str,
    gpus: tuple[GpuStatus, ...],
    now: datetime,
    before: Mapping[RunKey, datetime],
) -> dict[RunKey, datetime]:
    """Since when each replica on ``node_id`` has been idle, after the sample ``gpus`` taken at ``now``.

    A replica is idle in a sample when every one of its GPUs reports a utilisation below
    :data:`IDLE_UTIL_PCT`; it stays idle since its first such sample (``before``, else ``now``). A GPU in use,
    or of unknown utilisation (no evidence of idleness), ends it: the replica is left out.
    """
    util = {g.index: g.utilization_pct for g in gpus}
    out: dict[RunKey, datetime] = {}
    for k in state.by_node.get(node_id, ()):
        us = [util.get(g) for g in state.running[k].gpus]
        if us and all(u is not None and u < IDLE_UTIL_PCT for u in us):
            out[k] = before.get(k, now)
    return out


def heartbeat_event(
    state: AgentState,
    node_id: str,
    now: datetime,
    gpus: tuple[GpuStatus, ...] = (),
    sim_util_seed: int | None = None,
    idle: Mapping[RunKey, datetime] | None = None,
    idle_after_s: float = IDLE_AFTER_S,
) -> NodeHeartbeat:
    """``NodeHeartbeat`` for ``node_id`` with GPU samples (:func:`sampled_gpus`) and the replicas running there.

    Each replica carries the mean utilisation of its GPUs in the sample and, given ``idle`` (from
    :func:`idle_since`), how long it has been idle (``0.0`` when a GPU of its is in use or unknown) and
    whether that reached ``idle_after_s``; without ``idle``, neither.
    """
    gpus = sampled_gpus(state, node_id, gpus, sim_util_seed)
    util = {g.index: g.utilization_pct for g in gpus}
    running = []
    for k in sorted(state.by_node.get(node_id, ())):
        w = state.running[k]
        known = [u for u in (util.get(g) for g in w.gpus) if u is not None]
        idle_s = None if idle is None else (now - idle[k]).total_seconds() if k in idle else 0.0
        running.append(
            RunningWorkload(
                job_id=w.job_id,
                attempt=w.attempt,
                replica=w.replica,
                gpus=w.gpus,
                utilization_pct=round(sum(known) / len(known), 1) if known else None,
                idle_s=idle_s,
                idle=idle_s is not None and idle_s >= idle_after_s,
            )
        )
    return NodeHeartbeat(ts=now, producer=PRODUCER, node_id=node_id, gpus=gpus, running=tuple(running))
