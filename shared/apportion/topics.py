"""The single topic registry: names, keys, partitions, retention, compaction.

Every service, the provisioning script and the tests read topic facts from
here and nowhere else (STYLE rule 11). Event-to-topic routing lives beside
the event models in :data:`apportion.events.TOPIC_OF`.

Retention ``-1`` means kept forever: event logs are the source of truth and
occupancy windows are rebuilt from them. Compacted topics hold latest-state
only (one value per key) and are never used to rebuild occupancy.

Namespaces: a prefix is put in front of every topic name, so several
independent apportion clusters (staging and production, or one per
integration test) can share one Kafka cluster. :attr:`Topic.base` is the
registry name; :meth:`Topic.named` the physical name in a namespace. This
module reads no environment (it is part of the pure core's contract): the
namespace in force (``APPORTION_TOPIC_PREFIX``) is read at the settings edge,
:func:`apportion.settings.topic_prefix`, and its physical names are
:func:`apportion.settings.topic_name`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Topic:
    """One Kafka topic as apportion declares it.

    Attributes:
        base: the registry name, e.g. ``"apportion.jobs"``; :meth:`named`
            adds a namespace prefix.
        key: what the record key is (documentation; e.g. ``"job_id"``).
        partitions: partition count at creation.
        retention_ms: ``retention.ms``; ``-1`` keeps the log forever.
        compact: ``cleanup.policy=compact`` when True, else ``delete``.
        description: one line for ``--help`` and docs.
        extra_configs: further topic-level configs, ``(name, value)`` pairs
            (e.g. :data:`BROKER_TIME` on the signed topics).
    """

    base: str
    key: str
    partitions: int
    retention_ms: int
    compact: bool = False
    description: str = ""
    extra_configs: tuple[tuple[str, str], ...] = field(default=())

    def named(self, prefix: str) -> str:
        """Physical topic name in the namespace ``prefix``: ``prefix + base`` (``""``: the default namespace)."""
        return prefix + self.base

    def configs(self) -> dict[str, str]:
        """Topic-level configs to create with and to verify for drift."""
        cfg = {
            "cleanup.policy": "compact" if self.compact else "delete",
            "retention.ms": str(self.retention_ms),
        }
        cfg.update(dict(self.extra_configs))
        return cfg


KEEP_FOREVER = -1

#: The broker stamps each record with its append time (``message.timestamp.type=LogAppendTime``), on every
#: topic that holds signed records or key events (rule D10.proven-user): the readers judge a signature by the keys
#: as of its record's place in the log (:func:`apportion.logrecord.log_position`), which a producer's
#: ``CreateTime`` (the signer's choice) would let a holder of a revoked key backdate.
BROKER_TIME: tuple[tuple[str, str], ...] = (("message.timestamp.type", "LogAppendTime"),)

#: Most replicas a registry topic gets (rule D4.log: a cluster of three survives the loss of one broker).
MAX_REPLICAS = 3


def replication(brokers: int) -> tuple[int, int]:
    """``(replication factor, min.insync.replicas)`` of every registry topic on a cluster of ``brokers``.

    ``min(3, brokers)`` replicas and one fewer in sync, at least one: ``(1, 1)`` on one broker, ``(2, 1)`` on
    two, ``(3, 2)`` on three or more, so with ``acks=all`` an acknowledged write is on two brokers and the
    cluster keeps taking writes with one broker down. ``infra/kafka/start-cluster.sh`` applies the same rule to
    the broker's internal topics and defaults.

    Raises:
        ValueError: ``brokers`` < 1.
    """
    if brokers < 1:
        raise ValueError(f"a cluster has at least one broker, got {brokers}")
    rf = min(MAX_REPLICAS, brokers)
    return rf, max(1, rf - 1)


SUBMISSIONS = Topic(
    "apportion.submissions",
    "job_id",
    3,
    KEEP_FOREVER,
    description="JobSubmitted, JobCancelRequested from users, CLI and client",
    extra_configs=BROKER_TIME,
)
JOBS = Topic(
    "apportion.jobs",
    "job_id",
    3,
    KEEP_FOREVER,
    description="job lifecycle facts from dispatcher and node agents",
    extra_configs=BROKER_TIME,
)
NODES = Topic(
    "apportion.nodes",
    "node_id",
    3,
    KEEP_FOREVER,
    description="node inventory, heartbeats, cordon/drain/lost, refused ops requests",
    extra_configs=BROKER_TIME,
)
COMMANDS = Topic(
    "apportion.commands",
    "node_id",
    3,
    KEEP_FOREVER,
    description="StartWorkload, StopWorkload to node agents",
    extra_configs=BROKER_TIME,
)
BUDGETS = Topic(
    "apportion.budgets",
    "path (a BudgetBatch: cluster)",
    1,
    KEEP_FOREVER,
    description="BudgetSet, BudgetRemoved, BudgetBatch, BudgetRejected, key registrations and revocations",
    extra_configs=BROKER_TIME,
)
USAGE = Topic("apportion.usage", "budget", 3, KEEP_FOREVER, description="OccupancySnapshot from accounting")
RANKING = Topic("apportion.ranking", "cluster", 1, KEEP_FOREVER, description="FairShareRanking from policy")
DEADLETTER = Topic(
    "apportion.deadletter",
    "source key",
    1,
    KEEP_FOREVER,
    description="DeadLetter: undecodable or invalid input with the reason",
)

ALL_TOPICS: tuple[Topic, ...] = (
    SUBMISSIONS,
    JOBS,
    NODES,
    COMMANDS,
    BUDGETS,
    USAGE,
    RANKING,
    DEADLETTER,
)

BY_BASE: dict[str, Topic] = {t.base: t for t in ALL_TOPICS}


def by_name(name: str, prefix: str) -> Topic | None:
    """Registry topic for a physical name in the namespace ``prefix``, or for a base name; ``None`` if neither."""
    if prefix and name.startswith(prefix):
        name = name[len(prefix) :]
    return BY_BASE.get(name)
