"""`audit explain` and `audit verify` at 80 columns: no cell is cut or wrapped inside the table; what does not fit
follows it, a whole line per row (the tables folded long summaries and differences inside their cells)."""

from __future__ import annotations

from rich.console import Console

from apportion.audit.explain import explain
from apportion.audit.verify import Mismatch, records_from_events
from apportion.cli.audit import explain_table, mismatch_table
from tests.kit.audit_history import CFG, history


def render(renderable: object, width: int = 80) -> list[str]:
    c = Console(width=width, record=True)
    c.print(renderable)
    return [line.rstrip() for line in c.export_text().splitlines()]


def test_explain_at_80_columns_keeps_each_step_on_a_row_and_what_happened_whole_after_it() -> None:
    """a1 of the audit history (submitted 0:00, preempted by b1 at 1:00, requeued at 1:00:05): ten steps."""
    lines = render(explain_table(explain(records_from_events(history()), "a1", CFG), 80))
    assert max(map(len, lines)) <= 80
    assert lines[:6] == [
        "                                  job a1",
        " #  event time (UTC)     offset                     event            re-run",
        "───────────────────────────────────────────────────────────────────────────",
        " 1  2024-01-01 00:00:00  apportion.submissions:0@0  JobSubmitted",
        " 2  2024-01-01 00:00:00  apportion.jobs:0@0         JobQueued",
        " 3  2024-01-01 00:00:00  apportion.jobs:0@2         JobPlaced        same",
    ]
    assert lines[13:] == [
        "#1: submitted to lab/a by u: 1 x 1 GPU, min runtime 1h (allocated)",
        "#2: queued (attempt 1) in lab/a",
        "#3: placed (attempt 1) on n0[0] at rank 0, budget rank 0, r 0.0000",
        "#4: command: start on n0",
        "#5: replica 0 started on n0 GPUs [0]",
        "#6: preempted by b1 (lab/b): rule expired_behind at LCA lab: r(victim branch)",
        "2.0000 >= r(preemptor branch) 0.0000 + delta, protection ended",
        "2024-01-01T01:00:00+00:00; grace 30s; work lost 0.00 GPU-h since its last",
        "checkpoint",
        "#7: command: stop on n0",
        "#8: checkpoint: 1h of progress saved",
        "#9: requeued as attempt 2 (preempted), keeping submitted_at",
        "2024-01-01T00:00:00+00:00",
        "#10: replica 0 failed: stopped",
    ]


def test_explain_on_a_wide_terminal_keeps_what_happened_in_the_table() -> None:
    lines = render(explain_table(explain(records_from_events(history()), "a1", CFG), 400), 400)
    assert lines[4].split() == [
        "2", "2024-01-01", "00:00:00", "apportion.jobs:0@0", "JobQueued", "queued", "(attempt", "1)", "in", "lab/a"
    ]  # fmt: skip
    assert len(lines) == 13


def test_verify_mismatches_at_80_columns_keep_the_difference_whole_after_the_table() -> None:
    ms = [
        Mismatch(
            "read_model",
            "apportion.jobs:0@41",
            "2026-12-01T09:00:00+00:00",
            "lab/vision",
            "occupancy_gpu_s: read model 7200.0, rebuilt from the log 3600.0 (the accounting read model is ahead)",
        )
    ]
    assert render(mismatch_table(ms, "apportion.jobs:0@41", 80)) == [
        "          1 mismatches (first at apportion.jobs:0@41)",
        "check       first offset         event time           subject",
        "────────────────────────────────────────────────────────────────",
        "read_model  apportion.jobs:0@41  2026-12-01 09:00:00  lab/vision",
        "apportion.jobs:0@41: occupancy_gpu_s: read model 7200.0, rebuilt from the log",
        "3600.0 (the accounting read model is ahead)",
    ]
