"""``apportion history``: finished jobs, like Slurm's ``sacct``, folded from the log; ``apportion logs``: a job's output.

:func:`fold_jobs` is pure: the events of ``apportion.submissions`` and
``apportion.jobs`` in log order in, one :class:`JobHistory` per job out. A
job's state is ``pending``/``running`` while it lives, then ``completed``
(every replica of its last attempt exited 0), ``failed``, ``cancelled`` or
``rejected``. Per job it counts attempts and preemptions, the wait (first
start minus submission), the run time (event seconds its attempts held GPUs,
from the first replica's start to the run's end: the last replica's exit, the
preemption, the loss or the cancel), GPU-hours (run time x GPUs) and the work
lost (``lost_gpu_s`` of its preemptions and losses; ``None`` when the log
never recorded it). Each element of a job array is a job of its own
(``<array id>_<index>``); the array has a row of its own only while none of
its elements is queued (a rejected array, or one not yet answered).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from apportion import events
from apportion.arrays import element_id, split_element_id
from apportion.cli.common import (
    _checked,
    _print_json,
    _require_topics,
    check_budget_filter,
    err,
    fail,
    json_option,
    natural_width,
    refuse,
)
from apportion.domain.dispatch import COMPLETED_BEFORE_LOSS, LostRun, lost_run_report
from apportion.domain.user_usage import UserUsage, usage_by_user
from apportion.jobdirs import job_dir_name
from apportion.settings import topic_name
from apportion.timeutil import to_us

FINISHED = ("completed", "failed", "cancelled", "rejected")


def refuses_request_only(ev: events.Event, queued: bool) -> bool:
    """True for a ``JobRejected`` that refuses a request and says nothing about the job (which may be running).

    That is the refusal of a cancel, hold or release request (``request`` not ``JobSubmitted``:
    ``not_owner``, ``unauthenticated``), and any refusal of a later submission
    reusing the id of a job that was queued (``duplicate_job``, or an
    ``unauthenticated`` copy).
    """
    if not isinstance(ev, events.JobRejected):
        return False
    return ev.request != "JobSubmitted" or queued


@dataclass
class JobHistory:
    """One job as the log tells it (see the module docstring for the fields' meaning)."""

    job_id: str
    user: str
    budget: str
    gpus_per_replica: int
    replicas: int
    min_runtime_s: float
    submitted_at: datetime
    state: str = "pending"
    attempts: int = 0
    preemptions: int = 0
    first_start: datetime | None = None
    ended_at: datetime | None = None
    run_s: float = 0.0
    lost_gpu_s: float | None = None
    reason: str = ""
    _started: datetime | None = None
    _done: set[int] = field(default_factory=set)
    _preempted: int = 0  # the latest attempt preempted: its stopped replicas' failures end nothing
    # a stopped run whose completions stamped at or before its stop would finish the job (rule
    # D3.completed-before-loss); ``_lost``: it was lost (counts until the next placement; preempted: its requeue)
    _finishing: LostRun | None = None
    _lost: bool = False

    @property
    def gpus(self) -> int:
        return self.gpus_per_replica * self.replicas

    @property
    def wait_s(self) -> float | None:
        if self.first_start is None:
            return None
        return max(0.0, (self.first_start - self.submitted_at).total_seconds())

    @property
    def gpu_hours(self) -> float:
        return self.run_s * self.gpus / 3600.0

    def _end_run(self, ts: datetime) -> None:
        if self._started is not None:
            self.run_s += max(0.0, (ts - self._started).total_seconds())
            self._started = None

    def _lose(self, gpu_s: float | None) -> None:
        if gpu_s is not None:
            self.lost_gpu_s = (self.lost_gpu_s or 0.0) + gpu_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "user": self.user,
            "budget": self.budget,
            "state": self.state,
            "gpus_per_replica": self.gpus_per_replica,
            "replicas": self.replicas,
            "min_runtime_s": self.min_runtime_s,
            "submitted_at": self.submitted_at.isoformat(),
            "first_start": self.first_start.isoformat() if self.first_start else None,
            "ended_at": self.ended_at.isoformat() if self.ended_at else None,
            "attempts": self.attempts,
            "preemptions": self.preemptions,
            "wait_s": self.wait_s,
            "run_s": self.run_s,
            "gpu_hours": self.gpu_hours,
            "lost_gpu_s": self.lost_gpu_s,
            "reason": self.reason,
        }


