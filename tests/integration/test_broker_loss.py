"""A broker of a 3-node cluster is lost: no acknowledged submission is lost (issue 17).

On the ``kafka_cluster`` fixture (3 KRaft nodes, SASL/SCRAM and ACLs, replication 3, ``min.insync.replicas``
2): while a producer submits jobs (acks=all, idempotent: :mod:`apportion.bus.producer`) whose ids all hash to
one submissions partition, the leader of that partition is killed with SIGKILL. Every submission the broker
acknowledged reaches the dispatcher (it queues each), each is in the log exactly once (the producer's retries
across the leader change are not duplicates), and the killed node restarts on its data and rejoins the
in-sync replicas of every registry partition. Every wait polls with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from kafka.partitioner.default import murmur2

from apportion import events, topics
from apportion.bus.provision import admin_client, find_drift
from apportion.settings import topic_name

pytestmark = pytest.mark.integration

JOBS = 60  # submissions; the leader is killed after a third of them are acknowledged
DEADLINE_S = 90.0


def partition_of(key: str, partitions: int) -> int:
    """The partition kafka-python's default partitioner gives ``key`` (murmur2, as the Java client)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def job_ids(n: int, partition: int) -> list[str]:
    """``n`` fresh job ids that all land on submissions partition ``partition``."""
    out: list[str] = []
    while len(out) < n:
        j = f"bl-{uuid.uuid4().hex[:10]}"
        if partition_of(j, topics.SUBMISSIONS.partitions) == partition:
            out.append(j)
    return out


def leader_of(admin: Any, topic: str, partition: int) -> int:
    (d,) = admin.describe_topics([topic])
    return next(p["leader_id"] for p in d["partitions"] if p["partition_index"] == partition)


def in_sync_everywhere(admin: Any, node: int) -> bool:
    """True when ``node`` is in the ISR of every partition of every registry topic."""
    described = admin.describe_topics([topic_name(t) for t in topics.ALL_TOPICS])
    return all(node in p["isr_nodes"] for d in described for p in d["partitions"])


def poll(fn: Any, what: str, deadline_s: float = DEADLINE_S) -> Any:
    """The live-stack tests' one bounded poller (``tests.kit.livestack.until``) with this module's deadline."""
    from tests.kit.livestack import until

    return until(fn, what, deadline_s)


