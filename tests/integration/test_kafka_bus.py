"""The bus adapters against a real Kafka broker (kafka-python, aiokafka, faust).

Each test uses its own consumer group and, where it writes raw bytes, its
own topic, so tests do not see each other's records. Waiting is polling
with a deadline, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from apportion import events
from apportion.bus.consumer import Delivery, EventConsumer
from apportion.bus.producer import EventProducer
from apportion.bus.provision import admin_client, find_drift, provision
from apportion.bus.security import kafka_auth
from apportion.settings import topic_name
from apportion.topics import ALL_TOPICS, Topic
from tests.kit.narrowing import narrow

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0
T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)


def job_submitted(job_id: str | None = None) -> events.JobSubmitted:
    return events.JobSubmitted(
        job_id=job_id or f"job-{uuid.uuid4().hex[:8]}",
        budget="lab/prior/robotics",
        user="alice",
        gpus_per_replica=2,
        replicas=2,
        min_runtime_s=3600.0,
        duration_s=7200.0,
        submitted_at=T0,
        ts=T0,
        producer="test",
    )


def group() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def consume_until(consumer: EventConsumer, done: Callable[[], bool], deadline_s: float = DEADLINE_S) -> None:
    """Poll ``consumer`` until ``done()`` or fail at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {deadline_s}s; stats {consumer.stats}")
        consumer.poll_once(timeout_ms=200)


def committed(bootstrap: str, group_id: str) -> dict[tuple[str, int], int]:
    admin = admin_client(bootstrap)
    try:
        offsets = admin.list_group_offsets(group_id)[group_id]
    finally:
        admin.close()
    return {(tp.topic, tp.partition): om.offset for tp, om in offsets.items()}


# --------------------------------------------------------------------------- round trips


def test_kafka_python_round_trip_through_the_registry_topic(kafka_bootstrap: str) -> None:
    sent = job_submitted()
    with EventProducer(kafka_bootstrap, client_id="test") as producer:
        meta = producer.publish(sent)
    assert meta.topic == "apportion.submissions"

    got: list[tuple[events.Event, Delivery]] = []
    with EventConsumer(
        kafka_bootstrap, ["apportion.submissions"], group(), lambda e, d: got.append((e, d))
    ) as consumer:
        consume_until(consumer, lambda: any(e.event_id == sent.event_id for e, _ in got))
    event, delivery = next((e, d) for e, d in got if e.event_id == sent.event_id)
    assert event == sent
    assert isinstance(event, events.JobSubmitted)
    assert delivery.key == sent.job_id
    assert (delivery.partition, delivery.offset) == (meta.partition, meta.offset)


async def test_aiokafka_reads_kafka_python_and_back(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    topic = kafka_topic_factory("aiokafka")
    first, second = job_submitted(), job_submitted()
    with EventProducer(kafka_bootstrap) as producer:
        producer.send_raw(topic, events.encode(first), first.job_id.encode()).get(timeout=DEADLINE_S)

    aproducer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True, **kafka_auth())
    await aproducer.start()
    try:
        await aproducer.send_and_wait(topic, events.encode(second), key=second.job_id.encode())
    finally:
        await aproducer.stop()

    aconsumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=group(),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **kafka_auth(),
    )
    await aconsumer.start()
    try:
        seen: list[events.Event] = []
        async with asyncio.timeout(DEADLINE_S):
            while len(seen) < 2:
                batch = await aconsumer.getmany(timeout_ms=200)
                seen += [events.decode(r.value) for recs in batch.values() for r in recs]
        await aconsumer.commit()
    finally:
        await aconsumer.stop()
    assert seen == [first, second]

    got: list[events.Event] = []  # and kafka-python reads what aiokafka wrote
    with EventConsumer(kafka_bootstrap, [topic], group(), lambda e, d: got.append(e)) as consumer:
        consume_until(consumer, lambda: len(got) == 2)
    assert got == [first, second]


