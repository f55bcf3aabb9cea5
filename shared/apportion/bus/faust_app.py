"""faust app factory with apportion's event serialisation.

faust services (policy) get the same wire format as the
kafka-python wrappers: record values are :func:`apportion.events.encode`
JSON, keys are :func:`apportion.events.key_of` strings, topics come from the
registry. Values that do not decode are not thrown into the agent (which
would crash it): the codec yields an :class:`Undecodable`, and
:func:`decoded` turns it into a :class:`~apportion.events.DeadLetter` on
``apportion.deadletter`` and carries on, as :class:`EventConsumer` does.

Settings follow notes/kafka-local.md: ``store='memory://'`` by default
(replays the changelog on start), ``consumer_auto_offset_reset='earliest'``,
agent ``concurrency=1`` (faust 0.15.3 may commit past an in-flight message
otherwise), ``acks=all``. The faust producer is not idempotent unless
``processing_guarantee='exactly_once'``; consumers de-duplicate by
``event_id`` anyway.

Example::

    app = make_app("accounting", bootstrap)
    jobs = event_topic(app, topics.JOBS)

    @agent(app, jobs)
    async def on_job(stream):
        async for event in decoded(app, stream, producer="accounting"):
            ...   # pure logic, then publish(app, new_event)

Nothing is created at import time: the codec is registered by the factory.

Running in-process: a :class:`faust.App` is a mode service, so ``await
app.start()`` / ``await app.stop()`` run it inside the caller's event loop
(no worker, no signal handlers, nothing else taken over); ``start`` returns
once the group assigned the partitions. faust's table manager sleeps a fixed
1 s during start (``TableManager.on_start``), so a start takes about 1.2 s
on an idle local broker. The policy service runs this way (see
:mod:`services.policy.app`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from apportion import events
from apportion.bus.intake import IdLedger, IntakeStats, dead_letter
from apportion.settings import topic_name, topic_prefix
from apportion.topics import DEADLETTER, Topic, by_name

log = logging.getLogger(__name__)

CODEC = "apportion"


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A record value that is not a valid event, with the reason."""

    raw: bytes | None
    reason: str


def _codec_class() -> type:
    from faust.serializers.codecs import Codec

    class EventCodec(Codec):
        """faust codec: Event <-> apportion JSON bytes; bad input -> Undecodable."""

        def _dumps(self, obj: Any) -> bytes:
            if isinstance(obj, events.Event):
                return events.encode(obj)
            if isinstance(obj, (bytes, bytearray)):
                return bytes(obj)
            raise TypeError(f"{CODEC} codec serialises apportion events, got {type(obj).__name__}")

        def _loads(self, s: bytes | None) -> Any:
            raw = bytes(s) if s is not None else None
            try:
                return events.decode(raw)
            except events.DecodeError as exc:
                return Undecodable(raw, str(exc))

    return EventCodec


def register_codec() -> None:
    """Register the ``apportion`` codec with faust (idempotent)."""
    from faust.serializers import codecs

    if CODEC not in codecs.codecs:
        codecs.register(CODEC, _codec_class()())


def make_app(
    app_id: str,
    bootstrap: str,
    *,
    store: str = "memory://",
    datadir: str | Path | None = None,
    web_port: int | None = None,
    **settings: Any,
) -> Any:
    """Build a :class:`faust.App` wired for apportion.

    Args:
        app_id: the faust app id (consumer group and changelog prefix).
        bootstrap: ``host:port[,host:port...]`` of Kafka (every broker of a cluster: faust's own topics get
            :func:`apportion.topics.replication` of their count).
        store: table store URL; ``'rocksdb://'`` resumes from stored offsets.
        datadir: per-worker data directory (faust's default when ``None``).
        web_port: enable faust's web server on this port; disabled when ``None``.
        **settings: any other faust setting, overriding the defaults here.
    """
    import faust

    from apportion.topics import replication

    register_codec()
    hosts = [h.strip() for h in bootstrap.split(",") if h.strip()]
    conf: dict[str, Any] = {
        # faust takes several brokers as ";"-separated URLs, not one URL with a comma list
        "broker": ";".join(f"kafka://{h}" for h in hosts),
        "store": store,
        "consumer_auto_offset_reset": "earliest",
        "key_serializer": "raw",
        "value_serializer": CODEC,
        "producer_acks": -1,
        # its changelog and repartition topics: the registry's rule, the bootstrap list taken as the cluster
        "topic_replication_factor": replication(len(hosts))[0],
        "topic_allow_declare": True,
        "web_enabled": web_port is not None,
    }
    if web_port is not None:
        conf["web_port"] = web_port
        conf["web_bind"] = "127.0.0.1"  # faust's default is every interface (docs/security.md)
    if datadir is not None:
        conf["datadir"] = str(datadir)
    from apportion.bus.security import faust_auth

    conf.update(faust_auth())  # SASL_SSL (SCRAM over TLS) as APPORTION_KAFKA_USER (apportion.bus.security)
    conf.update(settings)
    return faust.App(app_id, **conf)


def quiet_client_logs() -> None:
    """Keep faust, mode and aiokafka at WARNING unless the root logger is at DEBUG.

    At INFO they log every service start/stop step and group join (about 60
    lines per start); services keep their own INFO lines. Idempotent.
    """
    import logging

    level = logging.getLogger().getEffectiveLevel()
    for name in ("faust", "mode", "aiokafka"):
        logging.getLogger(name).setLevel(max(logging.WARNING, level) if level > logging.DEBUG else level)


