"""Create apportion's topics from the registry and report config drift.

The registry is :data:`apportion.topics.ALL_TOPICS`. :func:`provision`
creates every missing topic with its partitions and configs (idempotent: a
topic that exists is left alone), then compares what the broker has with
what is declared and reports each difference as a :class:`Drift`. It never
changes an existing topic unless asked (``fix=True`` sets drifted configs;
partition counts and replication factors are only reported, since changing
them re-keys entities or moves data), except for the configs in
:data:`ALWAYS_SET`: the signed topics' ``message.timestamp.type=LogAppendTime``
(:data:`apportion.topics.BROKER_TIME`) is set on an existing topic too (it
only stamps later appends, moves and deletes nothing, and the readers' key
rule relies on it: a topic made before it was declared gets it at the next
``make up``, ``apportion stack up`` or ``provision``).

Replication comes from the cluster's size (:func:`apportion.topics.replication`):
one broker gives one replica, three or more give three replicas with
``min.insync.replicas=2`` (declared on each topic, checked for drift), so a
write acknowledged with ``acks=all`` survives the loss of any one broker.

Command line (also ``infra/provision.py``)::

    python -m apportion.bus.provision --bootstrap 127.0.0.1:9092 [--fix] [--strict] [--register-keys DIR]

``--register-keys DIR`` also publishes, as the caller (ops or admin), the
``UserKeyRegistered`` of every public key file in DIR (:func:`key_registrations`:
the compose file's signing keys, ``infra/compose-secrets.sh``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from apportion.settings import topic_name
from apportion.topics import ALL_TOPICS, BROKER_TIME, Topic, replication

#: Configs :func:`provision` sets on an existing topic whenever they drift, even without ``fix`` (module doc).
ALWAYS_SET = frozenset(k for k, _ in BROKER_TIME)


@dataclass(frozen=True, slots=True)
class Drift:
    """One way a topic on the broker differs from its declaration."""

    topic: str
    setting: str  # a config key, or "partitions"
    declared: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.setting} is {self.actual!r}, declared {self.declared!r}"


@dataclass(slots=True)
class ProvisionReport:
    """What :func:`provision` did and found."""

    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    drift: list[Drift] = field(default_factory=list)
    fixed: list[Drift] = field(default_factory=list)
    users: int = 0
    acls: int = 0
    #: ``(replication factor, min.insync.replicas)`` the topics were created and checked with
    replication: tuple[int, int] = (1, 1)

    def lines(self) -> list[str]:
        out = [f"created {t}" for t in self.created]
        out += [f"exists  {t}" for t in self.existing]
        out += [f"DRIFT   {d}" for d in self.drift]
        out += [f"fixed   {d}" for d in self.fixed]
        return out


def admin_client(bootstrap: str) -> Any:
    """A kafka-python admin client (the caller closes it)."""
    from kafka.admin import KafkaAdminClient

    from apportion.bus.security import kafka_auth

    return KafkaAdminClient(bootstrap_servers=bootstrap, client_id="apportion-provision", **kafka_auth())


def declared_configs(topic: Topic, replication: tuple[int, int] | None = None) -> dict[str, str]:
    """``topic``'s configs as provisioned: its own, plus ``min.insync.replicas`` when ``replication`` is given."""
    cfg = topic.configs()
    if replication is not None:
        cfg["min.insync.replicas"] = str(replication[1])
    return cfg


def cluster_replication(admin: Any) -> tuple[int, int]:
    """:func:`apportion.topics.replication` of the cluster ``admin`` is connected to (its registered brokers)."""
    return replication(len(admin.describe_cluster()["brokers"]))


def create_missing(
    admin: Any, topics: Iterable[Topic], replication_factor: int = 1, min_insync: int | None = None
) -> list[str]:
    """Create the topics that do not exist yet with ``replication_factor`` replicas (and ``min.insync.replicas``
    when ``min_insync`` is given; else the broker's default); return their names."""
    topics = list(topics)
    have = set(admin.list_topics())
    missing = [t for t in topics if topic_name(t) not in have]
    if not missing:
        return []
    rep = None if min_insync is None else (replication_factor, min_insync)
    spec = {
        topic_name(t): {
            "num_partitions": t.partitions,
            "replication_factor": replication_factor,
            "configs": declared_configs(t, rep),
        }
        for t in missing
    }
    resp = admin.create_topics(spec, raise_errors=False, wait_for_metadata=True)
    created = []
    for result in resp.get("topics", []):
        if result["error_code"] == 0:
            created.append(result["name"])
        elif result["error_code"] != 36:  # 36 TOPIC_ALREADY_EXISTS: someone raced us, fine
            raise RuntimeError(f"cannot create {result['name']}: {result.get('error_message')}")
    return sorted(created)


