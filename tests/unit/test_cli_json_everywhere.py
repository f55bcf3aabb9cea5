"""Which commands have ``--json``: the README's list of those without it is the CLI's own."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from apportion.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def commands_without_json() -> set[str]:
    """Every leaf command of ``apportion`` that takes no ``--json``, by its full name (``keys init``)."""
    out: set[str] = set()

    def walk(cmd: Any, name: str) -> None:
        subs = getattr(cmd, "commands", None)  # a group
        if subs is not None:
            for sub_name, sub in subs.items():
                walk(sub, f"{name} {sub_name}".strip())
        elif not any("--json" in getattr(p, "opts", ()) for p in cmd.params):
            out.add(name)

    walk(typer.main.get_command(app), "")
    return out


@pytest.mark.parametrize("page", ["README.md", "docs/researchers.md"])
def test_the_readme_names_every_command_without_json_and_no_other(page: str) -> None:
    text = " ".join((ROOT / page).read_text().split())
    m = re.search(r"Every command has `--help`, and `--json` but for (.+?)\. ", text)
    assert m, f"{page} says which commands have --json"
    named = set(re.findall(r"`([a-z ]+)`", m.group(1)))
    assert (
        named
        == commands_without_json()
        == {
            "schemas",
            "keys init",
            "keys show",
            "stack up",
            "stack down",
            "stack restart",
        }
    )
