"""Replication of the registry topics by cluster size, and the producer settings it relies on (issue 17)."""

from __future__ import annotations

import pytest

from apportion import topics
from apportion.bus.producer import RELIABLE, EventProducer
from apportion.bus.provision import declared_configs
from tests.kit.narrowing import narrow


@pytest.mark.parametrize(("brokers", "want"), [(1, (1, 1)), (2, (2, 1)), (3, (3, 2)), (5, (3, 2))])
def test_replication_is_min_three_and_one_fewer_in_sync(brokers: int, want: tuple[int, int]) -> None:
    assert topics.replication(brokers) == want


def test_a_cluster_without_brokers_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one broker"):
        topics.replication(0)


def test_min_insync_replicas_is_declared_only_with_a_replication() -> None:
    assert "min.insync.replicas" not in declared_configs(topics.SUBMISSIONS)
    cfg = declared_configs(topics.SUBMISSIONS, topics.replication(3))
    assert cfg == {
        "cleanup.policy": "delete",
        "retention.ms": "-1",
        "message.timestamp.type": "LogAppendTime",
        "min.insync.replicas": "2",
    }


def test_every_producer_waits_for_all_in_sync_replicas_and_is_idempotent() -> None:
    assert RELIABLE["acks"] == "all" and RELIABLE["enable_idempotence"] is True
    assert narrow(int, RELIABLE["max_in_flight_requests_per_connection"]) <= 5  # Kafka's idempotent limit
    with pytest.raises(ValueError, match="fixes"):
        EventProducer("127.0.0.1:1", acks=1)


def test_faust_apps_replicate_their_topics_by_the_same_rule_and_list_every_broker() -> None:
    from apportion.bus.faust_app import make_app

    app = make_app("repl-test", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3")
    assert app.conf.topic_replication_factor == 3
    assert app.conf.producer_acks == -1
    assert [str(u) for u in app.conf.broker] == ["kafka://127.0.0.1:1", "kafka://127.0.0.1:2", "kafka://127.0.0.1:3"]
