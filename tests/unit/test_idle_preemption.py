"""D3.idle-runs: an allocated run past its protection whose GPUs its node agents report idle for at least its
budget's ``preempt_idle_after_s`` is a victim for any waiting job that fits, after unallocated runs and before
busy expired ones; never while protected.

The rule alone (:func:`idle_rule`, :func:`victim_rule`), then whole dispatcher cycles. Tree::

    lab (1.0)
    ├── a  0.5   (alice)        <- the preemptor's leaf unless stated
    └── b  0.5   preempt_idle_after_s 7200 (2 h)

Nodes n0 and n1, 4 GPUs each. Two runs of lab/b, 4 GPUs each, started at T0 with a 1 h minimum runtime
(protected until T0 + 1 h): ``busy`` on n0, reported busy, and ``idle`` on n1, reported idle for the case's
seconds. At 3 h a 4-GPU job arrives: lab/b has used 24 GPU-h, lab/a none, so lab/b is behind and both runs are
expired-behind victims of equal cost; without the idle rule n0 (the lower node id) would go.
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.domain.preemption import (
    REFUSED_NOT_BEHIND,
    REFUSED_PROTECTED,
    REFUSED_STOPPING,
    RULE_EXPIRED_BEHIND,
    RULE_IDLE,
    RULE_UNALLOCATED,
    idle_rule,
    victim_rule,
)
from apportion.timeutil import from_us
from tests.kit.builders import T0, h, submitted
from tests.kit.domain_dispatch import hb, reg
from tests.kit.narrowing import narrow
from tests.kit.preemption import NOW, run_of, view

AFTER_S = 7200.0
TREE = BudgetTree.from_mapping(
    {
        "lab": 1.0,
        "lab/a": {"share": 0.5, "members": ["alice"]},
        "lab/b": {"share": 0.5, "preempt_idle_after_s": AFTER_S},
    }
)
CFG = DispatchConfig(heartbeat_timeout_s=None)
SHORT = AFTER_S - 1e-6  # one µs short of the setting


@pytest.mark.parametrize(
    ("idle_s", "after_s", "want"),
    [
        pytest.param(SHORT, AFTER_S, False, id="one µs short of the setting: not idle enough"),
        pytest.param(AFTER_S, AFTER_S, True, id="exactly the setting: idle enough"),
        pytest.param(1e9, None, False, id="no setting: never"),
        pytest.param(None, AFTER_S, False, id="no report: never"),
    ],
)
def test_idle_rule(idle_s, after_s, want):
    assert idle_rule(idle_s, after_s) is want


# (case id, run, now, idle_s, setting, expected rule); the view puts lab/b ahead of lab/a (not behind by delta)
RULE_CASES = [
    pytest.param(run_of(), NOW, SHORT, AFTER_S, REFUSED_NOT_BEHIND, id="one µs short: judged as any expired run"),
    pytest.param(run_of(), NOW, AFTER_S, AFTER_S, RULE_IDLE, id="at the setting: a victim though not behind"),
    pytest.param(run_of(), h(1) - 1, 1e9, AFTER_S, REFUSED_PROTECTED, id="protected: never, however idle"),
    pytest.param(run_of(min_runtime_s=1e9), NOW, 1e9, AFTER_S, REFUSED_PROTECTED, id="protected far ahead: never"),
    pytest.param(run_of(stopping=True), NOW, 1e9, AFTER_S, REFUSED_STOPPING, id="stopping: never"),
    pytest.param(run_of(allocated=False), NOW, None, None, RULE_UNALLOCATED, id="unallocated: as before"),
    pytest.param(run_of("lab/a"), NOW, AFTER_S, AFTER_S, RULE_IDLE, id="the preemptor's own leaf too"),
]


@pytest.mark.parametrize(("run", "now", "idle_s", "after_s", "want"), RULE_CASES)
def test_victim_rule_with_idle_reports(run, now, idle_s, after_s, want):
    verdict = victim_rule(run, "lab/a", now, view(2.0, 1.0), 0.125, idle_s=idle_s, idle_after_s=after_s)
    assert verdict.rule == want


# ------------------------------------------------------------------ whole cycles


def _started(job: str, node: str) -> ev.JobStarted:
    return ev.JobStarted(
        job_id=job, attempt=1, replica=0, node_id=node, gpus=(0, 1, 2, 3), ts=from_us(T0), producer="node-agent",
        event_id=ev.det_id("test-started", job),
    )  # fmt: skip


def _report(node: str, job: str, idle_s: float) -> ev.NodeHeartbeat:
    b = hb(node, h(3), (job, 1, 0))
    w = b.running[0].model_copy(update={"gpus": (0, 1, 2, 3), "idle_s": idle_s, "idle": idle_s >= AFTER_S})
    return b.model_copy(update={"running": (w,)})


def cluster(idle_s: float, *, min_runtime_s: float = 3600.0, first_unallocated: bool = False) -> DispatchState:
    """The two runs of the module docstring (the first unallocated when asked), their heartbeats at 3 h."""
    state = DispatchState(TREE)
    for e in (reg("n0"), reg("n1")):
        step(state, e, T0, CFG)
    for job, node in (("busy", "n0"), ("idle", "n1")):
        mrt = 0.0 if (first_unallocated and job == "busy") else min_runtime_s
        step(state, submitted(job, budget="lab/b", user="bob", gpus=4, min_runtime_s=mrt), T0, CFG)
        out = step(state, Tick(T0), T0, CFG)
        placed = narrow(ev.JobPlaced, next(e for e in out if isinstance(e, ev.JobPlaced)))
        assert placed.placements[0].node_id == node
        step(state, _started(job, node), T0, CFG)
    step(state, _report("n0", "busy", 0.0), h(3), CFG)
    step(state, _report("n1", "idle", idle_s), h(3), CFG)
    return state


def victims_of(state: DispatchState, job: str, budget: str = "lab/a", user: str = "alice") -> list[ev.Victim]:
    step(state, submitted(job, budget=budget, user=user, gpus=4, at=h(3)), h(3), CFG)
    out = step(state, Tick(h(3)), h(3), CFG)
    placed = [narrow(ev.JobPlaced, e) for e in out if isinstance(e, ev.JobPlaced)]
    assert [p.job_id for p in placed] in ([job], [])
    return list(placed[0].decision.victims) if placed else []


def test_an_idle_run_goes_before_a_busy_expired_one():
    [v] = victims_of(cluster(AFTER_S), "a1")
    assert (v.job_id, v.rule, v.idle_s, v.lca) == ("idle", RULE_IDLE, AFTER_S, None)


def test_one_us_short_of_the_setting_the_idle_run_is_an_expired_run_like_the_other():
    [v] = victims_of(cluster(SHORT), "a1")
    assert (v.job_id, v.rule, v.idle_s) == ("busy", RULE_EXPIRED_BEHIND, None)  # n0: the lower node id


def test_a_protected_idle_run_is_never_a_victim():
    assert victims_of(cluster(1e9, min_runtime_s=36000.0), "a1") == []  # both protected until 10 h


def test_an_unallocated_run_goes_before_an_idle_one():
    [v] = victims_of(cluster(AFTER_S, first_unallocated=True), "a1")
    assert (v.job_id, v.rule) == ("busy", RULE_UNALLOCATED)


def test_any_waiting_job_that_fits_may_take_an_idle_run_even_of_its_own_leaf():
    [v] = victims_of(cluster(AFTER_S), "b3", budget="lab/b", user="bob")
    assert (v.job_id, v.rule) == ("idle", RULE_IDLE)


def test_without_the_setting_an_idle_run_is_judged_as_any_other():
    state = cluster(1e9)
    state.tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 0.5, "members": ["alice"]}, "lab/b": 0.5})
    [v] = victims_of(state, "a1")
    assert (v.job_id, v.rule) == ("busy", RULE_EXPIRED_BEHIND)


# ------------------------------------------------------------------ the setting


def test_the_setting_is_inherited_and_none_at_the_root():
    tree = BudgetTree.from_mapping(
        {"lab": {"share": 1.0, "preempt_idle_after_s": 3600.0}, "lab/a": 0.5, "lab/b": TREE.to_mapping()["lab/b"]}
    )
    assert [tree.preempt_idle_after_s(p) for p in ("lab", "lab/a", "lab/b")] == [3600.0, 3600.0, AFTER_S]
    assert TREE.preempt_idle_after_s("lab") is None and TREE.preempt_idle_after_s("lab/a") is None


def test_budget_set_preempt_idle_after_takes_a_duration_keeps_it_and_inherit_drops_it(monkeypatch):
    from typer.testing import CliRunner

    from apportion.cli import budgets, main

    sent: list[ev.BudgetSet] = []
    monkeypatch.setattr(budgets, "_tree_in_force", lambda bootstrap: TREE)
    monkeypatch.setattr(budgets, "_budget_changes", lambda evts, *a, **k: sent.extend(evts))

    def budget_set(*args: str) -> float | None:
        res = CliRunner().invoke(main.app, ["budget", "set", *args])
        assert res.exit_code == 0, res.output
        return sent.pop().preempt_idle_after_s

    assert budget_set("lab/a", "--preempt-idle-after", "90m") == 5400.0
    assert budget_set("lab/b", "--share", "0.5") == AFTER_S  # not given: kept
    assert budget_set("lab/b", "--preempt-idle-after", "inherit") is None
    res = CliRunner().invoke(main.app, ["budget", "set", "lab/a", "--preempt-idle-after", "0s"])
    assert (
        res.exit_code == 2 and "--preempt-idle-after: Input should be greater than 0" in res.output
    )  # > 0: "never" is `inherit` at the root


def test_explain_says_why_an_idle_run_went():
    from apportion.audit.explain import _why

    v = ev.Victim(job_id="idle", attempt=1, budget="lab/b", allocated=True, gpus=4, rule="idle", idle_s=7260.0,
                  protected_until=from_us(h(1)))  # fmt: skip
    assert _why(v) == (
        "rule idle: its GPUs idle for 2h1m, at least its budget's preempt_idle_after, "
        f"protection ended {from_us(h(1)).isoformat()}"
    )


def test_a_budget_file_sets_the_setting_as_a_duration_or_seconds(tmp_path):
    from apportion.budgetfile import BudgetFileError, load_budget_tree

    f = tmp_path / "b.yaml"
    f.write_text(
        "budgets:\n  lab: {share: 1.0, preempt_idle_after: 90m}\n  lab/a: {share: 0.5, preempt_idle_after_s: 60}\n"
    )
    tree = load_budget_tree(f)
    assert [tree.preempt_idle_after_s(p) for p in ("lab", "lab/a")] == [5400.0, 60.0]
    f.write_text("budgets:\n  lab: {share: 1.0, preempt_idle_after: 2h, preempt_idle_after_s: 60}\n")
    with pytest.raises(BudgetFileError, match="give preempt_idle_after or preempt_idle_after_s, not both"):
        load_budget_tree(f)
