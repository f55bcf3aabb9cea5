"""The one budget-file reader (apportion.budgetfile): one file gives one tree wherever it is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion.audit.whatif import load_tree
from apportion.budgetfile import BudgetFileError, load_budget_tree, load_budgets
from apportion.cli.verdicts import batch_of
from apportion.domain.budgets import Budget, BudgetTree
from tests.kit.builders import T0_DT
from tests.kit.narrowing import narrow

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "b.yaml"
    p.write_text(text)
    return p


def test_example_file_keeps_its_limits_in_every_reader() -> None:
    # lab (1.0, max 12h) -> prior (0.6) -> robotics (0.5, members alice, bob); vision (0.4, max 8h)
    tree = load_budget_tree(ROOT / "infra/budgets/example.yaml")
    assert narrow(Budget, tree.get("lab")).max_min_runtime_s == 12 * 3600.0
    assert narrow(Budget, tree.get("lab/vision")).max_min_runtime_s == 8 * 3600.0
    assert narrow(Budget, tree.get("lab/prior/robotics")).members == frozenset({"alice", "bob"})
    assert tree.abs_share("lab/prior/robotics") == pytest.approx(0.3)
    # whatif reads the same tree (it used to drop max_min_runtime: "no limit")
    assert load_tree(ROOT / "infra/budgets/example.yaml") == tree


def test_simulator_file_reads_as_its_budget_tree() -> None:
    tree = load_budget_tree(ROOT / "infra/budgets/philly.yaml")
    assert tree.is_leaf("philly/other")
    assert tree.share("philly/other") == 0.02


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("a: 0.5\na: 0.6\n", "b.yaml:2:1: YAML syntax error: found duplicate key 'a'", id="key twice"),
        pytest.param("budgets:\n  a: {share: 0.5, owner: x}\n", "budgets.a: unknown key 'owner'", id="unknown key"),
        pytest.param(
            "budgets:\n  a: {share: 0.5, max_min_runtime: soon}\n", "budgets.a: bad duration 'soon'", id="bad duration"
        ),
        pytest.param(
            "budgets:\n  a: {share: 0.5, max_min_runtime: 1h, max_min_runtime_s: 60}\n",
            "not both",
            id="limit given twice",
        ),
        pytest.param("budgets:\n  a: 0.7\n  b: 0.7\n", "budgets:", id="siblings above 1"),
        pytest.param("budgets: {a: 1.0}\nextra: 1\n", "unknown key 'extra'", id="unknown top-level key"),
        pytest.param("- a\n- b\n", "a budget file is a YAML mapping", id="not a mapping"),
        pytest.param("budgets:\n  a: .nan\n", "budgets.a.share", id="nan share"),
        pytest.param(
            "budgets:\n  a: {share: 1.0, default_time_limit: 0}\n",
            "budgets.a: bad_time_limit: default time limit of 'a' must be above 0 and at most 11574d1h46m40s, got 0 s",
            id="time limit zero",
        ),
        pytest.param(
            "budgets:\n  a: {share: 1.0, max_time_limit_s: -60}\n",
            "budgets.a: bad_time_limit: max time limit of 'a' must be above 0",
            id="negative time limit",
        ),
        pytest.param(
            "budgets:\n  a: {share: 1.0, max_time_limit: 1h, max_time_limit_s: 60}\n", "not both", id="limit twice"
        ),
        pytest.param(
            "budgets:\n  a: {share: 1.0, default_time_limit: 8h}\n  a/b: {share: 1.0, max_time_limit: 2h}\n",
            "budgets: default time limit 8h (inherited from 'a') of 'a/b' is above its max time limit 2h",
            id="default in force above the max in force",
        ),
    ],
)
def test_bad_files_are_one_line_naming_the_place(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(BudgetFileError) as err:
        load_budget_tree(_write(tmp_path, text))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_both_spellings_of_the_limit_agree(tmp_path: Path) -> None:
    a = load_budget_tree(_write(tmp_path, "lab: {share: 1.0, max_min_runtime: 1h30m}\n"))
    b = load_budget_tree(_write(tmp_path, "lab: {share: 1.0, max_min_runtime_s: 5400}\n"))
    assert a == b
    assert narrow(Budget, a.get("lab")).max_min_runtime_s == 5400.0


def test_time_limits_in_a_file_are_the_tree_budget_set_makes(tmp_path: Path) -> None:
    # lab: default 24h (a duration), max 7 d (seconds); lab/a inherits both, lab/b lowers the max to 1d
    f = _write(
        tmp_path,
        "budgets:\n  lab: {share: 1.0, default_time_limit: 24h, max_time_limit_s: 604800}\n"
        "  lab/a: 0.5\n  lab/b: {share: 0.5, max_time_limit: 1d}\n",
    )
    tree = load_budget_tree(f)
    assert tree.time_limits_s("lab") == (86400.0, 604800.0)
    assert tree.time_limits_s("lab/a") == (86400.0, 604800.0)
    assert tree.time_limits_s("lab/b") == (86400.0, 86400.0)
    set_by_hand = BudgetTree.from_mapping(
        {
            "lab": {"share": 1.0, "default_time_limit_s": 86400.0, "max_time_limit_s": 604800.0},
            "lab/a": 0.5,
            "lab/b": {"share": 0.5, "max_time_limit_s": 86400.0},
        }
    )
    assert tree == set_by_hand


def test_budget_apply_publishes_every_limit_of_the_file(tmp_path: Path) -> None:
    # `budget apply` reads the file as budgets (load_budgets); the time limits and the idle preemption reach
    # the batch it publishes (the idle preemption used to be dropped there)
    f = _write(tmp_path, "lab: {share: 1.0, default_time_limit: 2h, max_time_limit: 8h, preempt_idle_after: 30m}\n")
    assert load_budgets(f) == {"lab": Budget("lab", 1.0, None, None, 7200.0, 28800.0, 1800.0)}
    batch = batch_of(BudgetTree.from_mapping({"lab": 1.0}), load_budgets(f), False, T0_DT)
    assert batch is not None
    (spec,) = batch.sets
    assert (spec.default_time_limit_s, spec.max_time_limit_s, spec.preempt_idle_after_s) == (7200.0, 28800.0, 1800.0)
