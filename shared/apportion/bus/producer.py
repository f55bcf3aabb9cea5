"""Kafka producer wrapper: every apportion event goes out through here.

Idempotent with ``acks=all`` (DESIGN section 4), JSON via
:func:`apportion.events.encode`, record key from :func:`apportion.events.key_of`
and topic from :data:`apportion.events.TOPIC_OF`, so no service spells a
topic name or a key itself.

Nothing connects at import time; :class:`EventProducer` connects when built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from apportion import events
from apportion.settings import topic_name

if TYPE_CHECKING:
    from kafka.producer.future import FutureRecordMetadata, RecordMetadata

#: Settings the wrapper insists on; callers cannot weaken them by accident.
RELIABLE = {
    "acks": "all",
    "enable_idempotence": True,
    "max_in_flight_requests_per_connection": 5,  # the idempotent maximum
}


class EventProducer:
    """Publish :class:`apportion.events.Event` models to their topics.

    Args:
        bootstrap: ``host:port[,host:port]`` of the Kafka cluster.
        client_id: shown in broker logs and metrics.
        **kafka_config: extra :class:`kafka.KafkaProducer` settings (e.g.
            ``linger_ms``). ``acks``, ``enable_idempotence`` and
            ``max_in_flight_requests_per_connection`` are fixed.

    Example::

        with EventProducer("127.0.0.1:9092", client_id="dispatcher") as p:
            p.publish(event)          # waits for the broker's ack
            p.send(other_event)       # returns a future; p.flush() waits
    """

    def __init__(self, bootstrap: str, *, client_id: str = "apportion", **kafka_config: Any) -> None:
        from kafka import KafkaProducer  # imported here: no Kafka import cost for pure users

        clash = sorted(set(kafka_config) & set(RELIABLE))
        if clash:
            raise ValueError(f"EventProducer fixes {clash}; do not override them")
        from apportion.bus.resilience import KAFKA_RECONNECT
        from apportion.bus.security import kafka_auth

        kafka_config.setdefault("linger_ms", 2)
        kafka_config = {**KAFKA_RECONNECT, **kafka_auth(), **kafka_config}
        self._producer = KafkaProducer(bootstrap_servers=bootstrap, client_id=client_id, **RELIABLE, **kafka_config)

    def send(self, event: events.Event, value: bytes | None = None) -> FutureRecordMetadata:
        """Queue ``event`` for its topic; the future resolves on the broker's ack.

        Args:
            event: the event; it gives the topic and the key.
            value: ``events.encode(event)`` when the caller already has it
                (the dispatcher encodes once and remembers the bytes), or the
                same event signed (a node agent's report:
                :meth:`apportion.identity.ReportSigner.value`); encoded here
                when ``None``. Passing anything else is a caller bug.
        """
        topic = topic_name(events.TOPIC_OF[event.type])
        return self._producer.send(
            topic, value=events.encode(event) if value is None else value, key=events.key_of(event).encode("utf-8")
        )

    def publish(self, event: events.Event, timeout_s: float = 30.0) -> RecordMetadata:
        """Send ``event`` and wait for the ack; raises the Kafka error on failure."""
        return self.send(event).get(timeout=timeout_s)

    def send_raw(self, topic: str, value: bytes | None, key: bytes | None = None) -> FutureRecordMetadata:
        """Send raw bytes (tests, replay tools). Prefer :meth:`send` for events."""
        return self._producer.send(topic, value=value, key=key)

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every queued record is acknowledged (or ``timeout_s``)."""
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and close the connection."""
        self._producer.close(timeout=timeout_s)

    def __enter__(self) -> EventProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Unacked:
    """Send without waiting for the acks; :meth:`check` raises once any of them was not delivered.

    For a writer that keeps deciding while its records are in flight and must stop at the first loss (the
    dispatcher: a decision never delivered ends the term, and the next term derives it again from the log,
    with the same deterministic id).

    Args:
        producer: ``send(event, value) -> future`` (:class:`EventProducer`).
    """

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        self.failed: list[BaseException] = []

    def send_all(self, sent: Sequence[tuple[events.Event, bytes | None]]) -> None:
        """Queue each ``(event, value)``; a delivery that fails later is kept in :attr:`failed`."""
        for e, value in sent:
            self._producer.send(e, value).add_errback(self.failed.append)

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the first failure when a record sent was not delivered."""
        if self.failed:
            raise RuntimeError(f"a record sent was not delivered ({self.failed[0]!r}): rebuilding from the log")