def find_drift(admin: Any, topics: Iterable[Topic], replication: tuple[int, int] | None = None) -> list[Drift]:
    """Compare partitions and declared configs on the broker with the registry; with ``replication``
    (:func:`apportion.topics.replication`) also every partition's replica count and ``min.insync.replicas``."""
    from kafka.admin import ConfigResource, ConfigResourceType

    topics = list(topics)
    drift: list[Drift] = []
    described = {d["name"]: d for d in admin.describe_topics([topic_name(t) for t in topics])}
    resources = [
        ConfigResource(
            ConfigResourceType.TOPIC, topic_name(t), configs={k: None for k in declared_configs(t, replication)}
        )
        for t in topics
    ]
    configs = admin.describe_configs(resources, config_filter="all").get("topic", {})
    for t in topics:
        d = described.get(topic_name(t))
        if d is None or d.get("error_code", 0) != 0:
            drift.append(Drift(topic_name(t), "exists", "yes", "no"))
            continue
        parts = len(d["partitions"])
        if parts != t.partitions:
            drift.append(Drift(topic_name(t), "partitions", str(t.partitions), str(parts)))
        if replication is not None:
            counts = sorted({len(p["replica_nodes"]) for p in d["partitions"]})
            if counts != [replication[0]]:
                drift.append(Drift(topic_name(t), "replication", str(replication[0]), ",".join(map(str, counts))))
        actual = configs.get(topic_name(t), {})
        for key, want in declared_configs(t, replication).items():
            got = actual.get(key, {}).get("value")
            if got != want:
                drift.append(Drift(topic_name(t), key, want, str(got)))
    return drift


