"""Clients of the session's Kafka and Redis signed in as one principal, with its password from the servers'
secrets (``APPORTION_KAFKA_SECRETS_DIR``, ``APPORTION_REDIS_SECRETS_DIR``): ``producer_as`` and ``as_user``;
``end_offset``, a topic's end summed over its partitions, read as the session's admin."""

from __future__ import annotations

import os
from pathlib import Path


def producer_as(principal: str, bootstrap: str, password_of: str | None = None, bootstrap_timeout_ms: int = 30_000):
    """A producer signed in as ``principal``, with the password of ``password_of`` when given."""
    from kafka import KafkaProducer

    from apportion.bus.security import sasl_ssl

    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])
    return KafkaProducer(
        bootstrap_servers=bootstrap,
        **sasl_ssl(principal, (secrets / f"{password_of or principal}.password").read_text().strip()),
        max_block_ms=10_000,
        bootstrap_timeout_ms=bootstrap_timeout_ms,
        retries=0,
    )


def end_offset(bootstrap: str, topic: str) -> int:
    from kafka import KafkaConsumer, TopicPartition

    from apportion.bus.security import kafka_auth

    kc = KafkaConsumer(bootstrap_servers=bootstrap, **kafka_auth())  # the session's admin
    try:
        parts = [TopicPartition(topic, p) for p in kc.partitions_for_topic(topic) or ()]
        return sum(kc.end_offsets(parts).values())
    finally:
        kc.close()


def as_user(redis_url: str, user: str):
    import redis

    from apportion.bus.security import redis_tls

    secrets = Path(os.environ["APPORTION_REDIS_SECRETS_DIR"])
    password = (secrets / f"{user}.password").read_text().strip()
    return redis.Redis.from_url(redis_url, username=user, password=password, decode_responses=True, **redis_tls())