def _history_of(sub: events.JobSubmitted, job_id: str) -> JobHistory:
    return JobHistory(
        job_id, sub.user, sub.budget, sub.gpus_per_replica, sub.replicas, sub.min_runtime_s, sub.submitted_at
    )


def fold_jobs(evts: Iterable[events.Event]) -> dict[str, JobHistory]:
    """Fold submissions and job events (log order) into one :class:`JobHistory` per job id."""
    jobs: dict[str, JobHistory] = {}
    arrays: dict[str, events.JobSubmitted] = {}  # a job array's submission, by its id
    seen: set[Any] = set()
    for ev in evts:
        if ev.event_id in seen:
            continue
        seen.add(ev.event_id)
        if isinstance(ev, events.JobSubmitted):
            if ev.job_id not in jobs and ev.job_id not in arrays:
                jobs[ev.job_id] = _history_of(ev, ev.job_id)  # an array's own row until its elements are queued
                if ev.array is not None:
                    arrays[ev.job_id] = ev
            continue
        if isinstance(ev, events.JobQueued) and ev.array_id in arrays and ev.job_id not in jobs:
            jobs.pop(ev.array_id, None)  # accepted: each element is its own job from now on
            jobs[ev.job_id] = _history_of(arrays[ev.array_id], ev.job_id)
        job = jobs.get(getattr(ev, "job_id", ""))
        if job is None:
            continue
        if refuses_request_only(ev, job.attempts > 0):
            continue  # a later request under the id (a resubmission, a cancel) was refused; the job goes on
        if isinstance(ev, events.JobRejected):
            job.state, job.ended_at = "rejected", ev.ts
            job.reason = f"{ev.reason.value}: {ev.message}"
        elif isinstance(ev, events.JobQueued):
            job.attempts = max(job.attempts, ev.attempt)
        elif isinstance(ev, events.JobPlaced):
            job.attempts = max(job.attempts, ev.attempt)
            job._done = set()
            job._finishing, job._lost = None, False
        elif isinstance(ev, events.JobStarted):
            if job._started is None and ev.attempt == job.attempts:
                job._started = ev.ts
                job.state = "running"
            if job.first_start is None:
                job.first_start = ev.ts
        elif isinstance(ev, events.JobPreempted):
            job.preemptions += 1
            job._preempted = ev.attempt
            job._lose(ev.lost_gpu_s)
            job._end_run(ev.ts)
            job._finishing = _finishing(job, ev.attempt, ev.ts)
        elif isinstance(ev, events.JobLost):
            job._lose(ev.lost_gpu_s)
            job._end_run(ev.charged_until)
            if job._finishing is None or job._finishing.attempt != ev.attempt:  # preempted first: that bound
                job._finishing = _finishing(job, ev.attempt, ev.ts) if job._preempted != ev.attempt else None
            job._lost = True
        elif isinstance(ev, events.JobCompleted | events.JobFailed) and _finishing_report(job, ev):
            job.state, job.ended_at, job.reason = "completed", ev.ts, COMPLETED_BEFORE_LOSS
        elif isinstance(ev, events.JobRequeued):
            if not job._lost:
                job._finishing = None  # a preempted run's stop is done
            job.state = "pending"
            job.attempts = max(job.attempts, ev.attempt)
        elif isinstance(ev, events.JobCancelled):
            job._end_run(ev.ts)
            ended = "completed" if ev.reason == COMPLETED_BEFORE_LOSS else "cancelled"  # the lost run had finished
            job.state, job.ended_at, job.reason = ended, ev.ts, ev.reason
        elif isinstance(ev, events.JobCompleted) and ev.attempt == job.attempts and job.state == "running":
            job._done.add(ev.replica if ev.replica is not None else -1)
            if ev.replica is None or len(job._done) >= job.replicas:
                job._end_run(ev.ts)
                job.state, job.ended_at = "completed", ev.ts
        elif isinstance(ev, events.JobFailed) and _ends_the_job(job, ev):
            if ev.replica is None or job.replicas == 1:
                job._end_run(ev.ts)
                job.state, job.ended_at, job.reason = "failed", ev.ts, ev.reason
    return jobs


