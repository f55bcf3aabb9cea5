"""A record of the log, its order and its place, pure: no Kafka client, no I/O.

* :class:`LogRecord`: one record as the audit and the CLI read it (from Kafka or from an export).
* :func:`log_order`: the documented total order of an audit replay; :func:`record_order` the same order
  over kafka-python ``ConsumerRecord`` objects (the services' merge of several topics).
* :func:`log_position`: where a record stands for the key registry (the broker's append time). Readers of
  every kind call it: the services' reader edge, the audit, the standby's token floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apportion import events
from apportion.timeutil import to_us

#: kafka-python's ``ConsumerRecord.timestamp_type`` of a timestamp the broker set at append
#: (``message.timestamp.type=LogAppendTime``, the signed topics' config: :data:`apportion.topics.BROKER_TIME`).
LOG_APPEND_TIME = 1


def log_position(rec: Any, ev: events.Event | None = None) -> int | None:
    """A record's place in the log for :class:`apportion.identity.registry.KeyRegistry`: a broker timestamp (ms), or ``None``.

    * An audit record (:class:`LogRecord`, an export's line): its ``timestamp_ms``.
    * A kafka-python ``ConsumerRecord`` (the services' reader edge, the standby's token floor): its
      ``timestamp`` when the broker set it (``timestamp_type`` :data:`LOG_APPEND_TIME`); a producer's
      ``CreateTime`` is ``None`` (a signer chooses it), except on a key event (``ev`` a registration or
      revocation): only ops may write ``apportion.budgets`` (Kafka ACL), so their clock is trusted there, and
      a revocation written before its topic got ``LogAppendTime`` still has a place.
    * A record without a timestamp: ``None``.
    """
    ms = getattr(rec, "timestamp_ms", None)
    if ms is not None:
        return int(ms)
    ms = getattr(rec, "timestamp", None)
    if ms is None or ms < 0:
        return None
    if getattr(rec, "timestamp_type", None) == LOG_APPEND_TIME:
        return int(ms)
    return int(ms) if isinstance(ev, (events.UserKeyRegistered, events.UserKeyRevoked)) else None


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One record of the log, decoded when possible.

    Attributes:
        topic, partition, offset: where it is.
        key: record key (str) or None.
        timestamp_ms: Kafka record timestamp (ms since epoch).
        raw: the value bytes as stored (None for a null value, a tombstone).
        event: the decoded event, or None when a reader refuses the record
            (:func:`apportion.bus.intake.screen`: it does not decode, or its
            key or topic disagrees with the event).
        error: the reason (``str(DecodeError)``) when ``event`` is None.
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int
    raw: bytes | None
    event: events.Event | None
    error: str | None = None


def log_order(rec: LogRecord) -> tuple:
    """The documented total order of an audit replay.

    Records sort by (event time ``ts``, topic, partition, offset); records
    that do not decode sort by their Kafka timestamp. Per-key order on one
    partition is preserved because offsets break ties within a partition
    and producers of one key write event times in order.
    """
    if rec.event is not None:
        t = to_us(rec.event.ts)
    else:
        t = rec.timestamp_ms * 1000
    return (t, rec.topic, rec.partition, rec.offset)


def record_order(rec: Any, event: Any) -> tuple:
    """Deterministic merge order of records from several topics.

    Same as :func:`log_order`: (event time, topic,
    partition, offset); undecodable records by their Kafka timestamp.
    """
    t = to_us(event.ts) if event is not None else rec.timestamp * 1000
    return (t, rec.topic, rec.partition, rec.offset)
