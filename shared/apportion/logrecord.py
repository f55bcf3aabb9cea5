"""A record's place in the log, pure: no Kafka client, no I/O.

:func:`log_position` is where a record stands for the key registry (the broker's append time). Readers of
every kind call it: the services' reader edge (kafka-python ``ConsumerRecord``), the audit (its own records),
the standby's token floor.
"""

from __future__ import annotations

from typing import Any

from apportion import events

#: kafka-python's ``ConsumerRecord.timestamp_type`` of a timestamp the broker set at append
#: (``message.timestamp.type=LogAppendTime``, the signed topics' config: :data:`apportion.topics.BROKER_TIME`).
LOG_APPEND_TIME = 1


def log_position(rec: Any, ev: events.Event | None = None) -> int | None:
    """A record's place in the log for :class:`apportion.identity.KeyRegistry`: a broker timestamp (ms since the epoch), or ``None``.

    * An audit record (:class:`apportion.bus.reader.LogRecord`, an export's line): its ``timestamp_ms``.
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
