"""The node agent's journal: which replicas it started and which ended, and the newest fencing token.

Rule 8 (idempotent handling) for an agent means a command redelivered after
a crash must not start a workload twice, and a restart must lose no run
silently. The consumer commits a command's offset only after the journal
line for its effect is on disk, and on start the agent reads the journal back:

* every replica started or ended here within the retention window is
  *known* (a second start is refused);
* the newest fencing token seen survives the restart (a stale leader stays
  refused), and so do the runs declared lost here;
* replicas started but not ended were running when the agent died
  (*orphans*): the agent adopts those still alive (pid *and* process start
  time match, so a reused pid is never mistaken for them; a simulated
  workload resumes its remaining duration) and reports the others
  ``JobLost``, after the last checkpoint their progress file holds (when it
  changed since the start: ``progress_file`` and ``progress_stamp``). See
  :meth:`services.node_agent.service.NodeAgent.start`.

Format: JSON lines, appended and fsynced::

    {"op": "start", "key": [node, job, attempt, replica], "pid": int|null, "pstart": int|null,
     "progress_file": str|null, "progress_stamp": [inode, size, mtime_ns]|null,
     "ts": iso|null, "gpus": [int], "sim_until": iso|null, "sim_progress": float|null,
     "sim_every": float|null, "time_limit_s": float|null}
    {"op": "end", "key": [...], "ts": iso|null, "lost": bool}
    {"op": "token", "token": int}

Fields added over time (``progress_*``, ``ts``, ``gpus``, ``sim_until``,
``sim_progress``, ``sim_every``, ``time_limit_s``, ``lost``, the ``token`` op) are optional: older journals load, with
``null``/absent read as unknown. A torn last line (a crash mid-write) is
skipped. :meth:`Journal.compact` rewrites the file with only what is still
needed (open starts, ends within the window, the token), atomically, so the
file stays bounded like the memory. With ``path=None`` the journal lives in
memory only (tests, throwaway demos).

Group commit: between :meth:`Journal.hold` and :meth:`Journal.release` the
lines are kept in memory; :meth:`Journal.take` hands them over and
:meth:`Journal.append` writes them with one write and one fsync (from a
worker thread if the caller likes: it touches nothing but the file). The
agent publishes the reports of a group only after its lines are on disk, and
the consumer commits the group's offsets after that, so the guarantee above
holds per group instead of per line.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from apportion.privatefiles import write_private
from services.node_agent.logic import FileStamp, RunKey, valid_token


def _stamp_of(value: object) -> FileStamp | None:
    """A journal's ``progress_stamp`` as a :data:`FileStamp`, ``None`` when absent or malformed."""
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) for v in value):
        return (value[0], value[1], value[2])
    return None


def _time_of(value: object) -> datetime | None:
    """An ISO time from the journal, ``None`` when absent or malformed (or naive)."""
    if not isinstance(value, str):
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    return t if t.tzinfo is not None else None


