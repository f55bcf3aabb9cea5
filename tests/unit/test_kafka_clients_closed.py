"""The kit's ``closing_kafka_clients`` stops the network thread that a kafka-python consumer which failed to
bootstrap leaves running (nothing listens on port 1 of the loopback)."""

from __future__ import annotations

import threading

import pytest

from tests.kit.kafka_clients import closing_kafka_clients


def kafka_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kafka-io")}


def test_a_consumer_that_cannot_bootstrap_leaves_its_thread_until_the_block_closes_its_client() -> None:
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError
    from kafka.net.compat import KafkaNetClient

    before = kafka_threads()
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError):
            KafkaConsumer(bootstrap_servers="127.0.0.1:1", bootstrap_timeout_ms=200)
        assert len(made) == 1
        assert len(kafka_threads() - before) == 1  # the fault: the constructor raised, its thread runs on
    assert kafka_threads() - before == set()
    assert KafkaConsumer.DEFAULT_CONFIG["kafka_client"] is KafkaNetClient  # the recorder is gone
