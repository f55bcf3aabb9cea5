"""kafka-python clients that leave nothing running when they cannot start, and start within their bootstrap timeout.

kafka-python 3 starts a client's network thread (``kafka-io-<client_id>``) in the constructor, before it
bootstraps; when no broker of ``bootstrap_servers`` answers in time, the constructor raises with that thread
still running and no client to close (a broker outage as a service starts or retries). :func:`kafka_consumer`,
:func:`kafka_admin` and :func:`kafka_producer` make the network client through a recorder, as kafka-python's
``kafka_client`` setting allows, and close it when the constructor raises: each try of a service that retries
through an outage leaves no thread behind.

kafka-python 3.0.12 checks the bootstrap's deadline (``bootstrap_timeout_ms``) only between tries, and bounds
only the TCP connect of a try: the TLS handshake and the SASL exchange that follow wait without bound, so a
constructor facing a server that accepts connections and never answers (a hung broker, a wrong port) did not
return. The recorder also fails, from the bootstrap's deadline on, every connection of the client still being
set up while the client has not bootstrapped: the constructor then raises its own ``KafkaTimeoutError``.

Nothing connects at import time.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["kafka_admin", "kafka_consumer", "kafka_producer"]

#: Wall seconds between two checks, from the bootstrap's deadline on, for connections still being set up.
BOOTSTRAP_CHECK_S = 0.1


def kafka_consumer(*topics: str, **config: Any) -> Any:
    """``kafka.KafkaConsumer(*topics, **config)``; when its constructor raises, the network client it made is
    closed (its thread stopped) before the exception propagates.

    The network client is made by ``config["kafka_client"]`` when given, else by the class default read at
    call time (a test's recorder of clients sees this one too)."""
    from kafka import KafkaConsumer

    return _made(KafkaConsumer, *topics, **config)


def kafka_admin(**config: Any) -> Any:
    """``kafka.KafkaAdminClient(**config)``, closing its network client when the constructor raises (as
    :func:`kafka_consumer`)."""
    from kafka import KafkaAdminClient

    return _made(KafkaAdminClient, **config)


def kafka_producer(**config: Any) -> Any:
    """``kafka.KafkaProducer(**config)``, closing its network client when the constructor raises (as
    :func:`kafka_consumer`)."""
    from kafka import KafkaProducer

    return _made(KafkaProducer, **config)


def _made(cls: Any, *args: Any, **config: Any) -> Any:
    maker = config.pop("kafka_client", None) or cls.DEFAULT_CONFIG["kafka_client"]
    bootstrap_s = config.get("bootstrap_timeout_ms", cls.DEFAULT_CONFIG["bootstrap_timeout_ms"]) / 1000
    made: list[Any] = []
    starting = [True]  # the constructor runs: its bootstrap is bounded (a later reconnection is kafka-python's)

    def recorded(**client_config: Any) -> Any:
        made.append(maker(**client_config))
        _bound_bootstrap(made[-1], bootstrap_s, starting)
        return made[-1]

    try:
        return cls(*args, kafka_client=recorded, **config)
    except BaseException:
        for client in made:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - the constructor's own error is the one to raise
                log.debug("closing the network client of a %s that did not start failed: %s", cls.__name__, exc)
        raise
    finally:
        starting[0] = False


def _bound_bootstrap(client: Any, timeout_s: float, starting: list[bool]) -> None:
    """From ``timeout_s`` after now (the bootstrap's deadline, which starts a moment later) until ``client``
    has bootstrapped or is closed or ``starting[0]`` is false (its constructor returned), fail each of its
    connections still being set up, every :data:`BOOTSTRAP_CHECK_S`: the bootstrap's next check of its deadline
    then ends it. A client of another kind than kafka-python's network client is left as it is."""
    from kafka.errors import KafkaTimeoutError

    manager, net = getattr(client, "_manager", None), getattr(client, "_net", None)
    if manager is None or net is None:
        return

    def expire() -> None:
        if not starting[0] or manager.closed or manager.bootstrapped:
            return
        for conn in list(manager._conns.values()):
            if not conn.init_future.is_done:
                conn.close(KafkaTimeoutError(f"the connection was not set up within {timeout_s:g} s"))
        net.call_later(BOOTSTRAP_CHECK_S, expire)

    net.call_later(timeout_s, expire)
