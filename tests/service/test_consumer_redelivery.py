"""The consumer's bound on redelivery of one record (rule D4.dead-letters), no broker needed.

An :class:`~apportion.bus.consumer.EventConsumer` is driven over a fake kafka-python consumer: per-partition
logs, positions that ``poll`` moves to the end and ``seek`` moves back, commits recorded. Each test calls
``poll_once`` the way the shared loop does (a poll that raises is polled again), so every try is one poll.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, cast

import pytest
from kafka.errors import KafkaConnectionError
from kafka.structs import TopicPartition

from apportion import events, topics
from apportion.bus.consumer import HANDLER_TRIES, Delivery, EventConsumer, handler_failure
from apportion.bus.producer import EventProducer
from apportion.bus.resilience import is_outage
from apportion.settings import topic_name
from tests.kit.builders import submitted

K = HANDLER_TRIES


@dataclass(frozen=True)
class Record:
    """The fields of a kafka-python ``ConsumerRecord`` the consumer reads."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    timestamp: int = 0


class FakeKafka:
    """A kafka-python consumer stand-in over fixed partition logs."""

    def __init__(self, logs: dict[TopicPartition, list[Record]], rotate: bool = False) -> None:
        self.logs = logs
        self.rotate = rotate
        self.polls = 0
        self.positions = dict.fromkeys(logs, 0)
        self.commits: list[dict[tuple[str, int], int]] = []

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {tp.partition for tp in self.logs if tp.topic == topic}

    def poll(self, timeout_ms: int = 0, max_records: int | None = None) -> dict[TopicPartition, list[Record]]:
        out = {}
        order = list(self.logs)
        if self.rotate:  # a poll need not hand the partitions in the same order each time
            order = order[self.polls % len(order) :] + order[: self.polls % len(order)]
        self.polls += 1
        for tp in order:
            log = self.logs[tp]
            if self.positions[tp] < len(log):
                out[tp] = log[self.positions[tp] :]
                self.positions[tp] = len(log)
        return out

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.positions[tp] = offset

    def commit(self, offsets: dict[TopicPartition, Any]) -> None:
        self.commits.append({(tp.topic, tp.partition): om.offset for tp, om in offsets.items()})

    def assignment(self) -> set[TopicPartition]:
        return set(self.logs)

    def close(self) -> None:
        pass


class Letters:
    """A dead-letter producer stand-in: keeps what is published."""

    def __init__(self) -> None:
        self.sent: list[events.DeadLetter] = []

    def publish(self, ev: events.DeadLetter) -> None:
        self.sent.append(ev)


TOPIC = topic_name(topics.SUBMISSIONS)


def partition_log(partition: int, *job_ids: str) -> tuple[TopicPartition, list[Record]]:
    tp = TopicPartition(TOPIC, partition)
    return tp, [
        Record(TOPIC, partition, off, job_id.encode(), events.encode(submitted(job_id)))
        for off, job_id in enumerate(job_ids)
    ]


class Script:
    """A handler that raises ``errors[job_id]`` (popped from the front; an ``Exception`` class repeats
    forever) and records every call as ``(job_id, outcome)``."""

    def __init__(self, errors: dict[str, list[BaseException] | type[Exception]]) -> None:
        self.errors = errors
        self.calls: list[tuple[str, str]] = []

    def __call__(self, event: events.Event, delivery: Delivery) -> None:
        assert isinstance(event, events.JobSubmitted)
        plan = self.errors.get(event.job_id)
        exc: BaseException | None = None
        if isinstance(plan, type):
            exc = plan("embedded null byte\nsecond line")
        elif plan:
            exc = plan.pop(0)
        self.calls.append((event.job_id, type(exc).__name__ if exc else "handled"))
        if exc is not None:
            raise exc


def consumer(kc: FakeKafka, handler: Script, letters: Letters) -> EventConsumer:
    producer = cast(EventProducer, letters)  # the consumer only calls ``publish``
    return EventConsumer("fake:9092", [TOPIC], "g", handler, dead_letters=producer, name="agent", client=kc)


def poll(c: EventConsumer, times: int) -> list[str]:
    """``poll_once`` ``times`` times as the shared loop does; the class name of each failure, ``"ok"`` else."""
    out = []
    for _ in range(times):
        try:
            c.poll_once(timeout_ms=0)
            out.append("ok")
        except Exception as exc:  # noqa: BLE001 - the loop logs any failure and polls again
            out.append(type(exc).__name__)
    return out


