"""Where the CLI finds an `apportion stack up` stack from any folder: the per-user state file, its namespace, its clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion import settings
from apportion.clock import ScaledClock, WallClock

VARS = (
    "APPORTION_KAFKA_BOOTSTRAP",
    "KAFKA_BOOTSTRAP",
    "APPORTION_REDIS_URL",
    "REDIS_URL",
    "APPORTION_STACK_DIR",
    "APPORTION_TOPIC_PREFIX",
    "APPORTION_TIME_SCALE",
    "APPORTION_CLOCK_EPOCH_WALL",
    "APPORTION_CLOCK_EPOCH_EVENT",
)


def _clear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset VARS so that monkeypatch restores them afterwards even when code under test sets them."""
    for v in VARS:
        monkeypatch.setenv(v, "")
        monkeypatch.delenv(v)


@pytest.fixture
def user_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    _clear(monkeypatch)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    f = tmp_path / "state" / "apportion" / "stack.env"
    f.parent.mkdir(parents=True)
    f.write_text(
        "KAFKA_BOOTSTRAP=127.0.0.1:41001\nREDIS_URL=redis://127.0.0.1:41002/0\nAPPORTION_TOPIC_PREFIX=dev.\n"
        "APPORTION_TIME_SCALE=60\nAPPORTION_CLOCK_EPOCH_WALL=2026-01-01T00:00:00+00:00\n"
        "APPORTION_CLOCK_EPOCH_EVENT=2017-10-01T00:00:00+00:00\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return f


def test_the_per_user_state_file_is_found_from_any_folder(user_state: Path) -> None:
    assert settings.stack_env_path() == user_state
    assert settings.Connection.resolve() == settings.Connection("127.0.0.1:41001", "redis://127.0.0.1:41002/0")


def test_a_checkout_run_dir_wins_over_the_per_user_file(user_state: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere" / ".run").mkdir()
    (tmp_path / "elsewhere" / ".run" / "stack.env").write_text("KAFKA_BOOTSTRAP=127.0.0.1:42001\n")
    assert settings.Connection.resolve().bootstrap == "127.0.0.1:42001"


def test_the_stack_brings_its_namespace_unless_the_environment_names_one(
    user_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    assert settings.apply_stack_prefix() == "dev."
    assert os.environ["APPORTION_TOPIC_PREFIX"] == "dev."
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "mine.")
    assert settings.apply_stack_prefix() is None
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX")
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "elsewhere:9092")  # another cluster: not the stack's namespace
    assert settings.apply_stack_prefix() is None
    assert "APPORTION_TOPIC_PREFIX" not in os.environ


def test_heartbeat_ages_use_the_stacks_scaled_clock(user_state: Path) -> None:
    clock = settings.event_clock()
    assert isinstance(clock, ScaledClock) and clock.scale == 60.0
    assert repr(clock).endswith("epoch_event=2017-10-01T00:00:00+00:00)")


def test_without_a_stack_the_clock_is_the_wall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear(monkeypatch)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "none"))
    monkeypatch.chdir(tmp_path)
    assert settings.stack_env_path() is None
    assert isinstance(settings.event_clock(), WallClock)
