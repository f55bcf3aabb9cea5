"""The dispatcher's zombie fencing on the real broker: Kafka transactions (KIP-98) and ``read_committed``.

What :mod:`services.dispatcher.app` relies on (docs/leadership.md, item 4): a new leader's
``init_transactions`` under the one transactional id aborts the previous leader's open transaction and
fences its producer (its commit fails with ``ProducerFencedError``, :func:`apportion.bus.producer.is_fenced`),
and a reader on :data:`apportion.bus.producer.READ_COMMITTED` never returns an aborted record, while a
plain reader does (so the isolation level, not luck, keeps a stale leader's decisions out). Waiting is
polling with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from apportion import events
from apportion.bus.producer import READ_COMMITTED, EventProducer, Unacked, is_fenced
from tests.kit.livestack import until

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def read_all(bootstrap: str, topic: str, *, committed: bool) -> list[bytes]:
    """Every value of ``topic``'s partition 0 up to its end (the last stable offset when ``committed``)."""
    from kafka import KafkaConsumer, TopicPartition

    from apportion.bus.security import kafka_auth

    kc = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        **(READ_COMMITTED if committed else {}),
        **kafka_auth(),
    )
    try:
        tp = TopicPartition(topic, 0)
        kc.assign([tp])
        kc.seek_to_beginning(tp)
        end = kc.end_offsets([tp])[tp]
        out: list[bytes] = []
        deadline = time.monotonic() + DEADLINE_S
        while kc.position(tp) < end:
            assert time.monotonic() < deadline, f"{topic} not read to {end} within {DEADLINE_S} s"
            for recs in kc.poll(timeout_ms=200).values():
                out += [r.value for r in recs]
        return out
    finally:
        kc.close()


@pytest.fixture
def writers(kafka_bootstrap: str) -> Iterator[Callable[[], EventProducer]]:
    """``make()``: a new transactional producer under one transactional id per test (closed after)."""
    tid = f"test-txn-{uuid.uuid4().hex[:12]}"
    made: list[EventProducer] = []

    def make() -> EventProducer:
        made.append(EventProducer(kafka_bootstrap, client_id="txn-test", transactional_id=tid))
        return made[-1]

    yield make
    for p in made:
        try:
            p.close(timeout_s=5)
        except Exception:  # noqa: BLE001 - a fenced producer may refuse to close cleanly
            pass


def test_a_fenced_writer_can_not_commit_and_no_committed_reader_returns_its_records(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], writers: Callable[[], EventProducer]
) -> None:
    topic = kafka_topic_factory("txn")
    old = writers()
    old.init_transactions()
    old.begin()
    old.send_raw(topic, b"kept")
    old.commit()
    old.begin()
    old.send_raw(topic, b"stale")
    old.flush()  # on the broker, in a transaction still open: a paused leader's decisions
    new = writers()
    new.init_transactions()  # the next leader takes the id over: the open transaction is aborted
    with pytest.raises(Exception) as raised:  # the type is what is_fenced judges
        old.commit()
    assert is_fenced(raised.value), repr(raised.value)
    new.begin()
    new.send_raw(topic, b"new")
    new.commit()
    assert read_all(kafka_bootstrap, topic, committed=True) == [b"kept", b"new"]
    assert read_all(kafka_bootstrap, topic, committed=False) == [b"kept", b"stale", b"new"]


def test_a_writer_that_meets_the_fence_before_its_commit_knows_it_is_fenced(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], writers: Callable[[], EventProducer]
) -> None:
    """kafka-python's sender may meet the fence first (a send after the takeover): it takes the refused
    produce for a recoverable epoch error and tries to bump the epoch, the commit raises a plain
    ``KafkaError`` (an invalid transition), and only once the broker refused the bump does the producer's
    state say why (:meth:`EventProducer.fenced`). The dispatcher therefore also asks its lease
    (``services/dispatcher/app._lead``): a fence means another instance took the lease first."""
    topic = kafka_topic_factory("txn")
    old = writers()
    old.init_transactions()
    old.begin()
    old.send_raw(topic, b"first")
    old.flush()
    assert not old.fenced()
    writers().init_transactions()
    with pytest.raises(Exception):  # noqa: B017 - the producer's state is what is checked
        old.send_raw(topic, b"late").get(timeout=DEADLINE_S)
    with pytest.raises(Exception):  # noqa: B017
        old.commit()
    until(old.fenced, "the producer to learn it is fenced", DEADLINE_S)
    assert read_all(kafka_bootstrap, topic, committed=True) == []


