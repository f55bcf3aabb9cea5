"""Exact scheduling cycles for the goodput rules (DESIGN sections 2 and 3).

Each case builds a cluster by folding events, a queue and window occupancy,
runs one :func:`run_cycle` at ``NOW`` and compares the decisions with values
worked out by hand in the comments.

Default tree::

    lab (1.0)
    ├── a  0.5
    └── b  0.5
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from builders import T0, h

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, pending_order, run_cycle
from apportion.timeutil import from_us

NOW = h(10)
AB = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})


@dataclass
class World:
    """Fluent cluster + queue builder."""

    tree: BudgetTree = AB
    cluster: ClusterState = field(default_factory=ClusterState)
    pending: dict[str, list[PendingJob]] = field(default_factory=dict)
    occupancy: dict[str, float] = field(default_factory=dict)
    capacity: float = 1000.0

    def node(self, nid: str, gpus: int = 8, model: str | None = None) -> World:
        self.cluster.apply(ev.NodeRegistered(node_id=nid, gpu_count=gpus, gpu_model=model, ts=from_us(T0)))
        return self

    def run(
        self,
        job_id: str,
        budget: str,
        where: dict[str, tuple[int, ...]],
        *,
        allocated: bool = True,
        min_runtime_s: float = 3600.0,
        started: int = h(0),
        checkpoint: int | None = None,
    ) -> World:
        places = tuple(ev.Placement(node_id=n, gpus=g) for n, g in where.items())
        self.cluster.apply(
            ev.JobPlaced(
                job_id=job_id,
                attempt=1,
                budget=budget,
                allocated=allocated,
                gpus_per_replica=len(places[0].gpus),
                replicas=len(places),
                min_runtime_s=min_runtime_s if allocated else 0.0,
                placements=places,
                submitted_at=from_us(T0),
                decision=ev.Decision(rank=0, budget_rank=0, ratio=0.0),
                ts=from_us(started),
            )
        )
        for r, p in enumerate(places):
            self.cluster.apply(
                ev.JobStarted(job_id=job_id, attempt=1, replica=r, node_id=p.node_id, ts=from_us(started))
            )
        if checkpoint is not None:
            self.cluster.apply(
                ev.JobCheckpointed(job_id=job_id, attempt=1, progress_s=1.0, replica=None, ts=from_us(checkpoint))
            )
        return self

    def job(
        self,
        job_id: str,
        budget: str,
        gpus: int = 1,
        replicas: int = 1,
        *,
        min_runtime_s: float = 3600.0,
        submitted: int = h(1),
        queued: int | None = None,
        model: str | None = None,
    ) -> World:
        pj = PendingJob(
            job_id=job_id,
            attempt=1,
            budget=budget,
            user="u",
            gpus_per_replica=gpus,
            replicas=replicas,
            min_runtime_s=min_runtime_s,
            submitted_at_us=submitted,
            queued_at_us=queued if queued is not None else NOW,
            gpu_model=model,
            duration_s=60.0,
        )
        lst = self.pending.setdefault(budget, [])
        lst.append(pj)
        lst.sort(key=pending_order)
        return self

    def cycle(self, now: int = NOW, **cfg):
        snap = CycleSnapshot(self.cluster.snapshot(), self.pending, self.tree, self.occupancy, self.capacity)
        return run_cycle(snap, now, EngineConfig(**cfg))


def placed_jobs(res) -> list[str]:
    return [e.job_id for e in res.events if isinstance(e, ev.JobPlaced)]


def placements(res) -> list[str]:
    return [
        "{}@{}".format(e.job_id, "+".join(f"{p.node_id}{list(p.gpus)}" for p in e.placements))
        for e in res.events
        if isinstance(e, ev.JobPlaced)
    ]


def preempted(res) -> list[str]:
    return [f"{e.job_id}<-{e.by_job_id}" for e in res.events if isinstance(e, ev.JobPreempted)]


# ---------------------------------------------------------------- cold start (DESIGN section 2)


def test_cold_start_splits_equal_demand_by_share_from_the_first_cycle():
    """Empty window (K = 0, no occupancy): 8 x 1-GPU jobs per budget on one 8-GPU node.

    K is floored at 1 GPU-s, so after a's first job (charge 1 * 3600 GPU-s) r_a = 3600 / 0.5 = 7200
    > r_b = 0: b goes next; then both are 7200 and the tie goes by path to a, and so on: a, b, a,
    b, ... 4 and 4. (With the old +inf ratios it was a, b, then a six more times: 7 and 1.)
    """
    w = World(capacity=0.0).node("n0", 8)
    for i in range(8):
        w.job(f"a{i}", "lab/a", submitted=h(1) + i).job(f"b{i}", "lab/b", submitted=h(1) + i)
    res = w.cycle()
    got = placed_jobs(res)
    assert got == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert Counter(j[0] for j in got) == {"a": 4, "b": 4}
    assert not preempted(res)


def test_cold_start_splits_by_unequal_shares():
    """a at 0.75, b at 0.25, K = 0: 8 free GPUs go 6 and 2 (r = charges / share: a's k-th job is
    ranked at (k-1) * 3600 / 0.75, b's at (k-1) * 3600 / 0.25)."""
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.75, "lab/b": 0.25})
    w = World(tree=tree, capacity=0.0).node("n0", 8)
    for i in range(8):
        w.job(f"a{i}", "lab/a", submitted=h(1) + i).job(f"b{i}", "lab/b", submitted=h(1) + i)
    got = placed_jobs(w.cycle())
    assert Counter(j[0] for j in got) == {"a": 6, "b": 2}
