"""The dispatcher's stop closes every Kafka client it opened (its reader, the reader's end-offsets asker, its
producer, the standby's log reads), whether it stops on ``stop`` or its task is cancelled (a caller's timeout),
so no client's network thread runs on in the process after it.

Fresh ``APPORTION_TOPIC_PREFIX`` per test; every wait bounded.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

pytestmark = pytest.mark.integration

DEADLINE_S = 60.0


async def _lead_then_end(
    kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, cancel: bool
) -> list[str]:
    """Run the dispatcher until it leads, end it (``stop``, or a cancel of its task), and return the network
    threads of the Kafka clients made meanwhile that still run."""
    from apportion import events
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.clock import ScaledClock
    from services.dispatcher.app import run as run_dispatcher
    from services.dispatcher.config import DispatcherSettings
    from tests.kit.kafka_clients import closing_kafka_clients, left_running

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"ds{uuid.uuid4().hex[:6]}.")
    await asyncio.to_thread(provision, kafka_bootstrap)
    now = datetime.now(UTC)
    clock = ScaledClock(30.0, now, now)
    with EventProducer(kafka_bootstrap, client_id="stop-test") as producer:
        producer.publish(events.BudgetSet(path="lab", share=1.0, ts=clock.now(), producer="test"))
    settings = DispatcherSettings(
        kafka_bootstrap=kafka_bootstrap, redis_url=redis_url, log_json=False, instance_id=f"d-{uuid.uuid4().hex[:6]}"
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    with closing_kafka_clients() as made:
        task = asyncio.create_task(run_dispatcher(settings, stop, clock=clock, ready=ready))
        try:
            await asyncio.wait_for(ready.wait(), DEADLINE_S)
        finally:
            if cancel:
                task.cancel()
            else:
                stop.set()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), DEADLINE_S)
        left = left_running(made)
        assert made, "the dispatcher made Kafka clients"
    return left


async def test_a_stopped_dispatcher_leaves_no_kafka_client_running(kafka_bootstrap, redis_url, monkeypatch):
    assert await _lead_then_end(kafka_bootstrap, redis_url, monkeypatch, cancel=False) == []


async def test_a_cancelled_dispatcher_leaves_no_kafka_client_running(kafka_bootstrap, redis_url, monkeypatch):
    """A cancel arrives while the leader's reader polls in a worker thread: the reader is closed once that poll
    returns, not left to its thread ('Concurrent access to net.poll!' refused the close)."""
    assert await _lead_then_end(kafka_bootstrap, redis_url, monkeypatch, cancel=True) == []


def test_a_reader_whose_end_offsets_asker_cannot_start_leaves_no_client_running(kafka_bootstrap, monkeypatch):
    """FAULT (a broker outage as a term starts): the leader's reader is made, then its end-offsets asker's first ask
    gets no answer. The constructor raises, and neither client is left running: before, the reader
    (``dispatcher-reader``) and the asker (``dispatcher-ends``) ran on with nothing to close them."""
    from kafka.errors import KafkaTimeoutError

    from apportion.bus.consumer import AssignedConsumer, EndsAsker
    from apportion.bus.provision import provision
    from apportion.settings import topic_name
    from apportion.topics import BUDGETS, JOBS
    from tests.kit.kafka_clients import closing_kafka_clients, left_running

    def no_answer(self: EndsAsker) -> dict:
        raise KafkaTimeoutError("end offsets: no answer")

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"ds{uuid.uuid4().hex[:6]}.")
    provision(kafka_bootstrap)
    monkeypatch.setattr(EndsAsker, "_ends", no_answer)
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError):
            AssignedConsumer(kafka_bootstrap, [topic_name(JOBS), topic_name(BUDGETS)], "dispatcher", overlap=True)
        assert len(made) == 2
        left = left_running(made)
    assert left == []


def test_a_reader_whose_own_end_offsets_get_no_answer_at_start_leaves_no_client_running(kafka_bootstrap, monkeypatch):
    """FAULT (a partition's leader lost as a term starts): the leader's reader and its asker are made and the
    asker's first ask is answered, then the reader's own ``end_offsets`` gets no answer. The constructor raises,
    and neither client is left running: before, both (``dispatcher-reader``, ``dispatcher-ends``) ran on."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError

    from apportion.bus.consumer import AssignedConsumer
    from apportion.bus.provision import provision
    from apportion.settings import topic_name
    from apportion.topics import BUDGETS, JOBS
    from tests.kit.kafka_clients import closing_kafka_clients, left_running

    answered = KafkaConsumer.end_offsets
    asked: list[str] = []

    def reader_gets_no_answer(self: KafkaConsumer, partitions: Any, timeout_ms: Any = None) -> Any:
        asked.append(self.config["client_id"])
        if self.config["client_id"] == "dispatcher-reader":
            raise KafkaTimeoutError("end offsets: no answer")
        return answered(self, partitions, timeout_ms)

    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"ds{uuid.uuid4().hex[:6]}.")
    provision(kafka_bootstrap)
    monkeypatch.setattr(KafkaConsumer, "end_offsets", reader_gets_no_answer)
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError, match="no answer"):
            AssignedConsumer(kafka_bootstrap, [topic_name(JOBS), topic_name(BUDGETS)], "dispatcher", overlap=True)
        assert asked == ["dispatcher-ends", "dispatcher-reader"]  # the asker answered first, then the fault
        assert len(made) == 2
        left = left_running(made)
    assert left == []