async def test_faust_agent_round_trip_and_dead_letter(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], tmp_path
) -> None:
    from apportion.bus.faust_app import agent, decoded, event_topic, make_app

    topic_name = kafka_topic_factory("faust")
    app = make_app(f"test-faust-{uuid.uuid4().hex[:8]}", kafka_bootstrap, datadir=tmp_path)
    source = event_topic(app, topic_name)
    received: asyncio.Queue[events.Event] = asyncio.Queue()

    @agent(app, source)
    async def collect(stream):  # faust stream
        async for event in decoded(app, stream, producer="faust-test"):
            await received.put(event)

    sent = [job_submitted(), job_submitted()]
    with EventProducer(kafka_bootstrap) as producer:  # bytes from another client, one malformed
        producer.send_raw(topic_name, events.encode(sent[0]), sent[0].job_id.encode())
        producer.send_raw(topic_name, b"{not json", b"bad")
        producer.send_raw(topic_name, events.encode(sent[1]), sent[1].job_id.encode())
        producer.flush(DEADLINE_S)

    await app.start()
    try:
        async with asyncio.timeout(DEADLINE_S):
            got = [await received.get(), await received.get()]
        published = await (
            await event_topic(app, topic_name).send(key=b"from-faust", value=job_submitted("from-faust"))
        )
        async with asyncio.timeout(DEADLINE_S):
            echoed = await received.get()
    finally:
        await app.stop()
    assert got == sent
    assert narrow(events.JobSubmitted, echoed).job_id == "from-faust" and published.topic == topic_name
    letters = dead_letters_for(kafka_bootstrap, topic_name, 1)
    assert letters[0].original_bytes() == b"{not json"
    assert letters[0].source_key == "bad" and "JSON" in letters[0].error
    assert letters[0].event_id == events.det_id("DeadLetter", topic_name, 0, 1)  # the same id on every meeting


# --------------------------------------------------------------------------- topics


def test_registry_topics_exist_with_declared_partitions_and_configs(kafka_bootstrap: str) -> None:
    report = provision(kafka_bootstrap)  # second run: idempotent
    assert report.created == []
    assert report.existing == sorted(topic_name(t) for t in ALL_TOPICS)
    assert report.drift == []
    admin = admin_client(kafka_bootstrap)
    try:
        parts = {d["name"]: len(d["partitions"]) for d in admin.describe_topics([topic_name(t) for t in ALL_TOPICS])}
    finally:
        admin.close()
    assert parts == {topic_name(t): t.partitions for t in ALL_TOPICS}


def test_config_drift_is_reported_then_fixed(kafka_bootstrap: str) -> None:
    from kafka.admin import ConfigResource, ConfigResourceType

    declared = Topic(f"test.drift.{uuid.uuid4().hex[:8]}", "key", 2, -1, compact=False)
    assert provision(kafka_bootstrap, [declared]).created == [topic_name(declared)]
    admin = admin_client(kafka_bootstrap)
    try:
        admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic_name(declared), configs={"retention.ms": "60000"})]
        )
        drift = find_drift(admin, [declared])
    finally:
        admin.close()
    assert [(d.setting, d.declared, d.actual) for d in drift] == [("retention.ms", "-1", "60000")]

    report = provision(kafka_bootstrap, [declared], fix=True)
    assert [d.setting for d in report.fixed] == ["retention.ms"]
    assert report.drift == []


