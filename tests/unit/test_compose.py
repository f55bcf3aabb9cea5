"""docker-compose.yml cannot run here (no Docker engine): keep it honest by test.

Checks that every apportion service has a container built from the one
Dockerfile with its own ``SERVICE`` build argument, that the Dockerfile starts the service it names,
that Kafka is three official KRaft nodes at the broker version of
infra/kafka/pom.xml secured as infra/kafka starts a broker (SASL/SCRAM, ACLs,
replication 3 and min.insync.replicas 2: the configuration
infra/kafka/container-start.sh renders is checked), that every password
comes from a generated secret, and that every environment variable the compose file
sets is one the service reads: a field of the pydantic-settings class in
``services/<name>/config.py`` (env_prefix + field name, or an alias), or one
of the connection variables read by :mod:`apportion.settings`.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("accounting", "policy", "dispatcher", "node_agent")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def built_from(svc: dict[str, Any]) -> str | None:
    """The services/<name> a compose service is built for (its ``SERVICE`` build argument), else None."""
    build = svc.get("build")
    if not isinstance(build, dict):
        return None
    return (build.get("args") or {}).get("SERVICE")


def test_every_service_has_a_container_from_the_dockerfile(compose: dict[str, Any]) -> None:
    built = {built_from(s) for s in compose["services"].values()}
    assert set(SERVICES) | {"web"} <= built


def test_every_build_is_the_one_dockerfile_with_a_service_it_knows(compose: dict[str, Any]) -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert "pip install ." in text
    assert "SERVICE_MODULE=services.${SERVICE}" in text
    assert 'CMD ["sh", "-c", "exec python -m \\"$SERVICE_MODULE\\""]' in text
    known = re.search(r'case "\$SERVICE" in ([\w|]+)\)', text)
    assert known is not None
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue
        build = svc["build"]
        assert build == {"context": ".", "dockerfile": "Dockerfile", "args": build.get("args")}, name
        service = built_from(svc)
        assert service in known.group(1).split("|"), f"{name}: SERVICE {service!r} is not one the Dockerfile builds"
        assert (ROOT / "services" / str(service) / "__main__.py").is_file(), name
        assert (build["args"].get("RUN_AS") == "root") == (service == "node_agent"), f"{name}: only the agent is root"


def kafka_nodes(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if s.get("image", "").startswith("apache/kafka:")}


def test_kafka_is_three_official_kraft_nodes_at_the_pinned_version(compose: dict[str, Any]) -> None:
    pom = (ROOT / "infra/kafka/pom.xml").read_text()
    found = re.search(r"<kafka.version>(.+?)</kafka.version>", pom)
    assert found is not None
    version = found.group(1)
    nodes = kafka_nodes(compose)
    assert sorted(nodes) == ["kafka-1", "kafka-2", "kafka-3"]
    voters = set()
    for name, svc in nodes.items():
        assert svc["image"] == f"apache/kafka:{version}"
        assert svc["command"] == ["bash", "/opt/apportion/kafka/container-start.sh"]
        assert "./infra/kafka:/opt/apportion/kafka:ro" in svc["volumes"]
        env = svc["environment"]
        assert "ZOOKEEPER" not in " ".join(env)
        voters.add(env["KAFKA_QUORUM_VOTERS"])
        assert env["KAFKA_ADVERTISED"] == f"{name}:9092"
        assert env["KAFKA_REPLICATION"] == "3"
    assert voters == {"1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"}
    assert sorted(n["environment"]["KAFKA_NODE_ID"] for n in nodes.values()) == ["1", "2", "3"]
    assert compose["services"]["redis"]["image"].startswith("redis:")


@pytest.mark.parametrize("node", ["kafka-1", "kafka-2", "kafka-3"])
def test_each_kafka_node_runs_sasl_scram_with_acls_and_three_replicas(
    compose: dict[str, Any], node: str, tmp_path: Path
) -> None:
    """Render what container-start.sh writes in the container and check it."""
    from apportion.bus.containers import ContainerSpec, make_secrets
    from apportion.topics import replication
    from tests.kit.broker_config import assert_secured, render

    svc = compose["services"][node]
    secrets = make_secrets(tmp_path / "secrets")
    env = dict(svc["environment"])
    for k in (
        "KAFKA_ADMIN_PASSWORD_FILE",
        "KAFKA_CONTROLLER_PASSWORD_FILE",
        "KAFKA_TLS_KEYSTORE_FILE",
        "KAFKA_TLS_CA_FILE",
    ):
        name = env[k].rsplit("/", 1)[1]  # /run/secrets/<secret>
        assert name in svc["secrets"]
        folder, file = compose["secrets"][name]["file"].rsplit("/", 2)[1:]  # ./.secrets/<folder>/<file>
        env[k] = str(secrets / folder / file)
    spec = ContainerSpec(svc["image"], env, svc["command"], {str(ROOT / "infra" / "kafka"): "/opt/apportion/kafka"})
    props, text = render(spec, tmp_path / "server.properties")
    assert_secured(props, text)
    n = env["KAFKA_NODE_ID"]
    host_port = {"1": 29092, "2": 29093, "3": 29094}[n]
    assert props["node.id"] == n
    assert props["advertised.listeners"] == f"SASL_SSL://{node}:9092,HOST://127.0.0.1:{host_port}"
    assert props["ssl.keystore.location"] == str(secrets / "tls" / "keystore.pem")
    assert f"127.0.0.1:{host_port}:29092" in svc["ports"]
    rf, isr = replication(3)
    assert (props["default.replication.factor"], props["min.insync.replicas"]) == (str(rf), str(isr))
    assert props["offsets.topic.replication.factor"] == str(rf)
    assert props["transaction.state.log.min.isr"] == str(isr)
    # the healthcheck authenticates with the admin client file the script writes
    assert "--command-config /tmp/apportion-server-admin-client.properties" in svc["healthcheck"]["test"][1]


def test_no_secret_is_in_the_compose_file_and_every_secret_is_generated(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert not re.search(r"(?i)password\s*[:=]\s*[\"']?[0-9a-f]{16,}", text)
    assert not re.search(r"(?i)_PASSWORD:\s", text), "a password given as a value (use *_PASSWORD_FILE)"
    script = (ROOT / "infra/compose-secrets.sh").read_text()
    for name, sec in compose["secrets"].items():
        path = sec["file"]
        assert path.startswith("./.secrets/"), f"{name}: secrets live in the generated .secrets/"
        sub, fname = path[len("./.secrets/") :].split("/")
        made = {
            "kafka": "password.sh",
            "redis": "acl.sh",
            "grafana": "password.sh",
            "keys": "signing-key.sh",
            "tls": "tls.sh",
        }[sub]
        assert made in script and (f'"$dir/{sub}"' in script or f'"$dir/{sub}/' in script), name
    assert ".secrets/" in (ROOT / ".gitignore").read_text().splitlines()
    assert ".secrets" in (ROOT / ".dockerignore").read_text().splitlines()


def test_every_client_verifies_the_compose_ca_and_no_server_listens_in_clear(compose: dict[str, Any]) -> None:
    """Transport (rule D10.transport): each container that connects to Kafka or Redis trusts the compose CA, Redis
    serves TLS only, the dashboard HTTPS, and the server certificate names every host the clients dial."""
    services = compose["services"]
    clients = {n: s for n, s in services.items() if "APPORTION_KAFKA_BOOTSTRAP" in s.get("environment", {})}
    assert {"provision", "dispatcher", "accounting", "policy", "web", "node-agent-1"} <= set(clients)
    for name, svc in clients.items():
        env = svc["environment"]
        assert env["APPORTION_TLS_CA"] == "/run/secrets/tls_ca" and "tls_ca" in svc["secrets"], name
        assert env.get("APPORTION_REDIS_URL", "rediss://").startswith("rediss://"), name
    redis = services["redis"]["command"]
    assert redis[redis.index("--port") + 1] == "0" and redis[redis.index("--tls-port") + 1] == "6379"
    assert "--tls --cacert /run/secrets/tls_ca" in services["redis"]["healthcheck"]["test"][1]
    web = services["web"]["environment"]
    assert (web["APPORTION_WEB_TLS_CERT"], web["APPORTION_WEB_TLS_KEY"]) == (
        "/run/secrets/tls_server_cert",
        "/run/secrets/tls_server_key",
    )
    dialled = {
        a.rsplit(":", 1)[0] for a in clients["dispatcher"]["environment"]["APPORTION_KAFKA_BOOTSTRAP"].split(",")
    }
    script = (ROOT / "infra/compose-secrets.sh").read_text()
    named = set(re.findall(r"--host (\S+)", script))
    assert dialled | {"redis", "web"} <= named, named
    assert compose["secrets"]["tls_ca"]["file"] == "./.secrets/tls/ca.pem"
    assert not any(sec["file"].endswith("ca.key") for sec in compose["secrets"].values()), "the CA key stays home"


def test_the_generated_kafka_principals_are_the_declared_ones() -> None:
    from apportion.bus.security import ADMIN, PRINCIPALS

    script = (ROOT / "infra/compose-secrets.sh").read_text()
    line = re.search(r"^for name in (.+); do$", script, re.M)
    assert line is not None
    assert line.group(1).split() == [ADMIN, "controller", *PRINCIPALS]


def test_each_node_agent_is_its_own_principal_declared_to_provisioning_with_a_password_made_for_it(
    compose: dict[str, Any],
) -> None:
    from apportion.bus.security import NODE_AGENTS_SETTING, node_agent_principal

    declared = compose["services"]["provision"]["environment"][NODE_AGENTS_SETTING].split(",")
    agents = {name: svc for name, svc in compose["services"].items() if built_from(svc) == "node_agent"}
    users = [svc["environment"]["APPORTION_KAFKA_USER"] for svc in agents.values()]
    assert users == [node_agent_principal(a) for a in declared] and len(set(users)) == len(agents) == 3
    script = (ROOT / "infra/compose-secrets.sh").read_text()
    loop = re.search(r"^for agent in (.+); do$", script, re.M)
    assert loop is not None and loop.group(1).split() == declared


def test_every_service_is_its_own_principal_with_its_password_from_a_secret(compose: dict[str, Any]) -> None:
    want = {
        "dispatcher": "dispatcher",
        "accounting": "accounting",
        "policy": "policy",
        "node_agent": None,  # one principal per agent: test_each_node_agent_is_its_own_principal_...
        "web": "web",
    }
    redis_users = {"dispatcher": "dispatcher", "accounting": "accounting", "web": "web"}
    for name, svc in compose["services"].items():
        service = built_from(svc)
        if service is None or name == "provision":
            continue
        env = svc["environment"]
        user = env["APPORTION_KAFKA_USER"]
        if service in want and want[service] is not None:
            assert user == want[service], name
        secret = env["APPORTION_KAFKA_PASSWORD_FILE"].removeprefix("/run/secrets/")
        assert secret in svc["secrets"] and secret in compose["secrets"], name
        assert compose["secrets"][secret]["file"] == f"./.secrets/kafka/{user}.password", name
        if service in redis_users or "APPORTION_REDIS_USER" in env:
            ruser = env["APPORTION_REDIS_USER"]
            assert ruser == redis_users[service], name
            rsecret = env["APPORTION_REDIS_PASSWORD_FILE"].removeprefix("/run/secrets/")
            assert compose["secrets"][rsecret]["file"] == f"./.secrets/redis/{ruser}.password", name
        assert env["APPORTION_KAFKA_BOOTSTRAP"] == "kafka-1:9092,kafka-2:9092,kafka-3:9092"
    prov = compose["services"]["provision"]["environment"]
    assert prov["APPORTION_KAFKA_USER"] == "admin" and prov["APPORTION_KAFKA_SECRETS_DIR"]
    assert "./.secrets/kafka:/run/apportion/kafka-secrets:ro" in compose["services"]["provision"]["volumes"]
    redis = compose["services"]["redis"]
    assert "--aclfile" in redis["command"] and "redis_users_acl" in redis["secrets"]


def test_every_signer_gets_its_key_and_provisioning_registers_them(compose: dict[str, Any]) -> None:
    """Rule D10.authentication: the dispatcher signs decisions, each agent its node's reports; without their key files
    neither runs (the dispatcher does not lead, the agent does not start), and readers need the registrations."""
    svcs = compose["services"]
    disp = svcs["dispatcher"]
    secret = disp["environment"]["APPORTION_DISPATCHER_KEY"].removeprefix("/run/secrets/")
    assert secret in disp["secrets"] and compose["secrets"][secret]["file"] == "./.secrets/keys/dispatcher.json"
    script = (ROOT / "infra/compose-secrets.sh").read_text()
    assert '"$dir/keys/dispatcher.json" "$dir/keys/public/dispatcher.json" service:dispatcher user' in script
    agents = {n: s for n, s in svcs.items() if built_from(s) == "node_agent"}
    listed = re.search(r"^for node in (.+); do$", script, re.M)
    assert listed is not None
    ids = [a["environment"]["APPORTION_NODE_ID"] for a in agents.values()]
    assert sorted(listed.group(1).split()) == sorted(ids)  # a key made for each agent's node, and only those
    for name, a in agents.items():
        env = a["environment"]
        node, keys, disp = (
            env["APPORTION_NODE_ID"],
            env["APPORTION_NODE_KEY_DIR"],
            env["APPORTION_DISPATCHER_PUBLIC_KEY_FILE"],
        )
        assert a["volumes"] == [  # its own node's key only, and the dispatcher's public half
            f"./.secrets/keys/nodes/{node}:{keys}:ro",
            f"./.secrets/keys/public/dispatcher.json:{disp}:ro",
        ], name
    prov = svcs["provision"]
    where = prov["command"][prov["command"].index("--register-keys") + 1]
    assert f"./.secrets/keys/public:{where}:ro" in prov["volumes"]
    assert not any("keys/nodes" in v or v.startswith("./.secrets/keys:") for v in prov["volumes"])  # no private


def test_compose_secrets_makes_keys_the_services_load_and_provisioning_registers(tmp_path: Path) -> None:
    import shutil
    import subprocess

    from apportion.bus.provision import key_registrations
    from apportion.identity.keys import Identity

    assert shutil.which("openssl"), "infra/signing-key.sh needs openssl"
    subprocess.run(["bash", str(ROOT / "infra/compose-secrets.sh"), str(tmp_path)], check=True, capture_output=True)
    disp = Identity.load(tmp_path / "keys/dispatcher.json")
    nodes = {n: Identity.load(tmp_path / f"keys/nodes/{n}/{n}.json") for n in ("node-1", "node-2", "node-3")}
    ops = Identity.load(tmp_path / "keys/ops.json")
    assert (disp.user, ops.user, ops.role) == ("service:dispatcher", "ops", "ops")
    assert {n: i.user for n, i in nodes.items()} == {n: f"node:{n}" for n in nodes}
    regs = key_registrations(tmp_path / "keys/public")
    assert sorted((r.user, r.role, r.public_key) for r in regs) == sorted(
        (i.user, i.role, i.public_key) for i in (disp, ops, *nodes.values())
    )
    assert not any("private_key" in p.read_text() for p in (tmp_path / "keys/public").iterdir())
    subprocess.run(["bash", str(ROOT / "infra/compose-secrets.sh"), str(tmp_path)], check=True, capture_output=True)
    assert Identity.load(tmp_path / "keys/dispatcher.json").public_key == disp.public_key  # kept, not remade
    assert key_registrations(tmp_path / "keys/public") == regs  # the same records: readers drop the repeat


def test_there_are_three_simulated_node_agents_with_distinct_ids(compose: dict[str, Any]) -> None:
    agents = [s for s in compose["services"].values() if built_from(s) == "node_agent"]
    ids = [s["environment"]["APPORTION_NODE_ID"] for s in agents]
    assert len(ids) >= 3 and len(set(ids)) == len(ids)


def shared_env() -> set[str]:
    """Connection and credential variables read by apportion.settings and apportion.bus.security (any service
    may use them)."""
    out: set[str] = set()
    for rel in ("shared/apportion/settings.py", "shared/apportion/bus/security.py"):
        path = ROOT / rel
        out |= set(re.findall(r"\bAPPORTION_[A-Z_]+\b", path.read_text())) if path.exists() else set()
    return out


def settings_env(service: str) -> set[str]:
    """Env names the pydantic-settings classes of services/<service>/config.py read."""
    from pydantic_settings import BaseSettings

    module = importlib.import_module(f"services.{service}.config")
    names: set[str] = set()
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if not issubclass(cls, BaseSettings) or cls is BaseSettings or cls.__module__ != module.__name__:
            continue
        prefix = cls.model_config.get("env_prefix", "")
        for fname, field in cls.model_fields.items():
            names.add((prefix + fname).upper())
            alias = field.validation_alias or field.alias
            choices = getattr(alias, "choices", [alias])
            names |= {c.upper() for c in choices if isinstance(c, str)}
    return names


def compose_services_with_env() -> list[str]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return [n for n, s in data["services"].items() if built_from(s) and s.get("environment")]


@pytest.mark.parametrize("name", compose_services_with_env())
def test_every_env_var_set_is_one_the_service_reads(compose: dict[str, Any], name: str) -> None:
    svc = compose["services"][name]
    service = built_from(svc)
    assert service is not None and (ROOT / f"services/{service}/config.py").exists(), (
        f"services/{service}/config.py is missing"
    )
    readable = settings_env(service) | shared_env()
    unknown = sorted(k for k in svc["environment"] if k.upper() not in readable)
    assert not unknown, f"{name} sets env vars {service} does not read: {unknown}"
