"""The kit's ``closing_kafka_clients`` stops the network thread that a kafka-python consumer which failed to
bootstrap leaves running (nothing listens on port 1 of the loopback), and the autouse ``kafka_clients_closed``
names a test that leaves one running and stops it."""

from __future__ import annotations

import threading

import pytest

from tests.kit.kafka_clients import closing_kafka_clients, left_running


def kafka_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kafka-io")}


def test_a_consumer_that_cannot_bootstrap_leaves_its_thread_until_the_block_closes_its_client() -> None:
    from kafka import KafkaConsumer
    from kafka.errors import KafkaTimeoutError
    from kafka.net.compat import KafkaNetClient

    before = kafka_threads()
    maker = KafkaConsumer.DEFAULT_CONFIG["kafka_client"]  # the autouse kafka_clients_closed's recorder
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError):
            KafkaConsumer(bootstrap_servers="127.0.0.1:1", bootstrap_timeout_ms=200, client_id="unreachable")
        assert len(made) == 1
        assert len(kafka_threads() - before) == 1  # the fault: the constructor raised, its thread runs on
        assert left_running(made) == ["kafka-io-unreachable"]
    assert kafka_threads() - before == set()
    assert left_running(made) == []
    assert KafkaConsumer.DEFAULT_CONFIG["kafka_client"] is maker  # the recorder is gone, the outer one back
    assert KafkaNetClient is not maker


LEAKY_FILE = """
from kafka import KafkaConsumer
from kafka.errors import KafkaTimeoutError

def test_a_leak():
    try:
        KafkaConsumer(bootstrap_servers="127.0.0.1:1", bootstrap_timeout_ms=200, client_id="leaked")
    except KafkaTimeoutError:
        pass  # the fault: no client to close, its network thread runs on
"""


def test_a_test_that_leaves_a_client_running_is_named_and_its_thread_stopped(pytester: pytest.Pytester) -> None:
    before = kafka_threads()
    pytester.makeconftest("from tests.conftest import kafka_clients_closed  # noqa: F401\n")
    pytester.makepyfile(test_leaky=LEAKY_FILE)
    result = pytester.runpytest_inprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-p", "no:asyncio", "-q")
    result.assert_outcomes(passed=1)  # other warnings (the inner run's unknown ini options) are not counted
    result.stdout.fnmatch_lines(
        ["*KafkaClientLeftRunning: *test_leaky.py::test_a_leak left kafka-python clients running (kafka-io-leaked);*"]
    )
    assert str(result.stdout).count("KafkaClientLeftRunning:") == 1
    assert kafka_threads() - before == set()
