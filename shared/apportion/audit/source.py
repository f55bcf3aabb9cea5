"""Where the audit reads the log from: Kafka or an export file.

Export format (``apportion log export -o FILE``): gzip-compressed JSON Lines,
one Kafka record per line::

    {"topic": "apportion.jobs", "partition": 0, "offset": 41, "key": "j1",
     "timestamp_ms": 1700000000000, "value": "<the record value as text>"}

``value`` is the record value verbatim (UTF-8 text), ``null`` for a null
value (a tombstone), or, for bytes that are not UTF-8, ``"value_b64"``
carries them in base64: nothing is lost, and the file decodes to exactly the
records Kafka holds. Reading a file screens each record as every reader of
Kafka does (:func:`apportion.bus.intake.screen`): a record refused keeps its
bytes and gets the reason in ``error``, so an audit of the file sees what
the services saw. The first line is a header
``{"apportion_export": 1, "topics": [...], "exported_at": ...}``. The file holds
every job's command and ``--env`` values: it is written mode 0600, complete or not
at all, never through a symbolic link (:mod:`apportion.privatefiles`).
"""

from __future__ import annotations

import base64
import gzip
import io
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from apportion import events, topics
from apportion.bus.intake import screen
from apportion.bus.reader import iter_topic_records
from apportion.logrecord import LogRecord, log_order
from apportion.privatefiles import private_file
from apportion.settings import topic_name

FORMAT_VERSION = 1


def audit_topics() -> tuple[str, ...]:
    """Topics an audit reads by default: every registry topic but the dead letters."""
    return tuple(topic_name(t) for t in topics.ALL_TOPICS if t is not topics.DEADLETTER)


def verify_topics() -> tuple[str, ...]:
    """Topics ``audit verify`` reads and ``log export`` writes: every registry topic, the dead letters too.

    A forgery a service refused is in ``apportion.deadletter``; without it ``audit verify`` could not tell a
    refused attack from a forgery no service refused (rule D10.node-boundary).
    """
    return tuple(topic_name(t) for t in topics.ALL_TOPICS)


class ExportFormatError(ValueError):
    """The file is not an apportion export (or a newer format)."""


def _decode(raw: bytes | None, key: str | None, topic: str) -> tuple[events.Event | None, str | None]:
    try:
        return screen(raw, key, topic), None
    except events.DecodeError as exc:
        return None, str(exc)


def write_export(
    records: Iterable[LogRecord], path: str | Path, *, topic_names: Iterable[str], exported_at: str
) -> int:
    """Write records to a gzip JSON Lines export, mode 0600 (:func:`apportion.privatefiles.private_file`);
    returns how many were written.

    Raises:
        OSError: ``path`` is a symbolic link (``ELOOP``), or it cannot be written.
    """
    n = 0
    with (
        private_file(path) as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6) as gz,
        io.TextIOWrapper(gz, encoding="utf-8") as f,
    ):
        f.write(
            json.dumps({"apportion_export": FORMAT_VERSION, "topics": sorted(topic_names), "exported_at": exported_at})
            + "\n"
        )
        for rec in records:
            line: dict[str, object] = {
                "topic": rec.topic,
                "partition": rec.partition,
                "offset": rec.offset,
                "key": rec.key,
                "timestamp_ms": rec.timestamp_ms,
            }
            if rec.raw is None:
                line["value"] = None  # a tombstone: kept as such
            else:
                try:
                    line["value"] = rec.raw.decode("utf-8")
                except UnicodeDecodeError:
                    line["value_b64"] = base64.b64encode(rec.raw).decode("ascii")
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
            n += 1
    return n


def _header(line: str, path: str | Path) -> dict[str, Any]:
    """The export's header line, checked: raises :class:`ExportFormatError` when it is missing or of a newer format."""
    header = json.loads(line or "{}")
    version = header.get("apportion_export") if isinstance(header, dict) else None
    if version is None:
        raise ExportFormatError(f"{path}: not an apportion export (no header line)")
    if version > FORMAT_VERSION:
        raise ExportFormatError(f"{path}: export format {version} is newer than this tool ({FORMAT_VERSION})")
    return header


def iter_export(path: str | Path) -> Iterator[LogRecord]:
    """Records of an export file, in file order, decoded.

    Raises:
        ExportFormatError: missing header or an unknown format version.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        _header(f.readline(), path)
        for line in f:
            d = json.loads(line)
            if "value" in d:
                raw = d["value"].encode("utf-8") if d["value"] is not None else None
            else:
                raw = base64.b64decode(d["value_b64"])
            ev, err = _decode(raw, d.get("key"), d["topic"])
            yield LogRecord(d["topic"], d["partition"], d["offset"], d.get("key"), d["timestamp_ms"], raw, ev, err)


def export_prefix(path: str | Path) -> str:
    """The topic namespace an export file was written in: the prefix its header's topics share.

    An export holds the physical names of the topics it read (``t1.apportion.jobs``); offline commands read
    the file in that namespace, not in the one of the environment, so that an export of another stack is
    not silently filtered to nothing.

    Returns:
        The prefix (``""`` for the default namespace, and for a header that names no registry topic).

    Raises:
        ExportFormatError: no header line, a newer format, or topics of more than one namespace.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        header = _header(f.readline(), path)
    prefixes = {
        name[: -len(base)] for name in header.get("topics", []) for base in topics.BY_BASE if name.endswith(base)
    }
    if len(prefixes) > 1:
        raise ExportFormatError(f"{path}: topics of several namespaces ({', '.join(sorted(prefixes))})")
    return prefixes.pop() if prefixes else ""


def load_log(
    *,
    bootstrap: str | None = None,
    from_file: str | Path | None = None,
    topic_names: Iterable[str] | None = None,
    since_ms: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[LogRecord]:
    """The log in :func:`apportion.logrecord.log_order`, from a file or Kafka.

    Args:
        bootstrap: Kafka bootstrap, used when ``from_file`` is None.
        from_file: an export file.
        topic_names: which topics to read (export files are filtered to them).
        since_ms: Kafka record timestamp to start from (offsets-for-times);
            for files, records before it are skipped.
        progress: called with the count of records read, every 10,000.
    """
    wanted = set(topic_names if topic_names is not None else audit_topics())
    if from_file is not None:
        recs = [
            r for r in iter_export(from_file) if r.topic in wanted and (since_ms is None or r.timestamp_ms >= since_ms)
        ]
        if progress is not None:
            progress(len(recs))
    else:
        if bootstrap is None:
            raise ValueError("need a Kafka bootstrap or an export file")
        recs = list(iter_topic_records(bootstrap, sorted(wanted), since_ms=since_ms, progress=progress))
    recs.sort(key=log_order)
    return recs
