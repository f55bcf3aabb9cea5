"""The node agent's settings that `apportion stack up` writes: one cgroup parent per stack, and the memory limit
per GPU that `--sandbox-memory-mb-per-gpu` gives (else the agent's own default)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.cli import stack
from apportion.cli.main import app
from apportion.cli.stack import StackInfo, agent_env
from services.node_agent.config import NodeAgentSettings


def _settings(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> NodeAgentSettings:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return NodeAgentSettings(sim_nodes=8)


def test_two_stacks_on_one_machine_have_their_own_cgroup_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = StackInfo(tmp_path / "a", "k:1", "redis://r:1/0", keyring=str(tmp_path / "a" / "keyring"))
    b = StackInfo(tmp_path / "b", "k:2", "redis://r:2/0", keyring=str(tmp_path / "b" / "keyring"))
    pa = _settings(agent_env(a), monkeypatch).cgroup_parent_path()
    pb = _settings(agent_env(b), monkeypatch).cgroup_parent_path()
    digest = hashlib.sha256(str((tmp_path / "a").resolve()).encode()).hexdigest()[:12]
    assert pa == f"apportion/stack-{digest}/sim"
    assert pa != pb
    assert "apportion/sim" not in (pa, pb)


def test_the_namespace_is_part_of_the_cgroup_parent(tmp_path: Path) -> None:
    info = StackInfo(tmp_path, "k:1", "redis://r:1/0", prefix="dev/x.", keyring="ring")
    assert agent_env(info)["APPORTION_CGROUP_PARENT"].endswith("/dev_x.sim")


def test_the_memory_limit_per_gpu_reaches_the_agent_only_when_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = StackInfo(tmp_path, "k:1", "redis://r:1/0", keyring="ring")
    monkeypatch.delenv("APPORTION_SANDBOX_MEMORY_MB_PER_GPU", raising=False)
    assert "APPORTION_SANDBOX_MEMORY_MB_PER_GPU" not in agent_env(info)
    assert _settings(agent_env(info, 2048), monkeypatch).sandbox_memory_mb_per_gpu == 2048


def test_stack_up_passes_the_memory_option_to_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got: dict[str, object] = {}

    def fake_up(run_dir: Path, **kw: object) -> None:
        got.update(kw)
        raise stack.StackUpError("stopped here")

    monkeypatch.setattr(stack, "up", fake_up)
    res = CliRunner().invoke(app, ["stack", "up", "--dir", str(tmp_path), "--sandbox-memory-mb-per-gpu", "3000"])
    assert res.exit_code == 3, res.output
    assert got["sandbox_memory_mb_per_gpu"] == 3000


def test_the_dispatcher_finds_its_stacks_keyring_beside_a_stopped_stacks_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stack started from a checkout whose own stack was stopped: the working directory's marker names no
    keyring, so the dispatcher, which found its signing key through a stack.env, could not start."""
    from apportion.cli.stack import dispatcher_env
    from apportion.identity.keys import keyring_dir

    checkout = tmp_path / "checkout"
    (checkout / ".run" / "researcher").mkdir(parents=True)
    (checkout / ".run" / "researcher" / "stack.env").write_text(
        f"APPORTION_STACK_STOPPED=2026-12-07T09:08:56+00:00\nRUN_DIR={checkout / '.run'}\n"
    )
    for v in ("APPORTION_STACK_DIR", "APPORTION_KEYRING"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(checkout)
    assert keyring_dir() is None  # what the dispatcher found before
    info = StackInfo(tmp_path / "run", "k:1", "redis://r:1/0", keyring=str(tmp_path / "run" / "keyring"))
    for k, v in dispatcher_env(info).items():
        monkeypatch.setenv(k, v)
    assert keyring_dir() == tmp_path / "run" / "keyring"


def test_the_agent_closes_every_port_of_the_stack_to_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bootstrap servers, Redis, every listener of every broker and controller (a cluster's brokers each have
    their ``server.properties``), the services' metrics ports and the dashboard's: the KRaft controller's port is
    not among the bootstrap servers, and a job that held connections to it ran the broker out of descriptors."""
    (tmp_path / "kafka" / "broker-1").mkdir(parents=True)
    (tmp_path / "kafka" / "server.properties").write_text(
        "node.id=1\nlisteners=SASL_SSL://127.0.0.1:9100,CONTROLLER://127.0.0.1:9101\n# listeners=X://h:1\n"
    )
    (tmp_path / "kafka" / "broker-1" / "server.properties").write_text("listeners = CONTROLLER://127.0.0.1:9201\n")
    info = StackInfo(tmp_path, "127.0.0.1:9100", "rediss://127.0.0.1:6400/0", metrics={"web": 8700})
    env = agent_env(info, service_ports=[8601, 8602])
    assert env["APPORTION_SANDBOX_CLOSED_PORTS"] == "[6400, 8601, 8602, 8700, 9100, 9101, 9201]"
    assert _settings(env, monkeypatch).closed_ports() == (6400, 8601, 8602, 8700, 9100, 9101, 9201)


def test_an_external_stack_closes_its_bootstrap_servers_and_redis(tmp_path: Path) -> None:
    """Given with ``--bootstrap``/``--redis`` (no broker data here): its servers' ports, Redis's default 6379."""
    info = StackInfo(tmp_path, "10.0.0.5:9092,10.0.0.6:9093", "redis://10.0.0.7/0", infra="external")
    assert stack.closed_ports(info) == [6379, 9092, 9093]