def _finishing(job: JobHistory, attempt: int, at: datetime) -> LostRun | None:
    """The stopped ``attempt``'s replicas not completed yet, stopped at ``at`` (``None``: not the latest)."""
    if attempt != job.attempts:
        return None
    done = frozenset(range(job.replicas)) if -1 in job._done else frozenset(job._done)
    return LostRun(attempt, to_us(at), frozenset(range(job.replicas)) - done)


def _finishing_report(job: JobHistory, ev: events.JobCompleted | events.JobFailed) -> bool:
    """Whether ``ev``, a report of ``job``'s stopped run, finishes the job (rule D3.completed-before-loss, judged
    by the dispatcher's test); it updates the replicas still to report."""
    run = job._finishing
    if run is None or run.attempt != ev.attempt or job.state in FINISHED:
        return False
    after = lost_run_report(run, ev, to_us(ev.ts))
    job._finishing = after if after is not None and after.replicas_left else None
    return after is not None and not after.replicas_left


def _ends_the_job(job: JobHistory, ev: events.JobFailed) -> bool:
    """Whether ``ev`` fails ``job``: a failure of its current attempt, placed or running (a start that failed,
    ``no_account`` or a spawn failure, ends a job that never ran), unless that attempt was preempted (its
    stopped replicas fail, and the dispatcher requeues the job)."""
    return ev.attempt == job.attempts and job.state in ("pending", "running") and ev.attempt != job._preempted


def _hours(s: float | None) -> str:
    from apportion.durations import format_duration

    return "-" if s is None else format_duration(round(s))


def history(
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's jobs.")] = None,
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget (and below).")] = None,
    state: Annotated[
        str | None, typer.Option("--state", help="Only jobs in this state: completed, failed, cancelled, rejected.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Finished at or after (ISO time, e.g. 2026-12-01T09:00Z, or 2h ago).")
    ] = None,
    until: Annotated[str | None, typer.Option("--until", help="Finished before (ISO time, or a duration ago).")] = None,
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")
    ] = None,
    wide: Annotated[
        bool, typer.Option("--wide", "-w", help="Every column: budget, attempts, preemptions, work lost, full end.")
    ] = False,
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """Finished jobs, like sacct: user, state, GPUs, wait, run time, GPU-hours, end and why it ended.

    Fits the terminal (80 columns: where a row does not fit, its reason follows the table, never cut); --wide
    adds budget, attempts, preemptions, work lost and the full end time, every column in the table. Built from the log (apportion.submissions and apportion.jobs); times are
    event times.

    Examples:

      apportion history -u alice --since 1d
      apportion history -b lab/vision --state failed --wide
    """
    from rich.console import Console

    from apportion import topics
    from apportion.bus.reader import read_log

    if state is not None and state not in FINISHED:
        fail(f"--state must be one of {', '.join(FINISHED)}, got {state!r}")
    check_budget_filter(budget)
    lo, hi = _when(since, "--since"), _when(until, "--until")
    conn = _require_topics(bootstrap, topic_name(topics.SUBMISSIONS), topic_name(topics.JOBS))
    recs = _checked(lambda: read_log(conn.bootstrap, [topic_name(topics.SUBMISSIONS), topic_name(topics.JOBS)]))
    rows = [
        j
        for j in fold_jobs(r.event for r in recs if r.event is not None).values()
        if j.state in FINISHED
        and (user is None or j.user == user)
        and (budget is None or j.budget == budget or j.budget.startswith(budget + "/"))
        and (state is None or j.state == state)
        and (lo is None or (j.ended_at is not None and j.ended_at >= lo))
        and (hi is None or (j.ended_at is not None and j.ended_at < hi))
    ]
    rows.sort(key=lambda j: (j.ended_at or j.submitted_at, j.job_id))
    if as_json:
        _print_json([j.to_dict() for j in rows])
        return
    console = Console()
    if wide:  # every column whole, however wide: the terminal wraps what it cannot show
        t = history_table(rows, wide=True)
        Console(width=max(console.width, natural_width(t))).print(t)
    else:
        console.print(history_table(rows, width=console.width))