def test_a_record_the_handler_always_raises_on_is_dead_lettered_after_k_tries_and_the_next_is_handled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kc = FakeKafka(dict([partition_log(0, "poison", "next")]))
    handler, letters = Script({"poison": ValueError}), Letters()
    c = consumer(kc, handler, letters)
    with caplog.at_level(logging.ERROR, logger="apportion.bus.consumer"):
        assert poll(c, K + 1) == ["ValueError"] * (K - 1) + ["ok", "ok"]
    assert K == 5
    assert handler.calls == [("poison", "ValueError")] * 5 + [("next", "handled")]
    [letter] = letters.sent
    assert letter.error == "handler failed 5 times: ValueError: embedded null byte"
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == (TOPIC, 0, 0)
    assert letter.original_bytes() == kc.logs[TopicPartition(TOPIC, 0)][0].value
    assert letter.event_id == events.dead_letter_id(TOPIC, 0, 0)
    assert (c.stats.handled, c.stats.dead_lettered, c.stats.handler_gave_up) == (1, 1, 1)
    # nothing committed while the record was retried; then past the letter and past the next record
    assert kc.commits == [{(TOPIC, 0): 2}]
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", f"dead-lettering {TOPIC}[0]@0: handler failed 5 times: ValueError: embedded null byte")
    ]


def test_a_handler_that_raises_k_minus_1_times_then_succeeds_handles_the_record_once_and_letters_nothing() -> None:
    kc = FakeKafka(dict([partition_log(0, "flaky", "next")]))
    handler, letters = Script({"flaky": [RuntimeError("busy") for _ in range(K - 1)]}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, K) == ["RuntimeError"] * 4 + ["ok"]
    assert handler.calls == [("flaky", "RuntimeError")] * 4 + [("flaky", "handled"), ("next", "handled")]
    assert letters.sent == []
    assert (c.stats.handled, c.stats.dead_lettered, c.stats.handler_gave_up) == (2, 0, 0)
    assert kc.commits == [{(TOPIC, 0): 2}]


@pytest.mark.parametrize(
    "outage",
    [
        KafkaConnectionError("111 ECONNREFUSED"),
        ConnectionError("refused"),
        TimeoutError("timed out"),
        RuntimeError("publish failed"),  # raised from a KafkaConnectionError below
    ],
    ids=["kafka-python error", "ConnectionError", "TimeoutError", "caused by a kafka-python error"],
)
def test_a_handler_failing_for_an_outage_k_plus_3_times_is_never_dead_lettered(outage: Exception) -> None:
    if isinstance(outage, RuntimeError):
        outage.__cause__ = KafkaConnectionError("111 ECONNREFUSED")
    kc = FakeKafka(dict([partition_log(0, "waits")]))
    handler, letters = Script({"waits": [outage] * (K + 3)}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, K + 4) == [type(outage).__name__] * 8 + ["ok"]
    assert handler.calls == [("waits", type(outage).__name__)] * 8 + [("waits", "handled")]
    assert letters.sent == []
    assert (c.stats.handled, c.stats.dead_lettered) == (1, 0)


def test_outages_between_failures_neither_count_nor_reset_the_tries() -> None:
    kc = FakeKafka(dict([partition_log(0, "poison")]))
    outage = ConnectionError("refused")
    plan: list[BaseException] = [*[ValueError("bad")] * 2, *[outage] * 10, *[ValueError("bad")] * 3]
    handler, letters = Script({"poison": plan}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, 15) == ["ValueError"] * 2 + ["ConnectionError"] * 10 + ["ValueError"] * 2 + ["ok"]
    assert [ev.error for ev in letters.sent] == ["handler failed 5 times: ValueError: bad"]


def test_a_handler_cancelled_by_a_stop_neither_counts_nor_resets_the_tries() -> None:
    kc = FakeKafka(dict([partition_log(0, "poison")]))
    plan: list[BaseException] = [*[ValueError("bad")] * 4, CancelledError(), ValueError("bad")]
    handler, letters = Script({"poison": plan}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, 6) == ["ValueError"] * 4 + ["CancelledError", "ok"]
    assert [ev.error for ev in letters.sent] == ["handler failed 5 times: ValueError: bad"]


