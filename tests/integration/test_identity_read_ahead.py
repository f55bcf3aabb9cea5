"""The identity read-ahead of :class:`apportion.bus.consumer.AssignedConsumer` on a real broker (issue 14).

Partitions are fetched independently, so a reader can get a submission before the key registration that was
published and acknowledged just before it (the CLI's first use of a development keyring does exactly that).
The test holds the budgets partition back the way a lagging fetch does (``pause``), appends a registration and
then a record on another topic, and checks that the poll that returns the latter also returns the former; the
same set-up without the read-ahead returns the record alone, so the check can fail.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from apportion.bus.consumer import AssignedConsumer
from apportion.bus.security import kafka_auth
from apportion.settings import topic_name
from apportion.topics import BUDGETS

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def _first_batch_with(consumer: AssignedConsumer, topic: str) -> list[Any]:
    """The first poll's records that hold one of ``topic``'s (fails at the deadline)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        batch = consumer.poll(200)
        if any(r.topic == topic for r in batch):
            return batch
    pytest.fail(f"no record of {topic} within {DEADLINE_S}s")


def _held_back_batch(
    kafka_bootstrap: str,
    other: str,
    *,
    read_ahead: bool,
    own: Callable[[Any], bool] | None = None,
    overlap: bool = False,
) -> tuple[list[Any], bytes, AssignedConsumer]:
    """Budgets held back, a registration then a record on ``other`` appended; the batch that returns the latter."""
    from kafka import KafkaProducer

    consumer = AssignedConsumer(
        kafka_bootstrap,
        [other, topic_name(BUDGETS)],
        f"test-{uuid.uuid4().hex[:12]}",
        tail={topic_name(BUDGETS): 0},
        read_ahead=read_ahead,
        overlap=overlap,
    )
    try:  # the caller closes the consumer it is handed; one that is not handed over is closed here
        consumer.own = own
        while not consumer.caught_up():  # positions known, nothing old to read
            consumer.poll(100, read_ahead=False)
        consumer._kc.pause(*[tp for tp in consumer.partitions if tp.topic == topic_name(BUDGETS)])
        marker = f"registration-{uuid.uuid4().hex}".encode()
        with KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", **kafka_auth()) as producer:
            producer.send(topic_name(BUDGETS), marker, key=b"read-ahead-test").get(timeout=DEADLINE_S)  # acked first
            producer.send(other, b"submission", key=b"read-ahead-test").get(timeout=DEADLINE_S)
        return _first_batch_with(consumer, other), marker, consumer
    except BaseException:
        consumer.close()
        raise


def test_a_poll_with_a_record_of_another_topic_holds_the_key_events_appended_before_it(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    batch, marker, consumer = _held_back_batch(kafka_bootstrap, kafka_topic_factory(), read_ahead=True)
    try:
        assert [r.value for r in batch if r.topic == topic_name(BUDGETS)] == [marker]
        assert consumer.identity_read_aheads == 1
        assert consumer.poll(200) == []  # nothing read twice, and the paused partitions were resumed
    finally:
        consumer.close()


def test_without_the_read_ahead_the_same_poll_misses_the_registration(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    batch, _, consumer = _held_back_batch(kafka_bootstrap, kafka_topic_factory(), read_ahead=False)
    try:
        assert [r.topic for r in batch if r.topic == topic_name(BUDGETS)] == []
        assert consumer.identity_read_aheads == 0
    finally:
        consumer.close()


def test_a_poll_of_only_the_readers_own_records_reads_no_keys_ahead(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    # the dispatcher's echoes: dropped unjudged, so no round trip for the end offsets of the key registrations
    batch, _, consumer = _held_back_batch(
        kafka_bootstrap, kafka_topic_factory(), read_ahead=True, own=lambda r: r.value == b"submission"
    )
    try:
        assert [r.value for r in batch] == [b"submission"]
        assert consumer.identity_read_aheads == 0
    finally:
        consumer.close()


def test_overlapped_the_poll_returns_at_once_and_the_settle_reads_the_registration_for_the_next_poll(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    # the dispatcher's way: judged meanwhile, the registration found before the commit and folded next
    batch, marker, consumer = _held_back_batch(kafka_bootstrap, kafka_topic_factory(), read_ahead=True, overlap=True)
    try:
        assert [r.value for r in batch] == [b"submission"]
        assert [r.value for r in consumer.settle() or []] == [marker]
        assert consumer.settle() == []  # nothing asked since
        assert [r.value for r in consumer.poll(200)] == [marker]  # at the head of the next poll, once
        assert consumer.poll(200) == []
    finally:
        consumer.close()
