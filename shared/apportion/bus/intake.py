"""The reader edge: every record becomes an event or a dead letter with its reason.

One home for what every reader of the log does with a record before any
domain code sees it (poison-proof readers; one home for dead-letter
construction). The services (dispatcher, accounting,
policy, through :class:`Intake`), :class:`~apportion.bus.consumer.EventConsumer`,
the faust agents (:func:`apportion.bus.faust_app.decoded`), the audit's log
reader (:func:`apportion.bus.reader.iter_topic_records`) and the export
(:mod:`apportion.audit.source`) all accept exactly what
:func:`screen` accepts, so the audit folds the same events the services
folded.

A record is refused, with ``str(DecodeError)`` as the reason, when
(:mod:`apportion.events`, codec section; ``docs/reliability.md``):

* its value is null (a tombstone) or not an event (not UTF-8 JSON of one
  object, unknown type or version, a field that fails validation);
* it holds a non-finite number anywhere (bare ``NaN``/``Infinity``, a
  literal that overflows, a non-finite float field; a ratio may be +inf);
* a time is not an ISO-8601 string with an offset (``12345``, ``"12345"``,
  a naive time);
* its key is not :func:`~apportion.events.key_of` of the event, or the
  event's type is not routed to the registry topic it was read from.

A service's :class:`Intake` also remembers the payload of the ids it has
read (:class:`IdLedger`): the same id with the same payload is a duplicate
(dropped, counted), the same id with another payload is a dead letter
``event_id reused``. And a record whose event the service could not apply
(the fold raised) is a dead letter ``apply failed: <type>: <message>``
(:meth:`Intake.failed`), so no record can stop a service.

:func:`dead_letter` is the one construction of a
:class:`~apportion.events.DeadLetter`: its id is
``det_id("DeadLetter", topic, partition, offset)``, so every reader that
meets the same bad record (and every restart that meets it again) writes the
same id and readers of the dead letters keep one.

Pure: nothing here connects; the caller publishes the dead letters.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

from apportion import events
from apportion.domain.admission import RUN_REPORT_TYPES, UNAUTHENTICATED_NODE
from apportion.logrecord import log_position
from apportion.settings import topic_prefix
from apportion.timeutil import WEEK_S

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Reason prefix of an event id read before with a different payload.
EVENT_ID_REUSED = "event_id reused"

#: Reason prefix of a value the codec failed on with something other than a DecodeError.
UNDECODABLE = "undecodable"

#: Reason prefix of a record whose event the service's fold raised on.
APPLY_FAILED = "apply failed"


def dead_letter(
    *,
    topic: str,
    partition: int | None,
    offset: int | None,
    key: bytes | str | None,
    value: bytes | None,
    reason: str,
    ts: datetime,
    producer: str,
) -> events.DeadLetter:
    """The dead letter of one record: where it was, its bytes, and why it was refused.

    The id is :func:`apportion.events.dead_letter_id` (the record's
    position): the same record gives the same dead-letter id, whoever meets
    it and however often.

    Args:
        topic, partition, offset: the record's position.
        key: its key (bytes are decoded as UTF-8, bad bytes replaced).
        value: its value; a null value (tombstone) is kept as empty bytes.
        reason: why it was refused (``str(DecodeError)``, or an apply failure).
        ts: event time of the dead letter (the reader's clock).
        producer: who writes it (the reader's name).
    """
    if isinstance(key, (bytes, bytearray)):
        key = bytes(key).decode("utf-8", "replace")
    return events.DeadLetter(
        event_id=events.dead_letter_id(topic, partition, offset),
        source_topic=topic,
        source_partition=partition,
        source_offset=offset,
        source_key=key,
        original=base64.b64encode(value or b"").decode("ascii"),
        error=reason,
        ts=ts,
        producer=producer,
    )


def screen(value: bytes | None, key: bytes | str | None, topic: str | None = None) -> events.Event:
    """The event in a record, or :class:`~apportion.events.DecodeError` with the reason (stateless).

    :func:`apportion.events.decode` of the value, then
    :func:`apportion.events.check_record` of its key and topic. Any other
    error the codec raises (a bug: it should not) is refused as well, with
    the reason ``undecodable: <type>: <message>``, so no value can stop a
    reader.
    """
    try:
        return events.decode_checked(value, key, topic, prefix=topic_prefix())
    except events.DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the codec's own bug must not stop a reader either
        raise events.DecodeError(f"{UNDECODABLE}: {type(exc).__name__}: {exc}") from None


def apply_failure(exc: BaseException) -> str:
    """The dead-letter reason of an event the fold raised on: ``apply failed: OverflowError: ...``."""
    return f"{APPLY_FAILED}: {type(exc).__name__}: {exc}"


#: Marks an id remembered without its payload digest (read back from a snapshot written before digests were the
#: same in every process).
_NO_DIGEST = -1


class IdLedger:
    """Map event id -> payload digest (:func:`apportion.events.payload_digest`), bounded by the window W.

    :meth:`check` tells a new id, a duplicate (same id, same payload) and a
    reused id (same id, another payload).

    Bounds: ids are kept in two generations by event time. The
    current one takes every id remembered; once an event's time is ``window_s``
    past the start of the current generation, the current becomes the old one
    and the old is dropped. So an id is remembered for at least W and at most
    2 W of event time (the newest event time read), whatever the rate, with
    no per-id time stamp (about 150 bytes an id). A hard cap ``capacity``
    (ids in both generations) is the safety net: the generations also turn
    when the current holds ``capacity // 2`` ids. Heartbeats
    (:data:`UNRECORDED`) are checked against the ids known but never
    remembered: folding one twice changes nothing, and they are most of a
    busy log. A reuse further apart than that is not caught here (the
    domain's own de-duplication still drops it).

    Limits: the generations follow the newest event time read, so a record
    dated far ahead (which a service then refuses) turns them early, and
    until the log catches up with that time only ``capacity`` bounds the
    ledger.

    Digests are the same in every process (:func:`~apportion.events.payload_digest`), so a pickled ledger
    (the dispatcher's snapshot, the accounting checkpoint) keeps them and tells a reused id from a duplicate
    after a restore too. A ledger pickled before that (its ids with :data:`_NO_DIGEST`) takes a record of a
    known id for a duplicate whatever its payload (it is not folded either way).
    """

    __slots__ = ("capacity", "window", "_cur", "_old", "_turn_at")

    #: Event types checked but never remembered.
    UNRECORDED: tuple[type[events.Event], ...] = (events.NodeHeartbeat,)

    def __init__(self, capacity: int = 200_000, window_s: float = float(WEEK_S)) -> None:
        if capacity < 2 or window_s <= 0:
            raise ValueError(f"capacity must be >= 2 and window_s > 0, got {capacity}, {window_s}")
        self.capacity = capacity
        self.window = timedelta(seconds=window_s)
        self._cur: dict[UUID, int] = {}
        self._old: dict[UUID, int] = {}
        self._turn_at: datetime | None = None  # event time at which the current generation turns old

    def _known(self, eid: UUID) -> int | None:
        known = self._cur.get(eid)
        return self._old.get(eid) if known is None else known

    def _add(self, eid: UUID, digest: int, ts: datetime) -> None:
        turn = self._turn_at
        if turn is None or ts >= turn or len(self._cur) >= self.capacity // 2:
            stale = turn is not None and ts >= turn + self.window  # a gap of more than W: both are too old
            self._old = {} if stale else self._cur
            self._cur = {}
            if turn is None or ts >= turn:
                self._turn_at = ts + self.window
        self._cur[eid] = digest

    def check(self, event: events.Event, *, remember: bool = True) -> bool:
        """True for a duplicate; False for a new id (remembered now unless ``remember`` is False).

        Raises:
            DecodeError: ``event_id reused: ...`` when the id was read with another payload.
        """
        digest = events.payload_digest(event)
        eid = event.event_id
        known = self._known(eid)
        if known is None:
            if remember and not isinstance(event, self.UNRECORDED):
                self._add(eid, digest, event.ts)
            return False
        if known == digest or known == _NO_DIGEST:
            return True
        raise events.DecodeError(f"{EVENT_ID_REUSED}: {eid} was read before with a different payload")

    def remember(self, event: events.Event) -> None:
        """Record ``event`` as read (a service's own output, so a reuse of its ids is caught)."""
        if self._known(event.event_id) is None and not isinstance(event, self.UNRECORDED):
            self._add(event.event_id, events.payload_digest(event), event.ts)

    def __len__(self) -> int:
        return len(self._cur) + len(self._old)

    def __getstate__(self) -> dict[str, Any]:
        """What a pickle keeps: the ids with their digests (the same in every process)."""
        return {
            "capacity": self.capacity,
            "window": self.window,
            "_cur": dict(self._cur),
            "_old": dict(self._old),
            "_turn_at": self._turn_at,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in self.__slots__:
            setattr(self, name, state[name])


@dataclass(slots=True)
class IntakeStats:
    """Counters of one reader edge (logs, metrics, tests)."""

    events: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    apply_failed: int = 0
    unauthenticated_node: int = 0
    unauthenticated: int = 0
    #: authenticated reports of a run no placement of which this reader knows (:meth:`Intake.authenticate`)
    unknown_run: int = 0


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Intake:
    """A service's reader edge: screen each record, drop duplicates, dead-letter the rest with the reason.

    Args:
        producer: written as ``producer`` on the dead letters.
        clock: event time of the dead letters.
        ledger: the id -> payload map; default a fresh :class:`IdLedger` of ``window_s``.
        on_dead: called with each dead letter made (the caller publishes it).
        drop_duplicates: False passes a duplicate (same id, same payload) on,
            counted, for a fold that is idempotent itself and must see it as a
            restarted reader would (accounting: its late-record count); a
            reused id is dead-lettered either way.
        gate: the check of who wrote what (:class:`apportion.identity.ReportGate`,
            rule D10.authentication) that :meth:`authenticate` applies; ``None``: none.
        window_s: the window W (event seconds) of the default ledger (:class:`IdLedger`).

    Example::

        intake = Intake("dispatcher", clock.now, on_dead=publish)
        for rec in batch:
            event = intake.admit(rec)      # None: dead-lettered or a duplicate
            if event is not None:
                intake.apply(rec, fold, event)
    """

    def __init__(
        self,
        producer: str,
        clock: Callable[[], datetime] = _utcnow,
        *,
        ledger: IdLedger | None = None,
        on_dead: Callable[[events.DeadLetter], Any] | None = None,
        drop_duplicates: bool = True,
        gate: Any = None,
        window_s: float = float(WEEK_S),
    ) -> None:
        self.producer = producer
        self.gate = gate
        self.drop_duplicates = drop_duplicates
        self.clock = clock
        self.ledger = ledger if ledger is not None else IdLedger(window_s=window_s)
        self.on_dead = on_dead
        self.stats = IntakeStats()

    def admit(self, rec: Any) -> events.Event | None:
        """The event of a kafka-python record, or None (dead-lettered, or a duplicate dropped).

        ``rec`` needs ``topic``, ``partition``, ``offset``, ``key`` and ``value``.
        """
        try:
            event = screen(rec.value, rec.key, rec.topic)
            if self.ledger is not None and self.ledger.check(event):
                self.stats.duplicates += 1
                if self.drop_duplicates:
                    return None
        except events.DecodeError as exc:
            self.refuse(rec, str(exc))
            return None
        self.stats.events += 1
        return event

    def authenticate(self, batch: list[T], pair: Callable[[T], tuple[Any, events.Event]]) -> list[T]:
        """``batch`` without the events the gate refuses; each refused one is dead-lettered and counted.

        The batch's identity events (key registrations and revocations) are
        folded first, each at its record's place in the log
        (:func:`apportion.logrecord.log_position`: the broker's append time),
        then each decision, command and node report is checked in batch order
        (a run's placement before its reports) against the keys as of *its*
        record's place: a revocation counts only for records appended after it
        (or whose own ``ts`` is after it), wherever the batch holds it, so a
        rebuild reading the whole log as one batch judges every record as the
        live reader did one poll at a time, and a rotated key voids nothing it
        signed before its revocation (:class:`apportion.identity.KeyRegistry`,
        the audit's rule too). A registration counts from its ``ts`` wherever
        it is in the batch (one in another partition, read in the same poll).
        A record whose place is unknown (a producer's ``CreateTime``: a topic
        without ``LogAppendTime``) is refused by every revocation folded so
        far. The dead letter's
        reason starts with ``unauthenticated`` (a decision the dispatcher's key
        did not sign) or ``unauthenticated_node`` (a report its node's key did
        not sign, or of a run another node holds;
        :func:`apportion.domain.admission.authorize_report`).

        Args:
            batch: screened items in the order the service folds them.
            pair: ``(record, event)`` of an item.
        """
        gate = self.gate
        if gate is None or not batch:
            return batch
        pairs = [pair(x) for x in batch]
        places = [log_position(rec, ev) for rec, ev in pairs]
        for (_, ev), place in zip(pairs, places, strict=True):
            gate.observe(ev, place)
        out = []
        for x, (rec, ev), place in zip(batch, pairs, places, strict=True):
            why = gate.report_refusal(rec.value, ev, place)
            if why is None:
                if isinstance(ev, RUN_REPORT_TYPES) and gate.checks(ev) and gate.keys.placement(ev) is None:
                    self._unknown_run(rec, ev)
                out.append(x)
                continue
            if why.startswith(UNAUTHENTICATED_NODE):
                self.stats.unauthenticated_node += 1
            else:
                self.stats.unauthenticated += 1
            self.refuse(rec, why)
        return out

    def _unknown_run(self, rec: Any, ev: events.Event) -> None:
        """Count (and log: the first 10, then every 1,000th) a report its node signed of a run never placed here.

        Its node's key proved it, so it is passed on; the folds know no such run and change nothing (an event
        naming an unknown run is never dropped silently). Also a report of a run placed more than
        :data:`apportion.identity.PLACEMENTS_KEPT` placements ago.
        """
        self.stats.unknown_run += 1
        n = self.stats.unknown_run
        if n <= 10 or n % 1000 == 0:
            log.warning(
                "%s[%s]@%s: %s of %s/%s from %s names a run this reader knows no placement of "
                "(changes nothing; %d so far)",
                rec.topic,
                rec.partition,
                rec.offset,
                ev.type,
                getattr(ev, "job_id", "?"),
                getattr(ev, "attempt", "?"),
                getattr(ev, "node_id", "?"),
                n,
            )

    def refuse(self, rec: Any, reason: str) -> events.DeadLetter:
        """Dead-letter ``rec`` with ``reason`` (logged, counted, handed to ``on_dead``)."""
        letter = dead_letter(
            topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            key=rec.key,
            value=rec.value,
            reason=reason,
            ts=self.clock(),
            producer=self.producer,
        )
        log.warning("dead-lettering %s[%s]@%s: %s", rec.topic, rec.partition, rec.offset, reason)
        self.stats.dead_lettered += 1
        if self.on_dead is not None:
            self.on_dead(letter)
        return letter

    def failed(self, rec: Any, exc: BaseException) -> events.DeadLetter:
        """Dead-letter ``rec`` whose event the fold raised ``exc`` on (``apply failed: <type>: <message>``)."""
        log.error("applying %s[%s]@%s failed", rec.topic, rec.partition, rec.offset, exc_info=exc)
        self.stats.apply_failed += 1
        return self.refuse(rec, apply_failure(exc))

    def apply(self, rec: Any, fold: Callable[[events.Event], Any], event: events.Event) -> Any:
        """``fold(event)``; if it raises an ``Exception``, dead-letter ``rec`` and return None.

        Only for pure folds (domain code): an I/O error must propagate, so the
        record is retried rather than dead-lettered.
        """
        try:
            return fold(event)
        except Exception as exc:  # noqa: BLE001 - any error of a pure fold is this record's poison
            self.failed(rec, exc)
            return None
