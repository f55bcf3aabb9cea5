"""`apportion budget show` shows the time limits and idle preemption in force, which `budget set` sets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from apportion.cli.budgets import limit_lines, unallocated_only_lines
from apportion.cli.main import app


def _row(
    path: str, default: float | None = None, most: float | None = None, idle: float | None = None
) -> dict[str, Any]:
    return {"path": path, "default_time_limit_s": default, "max_time_limit_s": most, "preempt_idle_after_s": idle}


def test_a_line_for_each_budget_that_sets_its_own_and_none_for_what_it_inherits() -> None:
    # lab (max 1d) ── a (inherits) ── b (default 2h, idle 30m)
    rows = [_row("lab", most=86400), _row("lab/a", most=86400), _row("lab/a/b", 7200, 86400, 1800), _row("lab/c")]
    assert limit_lines(rows) == [
        "lab: default time limit none, max time limit 1d, preempt idle after none",
        "lab/a/b: default time limit 2h, max time limit 1d, preempt idle after 30m",
        "lab/c: default time limit none, max time limit none, preempt idle after none",
    ]


def test_a_tree_that_sets_none_has_no_line() -> None:
    assert limit_lines([_row("lab"), _row("lab/a")]) == []


def test_show_prints_and_json_carries_the_idle_preemption_of_a_file(tmp_path: Path) -> None:
    f = tmp_path / "b.yaml"
    f.write_text("budgets:\n  lab: 1.0\n  lab/a:\n    share: 0.5\n    preempt_idle_after: 2h\n")
    res = CliRunner().invoke(app, ["budget", "show", "--from-file", str(f)], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert res.stdout.splitlines()[-1] == "lab/a: default time limit none, max time limit none, preempt idle after 2h"
    res = CliRunner().invoke(app, ["budget", "show", "--from-file", str(f), "--json"])
    rows = {r["path"]: r for r in json.loads(res.stdout)}
    assert (rows["lab/a"]["preempt_idle_after_s"], rows["lab"]["preempt_idle_after_s"]) == (7200.0, None)
    assert rows["lab/a"]["default_time_limit_s"] is None and rows["lab/a"]["max_time_limit_s"] is None


def test_budget_set_errors_name_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from apportion.cli import budgets
    from apportion.domain.budgets import BudgetTree

    monkeypatch.setattr(budgets, "_tree_in_force", lambda bootstrap: BudgetTree.from_mapping({"lab": 1.0}))
    res = CliRunner().invoke(app, ["budget", "set", "lab/a", "--share", "0.5", "--preempt-idle-after", "0"])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("error: invalid budget: --preempt-idle-after: ")


def test_a_budget_with_max_min_runtime_0_is_shown_taking_only_unallocated_work() -> None:
    # lab (no limit) ── vision (0s, inner) ── a (inherits 0s); lab/b sets 1h
    rows: list[dict[str, Any]] = [
        {"path": "lab", "max_min_runtime_s": None, "leaf": False},
        {"path": "lab/vision", "max_min_runtime_s": 0.0, "leaf": False},
        {"path": "lab/vision/a", "max_min_runtime_s": 0.0, "leaf": True},
        {"path": "lab/b", "max_min_runtime_s": 3600.0, "leaf": True},
    ]
    assert unallocated_only_lines(rows) == [
        "lab/vision and every budget below it: max min runtime 0s: takes only unallocated work (jobs with min "
        "runtime 0, free and preemptible at any time)"
    ]


def _budget_set(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], *args: str) -> Any:
    from apportion.cli import budgets
    from apportion.domain.budgets import BudgetTree

    published: list[Any] = []
    monkeypatch.setattr(budgets, "_tree_in_force", lambda bootstrap: BudgetTree.from_mapping(spec))
    monkeypatch.setattr(budgets, "_budget_changes", lambda evts, *rest, **kw: published.extend(evts))
    res = CliRunner().invoke(app, ["budget", "set", *args], env={"COLUMNS": "200"})
    return res, published


def test_budget_set_says_a_max_min_runtime_of_0_takes_only_unallocated_work(monkeypatch: pytest.MonkeyPatch) -> None:
    res, published = _budget_set(monkeypatch, {"lab": 1.0, "lab/vision": 0.4}, "lab/vision", "--max-min-runtime", "0")
    assert res.exit_code == 0, res.output
    assert [e.max_min_runtime_s for e in published] == [0.0]
    assert res.stderr.strip() == (
        "note: with max min runtime 0s, lab/vision takes only unallocated work: jobs with min runtime 0 "
        "(free, preemptible at any time); allocated jobs are rejected"
    )


def test_budget_set_refuses_a_default_time_limit_above_the_max_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"lab": 1.0, "lab/x": 0.4}
    res, published = _budget_set(monkeypatch, spec, "lab/x", "--default-time-limit", "2h", "--max-time-limit", "1h")
    assert (res.exit_code, published) == (1, [])
    assert res.stderr.strip() == (
        "error: refused: bad_time_limit: default time limit 2h of 'lab/x' is above its max time limit 1h: every job "
        "that gives no time limit would be refused; lower the default or raise the maximum"
    )
    inherited = {"lab": {"share": 1.0, "default_time_limit_s": 7200}, "lab/x": 0.4}
    res, published = _budget_set(monkeypatch, inherited, "lab/x", "--max-time-limit", "1h")
    assert (res.exit_code, published) == (1, [])
    assert "default time limit 2h (inherited from 'lab') of 'lab/x'" in res.stderr


def test_notes_under_the_table_are_wrapped_within_80_columns(tmp_path: Path) -> None:
    # each note is one line of 91 and one of 119 characters: wrapped at spaces, continuations indented by two
    f = tmp_path / "b.yaml"
    f.write_text(
        "budgets:\n  lab: 1.0\n"
        "  lab/robotics-manipulation: {share: 0.5, default_time_limit: 2h, max_time_limit: 1d, preempt_idle_after: 30m}\n"
        "  lab/vision: {share: 0.5, max_min_runtime: 0}\n"
    )
    for columns in ("80", "200"):
        res = CliRunner().invoke(app, ["budget", "show", "--from-file", str(f)], env={"COLUMNS": columns})
        assert res.exit_code == 0, res.output
        assert res.stdout.splitlines()[-4:] == [
            "lab/robotics-manipulation: default time limit 2h, max time limit 1d, preempt",
            "  idle after 30m",
            "lab/vision: max min runtime 0s: takes only unallocated work (jobs with min",
            "  runtime 0, free and preemptible at any time)",
        ]
    res = CliRunner().invoke(app, ["budget", "show", "--from-file", str(f)], env={"COLUMNS": "60"})
    assert res.stdout.splitlines()[-3:] == [
        "lab/vision: max min runtime 0s: takes only unallocated work",
        "  (jobs with min runtime 0, free and preemptible at any",
        "  time)",
    ]
