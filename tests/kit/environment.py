"""The process environment the tests share, and the check that a test leaves it as it found it.

A test that sets ``APPORTION_TOPIC_PREFIX`` (or any variable the clients read) and does not put it back changes
every later test of its worker. ``tests/conftest.py`` snapshots the watched variables before each test and
compares after the test's own fixtures (``monkeypatch`` included) are torn down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import pytest

#: Variables whose names start with one of these are watched: the clients, the services and the CLI read them.
WATCHED_PREFIXES = ("APPORTION_", "KAFKA_", "REDIS_")

#: Watched by exact name: the time zone, and the width the CLI's consoles read at import.
WATCHED_NAMES = frozenset({"TZ", "COLUMNS"})

UNSET = "<unset>"


def watched(environ: Mapping[str, str]) -> dict[str, str]:
    """The watched variables of ``environ`` (a copy)."""
    return {k: v for k, v in environ.items() if k.startswith(WATCHED_PREFIXES) or k in WATCHED_NAMES}


def changes(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """``NAME: before -> after`` for each variable that differs, sorted by name; ``<unset>`` where absent."""
    return [
        f"{name}: {_shown(before.get(name))} -> {_shown(after.get(name))}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    ]


def _shown(value: str | None) -> str:
    return UNSET if value is None else repr(value)


def restore(before: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Put the watched variables of ``environ`` (the process's by default) back to ``before``; others untouched."""
    env = os.environ if environ is None else environ
    for name in watched(env).keys() - before.keys():
        del env[name]
    env.update(before)


def leak_message(before: Mapping[str, str], after: Mapping[str, str]) -> str | None:
    """The failure for a test that left the watched environment changed, or ``None`` when it did not."""
    diff = changes(before, after)
    if not diff:
        return None
    return "test left the environment changed: " + "; ".join(diff) + " (restored; use monkeypatch.setenv/delenv)"


def hide_machine_stack(monkeypatch: pytest.MonkeyPatch, empty: Path) -> None:
    """Point ``APPORTION_STACK_DIR`` at the empty directory ``empty`` and ``XDG_STATE_HOME`` inside it, so the
    addresses the code under test resolves come from the test alone, never from the machine's own stack: a
    running ``make up``'s ``stack.env``, or the marker ``make down`` leaves, which refuses every address."""
    monkeypatch.setenv("APPORTION_STACK_DIR", str(empty))
    monkeypatch.setenv("XDG_STATE_HOME", str(empty / "state"))
