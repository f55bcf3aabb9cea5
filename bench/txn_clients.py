"""The dispatcher's write pattern with two Kafka clients: kafka-python and confluent-kafka (librdkafka).

One transaction per decision: begin, produce one signed-`StartWorkload`-sized record, commit; a
``read_committed`` reader assigned to the topic sees it. Each client writes to a topic of its own and each
topic has a reader of either client, so every round trip is timed for the four pairs of writer and reader
(kafka-python -> kafka-python is the dispatcher and the node agent as shipped). The pairs take turns, one
round trip each, so the machine's load falls on all of them alike. Per pair it prints p50/p95 of:

- begin -> commit returned (the writer's part: add the partition, produce, end the transaction);
- commit returned -> seen by the reader (the commit markers and the reader's wake-up);
- begin -> seen (the whole hop a decision takes to a reader).

It starts a local stack as ``bench/bench_live.py`` does (TLS, SASL/SCRAM, ACLs; the super user), or uses
``KAFKA_BOOTSTRAP`` with the stack's client environment when set; ``APPORTION_INFRA_DIR`` starts the broker
from another ``infra/`` (a variant of its settings). It needs ``confluent-kafka``, which apportion itself does
not use (``pip install confluent-kafka``). Not part of ``make bench``::

    .venv/bin/python bench/txn_clients.py --trips 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

#: bytes of a signed StartWorkload (docs/performance.md)
RECORD_BYTES = 721


def rdkafka_settings() -> dict[str, Any]:
    """:func:`apportion.bus.security.kafka_auth` in librdkafka's configuration keys: the same principal, password,
    mechanism and transport, the server verified against the same CA file, host name included."""
    from apportion.bus.security import TLS_CA_SETTING, kafka_auth
    from apportion.settings import stack_env

    kp = kafka_auth()
    if not kp:
        return {}
    out = {
        "security.protocol": kp["security_protocol"],
        "sasl.mechanism": kp["sasl_mechanism"],
        "sasl.username": kp["sasl_plain_username"],
        "sasl.password": kp["sasl_plain_password"],
    }
    if kp["security_protocol"] == "SASL_SSL":
        out["ssl.endpoint.identification.algorithm"] = "https"
        ca = os.environ.get(TLS_CA_SETTING) or stack_env().get(TLS_CA_SETTING)
        if ca:
            out["ssl.ca.location"] = ca
    return out


class KpWriter:
    name = "kafka-python"

    def __init__(self, bootstrap: str, topic: str) -> None:
        from apportion.bus.producer import EventProducer

        self.topic = topic
        self.p = EventProducer(bootstrap, client_id="txn-bench-kp", transactional_id=f"txn-bench-kp-{uuid.uuid4().hex}")
        self.p.init_transactions()

    def trip(self, key: bytes, value: bytes) -> None:
        self.p.begin()
        self.p.send_raw(self.topic, value, key)
        self.p.commit()

    def close(self) -> None:
        self.p.close()


class CkWriter:
    name = "confluent-kafka"

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.p = Producer(
            {
                "bootstrap.servers": bootstrap,
                "client.id": "txn-bench-ck",
                "transactional.id": f"txn-bench-ck-{uuid.uuid4().hex}",
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": 0,
                **rdkafka_settings(),
            }
        )
        self.p.init_transactions(30)

    def trip(self, key: bytes, value: bytes) -> None:
        self.p.begin_transaction()
        self.p.produce(self.topic, value=value, key=key)
        self.p.commit_transaction(30)

    def close(self) -> None:
        self.p.flush(10)


class Reader(threading.Thread):
    """A ``read_committed`` reader of one topic (made by the run, read from offset 0) on a thread of its own:
    records the ``perf_counter`` moment each key arrives."""

    def __init__(self, bootstrap: str, topic: str, kind: str) -> None:
        super().__init__(daemon=True)
        self.kind, self.topic = kind, topic
        self.seen: dict[bytes, float] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        if kind == "kafka-python":
            from kafka import KafkaConsumer, TopicPartition

            from apportion.bus.producer import READ_COMMITTED
            from apportion.bus.security import kafka_auth

            self.c: Any = KafkaConsumer(
                bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, **READ_COMMITTED, **kafka_auth()
            )
            parts = [TopicPartition(topic, p) for p in sorted(self.c.partitions_for_topic(topic) or ())]
            self.c.assign(parts)
            for tp in parts:  # the run made the topic: everything in it is the run's
                self.c.seek(tp, 0)
        else:
            from confluent_kafka import Consumer, TopicPartition

            self.c = Consumer(
                {
                    "bootstrap.servers": bootstrap,
                    "group.id": f"txn-bench-{uuid.uuid4().hex}",
                    "enable.auto.commit": False,
                    "isolation.level": "read_committed",
                    "fetch.wait.max.ms": 500,
                    **rdkafka_settings(),
                }
            )
            md = self.c.list_topics(topic, timeout=10)
            self.c.assign([TopicPartition(topic, p, 0) for p in sorted(md.topics[topic].partitions)])

    def run(self) -> None:
        while not self.stop.is_set():
            if self.kind == "kafka-python":
                batch = self.c.poll(timeout_ms=100)
                now = time.perf_counter()
                keys = [r.key for recs in batch.values() for r in recs]
            else:
                m = self.c.poll(0.1)  # returns at the first record (consume(n, t) waits for n or t)
                now = time.perf_counter()
                keys = [m.key()] if m is not None and m.error() is None else []
            if keys:
                with self.cond:
                    for k in keys:
                        self.seen.setdefault(k, now)
                    self.cond.notify_all()
        self.c.close()

    def wait(self, key: bytes, timeout: float = 30.0) -> float:
        end = time.perf_counter() + timeout
        with self.cond:
            while key not in self.seen:
                left = end - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"{self.kind} reader of {self.topic} did not see {key!r}")
                self.cond.wait(left)
            return self.seen[key]


def run(bootstrap: str, trips: int, warmup: int) -> None:
    from apportion.bus.provision import admin_client
    from apportion.report import percentile

    suffix = uuid.uuid4().hex[:6]
    topics = {"kafka-python": f"txn-bench-kp-{suffix}", "confluent-kafka": f"txn-bench-ck-{suffix}"}
    create_topics(admin_client(bootstrap), list(topics.values()))
    writers: dict[str, KpWriter | CkWriter] = {
        "kafka-python": KpWriter(bootstrap, topics["kafka-python"]),
        "confluent-kafka": CkWriter(bootstrap, topics["confluent-kafka"]),
    }
    readers = {(w, r): Reader(bootstrap, topics[w], r) for w in topics for r in topics}
    for rd in readers.values():
        rd.start()
    value = b"x" * RECORD_BYTES
    res: dict[tuple[str, str], dict[str, list[float]]] = {
        pair: {"commit": [], "wake": [], "total": []} for pair in readers
    }
    for i in range(warmup + trips):
        for wname, w in writers.items():
            key = f"{wname}-{i}".encode()
            t0 = time.perf_counter()
            w.trip(key, value)
            t1 = time.perf_counter()
            for rname in topics:
                seen = readers[(wname, rname)].wait(key)
                if i >= warmup:
                    r = res[(wname, rname)]
                    r["commit"].append((t1 - t0) * 1000)
                    r["wake"].append((seen - t1) * 1000)
                    r["total"].append((seen - t0) * 1000)
    for rd in readers.values():
        rd.stop.set()
    for rd in readers.values():
        rd.join(5)
    for w in writers.values():
        w.close()
    print(f"load average {os.getloadavg()[0]:.1f}; {trips} trips each, alternated; p50 / p95 ms")
    print(f"{'writer -> reader':<36} {'begin->commit':>16} {'commit->seen':>16} {'begin->seen':>16}")
    for (wname, rname), r in res.items():
        cells = [
            f"{statistics.median(r[k]):6.2f} / {percentile(r[k], 95) or 0:6.2f}" for k in ("commit", "wake", "total")
        ]
        print(f"{wname + ' -> ' + rname:<36} " + " ".join(f"{c:>16}" for c in cells))


def create_topics(admin: Any, names: list[str]) -> None:
    from kafka.admin import NewTopic

    admin.create_topics([NewTopic(n, 1, 1, topic_configs={"message.timestamp.type": "LogAppendTime"}) for n in names])
    admin.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trips", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        print("txn_clients.py needs confluent-kafka: .venv/bin/python -m pip install confluent-kafka", file=sys.stderr)
        return 2
    from scratch import scratch_dir

    from apportion.bus.stack import LocalStack

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
    if bootstrap:
        run(bootstrap, args.trips, args.warmup)
        return 0
    with scratch_dir("apportion-txn-bench-", False) as root:
        stack = LocalStack(root / "stack")
        try:
            stack.start()
            run(stack.bootstrap, args.trips, args.warmup)
        finally:
            stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
