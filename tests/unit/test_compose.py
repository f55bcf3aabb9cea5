"""docker-compose.yml cannot run here (no Docker engine): keep it honest by test.

Checks that every apportion service has a container built from its own
Dockerfile, that every Dockerfile named exists and starts its own service,
that Kafka is the official image in KRaft mode at the broker version of
infra/kafka/pom.xml, and that every environment variable the compose file
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
    """The services/<name> a compose service is built from, else None."""
    build = svc.get("build")
    if build is None:
        return None
    dockerfile = build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile"
    m = re.fullmatch(r"services/(\w+)/Dockerfile", dockerfile)
    return m.group(1) if m else None


def test_every_service_has_a_container_from_its_own_dockerfile(compose: dict[str, Any]) -> None:
    built = {built_from(s) for s in compose["services"].values()}
    assert set(SERVICES) <= built


def test_every_dockerfile_named_exists_and_runs_its_service(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue
        build = svc["build"]
        assert isinstance(build, dict) and build.get("context") == ".", f"{name}: build from the repo root"
        path = ROOT / build["dockerfile"]
        assert path.is_file(), f"{name}: {path} missing"
        text = path.read_text()
        assert re.search(r"^FROM python:3\.11-slim\b", text, re.M), f"{path}: base image"
        assert "pip install ." in text
        service = built_from(svc)
        assert f'"-m", "services.{service}"' in text, f"{path} must run python -m services.{service}"


def test_kafka_is_the_official_image_in_kraft_mode_at_the_pinned_version(compose: dict[str, Any]) -> None:
    kafka = compose["services"]["kafka"]
    pom = (ROOT / "infra/kafka/pom.xml").read_text()
    version = re.search(r"<kafka.version>(.+?)</kafka.version>", pom).group(1)
    assert kafka["image"] == f"apache/kafka:{version}"
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert "ZOOKEEPER" not in " ".join(env)
    assert compose["services"]["redis"]["image"].startswith("redis:")


def test_there_are_three_simulated_node_agents_with_distinct_ids(compose: dict[str, Any]) -> None:
    agents = [s for s in compose["services"].values() if built_from(s) == "node_agent"]
    ids = [s["environment"]["APPORTION_NODE_ID"] for s in agents]
    assert len(ids) >= 3 and len(set(ids)) == len(ids)


def shared_env() -> set[str]:
    """Connection variables read by apportion.settings (any service may use them)."""
    path = ROOT / "shared/apportion/settings.py"
    return set(re.findall(r"\bAPPORTION_[A-Z_]+\b", path.read_text())) if path.exists() else set()


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
    assert (ROOT / f"services/{service}/config.py").exists(), f"services/{service}/config.py is missing"
    readable = settings_env(service) | shared_env()
    unknown = sorted(k for k in svc["environment"] if k.upper() not in readable)
    assert not unknown, f"{name} sets env vars {service} does not read: {unknown}"
