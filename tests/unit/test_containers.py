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
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    inside = f"{containers.SECRETS}/tls"
    assert (flags["--port"], flags["--tls-port"], flags["--tls-auth-clients"]) == ("0", "6379", "no")
    assert (flags["--tls-cert-file"], flags["--tls-key-file"], flags["--tls-ca-cert-file"]) == (
        f"{inside}/server.pem",
        f"{inside}/server.key",
        f"{inside}/ca.pem",
    )
    assert containers.client_env(secrets)["APPORTION_TLS_CA"] == str(secrets / "tls" / "ca.pem")


def test_clients_of_the_containers_are_the_admin_with_password_files(tmp_path: Path) -> None:
    secrets = containers.make_secrets(tmp_path / "secrets")
    env = containers.client_env(secrets)
    assert env["APPORTION_KAFKA_USER"] == ADMIN and env["APPORTION_REDIS_USER"] == ADMIN
    assert Path(env["APPORTION_KAFKA_PASSWORD_FILE"]).read_text().strip()
    assert Path(env["APPORTION_REDIS_PASSWORD_FILE"]).read_text().strip()
    assert env["APPORTION_KAFKA_SECRETS_DIR"] == str(secrets / "kafka")  # provisioning makes the users' there
    assert not any("PASSWORD=" in f"{k}={v}" and not k.endswith("_FILE") for k, v in env.items())
