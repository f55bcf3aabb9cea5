"""FAULT (the broker stops answering while records are in flight): a producer closed with a short timeout gives
the undelivered records up, stops its sender thread and closes its connections, and says so once.

On a broker of this module's own (a one-node native stack) that the test freezes with SIGSTOP after a first
record was acknowledged: the next record cannot be delivered. kafka-python's ``close`` raised from its flush and
left the sender thread (``<client_id>-network-thread``) running; the client's ``__del__`` then raised the same
timeout again during garbage collection (an unraisable exception). :meth:`EventProducer.close` force-closes the
client after its timeout, the transactional producer whose abort got no answer included (a dispatcher's term
that ends while its transaction is open). Nothing here sleeps: each wait is the bound of the call under test.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration

CLOSE_S = 0.5  # the close's timeout: far below kafka-python's delivery timeout (120 s)


@pytest.fixture(scope="module")
def lone_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str]]]:
    """A one-node native stack of this module's own (the test freezes its broker), with its client environment;
    the session's broker keeps the process environment."""
    from apportion.bus.stack import LocalStack

    saved = dict(os.environ)
    stack = LocalStack(tmp_path_factory.mktemp("lone"), provision_topics=False)
    try:
        stack.start()
        env = stack.client_env()
    except Exception as exc:  # noqa: BLE001 - turn into a readable failure
        pytest.fail(f"cannot start a native broker from infra/: {exc}", pytrace=False)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        yield stack, env
    finally:
        stack.stop()


@pytest.fixture
def frozen(lone_broker: tuple[Any, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Yields ``(bootstrap, topic, freeze)``: ``freeze()`` stops the broker (SIGSTOP); it runs again after the
    test."""
    from kafka.admin import NewTopic

    from apportion.bus.provision import admin_client

    stack, env = lone_broker
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    topic = f"close.{uuid.uuid4().hex[:10]}"
    admin = admin_client(stack.bootstrap)
    try:
        admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        admin.close()
    pid = stack.node_pid(1)
    assert pid is not None
    stopped: list[int] = []

    def freeze() -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        yield stack.bootstrap, topic, freeze
    finally:
        for p in stopped:
            os.kill(p, signal.SIGCONT)


def producer_threads(client_id: str) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith((client_id, f"kafka-io-{client_id}")))


def collected_unraisable(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What garbage collection raised and could not propagate (a client's ``__del__``), from now on."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    return seen


def test_a_producer_whose_records_cannot_be_delivered_closes_within_its_timeout_and_leaves_nothing_running(
    frozen: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafka.errors import KafkaTimeoutError

    from apportion.bus.producer import EventProducer

    bootstrap, topic, freeze = frozen
    producer = EventProducer(bootstrap, client_id="close-plain")
    producer.send_raw(topic, b"first", b"k").get(timeout=30)
    assert producer_threads("close-plain") == ["close-plain-network-thread"]
    freeze()
    lost = producer.send_raw(topic, b"second", b"k")
    with pytest.raises(KafkaTimeoutError, match=r"not acknowledged within 0\.5 s were given up"):
        producer.close(timeout_s=CLOSE_S)
    assert lost.failed()
    assert producer_threads("close-plain") == []
    producer.close(timeout_s=CLOSE_S)  # closing again: nothing left to say
    unraisable = collected_unraisable(monkeypatch)
    del producer
    gc.collect()
    assert unraisable == []


def test_a_transactional_producer_whose_abort_gets_no_answer_closes_and_leaves_nothing_running(
    frozen: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dispatcher's term that ends with its transaction open while the broker is gone: the abort times out
    (``TimeoutError``), then the close stops the sender, whether the record was still in flight then (the close
    gives it up and says so) or the abort had already failed it."""
    from kafka.errors import KafkaTimeoutError

    from apportion.bus.producer import EventProducer

    bootstrap, topic, freeze = frozen
    producer = EventProducer(bootstrap, client_id="close-txn", transactional_id=f"close-{uuid.uuid4().hex[:8]}")
    producer.init_transactions()
    producer.begin()
    producer.send_raw(topic, b"first", b"k").get(timeout=30)
    freeze()
    lost = producer.send_raw(topic, b"second", b"k")
    with pytest.raises(TimeoutError, match="not aborted within"):
        producer.abort(timeout_s=CLOSE_S)
    try:
        producer.close(timeout_s=CLOSE_S)
    except KafkaTimeoutError as exc:  # the record was in flight when the abort was asked: the close gave it up
        assert "were given up" in str(exc)
    # else the abort failed the record before it was sent (an abort's records are given up by definition)
    assert lost.failed()
    assert producer_threads("close-txn") == []
    unraisable = collected_unraisable(monkeypatch)
    del producer
    gc.collect()
    assert unraisable == []
