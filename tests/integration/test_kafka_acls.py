"""Kafka authentication and ACLs on the real broker (rule D10.authentication; ``apportion.bus.security``).

The session broker runs SASL_SSL (SCRAM-SHA-512 over TLS) with KRaft's StandardAuthorizer
(``infra/kafka/start.sh``) and the ACL table provisioned for this test's
namespace. Each principal writes only the topics the table grants it: the
forbidden write fails with Kafka's ``TopicAuthorizationFailedError`` and
nothing reaches the topic; a client without credentials is not let in.
Transport: a plaintext request gets no answer, a client that does not trust the
stack's CA (or expects another name) fails on Kafka's and Redis' ports, and the
broker runs no plaintext listener.
"""

from __future__ import annotations

import os
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from apportion import topics
from apportion.settings import topic_name
from tests.kit.principals import end_offset, producer_as

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
    """kafka-python without TLS or SASL (the client settings of a plaintext broker): not let in."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    with pytest.raises(KafkaError):
        p = KafkaProducer(bootstrap_servers=kafka_bootstrap, max_block_ms=3000, api_version=(3, 0))
        try:
            p.send(topic_name(topics.SUBMISSIONS), value=b"{}").get(timeout=5)
        finally:
            p.close(timeout=2)


def _host_port(bootstrap: str) -> tuple[str, int]:
    host, port = bootstrap.split(",", 1)[0].rsplit(":", 1)
    return host, int(port)


#: A Kafka ApiVersions v0 request (api key 18, correlation id 7, client id "probe"), framed.
API_VERSIONS = struct.pack(">ihhih5s", 2 + 2 + 4 + 2 + 5, 18, 0, 7, 5, b"probe")


def test_the_client_listener_answers_no_plaintext_request(kafka_bootstrap: str) -> None:
    """A Kafka request in clear on the client port gets no Kafka answer: the broker reads it as a TLS record,
    answers with a TLS alert (content type 21) at most, and closes."""
    with socket.create_connection(_host_port(kafka_bootstrap), timeout=10) as sock:
        sock.sendall(API_VERSIONS)
        got = b""
        while chunk := sock.recv(4096):
            got += chunk
    assert got == b"" or got[0] == 21, got[:16]
    assert got[8:12] != struct.pack(">i", 7), "a plaintext ApiVersions request was answered"


@pytest.mark.parametrize(
    ("trust", "name", "error"),
    [
        ("the system's CAs, not the stack's", "127.0.0.1", "certificate verify failed"),
        ("the stack's CA, another host name", "kafka.example.org", "Hostname mismatch"),
    ],
)
def test_a_client_that_does_not_trust_the_servers_certificate_fails(
    kafka_bootstrap: str, redis_url: str, trust: str, name: str, error: str
) -> None:
    """The TLS handshake fails on both servers' client ports for a client that does not trust the stack's CA
    or that expects another name; the stack's own client context (``bus/security.tls_context``) succeeds."""
    import ssl

    from apportion.bus.security import tls_context

    ctx = tls_context() if "stack's CA" in trust else ssl.create_default_context()
    redis_host, redis_port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
    for address in (_host_port(kafka_bootstrap), (redis_host, int(redis_port))):
        with socket.create_connection(address, timeout=10) as sock:
            with pytest.raises(ssl.SSLCertVerificationError, match=error):
                ctx.wrap_socket(sock, server_hostname=name)
        with (
            socket.create_connection(address, timeout=10) as sock,
            tls_context().wrap_socket(sock, server_hostname=address[0]) as tls,
        ):
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    assert tls_context().check_hostname and tls_context().verify_mode == ssl.CERT_REQUIRED


def test_the_broker_has_no_plaintext_listener(kafka_bootstrap: str) -> None:
    """Every listener the broker runs, as it reports them, is TLS (``SASL_SSL``): none is ``PLAINTEXT`` or
    ``SASL_PLAINTEXT``, and clients' settings ask for TLS."""
    from kafka.admin import ConfigResource, ConfigResourceType

    from apportion.bus.provision import admin_client
    from apportion.bus.security import kafka_auth

    admin = admin_client(kafka_bootstrap)
    try:
        got = admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "1")], config_filter="all")
    finally:
        admin.close()
    cfg = {k: v["value"] if isinstance(v, dict) else v for k, v in got["broker"]["1"].items()}
    protocols = dict(kv.split(":", 1) for kv in cfg["listener.security.protocol.map"].split(","))
    listeners = [ln.split("://", 1)[0] for ln in cfg["listeners"].split(",")]
    assert listeners and {protocols[n] for n in listeners} == {"SASL_SSL"}, cfg["listeners"]
    assert cfg["advertised.listeners"].startswith("SASL_SSL://"), cfg["advertised.listeners"]
    assert kafka_auth()["security_protocol"] == "SASL_SSL"
    # and what infra/kafka/start.sh wrote for the test run's broker (the native stack: beside its secrets)
    written = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"]).parent / "server.properties"
    if written.is_file():
        last = {}  # later lines win, as in Kafka's loader
        for line in written.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                last[key] = value
        assert "PLAINTEXT" not in last["listeners"] + last["advertised.listeners"], last["listeners"]
        assert "PLAINTEXT" not in last["listener.security.protocol.map"], last["listener.security.protocol.map"]
        assert last["inter.broker.listener.name"] == "SASL_SSL"


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

    from apportion.bus.security import sasl_ssl
    from services.dispatcher.config import DispatcherSettings

    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])
    p = KafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        **sasl_ssl(principal, (secrets / f"{principal}.password").read_text().strip()),
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


def test_a_topic_the_acls_hide_answers_not_authorized_and_a_missing_one_unknown(
    kafka_bootstrap: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A researcher may not describe the dead letters: the topic list leaves it out as if it did not exist, and
    asked about alone the broker answers 29, which the CLI reports as not authorized, not as unprovisioned."""
    from kafka.errors import TopicAuthorizationFailedError, UnknownTopicOrPartitionError

    from apportion.cli import common

    dead = topic_name(topics.DEADLETTER)
    assert common.topic_error(kafka_bootstrap, f"{namespace}nosuch") == UnknownTopicOrPartitionError.errno
    secrets = Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"])
    monkeypatch.setenv("APPORTION_KAFKA_USER", "researcher")
    monkeypatch.setenv("APPORTION_KAFKA_PASSWORD_FILE", str(secrets / "researcher.password"))
    monkeypatch.delenv("APPORTION_KAFKA_PASSWORD", raising=False)
    assert common.partitions_of(kafka_bootstrap, dead) == 0
    assert common.topic_error(kafka_bootstrap, dead) == TopicAuthorizationFailedError.errno