def test_the_count_starts_again_when_another_record_of_the_partition_fails() -> None:
    # a fails 4 times, then passes; b then needs 5 failures of its own
    kc = FakeKafka(dict([partition_log(0, "a", "b")]))
    handler = Script({"a": [ValueError("a")] * 4, "b": ValueError})
    letters = Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, 9) == ["ValueError"] * 4 + ["ValueError"] * 4 + ["ok"]
    assert handler.calls == [("a", "ValueError")] * 4 + [("a", "handled")] + [("b", "ValueError")] * 5
    assert [(ev.source_offset, ev.error) for ev in letters.sent] == [
        (1, "handler failed 5 times: ValueError: embedded null byte")
    ]


def test_the_count_starts_again_when_the_position_moves_to_another_failing_record() -> None:
    # a fails 4 times; the partition is moved past it (a rebalance, a reset); b's first failure is its first
    kc = FakeKafka(dict([partition_log(0, "a", "b")]))
    handler, letters = Script({"a": ValueError, "b": ValueError}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, 4) == ["ValueError"] * 4
    kc.seek(TopicPartition(TOPIC, 0), 1)
    assert poll(c, 5) == ["ValueError"] * 4 + ["ok"]
    assert handler.calls == [("a", "ValueError")] * 4 + [("b", "ValueError")] * 5
    assert [ev.source_offset for ev in letters.sent] == [1]


def test_each_partition_counts_its_own_record_so_interleaved_failures_both_reach_the_bound() -> None:
    # partitions 0 and 1 each hold a record the handler always raises on; the polls hand partition 0 first,
    # then 1 first, and so on, so the failures alternate between the two records
    logs = dict([partition_log(0, "p0-poison", "p0-next"), partition_log(1, "p1-poison", "p1-next")])
    kc = FakeKafka(logs, rotate=True)
    handler, letters = Script({"p0-poison": ValueError, "p1-poison": TypeError}), Letters()
    c = consumer(kc, handler, letters)
    assert poll(c, 9) == ["ValueError", "TypeError"] * 4 + ["ok"]
    assert handler.calls == [("p0-poison", "ValueError"), ("p1-poison", "TypeError")] * 4 + [
        ("p0-poison", "ValueError"),
        ("p0-next", "handled"),
        ("p1-poison", "TypeError"),
        ("p1-next", "handled"),
    ]
    assert [(ev.source_partition, ev.error) for ev in letters.sent] == [
        (0, "handler failed 5 times: ValueError: embedded null byte"),
        (1, "handler failed 5 times: TypeError: embedded null byte"),
    ]
    assert (c.stats.handled, c.stats.handler_gave_up) == (2, 2)


def test_a_dead_letter_that_cannot_be_sent_rewinds_and_the_next_failure_sends_the_same_letter() -> None:
    class DownOnce(Letters):
        def publish(self, ev: events.DeadLetter) -> None:
            if not self.sent and not getattr(self, "failed", False):
                self.failed = True
                raise KafkaConnectionError("broker away")
            super().publish(ev)

    kc = FakeKafka(dict([partition_log(0, "poison", "next")]))
    handler, letters = Script({"poison": ValueError}), DownOnce()
    c = consumer(kc, handler, letters)
    assert poll(c, K + 1) == ["ValueError"] * 4 + ["KafkaConnectionError", "ok"]
    assert [ev.error for ev in letters.sent] == ["handler failed 5 times: ValueError: embedded null byte"]
    assert handler.calls == [("poison", "ValueError")] * 6 + [("next", "handled")]
    assert kc.commits == [{(TOPIC, 0): 2}]


def test_handler_failure_is_one_line_and_is_outage_follows_the_cause_chain() -> None:
    assert handler_failure(5, ValueError("embedded null byte\nmore")) == (
        "handler failed 5 times: ValueError: embedded null byte"
    )
    assert handler_failure(5, OSError()) == "handler failed 5 times: OSError"
    try:
        try:
            raise TimeoutError("slow")
        except TimeoutError:
            raise ValueError("wrapped") from None
    except ValueError as exc:
        assert not is_outage(exc)  # ``from None``: the cause is hidden, the context kept
    try:
        try:
            raise KafkaConnectionError("away")
        except KafkaConnectionError as inner:
            raise RuntimeError("send failed") from inner
    except RuntimeError as exc:
        assert is_outage(exc)
    assert not is_outage(ValueError("embedded null byte"))
    assert not is_outage(FileNotFoundError("no such file"))
    # the machine's storage away or full: the agent cannot journal a start, not the record's fault
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
        assert is_outage(OSError(code, os.strerror(code)))
    assert not is_outage(OSError(errno.EACCES, "permission denied"))
