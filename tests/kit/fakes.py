"""Fakes for the accounting service tests: kafka-python-like records and a transactional Redis.

``records`` encodes events onto their topics (partition by key, offsets in
order) the way the broker would; ``FakeRedis`` keeps hashes in memory and
applies a pipeline's commands only at ``execute`` (MULTI/EXEC), counting
transactions so tests can check what was written together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from apportion import events
from apportion.logrecord import LogRecord
from apportion.settings import topic_prefix
from tests.kit.signing import node_value, with_node_keys


@dataclass
class Rec:
    """A kafka-python ``ConsumerRecord`` with the fields the services read.

    ``timestamp_type`` 1 is a broker's append time (``LogAppendTime``, the signed topics'), 0 a producer's
    ``CreateTime`` (its place in the log is unknown to the readers' key rule: :func:`apportion.logrecord.log_position`).
    """

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None  # None: a tombstone
    timestamp: int = 0
    timestamp_type: int = 0


class ConsumerRecordLike(Protocol):
    """The fields of a ``ConsumerRecord`` the readers use (this module's :class:`Rec`, the dispatcher tests')."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def timestamp(self) -> int: ...


def log_record(r: ConsumerRecordLike) -> LogRecord:
    """``r`` as the audit reads it (:class:`apportion.logrecord.LogRecord`: the key as str, the value decoded)."""
    key = r.key.decode() if r.key is not None else None
    return LogRecord(r.topic, r.partition, r.offset, key, r.timestamp, r.value, events.decode(r.value))


def records(evs, *, partitions: int = 3, start: dict[tuple[str, int], int] | None = None) -> list[Rec]:
    """Encode events as records on their topics, partitioned by key, offsets in order.

    Node reports are signed by their node's key, whose registration goes before the node's first report
    (:func:`tests.kit.signing.with_node_keys`).

    Args:
        evs: events in production order.
        partitions: partitions per topic.
        start: (topic, partition) -> first offset (default 0), to append to an earlier call's log.
    """
    out, next_off = [], dict(start or {})
    for e in with_node_keys(evs):
        topic = events.topic_of(e, topic_prefix())
        key = events.key_of(e)
        p = sum(key.encode()) % partitions
        off = next_off.get((topic, p), 0)
        next_off[(topic, p)] = off + 1
        out.append(Rec(topic, p, off, key.encode(), node_value(e)))
    return out


def partition_offsets(recs: list[Rec], topics: list[str], partitions: int = 3) -> dict[str, int]:
    """``"topic:partition"`` -> end offset of ``recs`` (0 for empty partitions), for every partition."""
    out = {f"{t}:{p}": 0 for t in topics for p in range(partitions)}
    for r in recs:
        out[f"{r.topic}:{r.partition}"] = max(out[f"{r.topic}:{r.partition}"], r.offset + 1)
    return out


class _Pipe:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis = redis
        self.ops: list[tuple[str, tuple]] = []

    def delete(self, *keys):
        self.ops.append(("delete", keys))

    def hset(self, key, mapping):
        self.ops.append(("hset", (key, mapping)))

    def execute(self):
        self.redis.transactions.append([(op, args[0]) for op, args in self.ops])
        for op, args in self.ops:
            getattr(self.redis, op)(*args) if op == "delete" else self.redis.hset(*args)
        self.ops = []
        return []


class FakeRedis:
    """In-memory hashes; ``pipeline()`` buffers commands until ``execute`` (one transaction)."""

    def __init__(self) -> None:
        self.h: dict[str, dict[Any, Any]] = {}
        #: one entry per executed pipeline: [(command, key), ...]
        self.transactions: list[list[tuple[str, Any]]] = []

    def pipeline(self, transaction: bool = True) -> _Pipe:
        return _Pipe(self)

    def delete(self, *keys):
        for k in keys:
            self.h.pop(k, None)

    def hset(self, key, mapping):
        self.h.setdefault(key, {}).update(mapping)

    def hget(self, key, field):
        return self.h.get(key, {}).get(field)

    def hgetall(self, key):
        return dict(self.h.get(key, {}))
