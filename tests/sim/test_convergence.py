"""Fair-share convergence: saturating budgets end near their shares (design D2 and D3).

Tree::

    lab (1.0)
    ├── a  0.5
    ├── b  0.3
    └── c  0.2

16 GPUs (2 nodes x 8). Every budget alone asks for 2/3 of the cluster
(1-GPU jobs of 8 h with 2 h minimum runtime), so each is always backlogged
and together they ask for 2x capacity. After three simulated weeks, each
budget's occupancy over the trailing 7-day window is within 2 percentage
points of its share of the capacity integral.
"""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
from tests.kit.simkit import at

pytestmark = pytest.mark.sim

SHARES = {"lab/a": 0.5, "lab/b": 0.3, "lab/c": 0.2}


def test_three_saturating_budgets_converge_to_their_shares():
    tree = BudgetTree.from_mapping({"lab": 1.0, **SHARES})
    nodes = [SimNode("n0", 8), SimNode("n1", 8)]
    jobs = []
    period_h = 8
    per_period = 11  # ~2/3 of 16 GPUs per 8 h period, per budget
    for p in range(21 * 24 // period_h):
        for leaf in SHARES:
            for i in range(per_period):
                jobs.append(
                    SimJob(
                        f"{leaf[-1]}{p:03d}-{i:02d}",
                        leaf,
                        "u",
                        at(p * period_h, i),
                        1,
                        1,
                        2 * 3600.0,
                        period_h * 3600.0,
                    )
                )
    end = at(21 * 24)
    r = simulate(tree, nodes, jobs, SimConfig(seed=3, until_us=end, sample_s=0, keep_log=False))
    occ = r.state.ledger.occupancy(end)
    cap = r.state.ledger.capacity_gpu_s(end)
    got = {leaf: occ.get(leaf, 0.0) / cap for leaf in SHARES}
    assert r.violations == []
    for leaf, share in SHARES.items():
        assert got[leaf] == pytest.approx(share, abs=0.02), got
    assert sum(got.values()) > 0.97  # and the cluster stayed busy
