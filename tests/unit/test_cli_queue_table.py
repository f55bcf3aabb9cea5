"""`apportion queue`'s table: nothing a user copies is cut, at 80 columns and at 140."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from apportion.cli.jobs import QUEUE_WIDE, queue_table
from tests.kit.queue_rows import REASON, ROWS


def render(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(queue_table(ROWS, width))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_at_80_columns_every_line_fits_and_nothing_is_cut() -> None:
    lines = render(80)
    assert max(map(len, lines)) <= 80
    text = "\n".join(lines)
    assert "…" not in text
    row = next(line for line in lines if line.lstrip().startswith("- "))
    assert row.split() == ["-", "train-llm-7b-0042", "lab/vision/detect", "carol", "2x8", "running", "12-03", "15:01"]
    # nodes and reasons follow the table, one line per job, whole
    assert "train-llm-7b-0042: node-1,node-2" in lines
    assert f"sweep-17: {REASON}" in lines
    assert "min rt" not in text


def test_wide_terminals_get_one_table_with_every_column() -> None:
    lines = render(QUEUE_WIDE + 20)
    header = next(line for line in lines if line.lstrip().startswith("pos"))
    assert header.split() == [
        "pos",
        "job",
        "budget",
        "user",
        "GPUs",
        "min",
        "rt",
        "state",
        "att",
        "started",
        "(UTC)",
        "idle",
        "nodes",
        "/",
        "reason",
    ]
    row = next(line for line in lines if " sweep-17 " in line)
    assert row.split()[:8] == ["12", "sweep-17", "lab/nlp", "dave", "1x1", "10m", "pending", "0"]
    assert "2026-12-03 15:01:22" in "\n".join(lines)
    assert not any(line.startswith("sweep-17:") for line in lines)


IDLE_ROWS = [{**ROWS[0], "idle_s": 7260.0, "idle": True}, {**ROWS[0], "job_id": "busy-1", "idle_s": 0.0, "idle": False}]


def render_rows(rows: list[dict[str, Any]], width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(queue_table(rows, width))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_at_80_columns_an_idle_run_shows_idle_in_place_of_running_and_its_idle_time_after_the_table() -> None:
    lines = render_rows(IDLE_ROWS, 80)
    assert max(map(len, lines)) <= 80
    row = next(line for line in lines if " train-llm-7b-0042 " in line)
    assert row.split() == ["-", "train-llm-7b-0042", "lab/vision/detect", "carol", "2x8", "IDLE", "12-03", "15:01"]
    assert "train-llm-7b-0042: node-1,node-2 (GPUs idle 2h1m)" in lines  # 7260 s
    busy = next(line for line in lines if " busy-1 " in line)
    assert busy.split()[5] == "running"
    assert "busy-1: node-1,node-2" in lines  # busy now: no idle time


def test_wide_terminals_show_the_idle_column() -> None:
    lines = render_rows(IDLE_ROWS, QUEUE_WIDE + 20)
    header = next(line for line in lines if line.lstrip().startswith("pos"))
    assert header.split()[11] == "idle"
    row = next(line for line in lines if " train-llm-7b-0042 " in line)
    assert row.split()[6:12] == ["running", "1", "2026-12-03", "15:01:22", "IDLE", "2h1m"]
    busy = next(line for line in lines if " busy-1 " in line)
    assert busy.split()[10] == "0s"


# A hold's reason is a researcher's free text, and a raw producer's job id is any string the contract takes: every
# user's `queue` shows them. An escape sequence (clear the screen, set the window title) or a newline (a forged
# line) in them is shown as its escape, never sent to the terminal to act on.
HOSTILE = "wait\x1b]0;PWNED\x07ing \x1b[2J\nFAKE LINE\u202e"


def test_a_reason_or_job_id_holding_control_characters_is_shown_escaped_never_obeyed() -> None:
    rows = [{**ROWS[1], "job_id": "j\x1b[31m", "reason": f"held: held by dave ({HOSTILE})"}]
    for width in (80, QUEUE_WIDE + 20):
        console = Console(width=width, record=True, color_system=None)
        console.print(queue_table(rows, width))
        text = console.export_text()
        assert not any(c in text for c in "\x1b\x07\u202e")
        assert "FAKE LINE" not in [line.strip() for line in text.splitlines()]
        assert "j\\x1b[31m" in text
        escaped = "wait\\x1b]0;PWNED\\x07ing\\x1b[2J\\nFAKELINE\\u202e"  # as shown, wrapped: whitespace left out
        assert escaped in "".join(text.split())