def history_table(rows: list[JobHistory], *, wide: bool = False, width: int = 80) -> Any:
    """The ``history`` table: by default job, user, state, GPUs, wait, run, end (``MM-DD HH:MM``) and the
    reason, fitted to ``width`` columns, the terminal's, with no cell cut
    (:func:`apportion.cli.common.fitted_table`): where a row does not fit, the reason, then the end, then the
    user leave the table for a line per job after it (``job: end 12-01 14:00; exit 1: ...``). ``wide`` adds
    budget, attempts, preemptions, GPU-hours, work lost and the end with its year and seconds, and keeps every
    column in the table, however wide (the terminal wraps what it cannot show)."""
    from rich.console import Group
    from rich.text import Text

    from apportion.cli.common import Column, fitted_table, left_out

    def cell(name: str, value: Any) -> Column:
        return (
            name,
            {"justify": "right"} if name in {"att", "pre", "GPU-h", "lost GPU-h", "wait", "run"} else {},
            value,
        )

    end = "%Y-%m-%d %H:%M:%S" if wide else "%m-%d %H:%M"
    columns: list[Column] = [
        cell("job", lambda j: j.job_id),
        cell("user", lambda j: j.user),
        *([cell("budget", lambda j: j.budget)] if wide else []),
        cell("state", lambda j: j.state),
        cell("GPUs", lambda j: f"{j.replicas}x{j.gpus_per_replica}"),
        *([cell("att", lambda j: str(j.attempts)), cell("pre", lambda j: str(j.preemptions))] if wide else []),
        cell("wait", lambda j: _hours(j.wait_s)),
        cell("run", lambda j: _hours(j.run_s)),
        *(
            [
                cell("GPU-h", lambda j: f"{j.gpu_hours:.2f}"),
                cell("lost GPU-h", lambda j: "-" if j.lost_gpu_s is None else f"{j.lost_gpu_s / 3600:.2f}"),
            ]
            if wide
            else []
        ),
        cell("end", lambda j: j.ended_at.strftime(end) if j.ended_at else "-"),
        cell("reason", lambda j: j.reason or "-"),
    ]
    t, moved = fitted_table(
        f"history ({len(rows)} finished job{'' if len(rows) == 1 else 's'})",
        columns,
        rows,
        width,
        () if wide else ("reason", "end", "user"),
    )
    parts = [(j, left_out(columns, moved, j, bare=("reason",))) for j in (rows if moved else ())]
    lines = [Text.assemble((j.job_id, "bold"), ": ", "; ".join(p)) for j, p in parts if p != ["-"]]
    return Group(t, *lines)


def _when(text: str | None, flag: str) -> datetime | None:
    """An ISO time, or a duration meaning that long before now (``2h`` = two hours ago)."""
    from datetime import UTC, timedelta

    from apportion.durations import parse_duration
    from apportion.settings import event_clock

    if text is None:
        return None
    t = text.strip().removesuffix(" ago")
    try:
        d = datetime.fromisoformat(t.replace("Z", "+00:00"))
        return d if d.tzinfo else d.replace(tzinfo=UTC)
    except ValueError:
        pass
    try:
        return event_clock().now() - timedelta(seconds=parse_duration(t))
    except ValueError:
        fail(f"{flag}: not an ISO time or a duration: {text!r}")
    return None


