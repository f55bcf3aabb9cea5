"""`make help` lists every make command the README's table describes, and only targets the Makefile has."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _names(text: str) -> set[str]:
    """The targets named ``make X`` (and ``make X / Y``, ``/ make Y``) in ``text``."""
    names: set[str] = set()
    for m in re.finditer(r"make ([a-z-]+(?:\s*/\s*(?:make )?[a-z-]+)*)", text):
        names.update(n.strip().removeprefix("make ").strip() for n in m.group(1).split("/"))
    return names


def test_make_help_names_every_command_of_the_readme_table_and_only_real_targets() -> None:
    makefile = (ROOT / "Makefile").read_text()
    help_lines = [line.removeprefix("#   ") for line in makefile.splitlines() if line.startswith("#   make ")]
    in_help = _names("\n".join(line.split("  ")[0] for line in help_lines))
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## What each command does", 1)[1].split("\n## ", 1)[0]
    in_table = _names("\n".join(row.split("|")[1] for row in table.splitlines() if row.startswith("| `make")))
    targets = set(re.findall(r"^([a-z-]+):", makefile, re.MULTILINE))
    assert in_table <= in_help, sorted(in_table - in_help)
    assert in_help <= targets, sorted(in_help - targets)
    assert {"test-unit", "lint", "bench", "clean", "status"} <= in_help
