"""The deficit by day of the simulator's report: per budget and day of the run, its deficits of that day summed
over the number of (sample, budget) pairs of the whole run, so that they add up to the mean share deficit."""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
from apportion.sim.report import summarise
from tests.kit.simkit import at

H = 3600
DAY_US = 86_400 * 1_000_000


def test_deficit_by_day_is_each_days_deficits_over_every_pair_and_adds_up_to_the_mean():
    # one 8-GPU node; lab/b (share 0.25) fills it with 20-hour jobs from 0:00, lab/a (0.75) asks from 0:30 on:
    # lab/a is behind on day 0 and day 1, until its own work has run long enough
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.75, "lab/b": 0.25})
    jobs = [SimJob(f"b{i}", "lab/b", "u", at(0), 8, 1, 2 * H, 20 * H) for i in range(3)]
    jobs += [SimJob(f"a{i}", "lab/a", "u", at(0, 30), 8, 1, 2 * H, 20 * H) for i in range(2)]
    r = simulate(tree, [SimNode("n0", 8)], jobs, SimConfig(seed=1))
    rep = summarise(r, tree, "fairshare", 1)
    pairs: list[tuple[str, int, float]] = []
    for t, row in r.samples:
        for leaf, (share_now, _run, _pend, pend_alloc) in row.items():
            if pend_alloc and t >= r.start_us:
                pairs.append((leaf, (t - r.start_us) // DAY_US, max(0.0, tree.abs_share(leaf) - share_now) * 100))
    days = 1 + max(d for _, d, _ in pairs)
    assert days >= 2  # the run spans two days or more
    expected = {
        leaf: [sum(x for lf, d, x in pairs if lf == leaf and d == day) / len(pairs) for day in range(days)]
        for leaf in ("lab/a", "lab/b")
    }
    assert set(rep.deficit_by_day_pp) == set(expected)
    for leaf, per_day in expected.items():
        assert rep.deficit_by_day_pp[leaf] == pytest.approx(per_day)
    assert sum(sum(v) for v in rep.deficit_by_day_pp.values()) == pytest.approx(rep.mean_deficit_pp)
    assert sum(rep.deficit_by_day_pp["lab/a"]) > 0  # the behind budget is where the mean accrues