def test_cluster_topics_have_three_replicas_and_two_in_sync(
    kafka_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in kafka_cluster.env.items():
        monkeypatch.setenv(k, v)
    assert topics.replication(3) == (3, 2)
    admin = admin_client(kafka_cluster.bootstrap)
    try:
        assert find_drift(admin, topics.ALL_TOPICS, (3, 2)) == []
        (d,) = admin.describe_topics([topic_name(topics.SUBMISSIONS)])
        assert sorted(len(p["replica_nodes"]) for p in d["partitions"]) == [3, 3, 3]
    finally:
        admin.close()
    # the broker's own defaults and internal topics follow the same rule (infra/kafka/start-cluster.sh)
    for node in kafka_cluster.stack.node_ports():
        props = (kafka_cluster.stack.datadir / "kafka" / f"broker-{node}" / "server.properties").read_text()
        assert "\nmin.insync.replicas=2\n" in props and "\ndefault.replication.factor=3\n" in props
        assert "\noffsets.topic.replication.factor=3\n" in props
        assert "\nsasl.enabled.mechanisms=SCRAM-SHA-512\n" in props
        assert "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer" in props


async def test_killing_the_submissions_leader_loses_no_acknowledged_submission(
    kafka_cluster: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    from apportion.bus.producer import EventProducer
    from apportion.bus.provision import provision
    from apportion.bus.reader import read_log
    from apportion.bus.security import redis_auth
    from apportion.client import identity_for
    from apportion.clock import ScaledClock
    from services.dispatcher.app import run as run_dispatcher
    from services.dispatcher.config import DispatcherSettings

    for k, v in kafka_cluster.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", f"bl{uuid.uuid4().hex[:6]}.")
    bootstrap = kafka_cluster.bootstrap
    await asyncio.to_thread(provision, bootstrap)
    import redis as redis_lib

    redis_url = kafka_cluster.stack.redis_url
    redis_lib.Redis.from_url(redis_url, **redis_auth()).flushdb()

    now = datetime.now(UTC)
    clock = ScaledClock(30.0, now, now)
    producer = EventProducer(bootstrap, client_id="broker-loss")
    for path, share in (("lab", 1.0), ("lab/a", 1.0)):
        producer.publish(events.BudgetSet(path=path, share=share, ts=clock.now(), producer="test"))
    alice = await asyncio.to_thread(identity_for, "alice", bootstrap=bootstrap)
    stop = asyncio.Event()
    ready = asyncio.Event()
    settings = DispatcherSettings(
        kafka_bootstrap=bootstrap, redis_url=redis_url, log_json=False, instance_id="d-bl", grace_s=5.0
    )
    dispatcher = asyncio.create_task(run_dispatcher(settings, stop, clock=clock, ready=ready))
    admin = admin_client(bootstrap)
    try:
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        part = 0
        ids = job_ids(JOBS, part)
        acked: list[str] = []
        failed: list[str] = []

        def submit_all() -> None:
            for j in ids:
                t = clock.now()
                ev = alice.sign(
                    events.JobSubmitted(
                        job_id=j, budget="lab/a", user="alice", gpus_per_replica=1, min_runtime_s=0.0,
                        duration_s=60.0, submitted_at=t, ts=t, producer="test",
                    )
                )  # fmt: skip
                try:
                    producer.publish(ev, timeout_s=60.0)
                except Exception:  # noqa: BLE001 - not acknowledged: not promised, not counted
                    failed.append(j)
                else:
                    acked.append(j)

        sender = threading.Thread(target=submit_all, name="submitter")
        sender.start()
        await asyncio.to_thread(poll, lambda: len(acked) >= JOBS // 3, "a third of the submissions acknowledged")
        victim = leader_of(admin, topic_name(topics.SUBMISSIONS), part)
        pid = kafka_cluster.stack.node_pid(victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(sender.join, DEADLINE_S)
        assert not sender.is_alive()
        # the cluster went on without the victim: a new leader took the partition
        assert leader_of(admin, topic_name(topics.SUBMISSIONS), part) != victim
        assert len(acked) >= JOBS - 2, f"{len(failed)} submissions not acknowledged with one broker down: {failed}"

        def queued() -> set[str] | None:
            got = {
                r.event.job_id
                for r in read_log(bootstrap, [topic_name(topics.JOBS)])
                if isinstance(r.event, (events.JobQueued, events.JobPlaced))
            }
            return got if set(acked) <= got else None

        await asyncio.to_thread(poll, queued, "every acknowledged submission queued by the dispatcher")
        subs = [
            r.event.job_id
            for r in read_log(bootstrap, [topic_name(topics.SUBMISSIONS)])
            if isinstance(r.event, events.JobSubmitted)
        ]
        assert sorted(j for j in subs if j in set(ids)) == sorted(acked)  # each once: no retry duplicated
        # the victim restarts on its data and catches up with every partition
        await asyncio.to_thread(kafka_cluster.stack.start_kafka)
        assert kafka_cluster.stack.node_pid(victim) is not None
        await asyncio.to_thread(poll, lambda: in_sync_everywhere(admin, victim), f"node {victim} back in sync")
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(dispatcher, return_exceptions=True), 30)
        admin.close()
        producer.close()
        redis_lib.Redis.from_url(redis_url, **redis_auth()).flushdb()
        if kafka_cluster.stack.node_pid(1) is None or not kafka_cluster.stack.running():
            kafka_cluster.stack.start_kafka()  # leave the session's cluster whole for the next test
