"""Inputs of the preemption rules (rule D3.victims): ``view`` is a real :class:`FairShareQueue` over window
occupancy with K = 1,000,000 GPU-s (E_a = 500,000, E_b = E_c = 250,000 GPU-s), set by the ratios it is given;
``run_of`` is one run of 4 GPUs on n0 whose protection (its minimum runtime) ended at 1 h, before ``NOW``.

``TREE`` (``ONE_LINE`` is lab -> a -> x, each of share 1.0)::

    lab (1.0)
    ├── a  0.5
    ├── b  0.25
    └── c  0.25
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterState
from apportion.domain.fairshare import FairShareQueue
from apportion.timeutil import from_us
from tests.kit.builders import T0, h

K = 1_000_000.0
DELTA = 0.125
TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.25, "lab/c": 0.25})
ONE_LINE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 1.0, "lab/a/x": 1.0})


def view(r_a: float, r_b: float, tree: BudgetTree = TREE, **more: float) -> FairShareQueue:
    """A view with r(lab/a) = r_a and r(lab/b) = r_b (and other paths' O as given)."""
    occ = {"lab/a": r_a * 0.5 * K, "lab/b": r_b * 0.25 * K, **more}
    occ["lab"] = sum(v for p, v in occ.items() if p.count("/") == 1)
    return FairShareQueue(tree, occ, K, {})


def run_of(
    budget: str = "lab/b",
    *,
    allocated: bool = True,
    min_runtime_s: float = 3600.0,
    started: int = h(0),
    stopping: bool = False,
):
    """One run of ``budget``, 4 GPUs on n0, started at ``started`` (protection = min_runtime)."""
    cs = ClusterState()
    cs.apply(ev.NodeRegistered(node_id="n0", gpu_count=8, ts=from_us(T0)))
    cs.apply(
        ev.JobPlaced(
            job_id="v",
            attempt=1,
            budget=budget,
            allocated=allocated,
            gpus_per_replica=4,
            replicas=1,
            min_runtime_s=min_runtime_s if allocated else 0.0,
            placements=(ev.Placement(node_id="n0", gpus=(0, 1, 2, 3)),),
            submitted_at=from_us(T0),
            decision=ev.Decision(rank=0, budget_rank=0, ratio=0.0),
            ts=from_us(started),
        )
    )
    cs.apply(ev.JobStarted(job_id="v", attempt=1, node_id="n0", ts=from_us(started)))
    if stopping:
        cs.apply(ev.JobPreempted(job_id="v", attempt=1, budget=budget, allocated=allocated, ts=from_us(started)))
    return cs.runs[("v", 1)]


NOW = h(2)  # the default run's protection ended at 1 h

# (case id, run, preemptor leaf, now, view, charge GPU-s, moves, expected rule)
