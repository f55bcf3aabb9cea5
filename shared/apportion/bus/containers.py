"""Kafka and Redis in Docker via testcontainers, for machines with an engine.

The test fixtures try this after ``KAFKA_BOOTSTRAP``/``REDIS_URL`` and
before the native stack. Without a Docker engine the container constructor
raises :class:`docker.errors.DockerException`; :func:`start_containers`
lets it propagate so the caller can fall back. Nothing is built at import.

Secured as the native stack is (rules D10.authentication and D10.transport, ``docs/security.md``):
Kafka runs the official ``apache/kafka`` image (the version of
``infra/kafka/pom.xml``) in KRaft combined mode, started by
``infra/kafka/container-start.sh`` (mounted read-only) from the same
templates as ``infra/kafka/start.sh``: SASL_SSL (TLS, SCRAM-SHA-512) on every
listener, ACLs with KRaft's StandardAuthorizer, the super users ``admin``
and ``controller``. Redis runs TLS only with the ACL file of ``infra/redis/acl.sh``
(the default user off). The passwords and the local CA with the servers'
certificate (:mod:`apportion.bus.tls`) are made in a temporary secrets
directory (``kafka/``, ``redis/``, ``tls/``; mounted read-only, never in the image
or the repo). Kafka's client port is bound to a free host port chosen up
front, so the advertised listener is known before the container starts.

Connection limits (``docs/infra.md``): the broker's come with ``infra/kafka/server.properties.template``, which
``container-start.sh`` renders as ``start.sh`` does; Redis is started with ``infra/redis/limits.conf`` (mounted
read-only), the configuration file of every Redis of the stack.

The container settings are built by :func:`kafka_spec` and
:func:`redis_spec` as plain data, so a test checks them without Docker
(``tests/unit/test_containers.py``).
"""

from __future__ import annotations

import base64
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apportion.bus.stack import DEFAULT_INFRA_DIR, free_ports
from apportion.privatefiles import write_private

KAFKA_IMAGE = "apache/kafka:4.1.1"
REDIS_IMAGE = "redis:7.0"

#: Where the containers see ``infra/kafka``, ``infra/redis`` and the secrets.
KAFKA_SCRIPTS = "/opt/apportion/kafka"
REDIS_CONFIG = "/opt/apportion/redis"
SECRETS = "/run/apportion-secrets"


@dataclass(frozen=True)
class ContainerSpec:
    """What one container is started with: image, environment, command, read-only mounts and ports.

    Attributes:
        volumes: host path -> container path (all read-only).
        ports: container port -> host port on 127.0.0.1.
    """

    image: str
    env: dict[str, str]
    command: list[str]
    volumes: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)


