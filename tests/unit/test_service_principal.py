"""A service started alone signs in as its own Kafka principal, never as the CLI's the stack.env names
(rule D10.authentication): it takes its own password file beside the CLI's, or exits 2 saying what to set."""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion.bus import principal

KEYS = (
    "APPORTION_KAFKA_USER",
    "APPORTION_KAFKA_PASSWORD",
    "APPORTION_KAFKA_PASSWORD_FILE",
    "APPORTION_REDIS_USER",
    "APPORTION_REDIS_PASSWORD",
    "APPORTION_REDIS_PASSWORD_FILE",
    "APPORTION_KAFKA_NODE_AGENTS",
)


def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *passwords: str) -> Path:
    """A stack.env as `stack up` writes the owner's (the CLI's principal `ops`, Redis user `cli`), in force by
    ``APPORTION_STACK_DIR``; ``passwords``: the Kafka and Redis password files there besides the CLI's."""
    for k in KEYS:  # recorded, so whatever the test sets is put back
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    kafka, redis = tmp_path / "kafka", tmp_path / "redis"
    kafka.mkdir()
    redis.mkdir()
    for name in ("ops", *passwords):
        (kafka / f"{name}.password").write_text("pw\n")
    for name in ("cli", *passwords):
        (redis / f"{name}.password").write_text("pw\n")
    (tmp_path / "stack.env").write_text(
        "KAFKA_BOOTSTRAP=127.0.0.1:1\nREDIS_URL=redis://127.0.0.1:1/0\n"
        f"APPORTION_KAFKA_USER=ops\nAPPORTION_KAFKA_PASSWORD_FILE={kafka / 'ops.password'}\n"
        "APPORTION_KAFKA_NODE_AGENTS=sim\n"
        f"APPORTION_REDIS_USER=cli\nAPPORTION_REDIS_PASSWORD_FILE={redis / 'cli.password'}\n"
    )
    monkeypatch.setenv("APPORTION_STACK_DIR", str(tmp_path))
    return tmp_path


def test_a_service_takes_its_own_password_file_beside_the_clis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    d = stack(tmp_path, monkeypatch, "dispatcher")
    assert principal.own_principal("dispatcher") == "dispatcher"
    assert {k: os.environ.get(k) for k in KEYS[:6] if k in os.environ} == {
        "APPORTION_KAFKA_USER": "dispatcher",
        "APPORTION_KAFKA_PASSWORD_FILE": str(d / "kafka" / "dispatcher.password"),
        "APPORTION_REDIS_USER": "dispatcher",
        "APPORTION_REDIS_PASSWORD_FILE": str(d / "redis" / "dispatcher.password"),
    }


def test_the_node_agent_is_the_declared_agents_principal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    stack(tmp_path, monkeypatch, "node-agent.sim")
    assert principal.own_principal("node_agent") == "node-agent.sim"
    assert os.environ["APPORTION_KAFKA_USER"] == "node-agent.sim"
    assert "APPORTION_REDIS_USER" not in os.environ  # not a read-model writer: the stack's Redis user


def test_a_user_in_the_environment_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stack(tmp_path, monkeypatch, "policy")
    monkeypatch.setenv("APPORTION_KAFKA_USER", "admin")
    assert principal.own_principal("policy") is None


def test_without_its_password_file_the_service_exits_2_saying_what_to_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.policy.__main__ import main

    d = stack(tmp_path, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"error: services.policy has no Kafka principal of its own: the stack's settings ({d / 'stack.env'}) sign "
        f"in as 'ops', the CLI's; set APPORTION_KAFKA_USER=policy and "
        f"APPORTION_KAFKA_PASSWORD_FILE={d / 'kafka' / 'policy.password'} (docs/operations.md, one service alone)\n"
    )