def event_topic(app: Any, topic: Topic | str) -> Any:
    """The faust topic for a registry topic, with the apportion codec.

    ``topic`` may be a :class:`~apportion.topics.Topic` or a name; names not
    in the registry (tests) get one partition and no declared configs.
    """
    name = topic if isinstance(topic, str) else topic_name(topic)
    if isinstance(topic, str):
        topic = by_name(topic, topic_prefix()) or Topic(topic, "key", 1, -1)
    return app.topic(
        name,
        key_type=bytes,
        key_serializer="raw",
        value_serializer=CODEC,
        partitions=topic.partitions,
        config=topic.configs(),
    )


def agent(app: Any, channel: Any, **kwargs: Any) -> Callable[[Any], Any]:
    """``app.agent`` with ``concurrency=1`` enforced (see module doc)."""
    if kwargs.setdefault("concurrency", 1) != 1:
        raise ValueError("apportion agents run with concurrency=1")
    return app.agent(channel, **kwargs)


async def publish(app: Any, event: events.Event) -> Any:
    """Send ``event`` to its registry topic, keyed by :func:`events.key_of`.

    Returns faust's delivery future (``await`` it for the broker's ack and
    the ``RecordMetadata``); the send itself only queues the record.
    """
    topic = event_topic(app, events.TOPIC_OF[event.type])
    return await topic.send(key=events.key_of(event).encode("utf-8"), value=event)


async def publish_acked(app: Any, event: events.Event) -> Any:
    """Send ``event`` like :func:`publish` and wait until the broker acked it.

    Returns:
        The ``RecordMetadata`` (topic, partition, offset) of the written record.

    Raises:
        the producer's error when the write failed (e.g. ``KafkaError``).
    """
    return await (await publish(app, event))


async def refuse(
    app: Any, message: Any, value: bytes | None, reason: str, *, producer: str, now: Callable[[], datetime]
) -> events.DeadLetter:
    """Publish the dead letter of a faust ``message`` (acked) and return it.

    Built by :func:`apportion.bus.intake.dead_letter` (id from the record's
    position), like every reader's.
    """
    letter = dead_letter(
        topic=message.topic,
        partition=message.partition,
        offset=message.offset,
        key=message.key,
        value=value,
        reason=reason,
        ts=now(),
        producer=producer,
    )
    log.warning("dead-lettering %s[%s]@%s: %s", message.topic, message.partition, message.offset, reason)
    await (await event_topic(app, DEADLETTER).send(key=events.key_of(letter).encode("utf-8"), value=letter))
    return letter


async def decoded(
    app: Any,
    stream: Any,
    *,
    producer: str = "faust",
    clock: Callable[[], datetime] | None = None,
    ledger: IdLedger | None = None,
    stats: IntakeStats | None = None,
) -> AsyncIterator[events.Event]:
    """Yield the events of a faust stream, dead-lettering what a reader refuses.

    The same screen as every reader (:func:`apportion.bus.intake.screen`):
    a value that does not decode (the codec gave an :class:`Undecodable`), a
    key that is not the event's, an event type on another registry topic;
    with ``ledger``, also a reused id (the same id read before with another
    payload). A duplicate (same id, same payload) is yielded: the agent's
    fold is idempotent and may decide only after the last event it has.
    A dead letter's ``event_id`` is derived from (topic, partition, offset)
    (:func:`apportion.bus.intake.dead_letter`), so meeting the same bad
    record again (a restart, another service) writes the same id. The dead
    letter is acked by the broker before the stream moves on.

    Args:
        app: the faust app (its producer writes the dead letters).
        stream: the agent's stream of decoded values.
        producer: ``producer`` field of the dead letters.
        clock: event time of the dead letters (wall clock UTC when ``None``).
        ledger: id -> payload ledger (None: no reuse check here).
        stats: counters to add each event, duplicate and dead letter to (metrics), or None.
    """
    now = clock or (lambda: datetime.now(UTC))
    async for value in stream:
        msg = stream.current_event.message
        if value is None:  # faust does not call the codec for a null value (a tombstone)
            value = Undecodable(None, events.NULL_VALUE)
        elif not isinstance(value, (events.Event, Undecodable)):
            value = Undecodable(msg.value, f"not an apportion event: {type(value).__name__}")
        if isinstance(value, Undecodable):
            await refuse(app, msg, value.raw, value.reason, producer=producer, now=now)
            if stats is not None:
                stats.dead_lettered += 1
            continue
        try:
            events.check_record(value, msg.key, msg.topic, prefix=topic_prefix())
            # a duplicate still goes on: an agent may decide after each event
            duplicate = ledger is not None and ledger.check(value)
        except events.DecodeError as exc:
            raw = bytes(msg.value) if isinstance(msg.value, (bytes, bytearray)) else events.encode(value)
            await refuse(app, msg, raw, str(exc), producer=producer, now=now)
            if stats is not None:
                stats.dead_lettered += 1
            continue
        if stats is not None:
            stats.events += 1
            stats.duplicates += duplicate
        yield value


async def consumer_lag(app: Any, topics: Collection[str]) -> dict[tuple[str, int], int]:
    """Records behind the end of each partition of ``topics`` assigned to ``app``'s consumer (high watermark
    minus position); faust's own topics are left out, and so are partitions whose high watermark or position
    is not known yet.
    """
    out: dict[tuple[str, int], int] = {}
    consumer = app.consumer
    for tp in sorted(tp for tp in consumer.assignment() if tp.topic in topics):
        try:
            hw = consumer.highwater(tp)
            pos = await consumer.position(tp)
        except Exception:  # noqa: BLE001 - a partition being (re)assigned: measured next time
            continue
        if hw is not None and pos is not None:
            out[(tp.topic, tp.partition)] = max(0, hw - pos)
    return out
