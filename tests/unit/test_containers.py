"""The testcontainers path of the fixtures cannot run here (no Docker engine): check what it would start.

:mod:`apportion.bus.containers` builds the Kafka and Redis containers as data; these tests render the broker
configuration ``infra/kafka/container-start.sh`` writes inside the container (``KAFKA_RENDER_ONLY=1``, the
container paths mapped back to the host) and check it is secured as the native broker is: SASL/SCRAM on every
listener, the StandardAuthorizer with no access by default, the replication rule; and that Redis gets the ACL
file of ``infra/redis/acl.sh`` with the default user off.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path

from apportion.bus import containers
from apportion.bus.security import ADMIN
from tests.kit.broker_config import assert_secured, parse_properties, render

ROOT = Path(__file__).resolve().parents[2]


def test_kafka_container_is_the_pinned_image_started_by_our_script(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    spec = containers.kafka_spec(29999, secrets)
    version = re.search(r"<kafka.version>(.+?)</kafka.version>", (ROOT / "infra/kafka/pom.xml").read_text())
    assert version is not None and spec.image == f"apache/kafka:{version.group(1)}"
    assert spec.command == ["bash", f"{containers.KAFKA_SCRIPTS}/container-start.sh"]
    assert spec.volumes == {str(ROOT / "infra" / "kafka"): containers.KAFKA_SCRIPTS, str(secrets): containers.SECRETS}
    assert spec.ports == {9092: 29999}
    assert (ROOT / "infra/kafka/container-start.sh").is_file()


def test_kafka_container_config_is_sasl_scram_with_acls(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    props, text = render(containers.kafka_spec(29999, secrets), tmp_path / "server.properties")
    assert_secured(props, text)
    assert props["listeners"] == "SASL_SSL://0.0.0.0:9092,CONTROLLER://0.0.0.0:9093"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:29999"
    assert props["ssl.keystore.location"] == str(secrets / "tls" / "keystore.pem")
    assert props["ssl.truststore.location"] == str(secrets / "tls" / "ca.pem")
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@localhost:9093"
    assert (props["default.replication.factor"], props["min.insync.replicas"]) == ("1", "1")
    admin_pw = (secrets / "kafka" / "admin.password").read_text().strip()
    assert f'username="admin" password="{admin_pw}"' in props["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"]
    assert stat.S_IMODE((tmp_path / "server.properties").stat().st_mode) == 0o600
    client = parse_properties((tmp_path / "server-admin-client.properties").read_text())
    assert client["security.protocol"] == "SASL_SSL" and client["sasl.mechanism"] == "SCRAM-SHA-512"
    assert client["ssl.truststore.location"] == str(secrets / "tls" / "ca.pem")


def test_redis_container_has_acl_users_and_no_default_user(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    spec = containers.redis_spec(26379, secrets)
    assert spec.image.startswith("redis:")
    i = spec.command.index("--aclfile")
    acl_inside = spec.command[i + 1]
    assert acl_inside == f"{containers.SECRETS}/redis/users.acl"
    lines = (secrets / "redis" / "users.acl").read_text().splitlines()
    assert lines[0] == "user default off"
    users = {ln.split()[1]: ln for ln in lines[1:]}
    assert set(users) == {"admin", "dispatcher", "accounting", "cli", "web"}
    for name, line in users.items():
        pw = (secrets / "redis" / f"{name}.password").read_text().strip()
        assert f" on >{pw} " in line and len(pw) == 64
    assert "-@all +@read" in users["cli"] and "-@dangerous" in users["dispatcher"]
    # a container's user reads the files; the directories keep other host users out
    assert stat.S_IMODE((secrets / "redis" / "users.acl").stat().st_mode) == 0o644
    assert stat.S_IMODE((secrets / "redis").stat().st_mode) == 0o700
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700


def test_redis_container_serves_tls_only_with_the_secrets_certificate(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    cmd = containers.redis_spec(26379, secrets).command
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))  # after the configuration file, flag and value pairs
    inside = f"{containers.SECRETS}/tls"
    assert (flags["--port"], flags["--tls-port"], flags["--tls-auth-clients"]) == ("0", "6379", "no")
    assert (flags["--tls-cert-file"], flags["--tls-key-file"], flags["--tls-ca-cert-file"]) == (
        f"{inside}/server.pem",
        f"{inside}/server.key",
        f"{inside}/ca.pem",
    )
    assert containers.client_env(secrets)["APPORTION_TLS_CA"] == str(secrets / "tls" / "ca.pem")


#: The connection limits of docs/infra.md ("Connection limits"), as each server reports them.
KAFKA_LIMITS = {
    "listener.name.controller.max.connections": "64",
    "max.connections": "8000",
    "max.connections.per.ip": "256",
    "max.connections.per.ip.overrides": "127.0.0.1:8000",
    "connections.max.idle.ms": "600000",
}
REDIS_LIMITS = {"maxclients": "1024", "timeout": "300"}


def redis_config(path: Path) -> dict[str, str]:
    """``name value`` lines of a Redis configuration file (comments and blank lines left out)."""
    lines = [ln.split(None, 1) for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return {name: value.strip() for name, value in lines}


def test_kafka_container_has_the_native_brokers_connection_limits(tmp_path: Path) -> None:
    props, _ = render(containers.kafka_spec(29999, containers.make_secrets(tmp_path / "secrets")), tmp_path / "p")
    assert {k: props.get(k) for k in KAFKA_LIMITS} == KAFKA_LIMITS


def test_redis_container_starts_with_the_stacks_limits_file(tmp_path: Path) -> None:
    """Redis in a container is started with the native stack's limits file (its first argument, mounted read-only
    from ``infra/redis``), and no flag of its own sets a limit: one home for the numbers."""
    spec = containers.redis_spec(26379, containers.make_secrets(tmp_path / "secrets"))
    assert spec.command[:2] == ["redis-server", f"{containers.REDIS_CONFIG}/limits.conf"]
    host = {inside: host for host, inside in spec.volumes.items()}[containers.REDIS_CONFIG]
    assert Path(host) == ROOT / "infra" / "redis"
    assert redis_config(Path(host) / "limits.conf") == REDIS_LIMITS
    assert not {"--maxclients", "--timeout"} & set(spec.command)


def test_native_and_compose_redis_start_with_the_same_limits_file() -> None:
    import yaml

    start = (ROOT / "infra/redis/start.sh").read_text()
    assert '/limits.conf" "${listen[@]}"' in start and "--maxclients" not in start
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]
    assert compose["command"][:2] == ["redis-server", f"{containers.REDIS_CONFIG}/limits.conf"]
    assert f"./infra/redis:{containers.REDIS_CONFIG}:ro" in compose["volumes"]
    assert not {"--maxclients", "--timeout"} & set(compose["command"])


def test_clients_of_the_containers_are_the_admin_with_password_files(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    env = containers.client_env(secrets)
    assert env["APPORTION_KAFKA_USER"] == ADMIN and env["APPORTION_REDIS_USER"] == ADMIN
    assert Path(env["APPORTION_KAFKA_PASSWORD_FILE"]).read_text().strip()
    assert Path(env["APPORTION_REDIS_PASSWORD_FILE"]).read_text().strip()
    assert env["APPORTION_KAFKA_SECRETS_DIR"] == str(secrets / "kafka")  # provisioning makes the users' there
    assert not any("PASSWORD=" in f"{k}={v}" and not k.endswith("_FILE") for k, v in env.items())
