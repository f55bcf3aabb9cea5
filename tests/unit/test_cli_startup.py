"""The CLI's start imports no heavy module: a command's modules load when it runs or its help is asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import typer

from apportion.cli.common import readable_help
from apportion.cli.lazyimport import lazy_module
from apportion.cli.main import COMMANDS, LazyCommands, app, load_command

#: Imported by the commands that read the log, never by `apportion --help` or a command's own `--help` (pydantic:
#: every event model; the `apportion.events` module found is at most a lazy one not yet executed). rich prints
#: the tables: some command modules import it, the root's help and the queue's do not.
HEAVY = ("pydantic", "kafka", "redis", "apportion.domain", "apportion.bus.reader", "apportion.bus.security")

_PROBE = """
import json, sys
from apportion.cli.main import app
code = None
try:
    app(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
ev = sys.modules.get("apportion.events")
print(json.dumps({
    "code": code,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "kafka", "rich", "redis")
                      or m.startswith(("apportion.domain", "apportion.bus"))),
    "events_run": ev is not None and "EVENT_TYPES" in object.__getattribute__(ev, "__dict__"),
}))
"""


def _imported_by(*argv: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "80"},
    )
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [("--help",), ("queue", "--help"), ("share", "--help"), ("nodes", "--help")])
def test_help_imports_no_heavy_module(argv: tuple[str, ...]) -> None:
    got = _imported_by(*argv)
    assert got["code"] == 0
    assert [m for m in got["modules"] if m.startswith(HEAVY)] == []
    assert got["events_run"] is False
    if argv in (("--help",), ("queue", "--help")):
        assert [m for m in got["modules"] if m.startswith("rich")] == []


def test_the_probe_sees_a_heavy_import() -> None:
    """The probe reports what it is meant to: `schemas` lists the event types, so the events' models ran."""
    got = _imported_by("schemas")
    assert got["code"] in (0, None)
    assert "pydantic" in got["modules"] and got["events_run"] is True


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_listed_line_is_the_commands_own(name: str) -> None:
    cmd = load_command(name)
    readable_help(cmd)
    assert COMMANDS[name][2] == cmd.short_help


def test_the_root_lists_every_command_in_order_and_loads_one_on_use() -> None:
    root: Any = typer.main.get_command(app)
    lazy = root.commands
    assert isinstance(lazy, LazyCommands)
    assert list(lazy) == list(COMMANDS) and lazy.loaded == {}
    queue = lazy["queue"]
    assert list(lazy.loaded) == ["queue"] and queue.name == "queue" and lazy["queue"] is queue
    with pytest.raises(KeyError):
        lazy["nope"]


def test_lazy_module_runs_on_first_attribute_and_is_the_one_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import apportion

    for name in ("apportion.durations",):
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(apportion, "durations", raising=False)
    mod = lazy_module("apportion.durations")
    assert "parse_duration" not in object.__getattribute__(mod, "__dict__")
    from apportion import durations

    assert durations is mod and apportion.durations is mod and sys.modules["apportion.durations"] is mod
    assert mod.parse_duration("90s") == 90
    assert lazy_module("apportion.durations") is mod
    with pytest.raises(ModuleNotFoundError):
        lazy_module("apportion.no_such_module")
