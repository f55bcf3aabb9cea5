"""The command line with no stack: ``no_stack`` points Kafka and Redis where nothing listens (a command that gets
past its own checks exits 3), ``run`` invokes the app at 300 columns. ``stackless`` is ``no_stack`` as an autouse
fixture for every test of a module that imports it."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from apportion.cli.main import app


def no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)


@pytest.fixture(autouse=True)
def stackless(monkeypatch: pytest.MonkeyPatch) -> None:
    no_stack(monkeypatch)


def run(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})
