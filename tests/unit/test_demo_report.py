"""The main job's printed report shows goodput, work lost, completions, job completion time and churn for the
cluster and per budget, live next to the simulator (issue 12's report columns), from the same figures as
``report.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from apportion.audit.report import LogReport
from apportion.report import BudgetRow
from tools import demo


def row(lost: float, held: float, completed: int) -> BudgetRow:
    return BudgetRow(
        path="lab/a", share=1.0, alloc_share=0.5, free_share=0.1, goodput=(held - lost) / 1000.0, jobs=4, placed=4,
        never=0, wait_p50_s=60.0, wait_p95_s=7200.0, preemptions=3, completed=completed, jct_p50_s=600.0,
        jct_p95_s=9000.0, held_gpu_h=held, lost_gpu_h=lost, lost_pct=100 * lost / held,
        preemptions_per_job_hour=0.125, max_preemptions_per_job=2, mean_deficit_pp=lost / 100,
    )  # fmt: skip


def report(lost: float, held: float, completed: int) -> LogReport:
    return LogReport(
        start_us=0, end_us=3_600_000_000, capacity_gpu_s=3.6e6, utilisation=0.6, jobs=4, placed=4, never=0,
        wait_p50_s=60.0, wait_p95_s=7200.0, preemptions=3, violations=0, budgets=[row(lost, held, completed)],
        goodput=(held - lost) / 1000.0, completed=completed, jct_p50_s=600.0, jct_p95_s=9000.0, held_gpu_h=held,
        lost_gpu_h=lost, lost_pct=100 * lost / held, preemptions_per_job_hour=0.125, max_preemptions_per_job=2,
        mean_deficit_pp=lost / 100, max_deficit_pp=lost / 10,
    )  # fmt: skip


def test_the_printed_report_has_goodput_work_lost_completions_and_churn(tmp_path: Path) -> None:
    con = Console(record=True, width=250)
    args = argparse.Namespace(slice="week44", seed=1, time_scale=1440.0, tolerance_pp=2.0, json=False, dir=tmp_path)
    verdict = {
        "ok": True, "records": 10, "snapshots": 1, "decision_ticks": 2, "read_models": True, "signed_requests": 4,
        "wall_s": 0.1,
    }  # fmt: skip
    code = demo._report(con, args, report(200.0, 800.0, 3), report(8.0, 800.0, 4), 1.0, 0.5, 10, 0, verdict, Table)
    assert code == 0
    text = con.export_text()
    # cluster: goodput (800 - 200) / 1000 = 60.0% live, (800 - 8) / 1000 = 79.2% simulated
    assert "goodput" in text and "60.0%" in text and "79.2%" in text
    assert "200 (25.0%)" in text and "8 (1.0%)" in text  # work lost GPU-h (% of held)
    assert "0.1250 / 2" in text  # preemptions per job-hour / most of one job
    assert "2.00 / 20.00" in text and "0.08 / 0.80" in text  # share deficit mean / max, live and simulated
    assert "2.00 / 0.08" in text  # the budget's mean deficit, live / simulator
    assert "600s / 2.5h" in text  # JCT p50 / p95 (secs(): seconds below an hour)
    # per budget, live / simulator in one cell
    assert "60.0% / 79.2%" in text and "200 (25.0%) / 8 (1.0%)" in text and "3 / 4" in text
    saved = json.loads((tmp_path / "report.json").read_text())
    assert (saved["live"]["lost_gpu_h"], saved["simulator"]["completed"]) == (200.0, 4)
