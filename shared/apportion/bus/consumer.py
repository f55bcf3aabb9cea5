"""Kafka consumer wrapper: screen, de-duplicate, handle, then commit.

The loop every kafka-python based service runs (STYLE rule 8):

1. poll a batch;
2. for each record: :func:`apportion.bus.intake.screen` it (decode, key and
   topic checks); a record refused becomes a
   :class:`~apportion.events.DeadLetter` on ``apportion.deadletter``
   carrying the reason (:func:`apportion.bus.intake.dead_letter`: the one
   construction, deterministic id), and consumption goes on;
3. skip events the :class:`~apportion.bus.intake.IdLedger` has seen with
   the same payload (duplicates); the same id with another payload is a
   dead letter ``event_id reused``;
4. call the handler; once it returns, remember the id;
5. commit the offsets of everything handled (auto-commit is off).

A handler that raises ends the poll: the offsets of the records handled
before it are committed, the partition is rewound to the failing record so
it is delivered again, and the exception propagates to the loop that polls
(the shared one, ``consume``, logs it and polls again after a backoff:
:mod:`apportion.bus.resilience`; handlers must be idempotent anyway). That is for handlers that
do I/O (the node agent's); a pure fold should not raise, and the services
whose folds are pure dead-letter an apply error instead
(:meth:`apportion.bus.intake.Intake.apply`).

Redelivery is bounded (rule D4.dead-letters): when the handler raises on the
same record :data:`HANDLER_TRIES` times in a row (counted per partition; the
tries are the loop's backoff apart), the last time is not raised: the record
is dead-lettered with the reason ``handler failed 5 times: <class>: <message>``
(:func:`handler_failure`), logged at ERROR, counted (``dead_lettered``,
``handler_gave_up``), and consumption goes on with the next record. Failures
that say the broker or Redis is away (:func:`apportion.bus.resilience.is_outage`),
and a handler cancelled because the service stops, are not counted: an outage
never dead-letters a record, however long.

Nothing connects at import time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

from apportion import events
from apportion.bus.intake import IdLedger, dead_letter, screen
from apportion.bus.producer import READ_COMMITTED, EventProducer
from apportion.bus.resilience import KAFKA_RECONNECT, describe, is_outage
from apportion.settings import topic_name

log = logging.getLogger(__name__)

#: how long :meth:`AssignedConsumer.read_identity_to_end` waits for the broker (seconds)
IDENTITY_READ_AHEAD_S = 5.0

#: Times in a row the handler may raise on one record (not for an outage) before it is dead-lettered (rule
#: D4.dead-letters). With the shared loop's backoff (0.5 s doubling) the last try comes 7.5 wall seconds after the
#: first.
HANDLER_TRIES = 5


def handler_failure(tries: int, exc: BaseException) -> str:
    """The dead-letter reason of a record the handler raised on ``tries`` times, ending with ``exc``:
    ``handler failed 5 times: ValueError: embedded null byte`` (one line)."""
    return f"handler failed {tries} times: {describe(exc)}"


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a handled event came from (for logging, offsets in read models)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int
    value: bytes | None = None
    """The record value as read (a signature is checked on these bytes, rule D10.proven-user)."""


Handler = Callable[[events.Event, Delivery], None]


def _utcnow() -> datetime:
    return datetime.now(UTC)


#: Wall seconds between two lag measurements of a poll loop (:class:`LagMeter`).
LAG_EVERY_S = 1.0


def partition_lag(kc: Any, partitions: Iterable[Any]) -> dict[tuple[str, int], int]:
    """Records behind the end of each partition: high watermark minus position (kafka-python consumer ``kc``).

    Partitions without a known high watermark yet (no fetch answered) are left out. Call it from the thread
    that polls ``kc`` (kafka-python consumers are not thread-safe). Never waits on the broker: the position
    is asked with ``timeout_ms=0`` (without one, kafka-python 3 waits for a KIP-320 position validation,
    and during a broker outage that wait held the dispatcher's poll loop, and with it every decision).
    """
    out: dict[tuple[str, int], int] = {}
    for tp in partitions:
        hw = kc.highwater(tp)
        pos = kc.position(tp, timeout_ms=0) if hw is not None else None
        if hw is not None and pos is not None:
            out[(tp.topic, tp.partition)] = max(0, hw - pos)
    return out


class LagMeter:
    """Measures a poll loop's consumer lag at most every ``every_s`` wall seconds and hands it to ``sink``.

    ``sink`` (e.g. :meth:`apportion.metrics.ReaderCollector.set_lag`) is None until a service sets it; then
    :meth:`after_poll`, called by the consumer after each poll, measures :func:`partition_lag`. A measurement
    that raises (a rebalance under way, a broker that does not answer) is skipped: it never fails the poll.
    """

    def __init__(self, every_s: float = LAG_EVERY_S) -> None:
        self.every_s = every_s
        self.sink: Callable[[dict[tuple[str, int], int]], Any] | None = None
        self._at = -every_s

    def after_poll(self, kc: Any, partitions: Callable[[], Iterable[Any]]) -> None:
        """Measure and report, if a sink is set and the last measurement is older than ``every_s``."""
        import time

        if self.sink is None:
            return
        now = time.monotonic()
        if now - self._at < self.every_s:
            return
        self._at = now
        try:
            lag = partition_lag(kc, partitions())
        except Exception:  # a rebalance or a slow broker: metrics only, measured next time
            log.debug("could not measure the consumer lag", exc_info=True)
            return
        self.sink(lag)


@dataclass(slots=True)
class Stats:
    """Counters of one consumer, for logs, metrics and tests."""

    handled: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    handler_gave_up: int = 0
    """Records dead-lettered because the handler raised on them :data:`HANDLER_TRIES` times (also in
    ``dead_lettered``)."""


class EventConsumer:
    """Consume apportion events with manual commits, de-dup and dead-lettering.

    Args:
        bootstrap: ``host:port`` of the Kafka cluster.
        topics: topic names to subscribe to.
        group_id: consumer group; offsets are committed under it.
        handler: ``handler(event, delivery)``; called once per new event id.
        dedup: the id -> payload ledger to use; True (default): a fresh
            :class:`~apportion.bus.intake.IdLedger`; False: no de-duplication
            (handlers idempotent by construction).
        dead_letters: producer for dead letters; default one built lazily on
            the first undecodable record.
        name: written as ``producer`` on the dead letters this consumer emits.
        clock: wall clock for dead-letter timestamps (inject a fake in tests).
        before_commit: called once per poll that returned records, after the handler saw them and before
            their offsets are committed (the node agent closes its journal group there); if it raises,
            nothing of the poll is committed and the exception propagates.
        tries: times in a row the handler may raise on one record before it is dead-lettered
            (:data:`HANDLER_TRIES`; failures that are outages not counted).
        client: a kafka-python consumer already built (tests pass a fake); default one built here from
            ``bootstrap``, ``topics``, ``group_id`` and ``kafka_config``.
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
        dedup: IdLedger | bool = True,
        dead_letters: EventProducer | None = None,
        name: str = "consumer",
        clock: Callable[[], datetime] = _utcnow,
        before_commit: Callable[[], None] | None = None,
        tries: int = HANDLER_TRIES,
        client: Any = None,
        **kafka_config: Any,
    ) -> None:
        from apportion.bus.clients import kafka_consumer

        if tries < 1:
            raise ValueError(f"tries must be at least 1, got {tries}")
        if kafka_config.pop("enable_auto_commit", False):
            raise ValueError("EventConsumer commits manually; enable_auto_commit must stay False")
        kafka_config.setdefault("auto_offset_reset", "earliest")
        # kafka-python's default is 5 minutes: a group that joined while a
        # topic's metadata was missing would sit unassigned that long.
        kafka_config.setdefault("metadata_max_age_ms", 10_000)
        self._bootstrap = bootstrap
        self._handler = handler
        self._ledger: IdLedger | None = (IdLedger() if dedup else None) if isinstance(dedup, bool) else dedup
        self._dead_letters = dead_letters
        self._owns_dead_letters = dead_letters is None
        self._name = name
        self._clock = clock
        self._before_commit = before_commit
        self._tries = tries
        #: (topic, partition) -> (offset, failures in a row) of the record the handler last raised on there
        self._failing: dict[tuple[str, int], tuple[int, int]] = {}
        self.stats = Stats()
        #: consumer lag per assigned partition, measured after polls once its ``sink`` is set
        self.lag = LagMeter()
        topics = list(topics)
        from apportion.bus.security import kafka_auth

        self._consumer = (
            client
            if client is not None
            else kafka_consumer(
                *topics,
                bootstrap_servers=bootstrap,
                group_id=group_id,
                enable_auto_commit=False,
                **{**KAFKA_RECONNECT, **READ_COMMITTED, **kafka_auth(), **kafka_config},
            )
        )
        # Load partition metadata before the first poll joins the group, so
        # the assignment covers topics created moments ago.
        try:
            for topic in topics:
                self._consumer.partitions_for_topic(topic)
        except BaseException:  # the broker went away meanwhile: the consumer made here is not left running
            if client is None:
                self._consumer.close()
            raise

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
                        self._process_bounded(rec)
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
            if pending and self._before_commit is not None:
                self._before_commit()
            if done:
                self._consumer.commit(offsets=done)
        self.lag.after_poll(self._consumer, self._consumer.assignment)
        return count

    def wait_assigned(self, deadline_s: float) -> None:
        """Poll until the group assigned partitions and their positions are resolved.

        Records fetched while waiting are not lost: each partition is sought back to the first record
        returned, so the next :meth:`poll_once` gets them.

        Raises:
            TimeoutError: no assignment within ``deadline_s`` wall seconds.
        """
        import time

        kc = self._consumer
        end = time.monotonic() + deadline_s
        while not kc.assignment():
            if time.monotonic() > end:
                raise TimeoutError(f"no partition assignment within {deadline_s:g} s")
            for tp, recs in kc.poll(timeout_ms=100).items():
                if recs:
                    kc.seek(tp, recs[0].offset)
        for tp in kc.assignment():
            kc.position(tp)

    def run(self, stop: threading.Event | None = None, timeout_ms: int = 500) -> None:
        """Poll and handle until ``stop`` is set (forever when ``None``)."""
        while stop is None or not stop.is_set():
            self.poll_once(timeout_ms=timeout_ms)

    def _process_bounded(self, rec: Any) -> None:
        """:meth:`_process`, but the :data:`HANDLER_TRIES`-th failure in a row on ``rec`` (not an outage)
        dead-letters it instead of raising (rule D4.dead-letters)."""
        where = (rec.topic, rec.partition)
        try:
            self._process(rec)
        except Exception as exc:
            if is_outage(exc) or isinstance(exc, CancelledError):
                raise  # the broker or Redis is away, or the service is stopping: neither counted nor reset
            offset, n = self._failing.get(where, (rec.offset, 0))
            n = n + 1 if offset == rec.offset else 1
            self._failing[where] = (rec.offset, n)
            if n < self._tries:
                raise
            reason = handler_failure(self._tries, exc)  # the same reason however often the letter is sent
            self._dead_letter(rec, reason, level=logging.ERROR)
            self.stats.handler_gave_up += 1
        self._failing.pop(where, None)

    def _process(self, rec: Any) -> None:
        key = rec.key.decode("utf-8", "replace") if rec.key is not None else None
        try:
            event = screen(rec.value, rec.key, rec.topic)
            if self._ledger is not None and self._ledger.check(event, remember=False):
                self.stats.duplicates += 1
                log.debug("duplicate %s %s skipped", event.type, event.event_id)
                return
        except events.DecodeError as exc:
            self._dead_letter(rec, str(exc))
            return
        self._handler(event, Delivery(rec.topic, rec.partition, rec.offset, key, rec.timestamp, rec.value))
        if self._ledger is not None:
            self._ledger.remember(event)  # only once handled: a failed record is handled again
        self.stats.handled += 1

    def _dead_letter(self, rec: Any, reason: str, level: int = logging.WARNING) -> None:
        log.log(level, "dead-lettering %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, reason)
        letter = dead_letter(
            topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            key=rec.key,
            value=rec.value,
            reason=reason,
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


def tp_key(tp: Any) -> str:
    """A partition's key in offset maps, ``"topic:partition"``."""
    return f"{tp.topic}:{tp.partition}"


class AssignedConsumer:
    """Read whole topics from a chosen start, outside any group rebalance (kafka-python).

    Used by the services that rebuild their state from the log on start
    (policy; accounting when it has no usable checkpoint, else it seeks to
    the checkpoint's offsets with :meth:`seek`). Why not :class:`~apportion.bus.consumer.EventConsumer`
    or faust: both subscribe through a consumer group and resume from the
    committed offsets, while these services must read *every* partition of
    *several* topics from offset 0 (or from the tail) each time, know when
    they have caught up with the log as it was at start, and merge the
    topics in a deterministic order. Manual ``assign`` gives all of that
    directly. Offsets are still committed under ``group_id`` (after the
    effect is stored) so lag is visible with the usual Kafka tools.

    Args:
        bootstrap: Kafka ``host:port``.
        topics: physical topic names (:attr:`apportion.topics.Topic.name`).
        group_id: group to commit offsets under.
        tail: topic name -> how many records per partition to start before
            the end (e.g. ``{usage: 1}`` for the newest snapshot only);
            topics not listed start at offset 0.
        deadline_s: how long to wait for the topics' metadata.
        read_ahead: when ``topics`` hold the topic of the key registrations
            and revocations (:data:`apportion.topics.BUDGETS`, rule D4.topics),
            each :meth:`poll` that returns a record of another topic also reads
            that one to its end (:meth:`read_identity_to_end`), so that a signed
            record is judged with every key event appended before it (rule D10.proven-user). False: no read-ahead.
        overlap: with ``read_ahead``, a poll does not wait for the key topic's end offsets: it asks for them
            on a connection of its own (:class:`EndsAsker`) and returns, and the caller waits for them
            with :meth:`settle` before it makes anything it decided on the poll's records visible (the
            dispatcher, at its transaction's commit). False: each poll reads the key topic to its end itself.

    Raises:
        TimeoutError: a topic has no partitions after ``deadline_s``.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: list[str],
        group_id: str,
        *,
        tail: dict[str, int] | None = None,
        deadline_s: float = 30.0,
        read_ahead: bool = True,
        overlap: bool = False,
    ) -> None:
        from apportion.bus.clients import kafka_consumer
        from apportion.bus.security import kafka_auth

        self._kc = kafka_consumer(
            bootstrap_servers=bootstrap,
            group_id=group_id,
            client_id=f"{group_id}-reader",  # names its requests in the broker's request log
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=8 * 1024 * 1024,
            **KAFKA_RECONNECT,
            **READ_COMMITTED,
            **kafka_auth(),
        )
        self._asker: EndsAsker | None = None
        try:
            self._start(bootstrap, topics, group_id, tail or {}, deadline_s, read_ahead, overlap)
        except BaseException:  # a broker gone or a topic missing at any step: nothing made here is left running
            try:
                self.close()
            except Exception as exc:  # noqa: BLE001 - the start's own error is the one to raise
                log.debug("closing a reader that did not start failed: %s", exc)
            raise

    def _start(
        self,
        bootstrap: str,
        topics: list[str],
        group_id: str,
        tail: dict[str, int],
        deadline_s: float,
        read_ahead: bool,
        overlap: bool,
    ) -> None:
        """The constructor's steps after the reader is made: partitions, the asker, offsets, start positions."""
        import time

        from kafka import TopicPartition

        parts = []
        end_at = time.monotonic() + deadline_s
        for t in topics:
            while not (ps := self._kc.partitions_for_topic(t)):
                if time.monotonic() > end_at:
                    raise TimeoutError(f"topic {t!r} has no partitions (not provisioned?)")
                self._kc.poll(timeout_ms=100)  # refreshes metadata
            parts += [TopicPartition(t, p) for p in sorted(ps)]
        self.partitions = parts
        from apportion.topics import BUDGETS

        identity_topic = topic_name(BUDGETS) if read_ahead else None
        #: the identity topic's partitions (read ahead by :meth:`poll`), and the others (paused meanwhile)
        self.identity_parts = [tp for tp in parts if tp.topic == identity_topic]
        self._other_parts = [tp for tp in parts if tp.topic != identity_topic]
        self._identity_topic = identity_topic
        #: polls that had to read the identity topic ahead (they found it behind its end)
        self.identity_read_aheads = 0
        #: ``own(record)``: true for a record the reader wrote itself and drops unjudged (the dispatcher's
        #: echoes); a batch of only those needs no read-ahead, which costs a round trip to the broker
        self.own: Callable[[Any], bool] | None = None
        from apportion.bus.consumer import LagMeter

        #: consumer lag per partition, measured after polls once its ``sink`` is set
        self.lag = LagMeter()
        #: asks the key topic's end offsets on its own connection (``overlap``), and the answer awaited
        self._asker = EndsAsker(bootstrap, self.identity_parts, f"{group_id}-ends") if overlap else None
        self._asked: Future[dict[Any, int]] | None = None
        #: key records :meth:`settle` read, returned again at the head of the next poll
        self._carried: list[Any] = []
        self._kc.assign(parts)
        self.start_end = self._kc.end_offsets(parts)
        begin = self._kc.beginning_offsets(parts)
        #: log start offsets at start (records below them were deleted).
        self.start_begin = begin
        for tp in parts:
            back = tail.get(tp.topic)
            start = begin[tp] if back is None else max(begin[tp], self.start_end[tp] - back)
            self._kc.seek(tp, start)

    def offsets_at_start(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(begin, end)``: each partition's log start and end offsets at start, keyed ``"topic:partition"``."""
        return (
            {tp_key(tp): off for tp, off in self.start_begin.items()},
            {tp_key(tp): off for tp, off in self.start_end.items()},
        )

    def seek(self, offsets: dict[str, int]) -> None:
        """Move each partition to the next offset given as ``"topic:partition" -> offset``.

        Partitions not named keep their start position. Call before
        :meth:`catch_up` (e.g. to resume from a checkpoint's offsets).
        """
        for tp in self.partitions:
            off = offsets.get(tp_key(tp))
            if off is not None:
                self._kc.seek(tp, off)

    def poll(self, timeout_ms: int = 200, max_records: int = 5000, *, read_ahead: bool = True) -> list[Any]:
        """Next records (kafka-python ``ConsumerRecord``), partition by partition in offset order.

        With an identity topic and ``read_ahead``, a batch holding any record of
        another topic also holds every identity record appended before the
        batch was read (:meth:`read_identity_to_end`, appended after the rest).
        Why: partitions are fetched independently, so a submission can be read
        before the key registration published (and acknowledged) just before
        it, or a report before its key's revocation; the reader would judge it
        by keys the log's order contradicts, and the audit, which judges every
        record by the keys as of its own place (:func:`apportion.logrecord.log_position`),
        would disagree.

        With ``overlap`` the end offsets are asked here and the poll returns at once: :meth:`settle` waits for
        them. Key records a settle read come first in the next poll's batch.
        """
        batch = self._kc.poll(timeout_ms=timeout_ms, max_records=max_records)
        self.lag.after_poll(self._kc, lambda: self.partitions)
        out = _in_partition_order(batch)
        if self._carried:
            out, self._carried = self._carried + out, []
        if read_ahead and self._needs_identity(out):
            if self._asker is None:
                out += self.read_identity_to_end()
            else:
                self._asked = self._asker.ask(self._asked)
        return out

    @property
    def overlap(self) -> bool:
        """Do polls leave the key topic's end offsets to :meth:`settle`?"""
        return self._asker is not None

    def settle(self, wait: bool = True, deadline_s: float = IDENTITY_READ_AHEAD_S) -> list[Any] | None:
        """Wait for the key topic's end offsets the last poll asked for (``overlap``) and read up to them.

        The end offsets were asked after every record polls returned so far had been read, so they cover every
        key event acknowledged before any of those records was appended (rule D10.proven-user). Returns the
        key records the reader had not read yet (empty in the normal case: key events are rare); they come
        again at the head of the next poll, to be folded before what follows them. Nothing asked since the
        last settle: returns at once, empty. ``wait`` False: ``None`` while the answer is not in (asked again
        by the next settle). An answer that does not come within ``deadline_s`` is logged and the records are
        left judged with the keys read so far, as :meth:`read_identity_to_end` does.
        """
        asked = self._asked
        if asked is None:
            return []
        if not wait and not asked.done():
            return None
        self._asked = None
        try:
            ends = asked.result(timeout=deadline_s)
        except Exception as exc:  # noqa: BLE001 - the broker did not answer: judged with the keys read so far
            log.warning("identity topic's end offsets not known (%s): judging with the keys read so far", exc)
            return []
        late = self._read_identity_to(ends, deadline_s)
        self._carried += late
        return late

    def _needs_identity(self, records: list[Any]) -> bool:
        """True when ``records`` hold a record of a topic other than the identity topic that is not the reader's
        own (:attr:`own`): one judged by keys, so the identity topic is read ahead."""
        if not self.identity_parts:
            return False
        own, identity = self.own, self._identity_topic
        if own is None:
            return any(r.topic != identity for r in records)
        return any(r.topic != identity and not own(r) for r in records)

    def read_identity_to_end(self, deadline_s: float = IDENTITY_READ_AHEAD_S) -> list[Any]:
        """The identity topic's records from its positions to its end offsets, asked of the broker now.

        The other partitions are paused meanwhile (what they fetched is kept
        for the next poll), so this ends. The end offsets are asked after the
        batch that needs them was read, so they cover every identity record
        acknowledged before any record of that batch was appended. Gives up
        (logged; the batch is judged with the keys read so far, as without the
        read-ahead) when the broker does not answer within ``deadline_s``.

        Returns:
            the records read, partition by partition in offset order (empty when it was at its end).
        """
        from kafka.errors import KafkaError

        try:
            ends = self._kc.end_offsets(self.identity_parts, timeout_ms=int(deadline_s * 1000))
        except KafkaError as exc:
            log.warning("identity topic's end offsets not known (%s): judging with the keys read so far", exc)
            return []
        return self._read_identity_to(ends, deadline_s)

    def _read_identity_to(self, ends: dict[Any, int], deadline_s: float) -> list[Any]:
        """The identity topic's records from its positions up to ``ends`` (the other partitions paused)."""
        import time

        parts = self.identity_parts

        def behind() -> list[Any]:
            return [tp for tp in parts if (self._kc.position(tp, timeout_ms=0) or 0) < ends[tp]]

        if not behind():
            return []
        self.identity_read_aheads += 1
        out: list[Any] = []
        end_at = time.monotonic() + deadline_s
        self._kc.pause(*self._other_parts)
        self._kc.resume(*parts)
        try:
            while (late := behind()) and time.monotonic() < end_at:
                got = self._kc.poll(timeout_ms=100)
                out += _in_partition_order(got)
            if late:
                log.warning(
                    "identity topic not read to its end within %.1f s: judging with the keys read so far", deadline_s
                )
        finally:
            self._kc.resume(*self._other_parts)
        return out

    async def catch_up(self, stop: asyncio.Event) -> tuple[list[Any], list[Any]] | None:
        """Read up to the end offsets taken at start (in worker threads).

        Returns:
            ``(backlog, late)``: the records below the start's end offsets (the
            log as of the start, for a rebuild) and those appended meanwhile
            (to handle live afterwards); ``None`` when ``stop`` was set first.
        """
        ends = {(tp.topic, tp.partition): off for tp, off in self.start_end.items()}
        backlog: list[Any] = []
        late: list[Any] = []
        while not await asyncio.to_thread(self.caught_up):
            if stop.is_set():
                return None
            # no read-ahead: a rebuild judges the records once it has read the whole log to its end
            for rec in await asyncio.to_thread(partial(self.poll, 200, read_ahead=False)):
                (backlog if rec.offset < ends[(rec.topic, rec.partition)] else late).append(rec)
        if self._needs_identity(late):
            late += await asyncio.to_thread(self.read_identity_to_end)  # handled live: judged as a poll's
        return backlog, late

    def end_offsets_now(self, deadline_s: float = IDENTITY_READ_AHEAD_S) -> dict[str, int]:
        """Each partition's end offset asked of the broker now, ``"topic:partition"`` -> offset (the last
        stable offset: the consumer reads committed records only). Raises ``KafkaError`` when the broker
        does not answer within ``deadline_s``."""
        ends = self._kc.end_offsets(self.partitions, timeout_ms=int(deadline_s * 1000))
        return {tp_key(tp): off for tp, off in ends.items()}

    def positions(self) -> dict[str, int]:
        """Each partition's next offset to read, ``"topic:partition"`` -> offset, as far as known without
        waiting on the broker (past the records polls returned, and past transaction markers)."""
        return {tp_key(tp): off for tp, off in self._known_positions().items()}

    def _known_positions(self) -> dict[Any, int]:
        """Each partition's position known now (asked without waiting on the broker); unknown ones left out."""
        known = {tp: self._kc.position(tp, timeout_ms=0) for tp in self.partitions}
        return {tp: off for tp, off in known.items() if off is not None}

    def caught_up(self) -> bool:
        """True once every partition's position reached its end offset at start."""
        return all(self._kc.position(tp) >= self.start_end[tp] for tp in self.partitions)

    def commit(self, offsets: dict[str, int] | None = None) -> None:
        """Commit offsets under the group (observability; starts do not read them).

        Args:
            offsets: ``"topic:partition"`` -> next offset to commit; default
                the current positions of every partition (those known now: asked
                without waiting on the broker, as :func:`partition_lag` does).
        """
        from kafka.structs import OffsetAndMetadata

        if offsets is None:
            pos = self._known_positions()
        else:
            pos = {tp: offsets[k] for tp in self.partitions if (k := tp_key(tp)) in offsets}
        self._kc.commit({tp: OffsetAndMetadata(off, "", -1) for tp, off in pos.items()})

    def close(self) -> None:
        """Close the connections (the asker's even when the reader's close fails)."""
        try:
            self._kc.close()
        finally:
            if self._asker is not None:
                self._asker.close()


class EndsAsker:
    """Asks some partitions' end offsets (last stable offsets) on a connection of its own, without waiting.

    The broker answers one connection's requests in order, and a reader's connection has its next fetch
    waiting there (kafka-python 3 may send it as a poll returns records): a ``LIST_OFFSETS`` behind it would wait
    for it. So a client of its own, no group. kafka-python 3 runs each client's network on an IO thread of its
    own: the request is handed to that thread (:meth:`ask` returns at once) and its answer completes the
    returned future there; a kafka-python without that loop is asked from a worker thread instead. The first
    answer is taken here, so the connection is up before the first ask.

    Args:
        bootstrap: Kafka ``host:port``.
        parts: the ``TopicPartition`` s asked about.
        client_id: names its requests in the broker's request log.
    """

    def __init__(self, bootstrap: str, parts: list[Any], client_id: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from apportion.bus.clients import kafka_consumer
        from apportion.bus.security import kafka_auth

        self._parts = list(parts)
        self._kc = kafka_consumer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            enable_auto_commit=False,
            **KAFKA_RECONNECT,
            **READ_COMMITTED,
            **kafka_auth(),
        )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=client_id)
        net: Any = getattr(self._kc, "_net", None)
        offsets_by_times: Any = getattr(getattr(self._kc, "_fetcher", None), "_fetch_offsets_by_times_async", None)
        #: kafka-python's IO loop and its coroutine that asks for offsets (None: not this kafka-python)
        self._loop = (net, offsets_by_times) if hasattr(net, "call_soon_with_future") and offsets_by_times else None
        if self._parts:
            try:
                self._ends()
            except BaseException:  # no answer (the broker is gone): nothing made here is left running
                self.close()
                raise

    def _ends(self) -> dict[Any, int]:
        return self._kc.end_offsets(self._parts, timeout_ms=int(IDENTITY_READ_AHEAD_S * 1000))

    def ask(self, pending: Future[dict[Any, int]] | None = None) -> Future[dict[Any, int]]:
        """The end offsets as of a request sent from now on. ``pending``: an earlier ask, returned itself while it
        has not started (its request is sent later than now, so its answer serves as well)."""
        if pending is not None and not pending.running() and not pending.done():
            return pending
        if self._loop is None:
            return self._pool.submit(self._ends)
        from kafka.protocol.consumer.offsets import OffsetSpec

        net, offsets_by_times = self._loop
        out: Future[dict[Any, int]] = Future()
        out.set_running_or_notify_cancel()
        latest = {tp: OffsetSpec.LATEST for tp in self._parts}
        answer = net.call_soon_with_future(offsets_by_times, latest, int(IDENTITY_READ_AHEAD_S * 1000))
        answer.add_callback(lambda got: out.set_result({tp: got[tp].offset for tp in self._parts}))
        answer.add_errback(out.set_exception)
        return out

    def close(self) -> None:
        """Stop the thread (after the request in flight) and close the connection."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._kc.close()


def _in_partition_order(batch: dict[Any, list[Any]]) -> list[Any]:
    """A kafka-python poll result as one list: partition by partition (topic, partition), each in offset order."""
    return [r for tp in sorted(batch, key=lambda tp: (tp.topic, tp.partition)) for r in batch[tp]]