def test_signed_topics_get_the_brokers_time_and_provisioning_sets_it_on_an_existing_topic(kafka_bootstrap: str) -> None:
    """``message.timestamp.type=LogAppendTime`` (``topics.BROKER_TIME``): described on the registry's signed topics;
    a record sent with an old producer time is read back stamped by the broker (what the readers' key rule,
    ``logrecord.log_position``, takes as its place); and plain provisioning (no ``fix``) puts it back on an
    existing topic without touching its other configs."""
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType

    from apportion.logrecord import LOG_APPEND_TIME, log_position
    from apportion.topics import BROKER_TIME

    key = "message.timestamp.type"
    admin = admin_client(kafka_bootstrap)
    try:
        res = [ConfigResource(ConfigResourceType.TOPIC, topic_name(t), configs={key: None}) for t in ALL_TOPICS]
        got = {n: c[key]["value"] for n, c in admin.describe_configs(res, config_filter="all")["topic"].items()}
    finally:
        admin.close()
    signed = {"apportion.submissions", "apportion.jobs", "apportion.nodes", "apportion.commands", "apportion.budgets"}
    assert got == {topic_name(t): "LogAppendTime" if t.base in signed else "CreateTime" for t in ALL_TOPICS}

    declared = Topic(f"test.brokertime.{uuid.uuid4().hex[:8]}", "key", 1, -1, extra_configs=BROKER_TIME)
    assert provision(kafka_bootstrap, [declared]).created == [topic_name(declared)]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, **kafka_auth())
    try:
        producer.send(topic_name(declared), b"{}", key=b"k", timestamp_ms=1_000).get(timeout=DEADLINE_S)
    finally:
        producer.close()
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False, **kafka_auth())
    try:
        tp = TopicPartition(topic_name(declared), 0)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        recs: list = []
        deadline = time.monotonic() + DEADLINE_S
        while not recs and time.monotonic() < deadline:
            recs = consumer.poll(timeout_ms=200).get(tp, [])
    finally:
        consumer.close()
    assert recs and recs[0].timestamp_type == LOG_APPEND_TIME
    assert log_position(recs[0]) == recs[0].timestamp > 1_000  # the broker's clock, not the producer's 1970

    admin = admin_client(kafka_bootstrap)
    try:  # an operator (or a topic made before the declaration) sets the producer's time back
        admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic_name(declared), configs={key: "CreateTime"})]
        )
        assert [(d.setting, d.actual) for d in find_drift(admin, [declared])] == [(key, "CreateTime")]
    finally:
        admin.close()
    report = provision(kafka_bootstrap, [declared])  # no fix=True: this config is always set
    assert [(d.setting, d.declared) for d in report.fixed] == [(key, "LogAppendTime")]
    assert report.drift == []  # retention.ms still -1, cleanup.policy still delete


# --------------------------------------------------------------------------- consumer wrapper


def dead_letters_for(bootstrap: str, source_topic: str, n: int) -> list[events.DeadLetter]:
    """The first ``n`` dead letters whose source is ``source_topic``."""
    found: list[events.DeadLetter] = []

    def keep(event: events.Event, _: Delivery) -> None:
        if isinstance(event, events.DeadLetter) and event.source_topic == source_topic:
            found.append(event)

    with EventConsumer(bootstrap, ["apportion.deadletter"], group(), keep) as consumer:
        consume_until(consumer, lambda: len(found) >= n)
    return found


def test_malformed_messages_are_dead_lettered_and_consumption_continues(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    topic = kafka_topic_factory("malformed")
    good = [job_submitted(), job_submitted()]
    missing_field = events.to_dict(job_submitted())
    del missing_field["budget"]
    import json

    bad_values = [b"\x00 not json", json.dumps(missing_field).encode()]
    with EventProducer(kafka_bootstrap) as producer:
        producer.send_raw(topic, bad_values[0], b"k0")
        producer.send_raw(topic, events.encode(good[0]), good[0].job_id.encode())
        producer.send_raw(topic, bad_values[1], b"k2")
        producer.send_raw(topic, events.encode(good[1]), good[1].job_id.encode())
        producer.flush(DEADLINE_S)

    handled: list[events.Event] = []
    gid = group()
    with EventConsumer(kafka_bootstrap, [topic], gid, lambda e, d: handled.append(e), name="test-consumer") as consumer:
        consume_until(consumer, lambda: len(handled) == 2)
        assert consumer.stats.dead_lettered == 2
    assert handled == good
    assert committed(kafka_bootstrap, gid) == {(topic, 0): 4}

    letters = sorted(dead_letters_for(kafka_bootstrap, topic, 2), key=lambda d: narrow(int, d.source_offset))
    assert [d.source_offset for d in letters] == [0, 2]
    assert [d.source_key for d in letters] == ["k0", "k2"]
    assert [base64.b64decode(d.original) for d in letters] == bad_values
    assert "JSON" in letters[0].error
    assert letters[1].error.startswith("budget")  # the field that failed is named
    assert all(d.producer == "test-consumer" for d in letters)


def test_a_duplicate_event_is_handled_once(kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]) -> None:
    topic = kafka_topic_factory("dup")
    event, other = job_submitted(), job_submitted()
    with EventProducer(kafka_bootstrap) as producer:
        for e in (event, event, other, event):  # e.g. a producer retry after a lost ack
            producer.send_raw(topic, events.encode(e), e.job_id.encode())
        producer.flush(DEADLINE_S)

    handled: list[uuid.UUID] = []
    gid = group()
    with EventConsumer(kafka_bootstrap, [topic], gid, lambda e, d: handled.append(e.event_id)) as consumer:
        consume_until(consumer, lambda: consumer.stats.handled + consumer.stats.duplicates == 4)
        assert consumer.stats.duplicates == 2
    assert handled == [event.event_id, other.event_id]
    assert committed(kafka_bootstrap, gid) == {(topic, 0): 4}