def fix_drift(admin: Any, drift: Iterable[Drift]) -> list[Drift]:
    """Set drifted topic configs to their declared values (not partitions)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    fixable = [d for d in drift if d.setting not in ("partitions", "replication", "exists")]
    by_topic: dict[str, dict[str, str]] = {}
    for d in fixable:
        by_topic.setdefault(d.topic, {})[d.setting] = d.declared
    if by_topic:
        admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, configs=cfg) for name, cfg in by_topic.items()]
        )
    return fixable


def settled_drift(
    admin: Any,
    topics: Sequence[Topic],
    replication: tuple[int, int],
    fixed: Sequence[Drift],
    timeout_s: float = 10.0,
) -> list[Drift]:
    """The drift left once the broker answering describes shows the fixed settings: a KRaft broker applies a
    config change when the controller's metadata reaches it, so a describe right after the change can still
    read the old value. Asks again every 0.1 s until no fixed (topic, setting) reads as drifted, or
    ``timeout_s`` passed (then the drift as last read, which names what did not take)."""
    import time

    pending = {(d.topic, d.setting) for d in fixed}
    deadline = time.monotonic() + timeout_s
    while True:
        drift = find_drift(admin, topics, replication)
        if not pending & {(d.topic, d.setting) for d in drift} or time.monotonic() >= deadline:
            return drift
        time.sleep(0.1)


def provision(
    bootstrap: str,
    topics: Iterable[Topic] = ALL_TOPICS,
    *,
    fix: bool = False,
    replication_factor: int | None = None,
    node_agents: Sequence[str] | None = None,
) -> ProvisionReport:
    """Create missing topics, then verify every declared topic (see module doc).

    ``replication_factor``: ``None`` (default) takes :func:`apportion.topics.replication` of the brokers the
    cluster has registered; a number forces it (``min.insync.replicas`` one less, at least 1).

    Connected as the super user ``admin`` (a secured broker, :mod:`apportion.bus.security`), it also
    creates the Kafka users and the ACLs of the topic namespace in force, idempotently: one principal per
    node agent of ``node_agents`` (names; ``None``: :func:`apportion.bus.security.declared_node_agents`).
    """
    from apportion.bus.security import ADMIN, kafka_auth, provision_security, secrets_dir

    topics = list(topics)
    admin = admin_client(bootstrap)
    try:
        report = ProvisionReport()
        if replication_factor is None:
            report.replication = cluster_replication(admin)
        else:
            report.replication = (replication_factor, max(1, replication_factor - 1))
        report.created = create_missing(admin, topics, *report.replication)
        report.existing = sorted(topic_name(t) for t in topics if topic_name(t) not in report.created)
        if kafka_auth().get("sasl_plain_username") == ADMIN:  # a secured broker: users and ACLs too
            report.users, report.acls = provision_security(admin, secrets_dir(), node_agents)
        report.drift = find_drift(admin, topics, report.replication)
        to_fix = report.drift if fix else [d for d in report.drift if d.setting in ALWAYS_SET]
        if to_fix:
            report.fixed = fix_drift(admin, to_fix)
            report.drift = settled_drift(admin, topics, report.replication, report.fixed)
        return report
    finally:
        admin.close()


def key_registrations(key_dir: Path) -> list[Any]:
    """The ``UserKeyRegistered`` of each public key file ``key_dir/*.json`` (``infra/signing-key.sh``'s
    ``PUBLIC``: ``user``, ``role``, ``public_key``, ``created``), in file-name order.

    Each has event time ``created`` and an id made of the user and the key, so registering the same files
    again publishes the same records, which every reader drops as duplicates (a compose stack runs its
    provisioning at every ``up``).

    Raises:
        FileNotFoundError: ``key_dir`` is not a directory, or holds no key file (run the script first).
        ValueError: a file misses a field, or its key or role is not valid
            (:func:`apportion.client.key_registration`).
    """
    from apportion.client import key_registration
    from apportion.events import det_id

    if not any(key_dir.glob("*.json")):
        raise FileNotFoundError(f"no public key files in {key_dir} (infra/compose-secrets.sh makes them)")
    out = []
    for path in sorted(key_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        try:
            user, key, created = str(doc["user"]), str(doc["public_key"]), datetime.fromisoformat(doc["created"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is not a public key file of infra/signing-key.sh: {exc}") from None
        ev = key_registration(user, key, role=str(doc.get("role", "user")), by="provision", now=created)
        out.append(ev.model_copy(update={"event_id": det_id("key-file", user, key)}))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m apportion.bus.provision``: provision, print the report; exit 0, 1 (drift with ``--strict``),
    or 3 with one ``error:`` line on stderr when Kafka cannot be reached (the CLI's exit codes)."""
    from apportion.settings import Connection

    ap = argparse.ArgumentParser(description="Create apportion topics and report config drift.")
    ap.add_argument(
        "--bootstrap",
        default=None,
        help="Kafka bootstrap servers (default: $APPORTION_KAFKA_BOOTSTRAP, $KAFKA_BOOTSTRAP, the stack.env "
        "of `make up` / `apportion stack up`, else 127.0.0.1:9092)",
    )
    ap.add_argument(
        "--replication-factor",
        type=int,
        default=None,
        help="replicas per partition (default: min(3, brokers of the cluster); min.insync.replicas is one less)",
    )
    ap.add_argument("--fix", action="store_true", help="set drifted configs to their declared values")
    ap.add_argument("--strict", action="store_true", help="exit 1 when drift remains")
    ap.add_argument(
        "--register-keys",
        type=Path,
        default=None,
        metavar="DIR",
        help="also register the public key files DIR/*.json (infra/compose-secrets.sh's keys/public)",
    )
    args = ap.parse_args(argv)
    bootstrap = Connection.resolve(bootstrap=args.bootstrap).bootstrap
    try:
        regs = key_registrations(args.register_keys) if args.register_keys is not None else []
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        report = provision(bootstrap, fix=args.fix, replication_factor=args.replication_factor)
        if regs:
            from apportion.client import publish

            publish(*regs, bootstrap=bootstrap)
    except Exception as exc:
        if not type(exc).__module__.startswith("kafka"):  # kafka-python's errors have many types
            raise
        print(
            f"error: cannot reach Kafka at {bootstrap}: {exc} (is the stack up? `apportion stack up` or `make up`; "
            "`apportion stack status` prints its bootstrap; or give --bootstrap HOST:PORT)",
            file=sys.stderr,
        )
        return 3
    for line in report.lines():
        print(line)
    for ev in regs:
        print(f"key of {ev.user} ({ev.role}) registered: {ev.public_key}")
    if report.drift:
        print(
            f"{len(report.drift)} drifted setting(s); --fix sets configs back "
            "(partition counts are changed by hand only)",
            file=sys.stderr,
        )
        return 1 if args.strict else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
