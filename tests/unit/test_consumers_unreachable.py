"""FAULT (the broker is gone as a reader starts): every kafka-python consumer the services make raises when no
broker answers its bootstrap (nothing listens on port 1 of the loopback), and leaves no network thread running.

kafka-python 3 starts a consumer's network thread before it bootstraps and raises with it running; a service that
retries through an outage (the dispatcher's standby reading its fencing floor every few seconds, a new term's
reader) left one ``kafka-io-<client_id>`` thread per try. :func:`apportion.bus.clients.kafka_consumer` closes it.
The bootstrap wait is cut to 0.2 s for each client (kafka-python's default is 30 s); nothing else is changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.kit.kafka_clients import closing_kafka_clients, left_running

GONE = "127.0.0.1:1"


def kafka_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kafka-io")}


def _assigned_reader() -> Any:
    from apportion.bus.consumer import AssignedConsumer

    return AssignedConsumer(GONE, ["apportion.jobs"], "dispatcher", overlap=True)


def _ends_asker() -> Any:
    from kafka import TopicPartition

    from apportion.bus.consumer import EndsAsker

    return EndsAsker(GONE, [TopicPartition("apportion.budgets", 0)], "dispatcher-ends")


def _group_consumer() -> Any:
    from apportion.bus.consumer import EventConsumer

    return EventConsumer(GONE, ["apportion.commands"], "node-agent", lambda ev, d: None, client_id="node-agent")


def _standby_floor() -> Any:
    from services.dispatcher.lease import highest_token_in_log

    return highest_token_in_log(GONE, ["apportion.jobs"])


def _admin() -> Any:
    from apportion.bus.clients import kafka_admin

    return kafka_admin(bootstrap_servers=GONE, bootstrap_timeout_ms=200, client_id="policy-check")


STARTS: dict[str, Callable[[], Any]] = {
    "the dispatcher's reader (AssignedConsumer with its asker)": _assigned_reader,
    "the key end-offsets asker (EndsAsker)": _ends_asker,
    "a group consumer (EventConsumer)": _group_consumer,
    "the standby's fencing floor (highest_token_in_log)": _standby_floor,
    "an admin client (kafka_admin)": _admin,
}


@pytest.mark.parametrize("start", list(STARTS.values()), ids=list(STARTS))
def test_a_consumer_that_cannot_bootstrap_raises_and_leaves_no_thread(
    start: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError

    monkeypatch.setitem(KafkaConsumer.DEFAULT_CONFIG, "bootstrap_timeout_ms", 200)  # kafka_admin's is given
    before = kafka_threads()
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
            start()
        assert len(made) == 1  # the one client it made, closed by the code under test
        assert left_running(made) == []
        assert kafka_threads() - before == set()


def test_kafka_consumer_uses_the_network_client_maker_given() -> None:
    """``kafka_client`` given is the maker used (and recorded): kafka-python's own setting is kept."""
    from kafka.errors import KafkaTimeoutError
    from kafka.net.compat import KafkaNetClient

    from apportion.bus.clients import kafka_consumer

    asked: list[dict[str, Any]] = []

    def maker(**config: Any) -> Any:
        asked.append(config)
        return KafkaNetClient(**config)

    with pytest.raises(KafkaTimeoutError):
        kafka_consumer(bootstrap_servers=GONE, bootstrap_timeout_ms=200, client_id="given", kafka_client=maker)
    assert [c["client_id"] for c in asked] == ["given"]
    assert "kafka-io-given" not in kafka_threads()
