"""The transactions of :class:`apportion.bus.producer.EventProducer` on a fake kafka-python producer: the bounded
commit and abort, and a batch's partitions added before its first record is queued.

The transaction manager and the sender are fakes with kafka-python's own result type, so the bound, the
errors and the sender's wake-up are checked without a broker (the real broker: tests/integration/test_transactions.py).
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

import pytest
from kafka.errors import IllegalStateError, ProducerFencedError
from kafka.future import Future
from kafka.producer.transaction_manager import TransactionalRequestResult
from kafka.structs import TopicPartition

from apportion import events
from apportion.bus.producer import EventProducer, is_fenced
from apportion.settings import topic_name
from apportion.topics import COMMANDS, NODES


class FakeManager:
    def __init__(self, result: TransactionalRequestResult, transactional: bool = True) -> None:
        self.result, self.transactional = result, transactional
        self.ended: list[str] = []
        self.calls: list[str] = []  # shared with the producer's sends, in order

    def maybe_add_partition_to_transaction(self, tp: TopicPartition) -> None:
        self.calls.append(f"add {tp.topic}:{tp.partition}")

    def is_transactional(self) -> bool:
        return self.transactional

    def begin_commit(self) -> TransactionalRequestResult:
        self.ended.append("commit")
        return self.result

    def begin_abort(self) -> TransactionalRequestResult:
        self.ended.append("abort")
        return self.result


class FakeSender:
    def __init__(self) -> None:
        self.wakeups = 0

    def wakeup(self) -> None:
        self.wakeups += 1


class FakeKafkaProducer:
    """kafka-python's producer as far as the wrapper uses it; ``known`` topics have 3 partitions (by key length)."""

    def __init__(self, manager: FakeManager | None, known: tuple[str, ...] = ()) -> None:
        self._transaction_manager, self._sender, self.known = manager, FakeSender(), known
        self.calls: list[str] = manager.calls if manager is not None else []

    def _partition(
        self, topic: str, partition: int | None, key: bytes, value: bytes, kb: bytes, vb: bytes
    ) -> int | None:
        return len(key) % 3 if topic in self.known else None

    def send(self, topic: str, value: bytes, key: bytes) -> Future:
        self.calls.append(f"send {topic}")
        return Future()


def producer_with(manager: FakeManager | None, known: tuple[str, ...] = ()) -> tuple[EventProducer, FakeKafkaProducer]:
    p = object.__new__(EventProducer)
    kp = FakeKafkaProducer(manager, known)
    p._producer = kp
    return p, kp


def test_a_commit_the_sender_completes_returns_after_one_wakeup_and_starts_no_thread() -> None:
    result = TransactionalRequestResult()
    manager = FakeManager(result)
    p, kp = producer_with(manager)
    threads = threading.active_count()
    completer = threading.Timer(0.01, result.done)  # the sender thread ends the commit
    completer.start()
    p.commit(timeout_s=5)
    completer.join()
    assert manager.ended == ["commit"]
    assert kp._sender.wakeups == 1
    assert threading.active_count() == threads


def test_an_abort_asks_the_manager_to_abort() -> None:
    result = TransactionalRequestResult()
    result.done()
    manager = FakeManager(result)
    p, _ = producer_with(manager)
    p.abort(timeout_s=5)
    assert manager.ended == ["abort"]


def test_a_commit_that_does_not_end_within_the_bound_raises_timeout() -> None:
    p, _ = producer_with(FakeManager(TransactionalRequestResult()))
    with pytest.raises(TimeoutError, match="not committed within 0 s"):
        p.commit(timeout_s=0.05)


def test_a_fenced_commit_raises_the_fence() -> None:
    result = TransactionalRequestResult()
    result.done(ProducerFencedError())
    p, _ = producer_with(FakeManager(result))
    with pytest.raises(ProducerFencedError) as info:
        p.commit(timeout_s=5)
    assert is_fenced(info.value)


def test_a_producer_without_transactions_has_nothing_to_commit() -> None:
    p, kp = producer_with(None)
    with pytest.raises(IllegalStateError):
        p.commit(timeout_s=5)
    manager = FakeManager(TransactionalRequestResult(), transactional=False)
    p, kp = producer_with(manager)
    with pytest.raises(IllegalStateError):
        p.abort(timeout_s=5)
    assert manager.ended == [] and kp._sender.wakeups == 0


TS = datetime(2026, 1, 5, tzinfo=UTC)
# two records for two topics: a cordon (nodes, key "n1", partition 2) and a stop (commands, key "n22", partition 0)
CORDON = events.NodeCordoned(node_id="n1", ts=TS)
STOP = events.StopWorkload(job_id="j", attempt=1, node_id="n22", fencing_token=1, ts=TS)


def test_in_a_transaction_every_partition_of_a_batch_is_added_before_its_first_record_is_queued() -> None:
    nodes, commands = topic_name(NODES), topic_name(COMMANDS)
    assert events.key_of(CORDON) == "n1" and events.key_of(STOP) == "n22"
    manager = FakeManager(TransactionalRequestResult())
    p, kp = producer_with(manager, known=(nodes, commands))
    futures = p.send_many([(CORDON, b"c"), (STOP, None)])
    assert len(futures) == 2
    assert kp.calls == [f"add {nodes}:2", f"add {commands}:0", f"send {nodes}", f"send {commands}"]


def test_a_topic_the_producer_does_not_know_yet_is_left_to_send_and_one_record_adds_nothing_ahead() -> None:
    nodes, commands = topic_name(NODES), topic_name(COMMANDS)
    manager = FakeManager(TransactionalRequestResult())
    p, kp = producer_with(manager, known=(nodes,))
    p.send_many([(CORDON, b"c"), (STOP, None)])
    assert kp.calls == [f"add {nodes}:2", f"send {nodes}", f"send {commands}"]
    manager.calls.clear()
    p.send_many([(STOP, None)])
    assert kp.calls == [f"send {commands}"]


def test_without_a_transaction_a_batch_is_only_sent() -> None:
    nodes, commands = topic_name(NODES), topic_name(COMMANDS)
    p, kp = producer_with(FakeManager(TransactionalRequestResult(), transactional=False), known=(nodes, commands))
    p.send_many([(CORDON, b"c"), (STOP, None)])
    assert kp.calls == [f"send {nodes}", f"send {commands}"]