def _seconds_of(value: object, *, positive: bool) -> float | None:
    """Seconds from the journal: a finite number (not bool), > 0 when ``positive`` else >= 0; else ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if (value > 0 if positive else value >= 0) else None


def _gpus_of(value: object) -> tuple[int, ...]:
    if isinstance(value, list) and all(isinstance(g, int) and not isinstance(g, bool) for g in value):
        return tuple(value)
    return ()


@dataclass(frozen=True, slots=True)
class Orphan:
    """A replica the journal says was running when the agent stopped.

    Attributes:
        key: the replica.
        pid, pstart: its process id and start time (clock ticks since boot);
            ``pid`` is ``None`` for a simulated workload.
        progress_file: its progress file, ``None`` without one.
        progress_stamp: that file's stamp when the replica started (``None``: no file then).
        started_at: event time of its ``JobStarted`` (``None`` in older journals).
        gpus: GPU indices it holds (``()`` in older journals).
        sim_until: for a simulated workload, the event time it ends
            (start + duration - the progress it resumed from).
        sim_progress: for a simulated workload started with ``StartWorkload.progress_s``, that progress
            (seconds); ``None``: it runs without checkpoints (an older command or journal).
        sim_every: its checkpoint interval in force, seconds, or ``None``.
        time_limit_s: its time limit (``StartWorkload.time_limit_s``), event seconds from ``started_at``;
            ``None``: none (or an older journal). An adopted replica is stopped at it all the same.
    """

    key: RunKey
    pid: int | None
    pstart: int | None
    progress_file: str | None = None
    progress_stamp: FileStamp | None = None
    started_at: datetime | None = None
    gpus: tuple[int, ...] = ()
    sim_until: datetime | None = None
    sim_progress: float | None = None
    sim_every: float | None = None
    time_limit_s: float | None = None

    def record(self) -> dict:
        """Its journal line."""
        rec: dict = {"op": "start", "key": list(self.key), "pid": self.pid, "pstart": self.pstart}
        if self.progress_file is not None:
            rec["progress_file"] = self.progress_file
            rec["progress_stamp"] = list(self.progress_stamp) if self.progress_stamp is not None else None
        if self.started_at is not None:
            rec["ts"] = self.started_at.isoformat()
        if self.gpus:
            rec["gpus"] = list(self.gpus)
        if self.sim_until is not None:
            rec["sim_until"] = self.sim_until.isoformat()
        if self.sim_progress is not None:
            rec["sim_progress"] = self.sim_progress
            rec["sim_every"] = self.sim_every
        if self.time_limit_s is not None:
            rec["time_limit_s"] = self.time_limit_s
        return rec


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z":  # a zombie has exited: only its exit status is left
            return None
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Journal:
    """Append-only record of replica starts and ends, and of the newest fencing token.

    Args:
        path: the JSON-lines file (parent directories are created), or
            ``None`` for memory only.

    Attributes:
        fencing_token: the newest valid token recorded, ``None`` before the first.
    """

    path: Path | None = None
    fencing_token: int | None = None
    _open: dict[RunKey, Orphan] = field(default_factory=dict)
    _ended: OrderedDict[RunKey, datetime | None] = field(default_factory=OrderedDict)
    _lost: set[RunKey] = field(default_factory=set)
    _lines: int = 0
    _held: list[str] | None = None

    def __post_init__(self) -> None:
        if self.path is None:
            return
        self.path = Path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            return
        for line in self.path.read_text(errors="replace").splitlines():
            self._lines += 1
            try:
                rec = json.loads(line)
                op = rec.get("op")
                if op == "token":
                    self._token(rec.get("token"))
                    continue
                key = tuple(rec["key"])
                if len(key) != 4:
                    continue
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # a torn last line from a crash mid-write
            if op == "start":
                self._open[key] = Orphan(
                    key,
                    rec.get("pid"),
                    rec.get("pstart"),
                    rec.get("progress_file"),
                    _stamp_of(rec.get("progress_stamp")),
                    _time_of(rec.get("ts")),
                    _gpus_of(rec.get("gpus")),
                    _time_of(rec.get("sim_until")),
                    _seconds_of(rec.get("sim_progress"), positive=False),
                    _seconds_of(rec.get("sim_every"), positive=True),
                    _seconds_of(rec.get("time_limit_s"), positive=True),
                )
            elif op == "end":
                self._open.pop(key, None)
                self._end(key, _time_of(rec.get("ts")), bool(rec.get("lost")))

    def _token(self, token: object) -> bool:
        if valid_token(token) and (self.fencing_token is None or token > self.fencing_token):
            self.fencing_token = token
            return True
        return False

    def _end(self, key: RunKey, ts: datetime | None, lost: bool) -> None:
        self._ended.pop(key, None)
        self._ended[key] = ts
        if lost:
            self._lost.add(key)

    def _write(self, rec: dict) -> None:
        if self.path is None:
            return
        line = json.dumps(rec) + "\n"
        if self._held is not None:
            self._held.append(line)
            return
        self.append([line])

    def hold(self) -> None:
        """Keep the lines written from now on in memory until :meth:`take` (a group commit opens)."""
        if self._held is None:
            self._held = []

    def holding(self) -> bool:
        """A group is open: lines written wait for :meth:`take`."""
        return self._held is not None

    def take(self) -> list[str]:
        """The lines held since :meth:`hold` or the last take (the group stays open)."""
        if self._held is None:
            return []
        lines, self._held = self._held, []
        return lines

    def put_back(self, lines: list[str]) -> None:
        """Hold ``lines`` (taken, then not appended) again, before those held since."""
        if self._held is None:
            self._held = []
        self._held[:0] = lines

    def release(self) -> None:
        """Close the group: lines are written at once again. Call it after the last :meth:`take` was appended."""
        if self._held:
            raise RuntimeError(f"{len(self._held)} journal line(s) held and not appended")
        self._held = None

    def append(self, lines: list[str]) -> None:
        """Append ``lines`` (JSON lines, each ending in a newline) with one write and one fsync."""
        if self.path is None or not lines:
            return
        with open(self.path, "a", encoding="utf-8", opener=_private) as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
        self._lines += len(lines)

    def started(
        self,
        key: RunKey,
        pid: int | None,
        progress_file: str | None = None,
        progress_stamp: FileStamp | None = None,
        *,
        ts: datetime | None = None,
        gpus: tuple[int, ...] = (),
        sim_until: datetime | None = None,
        sim_progress: float | None = None,
        sim_every: float | None = None,
        time_limit_s: float | None = None,
    ) -> None:
        """Record that replica ``key`` started (as process ``pid``, or simulated).

        Args:
            key: the replica.
            pid: its process, ``None`` for a simulated workload.
            progress_file: its progress file, if it has one.
            progress_stamp: that file's stamp before the process started.
            ts: event time of its ``JobStarted`` (re-published as is after a restart).
            gpus: GPU indices it holds.
            sim_until: event time a simulated workload ends.
            sim_progress, sim_every: a simulated workload's resume point and checkpoint interval, seconds.
            time_limit_s: its time limit, event seconds from ``ts`` (``None``: none).
        """
        pstart = process_start_time(pid) if pid else None
        o = Orphan(
            key,
            pid,
            pstart,
            progress_file,
            progress_stamp,
            ts,
            tuple(gpus),
            sim_until,
            sim_progress,
            sim_every,
            time_limit_s,
        )
        self._open[key] = o
        self._write(o.record())

    def ended(self, key: RunKey, ts: datetime | None = None, *, lost: bool = False) -> None:
        """Record that replica ``key`` ended (or will never start) at event time ``ts``; ``lost``: reported JobLost."""
        self._open.pop(key, None)
        self._end(key, ts, lost)
        rec: dict = {"op": "end", "key": list(key)}
        if ts is not None:
            rec["ts"] = ts.isoformat()
        if lost:
            rec["lost"] = True
        self._write(rec)

    def token(self, token: int) -> None:
        """Record ``token`` when it is valid and newer than the one recorded (fsynced before returning)."""
        if self._token(token):
            self._write({"op": "token", "token": token})

    def known(self) -> frozenset[RunKey]:
        """Every replica started or ended according to the journal (ended ones within the window kept)."""
        return frozenset(self._ended) | frozenset(self._open)

    def lost_runs(self) -> frozenset[tuple[str, int]]:
        """``(job_id, attempt)`` of the replicas reported lost (and not pruned)."""
        return frozenset((k[1], k[2]) for k in self._lost)

    def orphans(self) -> tuple[Orphan, ...]:
        """Replicas started but not ended, sorted by key."""
        return tuple(sorted(self._open.values(), key=lambda o: o.key))

    def prune(self, now: datetime, retention_s: float, cap: int) -> list[RunKey]:
        """Forget ended replicas older than ``retention_s`` event seconds, and the oldest beyond ``cap``.

        Ends recorded without a time (older journals) count as ended ``now``.
        Returns the keys forgotten (to drop from the agent's state too).
        """
        cutoff = now - timedelta(seconds=retention_s)
        out: list[RunKey] = []
        for key, ts in list(self._ended.items()):
            if ts is None:
                self._ended[key] = now
                continue
            if ts >= cutoff and len(self._ended) <= cap:
                break
            del self._ended[key]
            self._lost.discard(key)
            out.append(key)
        while len(self._ended) > cap:  # undated entries filled in above
            key, _ = self._ended.popitem(last=False)
            self._lost.discard(key)
            out.append(key)
        return out

    def needs_compaction(self) -> bool:
        """The file holds many more lines than the state it describes."""
        live = len(self._open) + len(self._ended) + 1
        return self.path is not None and self._held is None and self._lines > 2 * live + 1000

    def compact(self) -> None:
        """Rewrite the file with only the token, the ended replicas kept and the open starts (atomic rename).

        Raises:
            RuntimeError: a group is open (its lines may be on their way to the file).
        """
        if self.path is None:
            return
        if self._held is not None:
            raise RuntimeError("cannot compact the journal while a group commit is open")
        lines = []
        if self.fencing_token is not None:
            lines.append({"op": "token", "token": self.fencing_token})
        for key, ts in self._ended.items():
            rec: dict = {"op": "end", "key": list(key)}
            if ts is not None:
                rec["ts"] = ts.isoformat()
            if key in self._lost:
                rec["lost"] = True
            lines.append(rec)
        lines.extend(o.record() for o in self.orphans())
        write_private(self.path, "".join(json.dumps(r) + "\n" for r in lines).encode(), durable=True, replace_link=True)
        self._lines = len(lines)

    @staticmethod
    def still_alive(o: Orphan) -> bool:
        """True when the orphan's process is alive and is the same process (start time matches)."""
        return o.pid is not None and o.pid > 0 and o.pstart is not None and process_start_time(o.pid) == o.pstart


def _private(path: str, flags: int) -> int:
    """Open a journal file mode 0600: the agent's own, unreadable to the jobs' accounts."""
    return os.open(path, flags, 0o600)
