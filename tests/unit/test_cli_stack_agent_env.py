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
