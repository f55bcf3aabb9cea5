"""Connection.resolve: flags > environment > the nearest .run/stack.env > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion.settings import DEFAULT_BOOTSTRAP, DEFAULT_REDIS_URL, Connection, stack_env_path

VARS = ("APPORTION_KAFKA_BOOTSTRAP", "KAFKA_BOOTSTRAP", "APPORTION_REDIS_URL", "REDIS_URL", "APPORTION_STACK_DIR")


@pytest.fixture
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with ``.run/stack.env``; the cwd is a folder two levels below it."""
    for v in VARS:
        monkeypatch.delenv(v, raising=False)
    (tmp_path / ".run").mkdir()
    (tmp_path / ".run" / "stack.env").write_text(
        "# made by make up\nKAFKA_BOOTSTRAP=127.0.0.1:40001\nREDIS_URL=redis://127.0.0.1:40002/0\n"
    )
    deep = tmp_path / "docs" / "img"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    return tmp_path


def test_stack_env_is_found_from_a_subfolder(checkout: Path) -> None:
    assert stack_env_path() == checkout / ".run" / "stack.env"
    assert Connection.resolve() == Connection("127.0.0.1:40001", "redis://127.0.0.1:40002/0")


def test_flags_then_environment_win_over_stack_env(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP", "127.0.0.1:50001")
    assert Connection.resolve() == Connection("127.0.0.1:50001", "redis://127.0.0.1:40002/0")
    assert Connection.resolve(bootstrap="h:1", redis_url="redis://h:2/3") == Connection("h:1", "redis://h:2/3")


def test_stack_dir_names_the_file_and_defaults_apply_without_one(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPORTION_STACK_DIR", str(checkout / "nowhere"))
    assert stack_env_path() is None
    assert Connection.resolve() == Connection(DEFAULT_BOOTSTRAP, DEFAULT_REDIS_URL)
