"""`forecast`, `queue` and `deadletter` at 80 columns: no cell is cut (a time, an offset, a job id); the columns that
do not fit leave the table for a line per row after it, and the forecast's bases are listed one a line."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from rich.console import Console

from apportion.cli.jobs import forecast_table, queue_table
from apportion.cli.main import deadletter_table
from apportion.timeutil import to_us
from tests.kit.queue_rows import ROWS

LONG_JOB = "alice-resnet50-sweep-lr3e4-seed1"
LONG_BUDGET = "research/vision/detection"


def render(renderable: Any, width: int = 80) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return [line.rstrip() for line in console.export_text().splitlines()]


def _forecast() -> Any:
    now = to_us(datetime(2026, 12, 6, 22, 1, tzinfo=UTC))
    job: dict[str, Any] = {"note": "", "chain": [], "after_us": None}
    return SimpleNamespace(
        now_us=now,
        jobs=[
            SimpleNamespace(
                job_id=LONG_JOB,
                budget=LONG_BUDGET,
                start_us=now + 30 * 3600 * 10**6,  # 30 h later: 12-08 04:01, in 1d6h
                wait_s=30 * 3600.0,
                basis="time_limit",
                reason_detail={"kind": "protected_until"},
                reason="protected_until: the runs it could preempt are protected",
                **job,
            ),
            SimpleNamespace(
                job_id="sweep-17",
                budget="lab/nlp",
                start_us=None,
                wait_s=None,
                basis="unknown",
                reason_detail={"kind": "budget_ahead"},
                reason="budget_ahead: ...",
                **job,
            ),
        ],
    )


def test_forecast_at_80_columns_moves_the_basis_and_reason_below_and_lists_the_bases_one_a_line() -> None:
    assert render(forecast_table(_forecast(), 80)) == [
        "           forecast at 2026-12-06T22:01:00+00:00 (2 pending job(s))",
        "job                               budget                     est. start     in",
        "──────────────────────────────────────────────────────────────────────────────",
        "alice-resnet50-sweep-lr3e4-seed1  research/vision/detection  12-08 04:01  1d6h",
        "sweep-17                          lab/nlp                    -               -",
        "alice-resnet50-sweep-lr3e4-seed1: basis time_limit, reason now protected_until",
        "sweep-17: basis unknown, reason now budget_ahead",
        "basis:  now           starts at once",
        "        rules         only protection and grace ends delay it (exact)",
        "        simulated     runs end at their declared work",
        "        time_limit    at their time limit",
        "        history       at their user's median run time",
        "        unknown       assumed to run W/4",
        "        recent_waits  unallocated: later of it and recent waits of its size",
    ]


def test_forecast_of_short_rows_keeps_every_column_in_the_table() -> None:
    fc = _forecast()
    fc.jobs = fc.jobs[1:]
    assert render(forecast_table(fc, 80))[1:4] == [
        "job       budget   est. start  in  basis    reason now",
        "────────────────────────────────────────────────────────",
        "sweep-17  lab/nlp  -            -  unknown  budget_ahead",
    ]


def test_queue_at_80_columns_moves_the_budget_below_rather_than_cut_the_start_time() -> None:
    rows = copy.deepcopy(ROWS)
    rows[0].update(job_id=LONG_JOB, budget=LONG_BUDGET, user="alice.smith", started_at="2026-12-06T22:01:22+00:00")
    assert render(queue_table(rows, 80)) == [
        "                                queue (2 jobs)",
        "pos  job                               user         GPUs  state    started",
        "──────────────────────────────────────────────────────────────────────────────",
        "  -  alice-resnet50-sweep-lr3e4-seed1  alice.smith  2x8   running  12-06 22:01",
        " 12  sweep-17                          dave         1x1   pending  -",
        "budget, nodes (running) / reason (pending), UTC times:",
        "alice-resnet50-sweep-lr3e4-seed1: budget research/vision/detection;",
        "node-1,node-2",
        "sweep-17: budget lab/nlp; budget_ahead: lab/vision (r 0.42) is served before",
        "lab/nlp (r 0.61)",
    ]


def test_queue_with_a_job_id_too_long_for_the_row_moves_the_start_time_below_whole() -> None:
    rows = copy.deepcopy(ROWS[:1])
    rows[0].update(job_id="x" * 56, started_at="2026-12-06T22:01:22+00:00")
    assert render(queue_table(rows, 80)) == [
        "                               queue (1 jobs)",
        "pos  job                                                       GPUs  state",
        "────────────────────────────────────────────────────────────────────────────",
        f"  -  {'x' * 56}  2x8   running",
        "budget, user, started, nodes (running) / reason (pending), UTC times:",
        f"{'x' * 56}: budget",
        "lab/vision/detect, user carol, started 12-06 22:01; node-1,node-2",
    ]


DEAD: list[dict[str, Any]] = [
    {
        "ts": "2026-12-06T22:01:22.123456+00:00",
        "producer": "dispatcher",
        "topic": "apportion.submissions",
        "partition": 11,
        "offset": 1234567,
        "key": "alice:sweep-17",
        "error": "unauthenticated: the signature does not verify against alice's registered key",
    },
    {
        "ts": "2026-12-06T22:03:05+00:00",
        "producer": "accounting",
        "topic": "apportion.jobs",
        "partition": None,
        "offset": 42,
        "key": None,
        "error": "undecodable: not JSON",
    },
]


def test_deadletter_at_80_columns_keeps_the_offset_whole_and_puts_the_reason_below() -> None:
    assert render(deadletter_table(DEAD, 80)) == [
        "                              dead letters (2)",
        "time (UTC)      by          topic[partition]@offset            key",
        "─────────────────────────────────────────────────────────────────────────────",
        "12-06 22:01:22  dispatcher  apportion.submissions[11]@1234567  alice:sweep-17",
        "12-06 22:03:05  accounting  apportion.jobs[?]@42               -",
        "apportion.submissions[11]@1234567: unauthenticated: the signature does not",
        "verify against alice's registered key",
        "apportion.jobs[?]@42: undecodable: not JSON",
    ]


def test_deadletter_wide_enough_shows_the_full_time_and_the_reason_in_the_table() -> None:
    lines = render(deadletter_table(DEAD[1:], 140), 140)
    assert lines[3] == ("2026-12-06 22:03:05  accounting  apportion.jobs[?]@42     -    undecodable: not JSON")
