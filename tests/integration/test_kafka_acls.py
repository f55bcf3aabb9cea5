"""Kafka authentication and ACLs on the real broker (DESIGN section 10; ``apportion.bus.security``).

The session broker runs SASL/SCRAM-SHA-512 with KRaft's StandardAuthorizer
(``infra/kafka/start.sh``) and the ACL table provisioned for this test's
namespace. Each principal writes only the topics the table grants it: the
forbidden write fails with Kafka's ``TopicAuthorizationFailedError`` and
nothing reaches the topic; a client without credentials is not let in.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apportion import topics
from apportion.settings import topic_name

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def namespace(kafka_bootstrap: str) -> Iterator[str]:
    """One provisioned namespace for the module (topics and ACL table; each write test compares its topic's
    end offset before and after, so the tests need no namespace of their own)."""
    from apportion.bus.provision import provision

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APPORTION_TOPIC_PREFIX", f"acl{uuid.uuid4().hex[:8]}.")
        report = provision(kafka_bootstrap)
        assert report.acls > 0, "the session broker is not secured (APPORTION_KAFKA_PLAINTEXT?)"
        yield os.environ["APPORTION_TOPIC_PREFIX"]


#: How long a producer retries its first sign-in before giving up (kafka-python's default: 30 s). A refused
#: sign-in is retried with a growing backoff until then, so a probe the broker must refuse costs all of it:
#: 5 s is several refused attempts (the first within milliseconds), and :func:`_refused` checks the broker
#: did drop at least one, so the verdict is the refusal's, not a slow broker's.
REFUSED_BOOTSTRAP_MS = 5_000


def producer_as(principal: str, bootstrap: str, password_of: str | None = None, bootstrap_timeout_ms: int = 30_000):
    """A producer signed in as ``principal``, with the password of ``password_of`` when given."""
    from kafka import KafkaProducer

    from apportion.bus.security import MECHANISM

    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])
    return KafkaProducer(
        bootstrap_servers=bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=MECHANISM,
        sasl_plain_username=principal,
        sasl_plain_password=(secrets / f"{password_of or principal}.password").read_text().strip(),
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


CASES = [
    # (principal, topic, allowed): the threats of docs/security.md, then what each role needs
    ("researcher", topics.BUDGETS, False),  # change budgets
    ("researcher", topics.NODES, False),  # drain others' nodes, forge node reports
    ("researcher", topics.JOBS, False),  # forge completions
    ("researcher", topics.COMMANDS, False),  # start or stop workloads
    ("node-agent", topics.COMMANDS, False),  # an agent commanding itself or others
    ("node-agent", topics.BUDGETS, False),
    ("ops", topics.COMMANDS, False),
    ("ops", topics.JOBS, False),
    ("policy", topics.COMMANDS, False),
    ("accounting", topics.JOBS, False),
    ("web", topics.SUBMISSIONS, False),  # the dashboard is read-only
    ("web", topics.BUDGETS, False),
    ("web", topics.JOBS, False),
    ("researcher", topics.SUBMISSIONS, True),
    ("ops", topics.BUDGETS, True),
    ("ops", topics.NODES, True),
    ("node-agent", topics.NODES, True),
    ("node-agent", topics.JOBS, True),
    ("dispatcher", topics.COMMANDS, True),
    ("policy", topics.RANKING, True),
    ("accounting", topics.USAGE, True),
]


@pytest.mark.parametrize(
    "principal, topic, allowed",
    [pytest.param(p, t, a, id=f"{p} {'may' if a else 'may not'} write {t.base}") for p, t, a in CASES],
)
def test_each_principal_writes_only_its_topics(
    kafka_bootstrap: str, namespace: str, principal: str, topic: topics.Topic, allowed: bool
) -> None:
    from kafka.errors import TopicAuthorizationFailedError

    before = end_offset(kafka_bootstrap, topic_name(topic))
    p = producer_as(principal, kafka_bootstrap)
    try:
        fut = p.send(topic_name(topic), key=b"k", value=b'{"probe": true}')
        if allowed:
            fut.get(timeout=15)
        else:
            with pytest.raises(TopicAuthorizationFailedError):
                fut.get(timeout=15)
    except TopicAuthorizationFailedError:
        if allowed:
            raise
    finally:
        p.close(timeout=5)
    assert end_offset(kafka_bootstrap, topic_name(topic)) == before + (1 if allowed else 0)


def test_a_client_without_credentials_is_not_let_in(kafka_bootstrap: str, namespace: str) -> None:
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    with pytest.raises(KafkaError):
        p = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_block_ms=3000, api_version=(3, 0))
        try:
            p.send(topic_name(topics.SUBMISSIONS), value=b"{}").get(timeout=5)
        finally:
            p.close(timeout=2)


def test_provisioning_twice_changes_nothing(kafka_bootstrap: str, namespace: str) -> None:
    from apportion.bus.provision import provision
    from apportion.bus.security import acls, declared_node_agents, grants

    report = provision(kafka_bootstrap)
    assert (report.created, report.users, report.acls) == ([], 0, len(acls(grants(declared_node_agents()))))


@pytest.mark.parametrize("principal", ["dispatcher", "node-agent", "ops", "researcher"])
def test_only_the_dispatcher_may_take_over_its_transactional_id(
    kafka_bootstrap: str, namespace: str, principal: str
) -> None:
    """Taking the id over fences the leader (docs/leadership.md): anyone else who could would stop every
    decision; the broker refuses them with ``TransactionalIdAuthorizationFailedError``."""
    from kafka import KafkaProducer
    from kafka.errors import TransactionalIdAuthorizationFailedError

    from apportion.bus.security import MECHANISM
    from services.dispatcher.config import DispatcherSettings

    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])
    p = KafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism=MECHANISM,
        sasl_plain_username=principal,
        sasl_plain_password=(secrets / f"{principal}.password").read_text().strip(),
        transactional_id=DispatcherSettings().transactional_id(),
        max_block_ms=10_000,
    )
    try:
        if principal == "dispatcher":
            p.init_transactions()
        else:
            with pytest.raises(TransactionalIdAuthorizationFailedError):
                p.init_transactions()
    finally:
        p.close(timeout=5)


def _write(
    principal: str,
    bootstrap: str,
    topic: topics.Topic,
    password_of: str | None = None,
    bootstrap_timeout_ms: int = 30_000,
) -> None:
    """One probe record to ``topic`` as ``principal``; raises what the client raises."""
    p = producer_as(principal, bootstrap, password_of, bootstrap_timeout_ms)
    try:
        p.send(topic_name(topic), key=b"k", value=b'{"probe": true}').get(timeout=10)
    finally:
        p.close(timeout=5)


def _refused(
    caplog: pytest.LogCaptureFixture,
    principal: str,
    bootstrap: str,
    topic: topics.Topic,
    password_of: str | None = None,
) -> None:
    """A probe the broker must not let sign in: the client gives up (a ``KafkaError``) after the broker dropped
    at least one of its sign-ins (kafka-python logs each dropped bootstrap connection)."""
    import logging

    from kafka.errors import KafkaError

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kafka.net.manager"), pytest.raises(KafkaError):
        _write(principal, bootstrap, topic, password_of, bootstrap_timeout_ms=REFUSED_BOOTSTRAP_MS)
    dropped = [r for r in caplog.records if r.getMessage().startswith("Bootstrap connection to bootstrap-0 failed")]
    assert dropped, [r.getMessage() for r in caplog.records]


def test_each_declared_node_agent_is_its_own_principal_and_can_be_locked_out_alone(
    kafka_bootstrap: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    from kafka.admin import UserScramCredentialDeletion
    from kafka.errors import TopicAuthorizationFailedError

    from apportion.bus.provision import admin_client, provision
    from apportion.bus.security import MECHANISM, acls, grants, node_agent_principal

    report = provision(kafka_bootstrap, node_agents=("rack1", "rack2"))
    role = len(acls(tuple(g for g in grants() if g.principal == "node-agent")))  # the node-agent rows' ACLs
    assert report.acls == len(acls(grants(("rack1", "rack2")))) == len(acls(grants())) + 2 * role
    one, two = node_agent_principal("rack1"), node_agent_principal("rack2")
    assert (one, two) == ("node-agent.rack1", "node-agent.rack2")
    # each has the node-agent role: node reports and outcomes, no commands
    before = end_offset(kafka_bootstrap, topic_name(topics.NODES))
    _write(one, kafka_bootstrap, topics.NODES)
    _write(two, kafka_bootstrap, topics.JOBS)
    with pytest.raises(TopicAuthorizationFailedError):
        _write(one, kafka_bootstrap, topics.COMMANDS)
    assert end_offset(kafka_bootstrap, topic_name(topics.NODES)) == before + 1
    # one agent's password does not sign in as another
    _refused(caplog, two, kafka_bootstrap, topics.NODES, password_of=one)
    # ops lock rack2 out (its SCRAM credential deleted): it cannot connect, rack1 runs on
    admin = admin_client(kafka_bootstrap)
    try:
        admin.alter_user_scram_credentials([UserScramCredentialDeletion(two, MECHANISM)])
    finally:
        admin.close()
    _refused(caplog, two, kafka_bootstrap, topics.NODES)
    _write(one, kafka_bootstrap, topics.NODES)
    assert end_offset(kafka_bootstrap, topic_name(topics.NODES)) == before + 2
