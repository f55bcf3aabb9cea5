"""The bounded commit and abort of :class:`apportion.bus.producer.EventProducer` on a fake kafka-python producer.

The transaction manager and the sender are fakes with kafka-python's own result type, so the bound, the
errors and the sender's wake-up are checked without a broker (the real broker: tests/integration/test_transactions.py).
"""

from __future__ import annotations

import threading

import pytest
from kafka.errors import IllegalStateError, ProducerFencedError
from kafka.producer.transaction_manager import TransactionalRequestResult

from apportion.bus.producer import EventProducer, is_fenced


class FakeManager:
    def __init__(self, result: TransactionalRequestResult, transactional: bool = True) -> None:
        self.result, self.transactional = result, transactional
        self.ended: list[str] = []

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
    def __init__(self, manager: FakeManager | None) -> None:
        self._transaction_manager, self._sender = manager, FakeSender()


def producer_with(manager: FakeManager | None) -> tuple[EventProducer, FakeKafkaProducer]:
    p = object.__new__(EventProducer)
    kp = FakeKafkaProducer(manager)
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