def make_secrets(root: Path, infra_dir: Path = DEFAULT_INFRA_DIR) -> Path:
    """Secrets for the containers under ``root``: ``kafka/admin.password``, ``kafka/controller.password``
    (``infra/password.sh``), ``redis/users.acl`` with its users' passwords (``infra/redis/acl.sh``) and ``tls/``
    (:func:`apportion.bus.tls.ensure`), each file mode 0644 in directories of mode 0700 (a container's user must
    read them; the CA's key stays 0600). Returns ``root``."""
    from apportion.bus.tls import ensure

    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    ensure(root / "tls", mode=0o644)
    for name in ("admin", "controller"):
        subprocess.run(
            ["bash", str(infra_dir / "password.sh"), str(root / "kafka"), name, "0644"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    acl = subprocess.run(
        ["bash", str(infra_dir / "redis" / "acl.sh"), str(root / "redis"), "0644"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = root / "redis" / "users.acl"
    write_private(path, acl.encode(), mode=0o644)
    return root


def kafka_spec(host_port: int, secrets: Path, infra_dir: Path = DEFAULT_INFRA_DIR) -> ContainerSpec:
    """The single-node Kafka container: TLS, SASL/SCRAM and ACLs on, advertised at ``127.0.0.1:host_port``."""
    cluster_id = "-"
    while cluster_id.startswith("-"):  # a leading "-" would read as an option of the storage tool
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_REPLICATION": "1",
        "KAFKA_CLUSTER_ID": cluster_id,
        "KAFKA_ADVERTISED": f"127.0.0.1:{host_port}",
        "KAFKA_ADMIN_PASSWORD_FILE": f"{SECRETS}/kafka/admin.password",
        "KAFKA_CONTROLLER_PASSWORD_FILE": f"{SECRETS}/kafka/controller.password",
        "KAFKA_TLS_KEYSTORE_FILE": f"{SECRETS}/tls/keystore.pem",
        "KAFKA_TLS_CA_FILE": f"{SECRETS}/tls/ca.pem",
        "KAFKA_HEAP_OPTS": "-Xms256m -Xmx512m",
    }
    return ContainerSpec(
        KAFKA_IMAGE,
        env,
        ["bash", f"{KAFKA_SCRIPTS}/container-start.sh"],
        {str(infra_dir / "kafka"): KAFKA_SCRIPTS, str(secrets): SECRETS},
        {9092: host_port},
    )


def redis_spec(host_port: int, secrets: Path, infra_dir: Path = DEFAULT_INFRA_DIR) -> ContainerSpec:
    """The Redis container: the connection limits of ``infra/redis/limits.conf`` (its configuration file, as
    ``infra/redis/start.sh`` starts the native one), TLS only (``port 0``), the ACL file of ``infra/redis/acl.sh``
    (default user off), no persistence."""
    return ContainerSpec(
        REDIS_IMAGE,
        {},
        ["redis-server", f"{REDIS_CONFIG}/limits.conf"]
        + ["--aclfile", f"{SECRETS}/redis/users.acl", "--save", "", "--appendonly", "no"]
        + ["--port", "0", "--tls-port", "6379", "--tls-auth-clients", "no"]
        + ["--tls-cert-file", f"{SECRETS}/tls/server.pem", "--tls-key-file", f"{SECRETS}/tls/server.key"]
        + ["--tls-ca-cert-file", f"{SECRETS}/tls/ca.pem"],
        {str(infra_dir / "redis"): REDIS_CONFIG, str(secrets): SECRETS},
        {6379: host_port},
    )


def client_env(secrets: Path) -> dict[str, str]:
    """The environment that makes Kafka and Redis clients the containers' super user ``admin``, over TLS
    verified against the containers' CA."""
    from apportion.bus.security import ADMIN, TLS_CA_SETTING, principal_env, redis_env

    return {
        TLS_CA_SETTING: str(secrets / "tls" / "ca.pem"),
        **principal_env(ADMIN, secrets / "kafka"),
        "APPORTION_KAFKA_SECRETS_DIR": str(secrets / "kafka"),
        **redis_env(ADMIN, secrets / "redis"),
        "APPORTION_REDIS_SECRETS_DIR": str(secrets / "redis"),
    }


@dataclass
class Containers:
    """Running Kafka and Redis containers, their addresses and the admin's environment (:func:`client_env`)."""

    kafka: Any
    redis: Any
    bootstrap: str
    redis_url: str
    env: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        for c in (self.kafka, self.redis):
            try:
                c.stop()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass


def wait_for_kafka(bootstrap: str, timeout_s: float = 90.0) -> None:
    """Poll a metadata call as the admin of the process environment until the broker answers (deadline,
    no fixed sleep)."""
    from kafka.admin import KafkaAdminClient

    from apportion.bus.security import kafka_auth

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000, **kafka_auth())
            try:
                if admin.describe_cluster().get("brokers"):
                    return
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = exc
        time.sleep(0.2)  # poll interval, bounded by the deadline
    raise TimeoutError(f"Kafka at {bootstrap} did not answer within {timeout_s}s: {last}")


def _container(spec: ContainerSpec) -> Any:
    from testcontainers.core.container import DockerContainer

    c = DockerContainer(spec.image).with_command(spec.command)
    for k, v in spec.env.items():
        c = c.with_env(k, v)
    for host, inside in spec.volumes.items():
        c = c.with_volume_mapping(host, inside, "ro")
    for inside_port, host_port in spec.ports.items():
        c = c.with_bind_ports(inside_port, host_port)
    return c


def start_containers(secrets_root: Path) -> Containers:
    """Start Kafka and Redis containers with their secrets in ``secrets_root``; raises DockerException
    without an engine. The caller puts :attr:`Containers.env` in the environment of its clients."""
    import os

    secrets = make_secrets(secrets_root)
    kafka_port, redis_port = free_ports(2)
    kafka = _container(kafka_spec(kafka_port, secrets))
    redis = _container(redis_spec(redis_port, secrets))
    env = client_env(secrets)
    kafka.start()
    try:
        redis.start()
        bootstrap = f"127.0.0.1:{kafka_port}"
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            wait_for_kafka(bootstrap)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    except BaseException:
        Containers(kafka, redis, "", "").stop()
        raise
    return Containers(kafka, redis, bootstrap, f"rediss://127.0.0.1:{redis_port}/0", env)
