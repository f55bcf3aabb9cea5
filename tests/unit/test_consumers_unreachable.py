"""FAULT (the broker is gone as a reader starts): every kafka-python client the services, the client and the CLI make
raises when no broker answers its bootstrap (nothing listens on port 1 of the loopback; or, over TLS, a socket of the
test accepts connections and never answers), and leaves no network thread running.

kafka-python 3 starts a consumer's network thread before it bootstraps and raises with it running; a service that
retries through an outage (the dispatcher's standby reading its fencing floor every few seconds, a new term's
reader) left one ``kafka-io-<client_id>`` thread per try. :func:`apportion.bus.clients.kafka_consumer` closes it.
The bootstrap wait is cut to 0.2 s for each client (kafka-python's default is 30 s); nothing else is changed.

kafka-python 3.0.12 bounds only the TCP connect of a bootstrap try: its TLS handshake with a server that never
answers waited without bound (a standby's fencing-floor read did not return within 60 s). The recorder of
:mod:`apportion.bus.clients` fails the connections still being set up from the bootstrap's deadline on.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.kafka_clients import closing_kafka_clients, left_running

GONE = "127.0.0.1:1"
#: Wall seconds a start may take against the silent server before the test calls it hung (its bound is 0.2 s).
HUNG_S = 30.0


def kafka_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("kafka-io")}


def _assigned_reader(at: str) -> Any:
    from apportion.bus.consumer import AssignedConsumer

    return AssignedConsumer(at, ["apportion.jobs"], "dispatcher", overlap=True)


def _ends_asker(at: str) -> Any:
    from kafka import TopicPartition

    from apportion.bus.consumer import EndsAsker

    return EndsAsker(at, [TopicPartition("apportion.budgets", 0)], "dispatcher-ends")


def _group_consumer(at: str) -> Any:
    from apportion.bus.consumer import EventConsumer

    return EventConsumer(at, ["apportion.commands"], "node-agent", lambda ev, d: None, client_id="node-agent")


def _standby_floor(at: str) -> Any:
    from services.dispatcher.lease import highest_token_in_log

    return highest_token_in_log(at, ["apportion.jobs"])


def _admin(at: str) -> Any:
    from apportion.bus.clients import kafka_admin
    from apportion.bus.security import kafka_auth

    return kafka_admin(bootstrap_servers=at, bootstrap_timeout_ms=200, client_id="policy-check", **kafka_auth())


def _producer(at: str) -> Any:
    from apportion.bus.producer import EventProducer

    return EventProducer(at, client_id="dispatcher", transactional_id="dispatcher-t")


def _verdict_watcher(at: str) -> Any:
    from apportion.client import VerdictWatcher

    return VerdictWatcher("j-1", bootstrap=at)


def _cli_reader(at: str) -> Any:
    from apportion.cli.common import _consumer

    return _consumer(at)


def _cli_admin(at: str) -> Any:
    from apportion.cli.common import _admin

    return _admin(at)


STARTS: dict[str, Callable[[str], Any]] = {
    "the dispatcher's reader (AssignedConsumer with its asker)": _assigned_reader,
    "the key end-offsets asker (EndsAsker)": _ends_asker,
    "a group consumer (EventConsumer)": _group_consumer,
    "the standby's fencing floor (highest_token_in_log)": _standby_floor,
    "an admin client (kafka_admin)": _admin,
    "a producer (EventProducer)": _producer,
    "the client's verdict watcher (VerdictWatcher)": _verdict_watcher,
    "the CLI's reader of the log (cli.common._consumer)": _cli_reader,
    "the CLI's admin client (cli.common._admin)": _cli_admin,
}


@pytest.fixture
def short_bootstrap(monkeypatch: pytest.MonkeyPatch) -> None:
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    for kind in (KafkaConsumer, KafkaProducer, KafkaAdminClient):
        monkeypatch.setitem(kind.DEFAULT_CONFIG, "bootstrap_timeout_ms", 200)
    monkeypatch.setattr("apportion.client.READER_BOOTSTRAP_MS", 200)  # the client's and the CLI's readers


@pytest.fixture
def silent_tls_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``host:port`` of a socket that accepts connections (the kernel completes them) and never answers, with the
    clients set to sign in over TLS (a CA of the test; a user and password that are never sent)."""
    from apportion.bus.tls import ensure

    ensure(tmp_path / "tls")
    monkeypatch.setenv("APPORTION_TLS_CA", str(tmp_path / "tls" / "ca.pem"))
    monkeypatch.setenv("APPORTION_KAFKA_USER", "dispatcher")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD", "never-sent")
    monkeypatch.delenv("APPORTION_NO_TLS", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield f"127.0.0.1:{server.getsockname()[1]}"


def started_or_raised(start: Callable[[str], Any], at: str) -> BaseException | None:
    """What ``start(at)`` raised (``None``: it returned), run in a thread of its own so that a start that hangs
    fails the test after :data:`HUNG_S` instead of stopping the suite."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            start(at)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)
        else:
            out.append(None)

    t = threading.Thread(target=run, name="start-under-test", daemon=True)
    t.start()
    t.join(HUNG_S)
    assert out, f"the start did not return within {HUNG_S:g} s (its bootstrap timeout is 0.2 s)"
    return out[0]


@pytest.mark.parametrize("start", list(STARTS.values()), ids=list(STARTS))
def test_a_client_that_cannot_bootstrap_raises_and_leaves_no_thread(
    start: Callable[[str], Any], short_bootstrap: None
) -> None:
    from kafka.errors import KafkaTimeoutError

    before = kafka_threads()
    with closing_kafka_clients() as made:
        with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
            start(GONE)
        assert len(made) == 1  # the one client it made, closed by the code under test
        assert left_running(made) == []
        assert kafka_threads() - before == set()


@pytest.mark.parametrize("start", list(STARTS.values()), ids=list(STARTS))
def test_a_client_whose_tls_server_never_answers_raises_within_its_bootstrap_timeout_and_leaves_no_thread(
    start: Callable[[str], Any], short_bootstrap: None, silent_tls_server: str
) -> None:
    from kafka.errors import KafkaTimeoutError

    before = kafka_threads()
    with closing_kafka_clients() as made:
        raised = started_or_raised(start, silent_tls_server)
        assert isinstance(raised, KafkaTimeoutError) and "Unable to bootstrap" in str(raised), raised
        assert len(made) == 1
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
