"""Kafka and Redis in Docker via testcontainers, for machines with an engine.

The test fixtures try this after ``KAFKA_BOOTSTRAP``/``REDIS_URL`` and
before the native stack. Without a Docker engine the container constructor
raises :class:`docker.errors.DockerException`; :func:`start_containers`
lets it propagate so the caller can fall back. Nothing is built at import.

Kafka runs the official ``apache/kafka`` image (the same version as
``infra/kafka/pom.xml``) in KRaft combined mode. Its client port is bound to
a free host port chosen up front, so the advertised listener is known before
the container starts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from apportion.bus.stack import free_ports

KAFKA_IMAGE = "apache/kafka:4.1.1"
REDIS_IMAGE = "redis:7.0"


@dataclass
class Containers:
    """Running Kafka and Redis containers and their addresses."""

    kafka: Any
    redis: Any
    bootstrap: str
    redis_url: str

    def stop(self) -> None:
        for c in (self.kafka, self.redis):
            try:
                c.stop()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass


def _kafka_env(host_port: int) -> dict[str, str]:
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{host_port}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_HEAP_OPTS": "-Xms256m -Xmx512m",
    }


def wait_for_kafka(bootstrap: str, timeout_s: float = 90.0) -> None:
    """Poll a metadata call until the broker answers (deadline, no fixed sleep)."""
    from kafka.admin import KafkaAdminClient

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
            try:
                if admin.describe_cluster().get("brokers"):
                    return
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
        time.sleep(0.2)  # poll interval, bounded by the deadline
    raise TimeoutError(f"Kafka at {bootstrap} did not answer within {timeout_s}s: {last}")


def start_containers() -> Containers:
    """Start Kafka and Redis containers; raises DockerException without an engine."""
    from testcontainers.community.redis import RedisContainer
    from testcontainers.core.container import DockerContainer

    (host_port,) = free_ports(1)
    kafka = DockerContainer(KAFKA_IMAGE).with_bind_ports(9092, host_port)
    for k, v in _kafka_env(host_port).items():
        kafka = kafka.with_env(k, v)
    redis = RedisContainer(REDIS_IMAGE)
    kafka.start()
    try:
        redis.start()
        bootstrap = f"127.0.0.1:{host_port}"
        wait_for_kafka(bootstrap)
        url = f"redis://{redis.get_container_host_ip()}:{redis.get_exposed_port(6379)}/0"
    except BaseException:
        Containers(kafka, redis, "", "").stop()
        raise
    return Containers(kafka, redis, bootstrap, url)
