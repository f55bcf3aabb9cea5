"""Every command's `--help` reads as plain text: no reStructuredText markup, no value type after a flag."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from apportion.cli.common import help_text
from apportion.cli.main import app


def _paths(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    yield path
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        if not getattr(sub, "hidden", False):
            yield from _paths(sub, (*path, name))


COMMANDS = list(_paths(typer.main.get_command(app)))


def test_every_command_is_checked() -> None:
    assert ("budget", "set") in COMMANDS and ("stack", "up") in COMMANDS and () in COMMANDS


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "apportion")
def test_help_has_no_rst_markup_and_no_type_after_a_flag(path: tuple[str, ...]) -> None:
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "``" not in res.output
    assert "<bool>" not in res.output
    assert ":func:`" not in res.output and ":mod:`" not in res.output


@pytest.mark.parametrize(
    ("doc", "shown"),
    [
        pytest.param("use ``--inherit-members``", "use `--inherit-members`", id="literal"),
        pytest.param("see :func:`apportion.forecast.job_forecast`", "see `apportion.forecast.job_forecast`", id="role"),
        pytest.param("see :class:`~apportion.x.Y`", "see `apportion.x.Y`", id="role-short-form"),
        pytest.param("``a`` and ``b``", "`a` and `b`", id="two-literals"),
        pytest.param("plain `x`", "plain `x`", id="already-plain"),
        pytest.param("a line wrapped\nat the source's width", "a line wrapped at the source's width", id="soft-break"),
        pytest.param("one.\n\nTwo.", "one.\n\nTwo.", id="paragraphs-kept"),
        pytest.param(
            "Examples:\n\n  apportion a\n  apportion b",
            "Examples:\n\n\b\n  apportion a\n  apportion b",
            id="indented-examples-kept",
        ),  # fmt: skip
        pytest.param("  apportion a\n  apportion b", "\b\n  apportion a\n  apportion b", id="examples-first"),
    ],
)
def test_help_text(doc: str, shown: str) -> None:
    assert help_text(doc) == shown


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "apportion")
def test_help_renders_whole_within_80_columns(path: tuple[str, ...]) -> None:
    # rich's panels cut what did not fit their help column with an ellipsis ("APPORTION_KAFKA_BOOTS…",
    # "--inherit-max-min-run…"), and a group's list of commands cuts each summary ("...")
    res = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert [line for line in lines if len(line) > 80] == []
    assert [line for line in lines if "…" in line or line.endswith("...") and not line.startswith("Usage:")] == []


def test_a_long_name_in_a_help_at_80_columns_is_whole() -> None:
    res = CliRunner().invoke(app, ["budget", "set", "--help"], env={"COLUMNS": "80"})
    words = res.output.split()
    assert "--inherit-max-min-runtime" in words and "APPORTION_KAFKA_BOOTSTRAP]" in words
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"})
    assert (
        " ".join(res.output.split()).count("cancel Cancel a pending or running job and wait for the dispatcher's") == 1
    )


def test_a_paragraph_of_help_is_wrapped_by_the_terminal_not_at_the_sources_line_breaks() -> None:
    res = CliRunner().invoke(app, ["hold", "--help"], env={"COLUMNS": "200"})
    lines = [" ".join(line.split()) for line in res.output.splitlines()]
    # the docstring breaks this sentence after "or the"; 200 columns hold it on one line
    assert any("not yours) or the log has no such job; 3 when Kafka" in line for line in lines), res.output


def _command(path: tuple[str, ...], root: Any = None) -> Any:
    cmd: Any = root if root is not None else typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


#: The commands a researcher or an operator types most: each help shows how, with an example.
WITH_EXAMPLES = [
    ("submit",), ("cancel",), ("hold",), ("release",), ("queue",), ("share",), ("history",), ("usage",), ("logs",),
    ("nodes",), ("drain",), ("cordon",), ("undrain",), ("budget", "set"), ("budget", "apply"), ("budget", "rm"),
]  # fmt: skip


@pytest.mark.parametrize("path", WITH_EXAMPLES, ids=" ".join)
def test_the_examples_in_a_help_are_commands_the_cli_parses(path: tuple[str, ...]) -> None:
    """Each ``apportion ...`` line under "Examples:" names options the command has (its ``(note)`` left out)."""
    import re
    import shlex

    doc = _command(path).help or ""
    assert "Examples:" in doc
    examples = [re.split(r"\s{2,}\(", ln.strip())[0] for ln in doc.split("Examples:", 1)[1].splitlines()]
    examples = [ex for ex in examples if ex.startswith("apportion ")]
    assert examples
    for ex in examples:
        args = shlex.split(ex)[1:]
        assert tuple(args[: len(path)]) == path, ex
        # --help right after the command: the options are parsed (an unknown one fails), nothing runs
        res = CliRunner().invoke(app, [*path, "--help", *args[len(path) :]], env={"COLUMNS": "200"})
        assert res.exit_code == 0, (ex, res.output)


def test_every_commands_help_ends_with_the_exit_codes() -> None:
    from apportion.cli.common import EXIT_CODES_HELP, readable_help

    root = typer.main.get_command(app)
    readable_help(root)
    leaves = [p for p in COMMANDS if p and not hasattr(_command(p), "commands")]
    assert len(leaves) > 30 and EXIT_CODES_HELP.startswith("Exit codes: 0 done, 1 refused or not found, 2 bad input")
    for path in leaves:
        assert _command(path, root).epilog == EXIT_CODES_HELP, path
    res = CliRunner().invoke(app, ["queue", "--help"], env={"COLUMNS": "200"})
    assert " ".join(res.output.split()).endswith(EXIT_CODES_HELP)


def test_the_root_help_names_every_command() -> None:
    import re

    root = _command(())
    named = set(re.findall(r"`([a-z]+)[ `]", root.help or ""))
    assert set(root.commands) - named == set()