def usage(
    by_user: Annotated[
        bool, typer.Option("--by-user", "-a", help="A row per user under each budget (sshare -a).")
    ] = False,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's rows.")] = None,
    budget: Annotated[str | None, typer.Option("--budget", "-b", help="Only this budget (and below).")] = None,
    window: Annotated[str, typer.Option("--window", help="Trailing window (7d, 24h).")] = "7d",
    bootstrap: Annotated[
        str | None, typer.Option("--bootstrap", help="Kafka bootstrap (host:port).", envvar="APPORTION_KAFKA_BOOTSTRAP")
    ] = None,
    as_json: Annotated[bool, json_option()] = False,
) -> None:
    """GPU-hours per leaf budget over the trailing window, with --by-user a row per user (like sshare -a).

    Alloc is what allocated runs held (charged: the budget's O), unalloc what unallocated runs held (its U);
    share is a user's part of the budget's alloc. Built from the log (apportion.jobs) with the accounting's
    own fold, at the stack's event time.

    Examples:

      apportion usage --by-user
      apportion usage -b lab/vision --window 1d
    """
    from rich.console import Console
    from rich.table import Table

    from apportion.durations import parse_duration

    check_budget_filter(budget)
    try:
        window_s = parse_duration(window)
    except ValueError as exc:
        fail(f"--window: {exc}")
    if window_s <= 0:
        fail("--window must be longer than 0")
    rows = usage_rows(logged_usage(bootstrap, window_s), by_user=by_user, user=user, budget=budget)
    if as_json:
        _print_json({"window_s": window_s, "rows": [r.to_dict() for r in rows]})
        return
    t = Table(title=f"usage over the last {window} (GPU-hours)")
    for col in ("budget", "user", "alloc", "unalloc", "share"):
        t.add_column(col, justify="left" if col in ("budget", "user") else "right")
    for r in rows:
        t.add_row(
            r.budget if not r.user else "",
            r.user or "(all)",
            f"{r.allocated_gpu_h:.2f}",
            f"{r.unallocated_gpu_h:.2f}",
            f"{100 * r.share_of_budget:.1f}%",
        )
    Console().print(t)


def logged_usage(bootstrap: str | None, window_s: float, at_us: int | None = None) -> list[UserUsage]:
    """:func:`usage_by_user` of the stack's log (``apportion.jobs``) at ``at_us`` (default: the stack's event
    time): what ``usage`` and ``share --users`` show. Kafka unreachable or the topic missing: one line, exit 3."""
    from apportion import topics
    from apportion.bus.reader import read_log
    from apportion.settings import event_clock

    conn = _require_topics(bootstrap, topic_name(topics.JOBS))
    recs = _checked(lambda: read_log(conn.bootstrap, [topic_name(topics.JOBS)]))
    at = at_us if at_us is not None else to_us(event_clock().now())
    return usage_by_user((r.event for r in recs if r.event is not None), window_s, at)


def usage_rows(
    rows: list[UserUsage], *, by_user: bool, user: str | None = None, budget: str | None = None
) -> list[UserUsage]:
    """The rows ``usage`` shows: budget totals (and with ``by_user`` each user's), filtered by ``user`` (that
    user's rows only) and ``budget`` (that budget and below)."""
    out = []
    for r in rows:
        if budget is not None and not (r.budget == budget or r.budget.startswith(budget + "/")):
            continue
        if user is not None:
            if r.user == user:
                out.append(r)
        elif r.user == "" or by_user:
            out.append(r)
    return out


