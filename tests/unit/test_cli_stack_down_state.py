"""What `apportion stack down` leaves for the CLI: no state file naming the stopped stack's addresses; other users'
`researcher/stack.env` a marker of the stopped stack, which the CLI reports as no stack running (exit 3), at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion import settings
from apportion.bus.stack import read_env_file
from apportion.cli.main import app
from apportion.cli.stack import StackInfo, _write_state, down

ADDRESSES = ("APPORTION_KAFKA_BOOTSTRAP", "KAFKA_BOOTSTRAP", "APPORTION_REDIS_URL", "REDIS_URL")


def up_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stack's state as `up` writes it (an external Kafka and Redis: nothing to stop) in ``tmp_path/run``, with
    no address in the environment and the per-user state in ``tmp_path/state``."""
    for v in (*ADDRESSES, "APPORTION_STACK_DIR", "APPORTION_TOPIC_PREFIX"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_state(StackInfo(run_dir, "127.0.0.1:1", "redis://127.0.0.1:1/0", "dev.", "external"))
    assert read_env_file(run_dir / "researcher" / "stack.env")["KAFKA_BOOTSTRAP"] == "127.0.0.1:1"
    return run_dir


@pytest.fixture
def stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """:func:`up_state`, then `down`."""
    run_dir = up_state(tmp_path, monkeypatch)
    down(run_dir, say=lambda _: None)
    return run_dir


def test_down_removes_the_owners_files_and_marks_the_researchers(stopped: Path) -> None:
    assert not (stopped / "stack.env").exists()
    assert not settings.user_stack_env().exists()
    marker = read_env_file(stopped / "researcher" / "stack.env")
    assert set(marker) == {settings.STOPPED, "RUN_DIR"} and marker["RUN_DIR"] == str(stopped)
    assert (stopped / "researcher" / "stack.env").stat().st_mode & 0o777 == 0o644


def test_down_removes_the_per_user_file_of_its_run_dir_when_its_own_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write_state(StackInfo(run_dir, "127.0.0.1:1", "redis://127.0.0.1:1/0", "", "external"))
    (run_dir / "stack.env").unlink()  # e.g. `make down` without the venv removed it
    down(run_dir, say=lambda _: None)
    assert not settings.user_stack_env().exists()


def test_the_cli_says_no_stack_is_running(stopped: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_STACK_DIR", str(stopped / "researcher"))
    res = CliRunner().invoke(app, ["queue"])
    assert res.exit_code == 3
    assert res.stderr.startswith(f"error: no stack running: the stack of {stopped} was stopped at ")
    res = CliRunner().invoke(app, ["submit", "-b", "lab", "--gpus", "1", "-m", "0", "--duration", "1h", "--json"])
    assert res.exit_code == 3
    assert json.loads(res.stdout)["verdict"] == "unreachable"


def test_an_address_given_is_used_whatever_the_marker(stopped: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_STACK_DIR", str(stopped / "researcher"))
    with pytest.raises(settings.StackStopped):
        settings.Connection.resolve(bootstrap="k:1")  # Redis still from the marker: none
    monkeypatch.setenv("APPORTION_REDIS_URL", "redis://r:2/0")
    assert settings.Connection.resolve(bootstrap="k:1") == settings.Connection("k:1", "redis://r:2/0")


@pytest.mark.parametrize("owner", ["this", "other"])
def test_make_down_without_a_venv_leaves_what_stack_down_leaves(
    owner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Makefile's `down` fallback (no venv, shell only) leaves the files `down` leaves: no owner's files, the
    researchers' file the marker the CLI reads as a stopped stack; a per-user file of another RUN_DIR is kept."""
    import os
    import subprocess

    run_dir = up_state(tmp_path, monkeypatch)
    user = settings.user_stack_env()
    if owner == "other":
        user.write_text("KAFKA_BOOTSTRAP=127.0.0.1:2\nRUN_DIR=/elsewhere/run\n")
    root = Path(__file__).resolve().parents[2]
    args = ["make", "-s", "down", f"VENV={tmp_path / 'no-venv'}", f"RUN_DIR={run_dir}"]
    res = subprocess.run(args, cwd=root, env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert not (run_dir / "stack.env").exists()
    assert user.exists() == (owner == "other")
    marker = read_env_file(run_dir / "researcher" / "stack.env")
    assert set(marker) == {settings.STOPPED, "RUN_DIR"} and marker["RUN_DIR"] == str(run_dir.resolve())
    assert (run_dir / "researcher" / "stack.env").stat().st_mode & 0o777 == 0o644
    assert list((run_dir / "researcher").iterdir()) == [run_dir / "researcher" / "stack.env"]
    monkeypatch.setenv("APPORTION_STACK_DIR", str(run_dir / "researcher"))
    with pytest.raises(settings.StackStopped, match=f"the stack of {run_dir.resolve()} was stopped at 20"):
        settings.Connection.resolve()


def test_the_owners_cli_in_the_checkout_reads_the_marker_too(
    stopped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's CLI in a folder whose `.run/` is the stopped stack's (no `APPORTION_STACK_DIR`): the owner's
    `stack.env` is gone, the marker in `.run/researcher/` says the stack stopped, not a default address."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    stopped.rename(checkout / ".run")
    monkeypatch.chdir(checkout)
    res = CliRunner().invoke(app, ["queue"])
    assert res.exit_code == 3
    assert res.stderr.startswith(f"error: no stack running: the stack of {stopped} was stopped at ")


@pytest.mark.parametrize("command", [["audit", "verify"], ["audit", "occupancy"], ["audit", "preemptions"]])
def test_an_export_is_audited_offline_whatever_the_marker(
    stopped: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    from tests.kit.audit_history import export, history

    monkeypatch.setenv("APPORTION_STACK_DIR", str(stopped / "researcher"))
    path = export(stopped / "log.jsonl.gz", history(), "")
    res = CliRunner().invoke(app, [*command, "--from-file", path])
    # it was 3, "no stack running", though no stack is needed (the kit's history has mismatches: verify says 1)
    assert res.exit_code in (0, 1) and "records in" in res.stderr, res.output
    assert "no stack running" not in res.stderr


def test_a_kafka_given_to_the_client_is_used_whatever_the_marker(
    stopped: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stack up --bootstrap K --redis R` in a checkout whose stack was stopped registers the keys at K: the client
    needs no Redis for that, so the marker (which names neither) must not refuse it."""
    from apportion.client import kafka_address

    monkeypatch.setenv("APPORTION_STACK_DIR", str(stopped / "researcher"))
    assert kafka_address("k:1") == "k:1"
    with pytest.raises(settings.StackStopped):
        kafka_address(None)


def test_a_stack_started_since_elsewhere_is_found_beside_the_marker(
    stopped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make down` in a checkout, then `stack up --dir ELSEWHERE`: from the checkout the CLI finds the running
    stack through the per-user state file, not the stopped one's marker ("no stack running")."""
    monkeypatch.chdir(stopped.parent)  # the checkout: its .run/researcher/stack.env is the marker
    (stopped.parent / ".run").symlink_to(stopped)
    with pytest.raises(settings.StackStopped):
        settings.Connection.resolve()
    other = tmp_path / "other"
    other.mkdir()
    _write_state(StackInfo(other, "127.0.0.1:2", "redis://127.0.0.1:2/0", "", "external"))
    assert settings.Connection.resolve() == settings.Connection("127.0.0.1:2", "redis://127.0.0.1:2/0")
