"""Read whole topics from Kafka: the CLI's and the audit's view of the log.

:func:`read_log` assigns every partition of the given topics, reads from the
beginning (or from the offsets for a timestamp) up to the end offsets taken
when it started, and returns records in a deterministic order. It never
joins a consumer group and never commits, so reading does not disturb the
services.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from apportion import events
from apportion.bus.intake import screen
from apportion.logrecord import LogRecord, log_order

__all__ = ["iter_topic_records", "read_log", "tp_of_key"]


def tp_of_key(key: str) -> tuple[str, int]:
    """``(topic, partition)`` of an offset map's ``"topic:partition"`` key (the inverse of
    :func:`apportion.bus.consumer.tp_key`).

    Raises:
        ValueError: ``key`` is not ``topic:partition`` with a whole-number partition.
    """
    topic, sep, part = key.rpartition(":")
    if not sep or not topic or not part.isdigit():
        raise ValueError(f"not a topic:partition key: {key!r}")
    return topic, int(part)


def iter_topic_records(
    bootstrap: str,
    topics: Iterable[str],
    *,
    since_ms: int | None = None,
    progress: Callable[[int], None] | None = None,
    decode: bool = True,
) -> Iterator[LogRecord]:
    """Yield every record of ``topics`` present when the call starts.

    Records come partition by partition (each in offset order); use
    :func:`read_log` for the documented global order.

    Args:
        bootstrap: Kafka bootstrap servers.
        topics: topic names; missing topics are skipped.
        since_ms: start at the first offset whose timestamp is >= this
            (offsets-for-times); None reads from offset 0.
        progress: called with the number of records read so far, every 10,000.
        decode: screen values into events (False leaves ``event`` None); a
            record refused gets ``error``, the reason its dead letter carries.
    """
    from kafka import TopicPartition

    from apportion.bus.clients import kafka_consumer
    from apportion.bus.producer import READ_COMMITTED
    from apportion.bus.security import kafka_auth

    consumer = kafka_consumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        group_id=None,
        consumer_timeout_ms=2000,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        bootstrap_timeout_ms=10_000,
        **READ_COMMITTED,
        **kafka_auth(),
    )
    try:
        existing = consumer.topics()
        parts = []
        for t in topics:
            if t not in existing:
                continue
            for p in sorted(consumer.partitions_for_topic(t) or ()):
                parts.append(TopicPartition(t, p))
        if not parts:
            return
        consumer.assign(parts)
        end = consumer.end_offsets(parts)
        start: dict[TopicPartition, int] = {tp: 0 for tp in parts}
        if since_ms is not None:
            found = consumer.offsets_for_times({tp: since_ms for tp in parts})
            for tp in parts:
                hit = found.get(tp)
                start[tp] = hit.offset if hit is not None else end[tp]
        for tp in parts:
            consumer.seek(tp, start[tp])
        remaining = {tp for tp in parts if start[tp] < end[tp]}
        n = 0
        while remaining:
            batch = consumer.poll(timeout_ms=1000, max_records=5000)
            if not batch:
                # nothing arrived within the poll timeout: check positions
                remaining = {tp for tp in remaining if consumer.position(tp) < end[tp]}
                continue
            for tp, records in batch.items():
                for rec in records:
                    if rec.offset >= end[tp]:
                        continue
                    ev, err = None, None
                    if decode:
                        try:
                            ev = screen(rec.value, rec.key, tp.topic)
                        except events.DecodeError as exc:
                            err = str(exc)
                    key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
                    yield LogRecord(tp.topic, tp.partition, rec.offset, key, rec.timestamp, rec.value, ev, err)
                    n += 1
                    if progress is not None and n % 10_000 == 0:
                        progress(n)
                if consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
    finally:
        consumer.close()


def read_log(bootstrap: str, topics: Iterable[str], **kwargs: Any) -> list[LogRecord]:
    """All records of ``topics`` in :func:`log_order` (see :func:`iter_topic_records`)."""
    recs = list(iter_topic_records(bootstrap, topics, **kwargs))
    recs.sort(key=log_order)
    return recs