def test_a_failing_handler_commits_only_what_was_handled_and_sees_the_record_again(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    topic = kafka_topic_factory("retry")
    batch = [job_submitted() for _ in range(3)]
    with EventProducer(kafka_bootstrap) as producer:
        for e in batch:
            producer.send_raw(topic, events.encode(e), e.job_id.encode())
        producer.flush(DEADLINE_S)

    handled: list[str] = []
    fail_once = {batch[1].job_id}

    def handler(event: events.Event, _: Delivery) -> None:
        job_id = narrow(events.JobSubmitted, event).job_id
        if job_id in fail_once:
            fail_once.discard(job_id)
            raise RuntimeError("store unavailable")
        handled.append(job_id)

    gid = group()
    with EventConsumer(kafka_bootstrap, [topic], gid, handler) as consumer:
        with pytest.raises(RuntimeError, match="store unavailable"):
            consume_until(consumer, lambda: False)
        assert committed(kafka_bootstrap, gid) == {(topic, 0): 1}
        consume_until(consumer, lambda: len(handled) == 3)
    assert handled == [e.job_id for e in batch]
    assert committed(kafka_bootstrap, gid) == {(topic, 0): 3}


def test_poison_records_are_dead_lettered_with_their_reason_and_a_reused_id_is_not_a_duplicate(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    topic = kafka_topic_factory("poison")
    first = job_submitted()
    reused = first.model_copy(update={"job_id": "another-job"})  # the same event_id, another payload
    with EventProducer(kafka_bootstrap) as producer:
        producer.send_raw(topic, None, b"tomb")  # offset 0: a tombstone
        producer.send_raw(topic, events.encode(first), b"not-the-job-id")  # 1: wrong key
        producer.send_raw(topic, events.encode(first), first.job_id.encode())  # 2: handled
        producer.send_raw(topic, events.encode(reused), reused.job_id.encode())  # 3: reused id
        producer.send_raw(topic, events.encode(first), first.job_id.encode())  # 4: a duplicate
        producer.flush(DEADLINE_S)

    handled: list[events.Event] = []
    gid = group()
    with EventConsumer(kafka_bootstrap, [topic], gid, lambda e, d: handled.append(e), name="poison-test") as consumer:
        consume_until(
            consumer, lambda: consumer.stats.handled + consumer.stats.duplicates + consumer.stats.dead_lettered == 5
        )
        assert (consumer.stats.handled, consumer.stats.duplicates, consumer.stats.dead_lettered) == (1, 1, 3)
    assert handled == [first]
    assert committed(kafka_bootstrap, gid) == {(topic, 0): 5}
    letters = sorted(dead_letters_for(kafka_bootstrap, topic, 3), key=lambda d: narrow(int, d.source_offset))
    assert [(d.source_offset, d.error) for d in letters] == [
        (0, "null record value (tombstone)"),
        (1, f"key: record key 'not-the-job-id' is not the event's key '{first.job_id}'"),
        (3, f"event_id reused: {first.event_id} was read before with a different payload"),
    ]
    assert [d.event_id for d in letters] == [events.det_id("DeadLetter", topic, 0, o) for o in (0, 1, 3)]
