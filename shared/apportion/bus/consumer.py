"""Kafka consumer wrapper: decode, de-duplicate, handle, then commit.

The loop every kafka-python based service runs (STYLE rule 8):

1. poll a batch;
2. for each record: decode with :func:`apportion.events.decode`; bytes that do
   not decode become a :class:`~apportion.events.DeadLetter` on
   ``apportion.deadletter`` carrying the reason, and consumption goes on;
3. skip events whose ``event_id`` the de-duplication hook has seen;
4. call the handler; once it returns, mark the id as seen;
5. commit the offsets of everything handled (auto-commit is off).

A handler that raises stops the loop: the offsets of the records handled
before it are committed, the partition is rewound to the failing record so
it is delivered again, and the exception propagates (the service restarts
and retries; handlers must be idempotent anyway).

Nothing connects at import time.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol
from uuid import UUID

from apportion import events
from apportion.bus.producer import EventProducer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a handled event came from (for logging, offsets in read models)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int


Handler = Callable[[events.Event, Delivery], None]


class Deduplicator(Protocol):
    """Remembers handled event ids. Swap in a durable one (Redis, the read
    model's own store) where redelivery after a restart must be caught."""

    def seen(self, event_id: UUID) -> bool:
        """True when ``event_id`` was already handled."""
        ...

    def mark(self, event_id: UUID) -> None:
        """Record that ``event_id`` has been handled."""
        ...


class MemoryDeduplicator:
    """Bounded in-memory set of recent event ids (oldest forgotten first).

    Catches duplicates a producer retry or a rebalance redelivers within one
    process lifetime. ``capacity`` bounds memory (about 100 bytes per id).
    """

    def __init__(self, capacity: int = 200_000) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[UUID, None] = OrderedDict()

    def seen(self, event_id: UUID) -> bool:
        return event_id in self._ids

    def mark(self, event_id: UUID) -> None:
        self._ids[event_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)


class NoDeduplication:
    """Hook that never reports a duplicate (for handlers idempotent by construction)."""

    def seen(self, event_id: UUID) -> bool:
        return False

    def mark(self, event_id: UUID) -> None:
        return None


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(slots=True)
class Stats:
    """Counters of one consumer, for logs, metrics and tests."""

    handled: int = 0
    duplicates: int = 0
    dead_lettered: int = 0


class EventConsumer:
    """Consume apportion events with manual commits, de-dup and dead-lettering.

    Args:
        bootstrap: ``host:port`` of the Kafka cluster.
        topics: topic names to subscribe to.
        group_id: consumer group; offsets are committed under it.
        handler: ``handler(event, delivery)``; called once per new event id.
        dedup: de-duplication hook; default a :class:`MemoryDeduplicator`.
        dead_letters: producer for dead letters; default one built lazily on
            the first undecodable record.
        name: written as ``producer`` on the dead letters this consumer emits.
        clock: wall clock for dead-letter timestamps (inject a fake in tests).
        **kafka_config: extra :class:`kafka.KafkaConsumer` settings.
            ``auto_offset_reset`` defaults to ``"earliest"`` (rebuild from the
            log); ``enable_auto_commit`` is always False.

    Example::

        consumer = EventConsumer(bootstrap, ["apportion.jobs"], "accounting", on_event)
        consumer.run(stop)        # until stop.set(); or call poll_once() in a loop
        consumer.close()
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Iterable[str],
        group_id: str,
        handler: Handler,
        *,
        dedup: Deduplicator | None = None,
        dead_letters: EventProducer | None = None,
        name: str = "consumer",
        clock: Callable[[], datetime] = _utcnow,
        **kafka_config: Any,
    ) -> None:
        from kafka import KafkaConsumer

        if kafka_config.pop("enable_auto_commit", False):
            raise ValueError("EventConsumer commits manually; enable_auto_commit must stay False")
        kafka_config.setdefault("auto_offset_reset", "earliest")
        # kafka-python's default is 5 minutes: a group that joined while a
        # topic's metadata was missing would sit unassigned that long.
        kafka_config.setdefault("metadata_max_age_ms", 10_000)
        self._bootstrap = bootstrap
        self._handler = handler
        self._dedup: Deduplicator = dedup if dedup is not None else MemoryDeduplicator()
        self._dead_letters = dead_letters
        self._owns_dead_letters = dead_letters is None
        self._name = name
        self._clock = clock
        self.stats = Stats()
        topics = list(topics)
        self._consumer = KafkaConsumer(
            *topics, bootstrap_servers=bootstrap, group_id=group_id, enable_auto_commit=False, **kafka_config
        )
        # Load partition metadata before the first poll joins the group, so
        # the assignment covers topics created moments ago.
        for topic in topics:
            self._consumer.partitions_for_topic(topic)

    # ------------------------------------------------------------------ loop

    def poll_once(self, timeout_ms: int = 500, max_records: int | None = None) -> int:
        """Poll one batch, handle it, commit it. Returns the records consumed."""
        from kafka.structs import OffsetAndMetadata

        batches = self._consumer.poll(timeout_ms=timeout_ms, max_records=max_records)
        done: dict[Any, OffsetAndMetadata] = {}
        count = 0
        pending = list(batches.items())
        try:
            for i, (tp, records) in enumerate(pending):
                for rec in records:
                    try:
                        self._process(rec)
                    except BaseException:
                        # poll() moved every position past its batch: rewind the
                        # failing record and the batches not reached yet.
                        self._consumer.seek(tp, rec.offset)
                        for later_tp, later in pending[i + 1 :]:
                            self._consumer.seek(later_tp, later[0].offset)
                        raise
                    done[tp] = OffsetAndMetadata(rec.offset + 1, "", -1)
                    count += 1
        finally:
            if done:
                self._consumer.commit(offsets=done)
        return count

    def run(self, stop: threading.Event | None = None, timeout_ms: int = 500) -> None:
        """Poll and handle until ``stop`` is set (forever when ``None``)."""
        while stop is None or not stop.is_set():
            self.poll_once(timeout_ms=timeout_ms)

    def _process(self, rec: Any) -> None:
        raw: bytes = rec.value if rec.value is not None else b""
        key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
        try:
            event = events.decode(raw)
        except events.DecodeError as exc:
            self._dead_letter(rec, raw, key, exc)
            return
        if self._dedup.seen(event.event_id):
            self.stats.duplicates += 1
            log.debug("duplicate %s %s skipped", event.type, event.event_id)
            return
        self._handler(event, Delivery(rec.topic, rec.partition, rec.offset, key, rec.timestamp))
        self._dedup.mark(event.event_id)
        self.stats.handled += 1

    def _dead_letter(self, rec: Any, raw: bytes, key: str | None, exc: events.DecodeError) -> None:
        reason = f"{exc.field}: {exc.reason}" if exc.field else exc.reason
        log.warning("dead-lettering %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, reason)
        letter = events.DeadLetter(
            source_topic=rec.topic,
            source_partition=rec.partition,
            source_offset=rec.offset,
            source_key=key,
            original=_b64(raw),
            error=reason,
            ts=self._clock(),
            producer=self._name,
        )
        if self._dead_letters is None:
            self._dead_letters = EventProducer(self._bootstrap, client_id=f"{self._name}-deadletter")
        self._dead_letters.publish(letter)  # acked before the offset is committed
        self.stats.dead_lettered += 1

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Leave the group and close connections (and the dead-letter producer we made)."""
        self._consumer.close()
        if self._owns_dead_letters and self._dead_letters is not None:
            self._dead_letters.close()

    def __enter__(self) -> EventConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode("ascii")
