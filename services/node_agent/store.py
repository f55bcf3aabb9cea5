"""The node agent's journal: which replicas it started and which ended.

Rule 8 (idempotent handling) for an agent means a command redelivered after
a crash must not start a workload twice. The consumer commits a command's
offset only after the journal line for its effect is on disk, and on start
the agent reads the journal back:

* every replica ever started here is *known* (a second start is refused);
* replicas started but not ended were running when the agent died: their
  processes are killed if still alive (matched by pid *and* process start
  time, so a reused pid is never hit) and ``JobFailed(reason="agent_restarted")``
  is reported for them, after the last checkpoint their progress file holds
  (when it changed since the start: ``progress_file`` and ``progress_stamp``).

Format: JSON lines ``{"op": "start"|"end", "key": [node, job, attempt, replica],
"pid": int|null, "pstart": int|null, "progress_file": str|null,
"progress_stamp": [inode, size, mtime_ns]|null}`` (the last two absent in
journals written before checkpoints; read as null), appended and fsynced. With
``path=None`` the journal lives in memory only (tests, throwaway demos).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from services.node_agent.logic import FileStamp, RunKey


def _stamp_of(value: object) -> FileStamp | None:
    """A journal's ``progress_stamp`` as a :data:`FileStamp`, ``None`` when absent or malformed."""
    if isinstance(value, list) and len(value) == 3 and all(isinstance(v, int) for v in value):
        return (value[0], value[1], value[2])
    return None


@dataclass(frozen=True, slots=True)
class Orphan:
    """A replica the journal says was running when the agent stopped.

    Attributes:
        key: the replica.
        pid, pstart: its process id and start time (clock ticks since boot).
        progress_file: its progress file, ``None`` without one.
        progress_stamp: that file's stamp when the replica started (``None``: no file then).
    """

    key: RunKey
    pid: int | None
    pstart: int | None
    progress_file: str | None = None
    progress_stamp: FileStamp | None = None


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Journal:
    """Append-only record of replica starts and ends.

    Args:
        path: the JSON-lines file (parent directories are created), or
            ``None`` for memory only.
    """

    path: Path | None = None
    _open: dict[RunKey, Orphan] = field(default_factory=dict)
    _ended: set[RunKey] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.path is not None:
            self.path = Path(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    try:
                        rec = json.loads(line)
                        key = tuple(rec["key"])  # type: ignore[assignment]
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line from a crash mid-write
                    if rec.get("op") == "start":
                        self._open[key] = Orphan(  # type: ignore[index]
                            key,  # type: ignore[arg-type]
                            rec.get("pid"),
                            rec.get("pstart"),
                            rec.get("progress_file"),
                            _stamp_of(rec.get("progress_stamp")),
                        )
                    elif rec.get("op") == "end":
                        self._open.pop(key, None)  # type: ignore[arg-type]
                        self._ended.add(key)  # type: ignore[arg-type]

    def _write(self, rec: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def started(
        self,
        key: RunKey,
        pid: int | None,
        progress_file: str | None = None,
        progress_stamp: FileStamp | None = None,
    ) -> None:
        """Record that replica ``key`` started (as process ``pid``, or simulated).

        Args:
            key: the replica.
            pid: its process, ``None`` for a simulated workload.
            progress_file: its progress file, if it has one.
            progress_stamp: that file's stamp before the process started.
        """
        pstart = process_start_time(pid) if pid else None
        self._open[key] = Orphan(key, pid, pstart, progress_file, progress_stamp)
        rec: dict = {"op": "start", "key": list(key), "pid": pid, "pstart": pstart}
        if progress_file is not None:
            rec["progress_file"] = progress_file
            rec["progress_stamp"] = list(progress_stamp) if progress_stamp is not None else None
        self._write(rec)

    def ended(self, key: RunKey) -> None:
        """Record that replica ``key`` ended (or will never start)."""
        self._open.pop(key, None)
        self._ended.add(key)
        self._write({"op": "end", "key": list(key)})

    def known(self) -> frozenset[RunKey]:
        """Every replica started or ended according to the journal."""
        return frozenset(self._ended) | frozenset(self._open)

    def orphans(self) -> tuple[Orphan, ...]:
        """Replicas started but not ended, sorted by key."""
        return tuple(sorted(self._open.values(), key=lambda o: o.key))

    @staticmethod
    def still_alive(o: Orphan) -> bool:
        """True when the orphan's process is alive and is the same process (start time matches)."""
        return bool(o.pid) and o.pstart is not None and process_start_time(o.pid) == o.pstart  # type: ignore[arg-type]