def output_files(folder: Path, replica: int, stream: str) -> tuple[dict[int, Path], dict[int, tuple[Path, str]]]:
    """The output files of ``replica`` in a job's output directory, by attempt: the names the node agent writes
    (``attempt-<a>.replica-<r>.out|.err``; the directory is :func:`apportion.jobdirs.job_dir_name`'s) that are
    regular files with one link. The directory is the job's: anything else a job left there (a symbolic link
    to ``/etc/shadow`` named as a later attempt, a hard link, a FIFO) is not the agent's output and is
    skipped, and returned second: its path and what it is instead, by attempt. ``({}, {})`` when the directory is
    missing or is not a directory (a link is not followed)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}, {}
    pattern = re.compile(rf"attempt-([1-9][0-9]{{0,8}})\.replica-{replica}\.{re.escape(stream)}")
    out: dict[int, Path] = {}
    skipped: dict[int, tuple[Path, str]] = {}
    try:
        for name in os.listdir(fd):
            m = pattern.fullmatch(name)
            if m is None:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                out[int(m.group(1))] = folder / name
            else:
                what = (
                    "a symbolic link"
                    if stat.S_ISLNK(st.st_mode)
                    else f"a hard link ({st.st_nlink} links)"
                    if stat.S_ISREG(st.st_mode)
                    else "not a regular file"
                )
                skipped[int(m.group(1))] = (folder / name, what)
    finally:
        os.close(fd)
    return out, skipped


#: What ``apportion logs`` shows of an output file by default: its last MiB (a job's file can be of any size,
#: sparse ones of terabytes included, and is never read whole into memory).
TAIL_BYTES = 1 << 20
#: The chunk ``logs --all`` copies the file in.
CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class OutputTail:
    """The end of an output file that :func:`read_output` read: ``text`` begins at byte ``offset`` of a file of
    ``size`` bytes; ``cut`` when bytes before it (or lines, with a line limit) were left out."""

    text: str
    size: int
    offset: int
    cut: bool


def open_output(path: Path) -> Any:
    """A job's output file opened for reading (binary), without following a link or waiting on a FIFO.

    The directory is the job's, so what lies at the name is the job's choice, and it may change it after
    :func:`output_files` looked: a symbolic link (to ``/etc/shadow``, read by root's ``apportion logs``), a hard
    link, a FIFO or a device is refused on the descriptor read.

    Raises:
        OSError: not a regular file with one link (``strerror`` says which), or it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    if st.st_nlink != 1:
        f.close()
        raise OSError(errno.EPERM, f"it has {st.st_nlink} links (a hard link)", str(path))
    return f


def read_output(path: Path, *, max_bytes: int = TAIL_BYTES, lines: int | None = None) -> OutputTail:
    """The end of a job's output file (:func:`open_output`): its last ``max_bytes`` bytes, and of those the last
    ``lines`` lines when given; at most ``max_bytes`` are read, whatever the file's size.

    Raises:
        OSError: as :func:`open_output`.
    """
    with open_output(path) as f:
        size = os.fstat(f.fileno()).st_size
        offset = max(0, size - max_bytes)
        f.seek(offset)
        data = f.read(max_bytes)
    if lines is not None:
        keep = data.splitlines(keepends=True)[-lines:] if lines > 0 else []
        dropped = len(data) - sum(map(len, keep))
        offset, data = offset + dropped, data[dropped:]
    return OutputTail(data.decode(errors="replace"), size, offset, offset > 0)


def copy_output(path: Path, out: Any) -> int:
    """Copy a whole output file (:func:`open_output`) to the binary stream ``out`` in chunks of
    :data:`CHUNK_BYTES`; returns the bytes copied.

    Raises:
        OSError: as :func:`open_output`.
    """
    n = 0
    with open_output(path) as f:
        while chunk := f.read(CHUNK_BYTES):
            out.write(chunk)
            n += len(chunk)
    out.flush()
    return n


def no_output_message(job_id: str, replica: int, folder: Path) -> str:
    """Why ``apportion logs`` shows nothing, a line each (the folder looked in, then where to learn why), so that
    at 80 columns only a long path or job id runs past the edge: a simulated ``--duration`` job has no output,
    nor one refused at its start. An array id has no output of its own: where the folder beside holds its
    elements' directories, a last line says so and names the first (``apportion logs sweep_0``)."""
    message = (
        f"no output of job {job_id} (replica {replica}) in\n"
        f"  {folder}\n"
        f"  only a started command has output (`apportion audit explain {job_id}`)"
    )
    elements = array_elements_in(folder.parent, job_id)
    if elements:
        first = element_id(job_id, elements[0])
        message += f"\n  a job array: its {len(elements)} elements here have output, e.g. `apportion logs {first}`"
    return message


def array_elements_in(base: Path, array_id: str) -> list[int]:
    """The indices of ``array_id``'s elements (:func:`apportion.arrays.element_id`) whose output directories
    ``base`` holds, in index order; none when ``base`` cannot be listed."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    indices = []
    for name in names:
        parts = split_element_id(name)
        if parts is not None and parts[0] == array_id and job_dir_name(name) == name:  # an element's own directory
            indices.append(parts[1])
    return sorted(indices)


def logs(
    job_id: Annotated[str, typer.Argument(help="The job.")],
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", help="Attempt (default: the latest).")] = None,
    replica: Annotated[int, typer.Option("--replica", "-r", min=0, help="Replica of a gang.")] = 0,
    stderr: Annotated[bool, typer.Option("--stderr", help="Show stderr instead of stdout.")] = False,
    log_dir: Annotated[
        Path | None,
        typer.Option(
            "--dir", help="The node agent's job log directory (default: APPORTION_JOB_LOG_DIR or the stack's)."
        ),
    ] = None,
    tail_bytes: Annotated[
        int, typer.Option("--bytes", "-c", min=1, help="Show at most the last N bytes (default 1 MiB).")
    ] = TAIL_BYTES,
    lines: Annotated[
        int | None, typer.Option("--lines", "-n", min=0, help="Show the last N lines (of the last --bytes).")
    ] = None,
    whole: Annotated[bool, typer.Option("--all", help="The whole file, copied in chunks (not with --json).")] = False,
    as_json: Annotated[bool, json_option("Print JSON for scripts: the file, its attempts, the text.")] = False,
) -> None:
    """A job's output: the stdout (or stderr) file the node agent writes per attempt and replica.

    Shows the file's last MiB (--bytes N, and --lines N of those), with a note on stderr when the start was
    left out; --all copies the whole file. Exit 1 when the job has no output there (never ran on this machine's
    agent, or another directory); with --json the refusal is a ``{"ok": false, ...}`` object on stdout too.
    --json on success: ``{"ok": true, "job_id", "attempt", "attempts", "replica", "stream", "path", "text",
    "size", "offset", "cut"}`` (``text`` begins at byte ``offset`` of the ``size`` bytes).

    Examples:

      apportion logs j-42
      apportion logs j-42 --stderr --lines 50
      apportion logs j-42 --attempt 1 --replica 2
    """
    import sys

    from apportion.settings import stack_env

    if whole and as_json:
        fail("--all copies the whole file to stdout; with --json give --bytes N (the last N bytes) instead")
    if whole and lines is not None:
        fail("--all and --lines exclude each other")
    base = log_dir or (
        Path(os.environ["APPORTION_JOB_LOG_DIR"])
        if os.environ.get("APPORTION_JOB_LOG_DIR")
        else Path(stack_env()["JOB_LOG_DIR"])
        if stack_env().get("JOB_LOG_DIR")
        else None
    )
    if base is None:
        fail("no job log directory known: give --dir, set APPORTION_JOB_LOG_DIR, or start the stack with `stack up`")
    folder = base / job_dir_name(job_id)
    stream = "err" if stderr else "out"
    by_attempt, skipped = output_files(folder, replica, stream)
    if not by_attempt and skipped:  # the job replaced its output: say so, rather than that it never had any
        path, what = skipped[max(skipped)]
        refuse(
            f"job {job_id}'s output {path} is not read: {what}, not the node agent's file (a job may change "
            "what its own directory holds)",
            as_json=as_json,
            reason="not_a_plain_file",
            job_id=job_id,
            path=str(path),
        )
    if not by_attempt:
        refuse(
            no_output_message(job_id, replica, folder),
            as_json=as_json,
            verdict="not_found",
            reason="no_output",
            job_id=job_id,
        )
    pick = max(by_attempt) if attempt is None else attempt
    if pick not in by_attempt:
        refuse(
            f"job {job_id} has no attempt {pick} here (attempts: {', '.join(map(str, sorted(by_attempt)))})",
            as_json=as_json,
            verdict="not_found",
            reason="no_attempt",
            job_id=job_id,
            attempts=sorted(by_attempt),
        )
    try:
        if whole:
            copy_output(by_attempt[pick], sys.stdout.buffer)
            return
        tail = read_output(by_attempt[pick], max_bytes=tail_bytes, lines=lines)
    except OSError as exc:
        refuse(
            f"job {job_id}'s output {by_attempt[pick]} is not read: {exc.strerror}",
            as_json=as_json,
            reason="not_a_plain_file",
            job_id=job_id,
            path=str(by_attempt[pick]),
        )
    if as_json:
        _print_json(
            {
                "ok": True,
                "job_id": job_id,
                "attempt": pick,
                "attempts": sorted(by_attempt),
                "replica": replica,
                "stream": "stderr" if stderr else "stdout",
                "path": str(by_attempt[pick]),
                "text": tail.text,
                "size": tail.size,
                "offset": tail.offset,
                "cut": tail.cut,
            }
        )
        return
    if tail.cut:
        err.print(
            f"note: output cut: the last {tail.size - tail.offset:,} of {tail.size:,} bytes shown "
            "(--bytes N or --lines N for another tail, --all for the whole file)",
            highlight=False,
            soft_wrap=True,
        )
    sys.stdout.write(tail.text)


def register(app: typer.Typer) -> None:
    """Attach ``apportion history``, ``apportion usage`` and ``apportion logs``."""
    app.command("history")(history)
    app.command("usage")(usage)
    app.command("logs")(logs)
