"""Kafka producer wrapper: every apportion event goes out through here.

Idempotent with ``acks=all`` (rule D4.log), JSON via
:func:`apportion.events.encode`, record key from :func:`apportion.events.key_of`
and topic from :data:`apportion.events.TOPIC_OF`, so no service spells a
topic name or a key itself.

A writer that must not outlive its leadership (the dispatcher) publishes in Kafka transactions
(``transactional_id``, KIP-98): a new instance's :meth:`EventProducer.init_transactions` bumps the
producer epoch, aborts the previous instance's open transaction and makes its later sends and commits
fail (``ProducerFencedError``); readers on :data:`READ_COMMITTED` never return an aborted record. Every
reader of the topics a transactional writer writes uses :data:`READ_COMMITTED` (docs/leadership.md).

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

#: Consumer setting of every reader of the log: a record of an aborted or still open transaction is never
#: returned (a fenced leader's decisions; docs/leadership.md). Pass as ``**READ_COMMITTED``.
READ_COMMITTED = {"isolation_level": "read_committed"}

#: Transactional producers retry after this many ms (kafka-python's default is 100): each commit is an
#: AddPartitions, an EndTxn and their retries, and a one-record transaction took 122 ms at 100 against
#: 21 ms at 5 (docs/leadership.md).
RETRY_BACKOFF_MS = 5

#: Wall seconds a commit may take before the writer gives up on it (the term then ends and the next
#: rebuilds from the log): kafka-python's ``commit_transaction`` waits without a bound.
COMMIT_TIMEOUT_S = 30.0

#: Wall seconds :meth:`EventProducer.close` waits for the sender thread to stop once it gave the records
#: still unacknowledged up (it wakes from its poll and fails them; the broker is not waited for).
FORCE_CLOSE_S = 5.0


def is_fenced(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it was raised from) says a newer producer took over this
    transactional id: ``ProducerFencedError`` or ``InvalidProducerEpochError`` of kafka-python, by type."""
    from kafka.errors import InvalidProducerEpochError, ProducerFencedError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ProducerFencedError | InvalidProducerEpochError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class EventProducer:
    """Publish :class:`apportion.events.Event` models to their topics.

    Args:
        bootstrap: ``host:port[,host:port]`` of the Kafka cluster.
        client_id: shown in broker logs and metrics.
        transactional_id: publish in transactions under this id (call :meth:`init_transactions` once,
            then :meth:`begin` and :meth:`commit`); ``None``: no transactions.
        transaction_timeout_s: the broker aborts a transaction open longer than this (wall seconds).
        **kafka_config: extra :class:`kafka.KafkaProducer` settings (e.g.
            ``linger_ms``). ``acks``, ``enable_idempotence`` and
            ``max_in_flight_requests_per_connection`` are fixed.

    Example::

        with EventProducer("127.0.0.1:9092", client_id="dispatcher") as p:
            p.publish(event)          # waits for the broker's ack
            p.send(other_event)       # returns a future; p.flush() waits
    """

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "apportion",
        transactional_id: str | None = None,
        transaction_timeout_s: float = 10.0,
        **kafka_config: Any,
    ) -> None:
        clash = sorted(set(kafka_config) & set(RELIABLE))
        if clash:
            raise ValueError(f"EventProducer fixes {clash}; do not override them")
        from apportion.bus.clients import kafka_producer  # imported here: no Kafka import cost for pure users
        from apportion.bus.resilience import KAFKA_RECONNECT
        from apportion.bus.security import kafka_auth

        kafka_config.setdefault("linger_ms", 2)
        if transactional_id is not None:
            kafka_config["transactional_id"] = transactional_id
            kafka_config["transaction_timeout_ms"] = int(transaction_timeout_s * 1000)
            kafka_config.setdefault("retry_backoff_ms", RETRY_BACKOFF_MS)
        kafka_config = {**KAFKA_RECONNECT, **kafka_auth(), **kafka_config}
        # made by apportion.bus.clients: a constructor that cannot bootstrap raises within bootstrap_timeout_ms
        # (30 s by default), a TLS server that never answers included, and leaves nothing running
        self._producer = kafka_producer(bootstrap_servers=bootstrap, client_id=client_id, **RELIABLE, **kafka_config)

    def send(self, event: events.Event, value: bytes | None = None) -> FutureRecordMetadata:
        """Queue ``event`` for its topic; the future resolves on the broker's ack.

        Args:
            event: the event; it gives the topic and the key.
            value: ``events.encode(event)`` when the caller already has it
                (the dispatcher encodes once and remembers the bytes), or the
                same event signed (a node agent's report:
                :meth:`apportion.identity.keys.ReportSigner.value`); encoded here
                when ``None``. Passing anything else is a caller bug.
        """
        topic, value, key = self._record(event, value)
        return self._producer.send(topic, value=value, key=key)

    @staticmethod
    def _record(event: events.Event, value: bytes | None) -> tuple[str, bytes, bytes]:
        """``event``'s topic, value (``value``, or the event encoded when ``None``) and key as bytes."""
        return (
            topic_name(events.TOPIC_OF[event.type]),
            events.encode(event) if value is None else value,
            events.key_of(event).encode("utf-8"),
        )

    def send_many(self, sent: Sequence[tuple[events.Event, bytes | None]]) -> list[FutureRecordMetadata]:
        """:meth:`send` each ``(event, value)``; in a transaction, every partition they go to is added to it
        before the first is queued.

        kafka-python adds a transaction's new partitions in one AddPartitionsToTxn request when its sender
        thread wakes, which the first record of a new batch does; a partition met after that waits for the
        answer and a second request, and every record of the transaction with it. Adding them all first
        (what ``send`` itself would add, partitioned as ``send`` partitions) makes it one request. A topic whose
        partitions the producer does not know yet is left to ``send``, as before."""
        records = [self._record(e, v) for e, v in sent]
        kp = self._producer
        manager = kp._transaction_manager
        if manager is not None and manager.is_transactional() and len(records) > 1:
            from kafka.structs import TopicPartition

            for topic, value, key in records:
                partition = kp._partition(topic, None, key, value, key, value)
                if partition is not None:
                    manager.maybe_add_partition_to_transaction(TopicPartition(topic, partition))
        return [kp.send(topic, value=value, key=key) for topic, value, key in records]

    def publish(self, event: events.Event, timeout_s: float = 30.0) -> RecordMetadata:
        """Send ``event`` and wait for the ack; raises the Kafka error on failure."""
        return self.send(event).get(timeout=timeout_s)

    def send_raw(self, topic: str, value: bytes | None, key: bytes | None = None) -> FutureRecordMetadata:
        """Send raw bytes (tests, replay tools). Prefer :meth:`send` for events."""
        return self._producer.send(topic, value=value, key=key)

    def init_transactions(self) -> None:
        """Take the transactional id over: the broker aborts the previous holder's open transaction and
        fences it (its next send or commit fails). Blocking; raises the Kafka error (``KafkaTimeoutError``
        when the coordinator did not answer within ``max_block_ms``, an ``AuthorizationError`` without the
        ACL on the id)."""
        self._producer.init_transactions()

    def begin(self) -> None:
        """Open a transaction (local: nothing is sent until the first record)."""
        self._producer.begin_transaction()

    def fenced(self) -> bool:
        """True when this producer's transactions failed because a newer instance took the id over.

        kafka-python raises a plain ``KafkaError`` ("in an error state") from a send, ``begin`` or
        ``commit`` made after its sender met the fence, with the fence only in the transaction manager's
        last error; :func:`is_fenced` of that error says so."""
        manager = getattr(self._producer, "_transaction_manager", None)
        return manager is not None and is_fenced(getattr(manager, "last_error", None))

    def abort(self, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        """Abort the open transaction (its records are never returned to :data:`READ_COMMITTED` readers),
        so that readers do not wait at it until the transaction timeout; raises like :meth:`commit`."""
        self._end_transaction(False, timeout_s)

    def commit(self, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        """Flush and commit the open transaction; raises what the commit raised (``ProducerFencedError``:
        a newer instance holds the id, :func:`is_fenced`), or ``TimeoutError`` after ``timeout_s`` wall
        seconds (the commit may still end later; the caller ends its term either way)."""
        self._end_transaction(True, timeout_s)

    def _end_transaction(self, commit: bool, timeout_s: float) -> None:
        """What kafka-python's ``commit_transaction`` (``abort_transaction``) does, with a bound on the wait.

        Its own calls wait without a bound; waiting here, in the caller's thread, on the result the sender
        thread completes keeps the bound without a helper thread (a thread start and a join per commit,
        each a hand-off that waits for a core on a loaded machine). Raises what the transaction manager
        raised when asked (a producer in an error state), what the commit or abort ended with, or
        ``TimeoutError``."""
        manager = self._producer._transaction_manager
        if manager is None or not manager.is_transactional():
            from kafka.errors import IllegalStateError

            raise IllegalStateError("this producer has no transactional_id: no transaction to end")
        result = manager.begin_commit() if commit else manager.begin_abort()
        self._producer._sender.wakeup()
        if not result.wait(timeout_ms=int(timeout_s * 1000)):
            what = "committed" if commit else "aborted"
            raise TimeoutError(f"the transaction was not {what} within {timeout_s:.0f} s")

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every queued record is acknowledged (or ``timeout_s``)."""
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and close; whatever the broker does, nothing of the producer runs on when this returns.

        A record not acknowledged within ``timeout_s`` wall seconds (the broker gone) is given up: its future
        fails, the sender thread stops within :data:`FORCE_CLOSE_S` and its connections close, and this raises
        ``KafkaTimeoutError`` saying so, once. kafka-python's own ``close`` raises from its flush before it
        force-closes (at any timeout, 0 included), leaving the sender running and the client open, so that its
        ``__del__`` raises the same timeout again during garbage collection."""
        from kafka.errors import KafkaTimeoutError

        kp = self._producer
        given_up: KafkaTimeoutError | None = None
        try:
            kp.close(timeout=timeout_s)
        except KafkaTimeoutError as exc:
            given_up = exc
            kp._sender.force_close()  # fails every batch still unacknowledged, then closes the network client
        kp._sender.join(FORCE_CLOSE_S)  # kafka-python's close does not wait for a sender it force-closed either
        if kp._sender.is_alive():
            raise KafkaTimeoutError(
                f"the producer's sender did not stop within {timeout_s:g} s and {FORCE_CLOSE_S:g} s more"
            ) from given_up
        if given_up is None:
            return
        kp.close(timeout=0)  # nothing left to flush: marks it closed (its __del__ then does nothing)
        raise KafkaTimeoutError(
            f"records not acknowledged within {timeout_s:g} s were given up (their futures fail);"
            " the producer is closed"
        ) from given_up

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
        producer: ``send_many(pairs) -> futures`` and ``flush()`` (:class:`EventProducer`); with
            ``transactional``, also ``begin()`` and ``commit()``.
        transactional: the first send after a :meth:`flush` opens a transaction and :meth:`flush` commits
            it, so what one flush covers becomes visible to :data:`READ_COMMITTED` readers at once or never.

    Attributes:
        open: a transaction is open (records were sent since the last :meth:`flush`).
        failed: the delivery errors seen so far.
    """

    def __init__(self, producer: Any, *, transactional: bool = False) -> None:
        self._producer = producer
        self.transactional = transactional
        self.open = False
        self.failed: list[BaseException] = []

    def send_all(self, sent: Sequence[tuple[events.Event, bytes | None]]) -> None:
        """Queue each ``(event, value)``; a delivery that fails later is kept in :attr:`failed`."""
        if sent and self.transactional and not self.open:
            self._producer.begin()
            self.open = True
        for future in self._producer.send_many(sent):
            future.add_errback(self.failed.append)

    def flush(self) -> None:
        """Block until every record sent is acknowledged; in a transaction, commit it. Raises what the
        commit raised (a fenced writer: ``ProducerFencedError``, :func:`is_fenced`), or :meth:`check`'s
        error when a record sent was not delivered although the commit returned (kafka-python commits
        what is left after a transaction the broker aborted on its timeout: the lost records are only
        known from their futures)."""
        if not self.transactional:
            self._producer.flush()
        elif self.open:
            self.open = False  # a failed commit leaves the producer in an error state: no retry of it
            self._producer.commit()
        self.check()

    def check(self) -> None:
        """Raise ``RuntimeError`` naming the first failure when a record sent was not delivered (raised
        from it, so :func:`is_fenced` sees a fence)."""
        if self.failed:
            first = self.failed[0]
            raise RuntimeError(f"a record sent was not delivered ({first!r}): rebuilding from the log") from first
