"""A fluent cluster and queue for one scheduling cycle (rule D3.scheduling-cycle): ``World`` folds nodes and runs
(with their checkpoints) into a :class:`ClusterState` over its ``tree`` (``TREE`` unless given) and queues pending
jobs; ``World.cycle`` runs :func:`run_cycle` at ``NOW``. ``placed`` and ``preempted`` render a cycle's events as
``job@node[gpus]`` and ``victim<-by``. ``tests.kit.goodput_world`` is the same world over another tree.

``TREE``::

    lab (1.0)
    ├── a  0.5
    ├── b  0.25
    └── c  0.25
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, pending_order, run_cycle
from apportion.timeutil import from_us
from tests.kit.builders import T0, h

NOW = h(10)
TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.25, "lab/c": 0.25})


@dataclass
class World:
    """Fluent cluster + queue builder."""

    tree: BudgetTree = TREE
    cluster: ClusterState = field(default_factory=ClusterState)
    pending: dict[str, list[PendingJob]] = field(default_factory=dict)
    occupancy: dict[str, float] = field(default_factory=dict)
    capacity: float = 1000.0

    def node(self, nid: str, gpus: int = 8, model: str | None = None, state: str = "ready") -> Self:
        self.cluster.apply(ev.NodeRegistered(node_id=nid, gpu_count=gpus, gpu_model=model, ts=from_us(T0)))
        if state == "draining":
            self.cluster.apply(ev.NodeDrainRequested(node_id=nid, ts=from_us(T0)))
        elif state == "cordoned":
            self.cluster.apply(ev.NodeCordoned(node_id=nid, ts=from_us(T0)))
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
        stopping: bool = False,
        checkpoint: int | None = None,
        checkpoint_every_s: float | None = None,
    ) -> Self:
        """A run placed and started at ``started`` (each replica on its node), checkpointed at ``checkpoint``,
        asked to stop when ``stopping``."""
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
                checkpoint_interval_s=checkpoint_every_s,
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
        if stopping:
            self.cluster.apply(
                ev.JobPreempted(job_id=job_id, attempt=1, budget=budget, allocated=allocated, ts=from_us(started))
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
    ) -> Self:
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

    def cycle(self, now: int = NOW, *, explain: bool = False, explain_only: set[str] | None = None, **cfg: Any):
        # untyped result: tests read its events
        snap = CycleSnapshot(self.cluster.snapshot(), self.pending, self.tree, self.occupancy, self.capacity)
        return run_cycle(snap, now, EngineConfig(**cfg), explain=explain, explain_only=explain_only)


def placed(res) -> list[str]:
    """``job@node[gpus]+node[gpus]`` per JobPlaced, in order."""
    return [
        "{}@{}".format(e.job_id, "+".join(f"{p.node_id}{list(p.gpus)}" for p in e.placements))
        for e in res.events
        if isinstance(e, ev.JobPlaced)
    ]


def preempted(res) -> list[str]:
    return [f"{e.job_id}<-{e.by_job_id}" for e in res.events if isinstance(e, ev.JobPreempted)]
