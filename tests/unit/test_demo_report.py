"""The main job's report fits an 80-column terminal: compact tables, no cell cut, prose wrapped at 80."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from apportion.audit.report import LogReport
from apportion.report import BudgetRow
from tools import demo


def _budget(path: str) -> BudgetRow:
    # wide figures: 4-digit counts, waits and JCTs over 100 h, thousands of GPU-hours lost
    return BudgetRow(
        path=path,
        share=0.178181818182,
        alloc_share=0.1234,
        free_share=0.0456,
        goodput=0.1567,
        jobs=1234,
        placed=1200,
        never=34,
        wait_p50_s=45296.0,
        wait_p95_s=444240.0,
        preemptions=1234,
        completed=1187,
        jct_p50_s=45296.0,
        jct_p95_s=1644120.0,
        held_gpu_h=100365.0,
        lost_gpu_h=12345.0,
        lost_pct=12.3,
        preemptions_per_job_hour=0.0123,
        max_preemptions_per_job=17,
        mean_deficit_pp=12.34,
    )


def _log(paths: list[str]) -> LogReport:
    return LogReport(
        start_us=0,
        end_us=1,
        capacity_gpu_s=1.0,
        utilisation=0.9876,
        jobs=12345,
        placed=12000,
        never=345,
        wait_p50_s=45296.0,
        wait_p95_s=444240.0,
        preemptions=12345,
        violations=0,
        budgets=[_budget(p) for p in paths],
        goodput=0.8765,
        completed=11987,
        lost_gpu_h=123456.0,
        lost_pct=10.0,
        jct_p50_s=45296.0,
        jct_p95_s=1644120.0,
        preemptions_per_job_hour=0.0123,
        max_preemptions_per_job=17,
        mean_deficit_pp=1.23,
        max_deficit_pp=45.67,
    )


def _render(tmp_path: Path, verdict: dict[str, Any]) -> list[str]:
    buf = io.StringIO()
    con = Console(file=buf, width=demo.REPORT_WIDTH)
    args = argparse.Namespace(slice="week44+3d", seed=1, time_scale=1440.0, tolerance_pp=2.0, json=False, dir=tmp_path)
    live, sim = _log(["philly/0e4a51", "philly/other"]), _log(["philly/0e4a51", "philly/other"])
    demo._report(con, args, live, sim, 1234.5, 12.3, 123456, 0, verdict, Table)
    return [line.rstrip() for line in buf.getvalue().splitlines()]


VERDICT = {
    "ok": False,
    "records": 123456,
    "snapshots": 1234,
    "decision_ticks": 12345,
    "read_models": True,
    "signed_requests": 1234,
    "wall_s": 12.3,
    "mismatches": [
        {
            "check": "decision",
            "offset": "apportion.jobs:0@123456",
            "at": "2017-10-30T00:00:00+00:00",
            "subject": "job j123",
            "detail": "placed differently: n1 vs n2 at rank 3",
        }
    ],
    "first_offset": "apportion.jobs:0@123456",
    "export": "/r/.run/demo/export",
}


def test_the_report_fits_80_columns_with_every_cell_whole(tmp_path: Path) -> None:
    lines = _render(tmp_path, VERDICT)
    assert max(len(line) for line in lines) <= 80
    # each budget: a live row, a sim row under it, in both per-budget tables; nothing cut (no "…")
    assert not [line for line in lines if "…" in line]
    i = lines.index(" budget         run   share  alloc  free  wait p50/p95  preempt (most)")
    assert lines[i + 2 : i + 4] == [
        " philly/0e4a51  live  17.8%  12.3%  4.6%  12.6h/123.4h       1234 (17)",
        "                sim          12.3%  4.6%  12.6h/123.4h       1234 (17)",
    ]
    i = lines.index(" budget         run   deficit  goodput  lost GPU-h (%)  done   JCT p50/p95")
    assert lines[i + 2] == " philly/0e4a51  live    12.34    15.7%  12,345 (12.3%)  1187  12.6h/456.7h"
    assert " preemptions per job-h / most of a job      0.0123 / 17      0.0123 / 17" in lines
    # the command to run offline is on a line of its own, whole
    i = lines.index("  offline:")
    assert lines[i + 1] == "  apportion audit verify --from-file /r/.run/demo/export"


def test_the_console_is_at_most_80_columns_on_a_wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert demo.report_console(Console, False).width == 80
    monkeypatch.setenv("COLUMNS", "60")
    assert demo.report_console(Console, False).width == 60


def test_the_replays_progress_off_a_terminal_is_a_plain_line_at_each_tenth_and_at_the_end() -> None:
    said: list[str] = []
    with demo.PlainProgress(said.append) as prog:
        task = prog.add_task("submitting", total=9120, at="")
        for done, at in ((1, "2026-10-30 00:00"), (900, "2026-10-30 01:00"), (912, "2026-10-30 01:10")):
            prog.update(task, completed=done, at=at)
        prog.update(task, completed=5000, at="2026-10-31 12:00")  # 54%: one line, not one per tenth passed
        prog.update(task, completed=5001)
        prog.update(task, completed=9120)
        hours = prog.add_task("event hours to the end of the slice", total=168, at="")
        prog.update(hours, completed=168, at="2026-11-06 00:00")
    assert said == [
        "submitting: 912/9,120 (10%), event time 2026-10-30 01:10",
        "submitting: 5,000/9,120 (54%), event time 2026-10-31 12:00",
        "submitting: 9,120/9,120 (100%), event time 2026-10-31 12:00",
        "event hours to the end of the slice: 168/168 (100%), event time 2026-11-06 00:00",
    ]
    assert max(map(len, said)) <= 80
