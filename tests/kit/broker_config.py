"""The broker configuration ``infra/kafka/container-start.sh`` writes inside a container, rendered on the host
(``KAFKA_RENDER_ONLY=1``, the container paths mapped back): ``render``, ``parse_properties`` (as Java reads a
properties file) and ``assert_secured`` (SASL/SCRAM over TLS on every listener, no access by default)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from apportion.bus import containers


def parse_properties(text: str) -> dict[str, str]:
    """``key=value`` lines as Java reads a properties file: comments skipped, the last of a key wins."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def render(spec: containers.ContainerSpec, out: Path, **extra: str) -> tuple[dict[str, str], str]:
    """Run ``container-start.sh`` of ``spec`` on the host with ``KAFKA_RENDER_ONLY=1``; ``(properties, text)``."""
    to_host = {inside: host for host, inside in spec.volumes.items()}
    env = {k: v for k, v in spec.env.items()}
    for k, v in env.items():
        for inside, host in to_host.items():
            if v.startswith(inside + "/"):
                env[k] = host + v[len(inside) :]
    script = spec.command[-1]
    for inside, host in to_host.items():
        script = script.replace(inside, host)
    env.update(extra, KAFKA_RENDER_ONLY="1", KAFKA_CONFIG=str(out), PATH=os.environ["PATH"])
    subprocess.run(["bash", script], env=env, check=True)
    text = out.read_text()
    return parse_properties(text), text


def assert_secured(props: dict[str, str], text: str) -> None:
    """Every listener TLS with SASL (SASL_SSL), the PEM keystore and truststore filled in, SCRAM-SHA-512 for
    clients and brokers, ACLs deny by default, nothing left unfilled."""
    protocols = dict(p.split(":") for p in props["listener.security.protocol.map"].split(","))
    listeners = [entry.split("://")[0] for entry in props["listeners"].split(",")]
    assert listeners and all(protocols[name] == "SASL_SSL" for name in listeners), props["listeners"]
    assert "PLAINTEXT" not in props["advertised.listeners"] and "PLAINTEXT" not in protocols.values()
    assert (props["ssl.keystore.type"], props["ssl.truststore.type"]) == ("PEM", "PEM")
    assert props["ssl.endpoint.identification.algorithm"] == "https"
    assert props["sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["sasl.mechanism.inter.broker.protocol"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin;User:controller"
    assert props["process.roles"] == "broker,controller"
    assert props["auto.create.topics.enable"] == "false"
    assert "@" not in re.sub(r"\d+@[\w.-]+:\d+", "", props["controller.quorum.voters"])
    assert not re.search(r"@[A-Z_]+@", text), "a template placeholder was left unfilled"
