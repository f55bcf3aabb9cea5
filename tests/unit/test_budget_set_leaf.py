"""``budget set`` of a new budget under a leaf: refused while queued or running jobs charge the leaf (only leaves
take jobs, so it cannot become an inner budget under them), exit 1 with the jobs named; allowed once none do.

    lab (1.0)
    ├── a (0.5)    jobs: a1 pending, a2 running, a3 running
    └── b (0.5)    no jobs
"""

from __future__ import annotations

import json

import pytest

from apportion import events, readmodel
from apportion.domain.budgets import BudgetTree
from tests.kit.cli import no_stack, run
from tests.kit.fakes import FakeRedis

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[events.BudgetSet]:
    from apportion.cli import budgets

    no_stack(monkeypatch)
    r = FakeRedis()
    jobs = {"a1": "pending", "a2": "running", "a3": "running"}
    readmodel.replace_hash(
        r, readmodel.jobs_key(), {j: {"job_id": j, "budget": "lab/a", "state": s} for j, s in jobs.items()}
    )
    out: list[events.BudgetSet] = []
    monkeypatch.setattr(budgets, "_tree_in_force", lambda bootstrap: TREE)
    monkeypatch.setattr(budgets, "_redis", lambda url: r)
    monkeypatch.setattr(budgets, "_budget_changes", lambda evts, *a, **k: out.extend(evts))
    return out


MESSAGE = (
    "refused: in_use: lab/a is a leaf with 1 pending, 2 running job(s) (a1, a2, a3): a budget with queued or "
    "running jobs cannot get children (lab/a/x); let them end or cancel them first"
)


def test_a_child_of_a_leaf_with_jobs_is_refused_with_the_jobs_named(sent: list[events.BudgetSet]) -> None:
    res = run("budget", "set", "lab/a/x", "--share", "1")
    assert (res.exit_code, res.stderr, sent) == (1, f"error: {MESSAGE}\n", [])


def test_under_json_the_refusal_names_parent_and_jobs(sent: list[events.BudgetSet]) -> None:
    res = run("budget", "set", "lab/a/x", "--share", "1", "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout) == {
        "ok": False,
        "verdict": "refused",
        "reason": "in_use",
        "message": MESSAGE,
        "exit_code": 1,
        "path": "lab/a/x",
        "parent": "lab/a",
        "jobs": ["a1", "a2", "a3"],
    }


def test_a_child_of_a_leaf_without_jobs_and_a_change_to_the_leaf_itself_pass(sent: list[events.BudgetSet]) -> None:
    assert run("budget", "set", "lab/b/x", "--share", "1").exit_code == 0
    assert run("budget", "set", "lab/a", "--share", "0.4").exit_code == 0
    assert [(e.path, e.share) for e in sent] == [("lab/b/x", 1.0), ("lab/a", 0.4)]
