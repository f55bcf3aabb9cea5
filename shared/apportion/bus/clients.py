"""kafka-python consumers and admin clients that leave nothing running when they cannot start.

kafka-python 3 starts a client's network thread (``kafka-io-<client_id>``) in the constructor, before it
bootstraps; when no broker of ``bootstrap_servers`` answers in time, the constructor raises with that thread
still running and no client to close (a broker outage as a service starts or retries). :func:`kafka_consumer`
and :func:`kafka_admin` make the network client through a recorder, as kafka-python's ``kafka_client`` setting
allows, and close it when the constructor raises: each try of a service that retries through an outage leaves no
thread behind.

Nothing connects at import time.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["kafka_admin", "kafka_consumer"]


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


def _made(cls: Any, *args: Any, **config: Any) -> Any:
    maker = config.pop("kafka_client", None) or cls.DEFAULT_CONFIG["kafka_client"]
    made: list[Any] = []

    def recorded(**client_config: Any) -> Any:
        made.append(maker(**client_config))
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