def test_unacked_makes_what_one_flush_covers_visible_at_once(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], writers: Callable[[], EventProducer]
) -> None:
    topic = kafka_topic_factory("txn")
    p = writers()
    p.init_transactions()
    raw: Any = _RawTo(p, topic)
    sends = Unacked(raw, transactional=True)
    assert not sends.open
    cordon = events.NodeCordoned(node_id="n1", ts=datetime(2026, 1, 5, tzinfo=UTC))
    sends.send_all([(cordon, b"a"), (cordon, b"b")])
    assert sends.open
    p.flush()  # delivered, not committed: a read_committed reader stops before them
    assert read_all(kafka_bootstrap, topic, committed=True) == []
    sends.flush()
    assert not sends.open
    sends.check()
    assert read_all(kafka_bootstrap, topic, committed=True) == [b"a", b"b"]
    sends.flush()  # nothing open: no empty transaction
    assert not sends.open


class _RawTo:
    """``send_many([(event, value)])`` of :class:`EventProducer` to one test topic (the values as given)."""

    def __init__(self, producer: EventProducer, topic: str) -> None:
        self._p, self._topic = producer, topic

    def send_many(self, sent: list[tuple[events.Event, bytes]]) -> list[Any]:
        return [self._p.send_raw(self._topic, value) for _, value in sent]

    def begin(self) -> None:
        self._p.begin()

    def commit(self) -> None:
        self._p.commit()


def test_a_reader_reaches_the_end_offsets_it_is_given_past_commit_markers_and_up_to_an_open_transaction(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], writers: Callable[[], EventProducer]
) -> None:
    """The dispatcher's read barrier before a loss (rule D3.loss-barrier) on the real broker: the end offsets
    a ``read_committed`` reader is given stop at an open transaction, and its positions pass the commit
    markers, so the barrier is reached once every committed record is read, and not before."""
    from apportion.bus.consumer import AssignedConsumer
    from services.dispatcher.logic import read_to

    topic = kafka_topic_factory("txn")
    p = writers()
    p.init_transactions()
    for batch in ([b"a", b"b"], [b"c"]):
        p.begin()
        for v in batch:
            p.send_raw(topic, v)
        p.commit()  # three records and two commit markers: offsets 0-4
    p.begin()
    p.send_raw(topic, b"open")
    p.flush()  # offset 5, in a transaction still open
    reader = AssignedConsumer(kafka_bootstrap, [topic], f"test-barrier-{uuid.uuid4().hex[:8]}", read_ahead=False)
    try:
        # A commit returns once the coordinator has decided it; the partition's marker follows, so the last
        # stable offset moves a moment later: wait for it (bounded), then it stays at the open transaction.
        until(lambda: reader.end_offsets_now() == {f"{topic}:0": 5}, "the second commit's marker", DEADLINE_S)
        ends = reader.end_offsets_now()
        assert ends == {f"{topic}:0": 5}  # the last stable offset: the open transaction's first
        assert not read_to(reader.positions(), ends)
        got: list[bytes] = []
        read_until(reader, ends, got)
        assert got == [b"a", b"b", b"c"]
        p.commit()
        until(lambda: reader.end_offsets_now() == {f"{topic}:0": 7}, "the third commit's marker", DEADLINE_S)
        later = reader.end_offsets_now()
        assert later == {f"{topic}:0": 7} and not read_to(reader.positions(), later)
        read_until(reader, later, got)
        assert got == [b"a", b"b", b"c", b"open"]
    finally:
        reader.close()


def read_until(reader: Any, ends: dict[str, int], got: list[bytes]) -> None:
    """Poll ``reader`` into ``got`` until its positions reach ``ends`` (bounded: ``DEADLINE_S``)."""
    from services.dispatcher.logic import read_to

    def reached() -> bool:
        got.extend(r.value for r in reader.poll(100))
        return read_to(reader.positions(), ends)

    until(reached, f"the reader to reach {ends}", DEADLINE_S)
