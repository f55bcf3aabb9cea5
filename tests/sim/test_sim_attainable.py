"""The attainable share (docs/simulation.md): a budget whose waiting work needs a scarce model is measured
against min(share, the part of the cluster on models its waiting work can use)."""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate, usable_fraction
from apportion.sim.report import summarise
from tests.kit.simkit import at

H = 3600
MODELS: dict[str | None, int] = {"x": 8, "y": 24}  # GPUs per model


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        pytest.param(["x"], 0.25, id="all on the scarce model: 8 of 32"),
        pytest.param(["x", "x"], 0.25, id="repeats count once"),
        pytest.param(["x", "y"], 1.0, id="both models"),
        pytest.param(["x", None], 1.0, id="one job without a constraint: every GPU"),
        pytest.param(["z"], 0.0, id="a model the cluster lacks"),
    ],
)
def test_usable_fraction(models, expected):
    assert usable_fraction(MODELS, models) == expected


def test_a_budget_waiting_only_for_the_scarce_model_is_measured_against_what_it_can_get():
    # x0 (8 GPUs of model x) and y0 (8 of model y); lab/a (share 0.75) asks only for x, lab/b (0.25) for any
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.75, "lab/b": 0.25})
    nodes = [SimNode("x0", 8, "x"), SimNode("y0", 8, "y")]
    jobs = [SimJob(f"a{i}", "lab/a", "u", at(0), 8, 1, 2 * H, 2 * H, gpu_model="x") for i in range(4)]
    jobs += [SimJob(f"b{i}", "lab/b", "u", at(0), 8, 1, 2 * H, 2 * H) for i in range(4)]
    r = simulate(tree, nodes, jobs, SimConfig(seed=1))
    rep = summarise(r, tree, "fairshare", 1)
    plain, attainable = [], []
    for (_t, row), usable in zip(r.samples, r.usable, strict=True):
        for leaf, (share_now, _run, _pend, pend_alloc) in row.items():
            if pend_alloc:
                share = tree.abs_share(leaf)
                plain.append(max(0.0, share - share_now) * 100)
                attainable.append(max(0.0, min(share, usable.get(leaf, 1.0)) - share_now) * 100)
    assert any(u.get("lab/a") == 0.5 for u in r.usable)  # lab/a's waiting work can use x0 only: 8 of 16 GPUs
    assert rep.mean_attainable_deficit_pp == pytest.approx(sum(attainable) / len(attainable))
    assert rep.mean_deficit_pp == pytest.approx(sum(plain) / len(plain))
    assert rep.mean_attainable_deficit_pp < rep.mean_deficit_pp
