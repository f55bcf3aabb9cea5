"""A slow, literal scheduling cycle: the placement and preemption rules of docs/design/README.md, for tests only.

No index, no cache, no memo: every question is answered by looking at every node and every run again. It
is the yardstick the fast cycle (:func:`apportion.domain.engine.run_cycle`) is compared with on small
random clusters (``tests/unit/test_reference_cycle.py``); what it leaves out, it says.

What it takes from the product rather than restating:

* the budget order and every r, with the in-cycle provisional charges (D2.usage-ratio,
  D2.fair-share-order, D2.cold-start): a :class:`~apportion.domain.fairshare.FairShareQueue` used only as the
  cycle's view of r (``order``, ``ratio``, ``ratio_after``, ``charge``), never as a queue;
* whether one run may be preempted for one job (D3.victims candidates 1 and 2, D3.consistent-view,
  D3.gangs): :func:`~apportion.domain.preemption.victim_rule`, the rule's one home, asked of every run;
* a job's protection and the cap of a budget's protections (D3.bounded-churn), and the work a run would
  lose (D1.work-lost).

Out of its scope (the test turns them off): reservations (``reservation_after``), idle runs
(D3.idle-runs: no heartbeats), and the engine's two waiting rules (``patience_s``, ``checkpoint_wait_s``).
Rule D3.hero-cover concerns jobs and runs of at least ``hero_min_gpus`` GPUs (default 1,024), which the small
random clusters never hold: the reference leaves it out.

Where the design leaves a choice open, the reference follows the engine and says so (AMBIGUOUS below).

KNOWN DIVERGENCE (D3.victims, "the feasible victim set of least cost"): the engine prices each node it could
free on its own, counting every victim's whole-run GPUs there, and takes the k cheapest nodes. A gang victim
with replicas on two of the nodes it would free is then counted once per node, or its second node is passed
over for a dearer one: three 4-GPU nodes, four unallocated 1-GPU runs on the first, one unallocated 4 x 2 gang
on the other two, and a 1 x 2 allocated job: the engine preempts a 1-GPU run and the gang (9 unallocated
GPUs), the rule the gang alone (8). The reference applies the rule; the property test accepts this one
difference where it is the first one, and ``test_known_divergence_...`` pins the example.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterSnapshot, Run, RunKey, work_lost_gpu_s
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, protection_cap_us
from apportion.domain.fairshare import FairShareQueue, free_order_key, owner_headroom
from apportion.domain.preemption import RULE_EXPIRED_BEHIND, Move, branches_of, charge_of, victim_rule
from apportion.timeutil import Micros

__all__ = ["Placed", "cost", "reference_cycle"]


@dataclass(frozen=True)
class Placed:
    """One placement the cycle decided: the job, its GPUs per node (by node id), the runs it preempts.

    AMBIGUOUS (D3.placement names no replica order): the placements are compared by node id, not in
    replica order (the engine puts a preemption's free nodes first, then the cheapest to free)."""

    job_id: str
    placements: tuple[tuple[str, tuple[int, ...]], ...]
    victims: tuple[RunKey, ...]


def reference_cycle(snapshot: CycleSnapshot, now_us: Micros, cfg: EngineConfig) -> list[Placed]:
    """The placements of one cycle on ``snapshot`` at ``now_us``, in the order they are decided."""
    tree = snapshot.tree
    pending = {leaf: list(jobs) for leaf, jobs in snapshot.pending.items() if jobs and tree.is_leaf(leaf)}
    view: FairShareQueue[PendingJob] = FairShareQueue(tree, snapshot.occupancy, snapshot.capacity_gpu_s, {})
    cluster = snapshot.cluster
    free = {nid: sorted(n.free) for nid, n in cluster.nodes.items() if n.state == "ready"}
    spare = _spare_models(cluster, pending)
    taken: set[RunKey] = set()
    moves: set[Move] = set()
    out: list[Placed] = []

    # AMBIGUOUS (D3.scheduling-cycle says "walk pending jobs in fair-share order"): the engine walks the
    # allocated jobs first, then the unallocated ones (D3.free-order, or without it in the budget order the
    # first walk left); so does this.
    done: set[str] = set()
    owner_done = not cfg.owner_free
    while (job := _next_allocated(view, pending, done)) is not None:
        if not owner_done and view.ratio(job.budget) > 1.0:
            # D3.owner-free: the walk reaches a leaf over its share
            owner_done = True
            out.extend(_owner_free(view, tree, pending, cluster, free, spare, taken, out))
        done.add(job.job_id)
        leaf = job.budget
        charge = charge_of(job.gpus_per_replica, job.replicas, job.min_runtime_s, cfg.window_s)
        nodes = _best_fit(cluster, free, job, spare)
        if nodes is not None:
            out.append(Placed(job.job_id, tuple(sorted(_take_free(free, nodes, job.gpus_per_replica))), ()))
        elif cfg.preemption:
            plan = _least_cost_plan(cluster, free, job, taken, _CycleView(view, moves, now_us, cfg, tree))
            if plan is None:
                continue
            nodes, victims = plan
            placements = _take_with_victims(cluster, free, nodes, victims, job.gpus_per_replica)
            for run in victims:
                taken.add(run.key)
                verdict = _may_preempt(run, job, _CycleView(view, moves, now_us, cfg, tree))
                br = branches_of(run.budget, leaf)
                if verdict == RULE_EXPIRED_BEHIND and br is not None:
                    moves.add(br)  # D3.consistent-view: no same-cycle reversal
            out.append(Placed(job.job_id, tuple(sorted(placements)), tuple(sorted(r.key for r in victims))))
        else:
            continue
        view.charge(leaf, charge)  # D2.provisional-charge
    if not owner_done:
        out.extend(_owner_free(view, tree, pending, cluster, free, spare, taken, out))
    placed_free = {p.job_id for p in out}
    pending = {leaf: [j for j in jobs if j.job_id not in placed_free] for leaf, jobs in pending.items()}
    order = view.order()
    if cfg.free_las and not cfg.free_order:
        # D3.free-las: every unallocated job by the GPU-seconds its earlier attempts held, ties by the budget order
        # and the job's place in its leaf
        ranked = sorted(
            (job.attained_gpu_s, pos, i, job)
            for pos, leaf in enumerate(order)
            for i, job in enumerate(pending.get(leaf, ()))
            if not job.allocated
        )
        for *_, job in ranked:
            nodes = _best_fit(cluster, free, job, spare)  # D1.unallocated-job: idle GPUs only
            if nodes is not None:
                out.append(Placed(job.job_id, tuple(sorted(_take_free(free, nodes, job.gpus_per_replica))), ()))
        return out
    if not cfg.free_order:
        for leaf in order:
            for job in pending.get(leaf, ()):
                if job.allocated:
                    continue
                nodes = _best_fit(cluster, free, job, spare)  # D1.unallocated-job: idle GPUs only
                if nodes is not None:
                    out.append(Placed(job.job_id, tuple(sorted(_take_free(free, nodes, job.gpus_per_replica))), ()))
        return out
    # D3.free-order: one job at a time to the leaf with unallocated work left whose unallocated GPUs in use per
    # unit of abs share are fewest, ties by the budget order; a job looked at and not placed is not looked at again
    in_use = {leaf: 0 for leaf in order}
    for run in cluster.runs.values():
        if not run.allocated and not run.stopping and run.key not in taken:
            in_use[run.budget] = in_use.get(run.budget, 0) + sum(len(run.placements[r].gpus) for r in run.open_replicas)
    left = {leaf: [j for j in pending.get(leaf, ()) if not j.allocated] for leaf in order}
    while True:
        cands = [leaf for leaf in order if left[leaf]]
        if not cands:
            return out
        leaf = min(cands, key=lambda lf: (free_order_key(in_use[lf], tree.abs_share(lf)), order.index(lf)))
        while left[leaf]:
            job = left[leaf].pop(0)
            nodes = _best_fit(cluster, free, job, spare)  # D1.unallocated-job: idle GPUs only
            if nodes is not None:
                out.append(Placed(job.job_id, tuple(sorted(_take_free(free, nodes, job.gpus_per_replica))), ()))
                in_use[leaf] += job.gpus_per_replica * job.replicas
                break


def _owner_free(
    view: FairShareQueue[PendingJob],
    tree: BudgetTree,
    pending: Mapping[str, Sequence[PendingJob]],
    cluster: ClusterSnapshot,
    free: dict[str, list[int]],
    spare: set[str | None],
    taken: set[RunKey],
    out: Sequence[Placed],
) -> list[Placed]:
    """D3.owner-free: each leaf at or under its share with unallocated work, in the budget order, places its
    unallocated jobs on free GPUs while each fits its headroom: abs share x the ready nodes' GPUs, less the GPUs
    its runs hold (not stopping, not preempted in this cycle) and those placed for it in this cycle."""
    capacity = sum(n.gpu_count for n in cluster.nodes.values() if n.state == "ready")
    in_use: dict[str, int] = {}
    for run in cluster.runs.values():
        if not run.stopping and run.key not in taken:
            in_use[run.budget] = in_use.get(run.budget, 0) + sum(len(run.placements[r].gpus) for r in run.open_replicas)
    budget_of = {j.job_id: j.budget for jobs in pending.values() for j in jobs}
    for p in out:
        in_use[budget_of[p.job_id]] = in_use.get(budget_of[p.job_id], 0) + sum(len(g) for _, g in p.placements)
    got: list[Placed] = []
    for leaf in view.order():
        if view.ratio(leaf) > 1.0:
            continue
        room = owner_headroom(tree.abs_share(leaf), capacity, in_use.get(leaf, 0))
        for job in pending.get(leaf, ()):
            if job.allocated or job.gpus_per_replica * job.replicas > room:
                continue
            nodes = _best_fit(cluster, free, job, spare)
            if nodes is not None:
                got.append(Placed(job.job_id, tuple(sorted(_take_free(free, nodes, job.gpus_per_replica))), ()))
                room -= job.gpus_per_replica * job.replicas
    return got


def _next_allocated(
    view: FairShareQueue[PendingJob], pending: Mapping[str, Sequence[PendingJob]], done: set[str]
) -> PendingJob | None:
    """D2.fair-share-order: the first allocated job not yet taken, leaves by the current r (charges
    included), jobs of a leaf by (submitted_at, job_id)."""
    for leaf in view.order():
        for job in pending.get(leaf, ()):
            if job.allocated and job.job_id not in done:
                return job
    return None


def _spare_models(cluster: ClusterSnapshot, pending: Mapping[str, Sequence[PendingJob]]) -> set[str | None]:
    """D3.scheduling-cycle: the models of ready nodes that no waiting job asks for."""
    asked = {j.gpu_model for jobs in pending.values() for j in jobs if j.gpu_model is not None}
    return {n.gpu_model for n in cluster.nodes.values() if n.state == "ready" and n.gpu_model not in asked}


def _best_fit(
    cluster: ClusterSnapshot, free: Mapping[str, list[int]], job: PendingJob, spare: set[str | None]
) -> list[str] | None:
    """D3.placement: k distinct ready nodes of the job's model with g free GPUs, fewest free first, ties by
    node id; a job without a model tries the spare models' nodes first (D3.scheduling-cycle)."""
    g, k = job.gpus_per_replica, job.replicas

    def fits(nid: str) -> bool:
        model = cluster.nodes[nid].gpu_model
        return len(free[nid]) >= g and (job.gpu_model is None or model == job.gpu_model)

    fitting = sorted((nid for nid in free if fits(nid)), key=lambda nid: (len(free[nid]), nid))
    if job.gpu_model is None:
        on_spare = [nid for nid in fitting if cluster.nodes[nid].gpu_model in spare]
        if len(on_spare) >= k:
            return on_spare[:k]
    return fitting[:k] if len(fitting) >= k else None


def _take_free(free: dict[str, list[int]], nodes: list[str], g: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The lowest g free GPUs of each node, taken."""
    got = []
    for nid in nodes:
        got.append((nid, tuple(free[nid][:g])))
        free[nid] = free[nid][g:]
    return tuple(got)


@dataclass(frozen=True)
class _CycleView:
    """What the preemption rules read of the cycle: r with charges, this cycle's moves, time, knobs."""

    view: FairShareQueue[PendingJob]
    moves: set[Move]
    now_us: Micros
    cfg: EngineConfig
    tree: BudgetTree


def _may_preempt(run: Run, job: PendingJob, cv: _CycleView) -> str | None:
    """D3.victims / D3.consistent-view / D3.gangs: the allowing rule id, or ``None``."""
    cfg = cv.cfg
    verdict = victim_rule(
        run,
        job.budget,
        cv.now_us,
        cv.view,
        cfg.delta,
        charge_of(job.gpus_per_replica, job.replicas, job.min_runtime_s, cfg.window_s),
        cv.moves,
        job.gpus_per_replica * job.replicas if cfg.gang_rule else None,
        gang_cap_us=protection_cap_us(run.budget, cv.tree, cfg),
        gang_least_gpus=cfg.gang_min_gpus,
        gang_times=cfg.gang_bound_x,
    )
    return verdict.rule if verdict.allowed else None


def _on(run: Run, nid: str) -> tuple[int, ...]:
    """The GPUs ``run`` holds on node ``nid``."""
    return tuple(g for p in run.placements if p.node_id == nid for g in p.gpus)


def cost(victims: Sequence[Run], now_us: Micros) -> tuple[int, int, float]:
    """D3.victims: (allocated GPUs, unallocated GPUs, work lost), each victim counted whole and once."""
    alloc = sum(r.gpus_per_replica * r.replicas for r in victims if r.allocated)
    unalloc = sum(r.gpus_per_replica * r.replicas for r in victims if not r.allocated)
    return (alloc, unalloc, sum(work_lost_gpu_s(r, now_us) for r in victims))


def _subsets(runs: Sequence[Run]) -> Iterator[tuple[Run, ...]]:
    for n in range(1, len(runs) + 1):
        yield from combinations(runs, n)


def _least_cost_plan(
    cluster: ClusterSnapshot, free: Mapping[str, list[int]], job: PendingJob, taken: set[RunKey], cv: _CycleView
) -> tuple[list[str], tuple[Run, ...]] | None:
    """D3.victims: of every set of allowed victims after which J can be placed, the one of least cost.

    J then goes on k distinct eligible nodes (ready, its model, g GPUs in all): those with g free GPUs
    first, then those the set frees; every victim of the set must free GPUs on a node J takes (a set with
    a needless victim costs more than the set without it). Ties: the fewer-id nodes, then the victims'
    keys (AMBIGUOUS: the design names no tie-break; the engine takes nodes by id and victims by job id).
    """
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model

    def eligible(nid: str) -> bool:
        node = cluster.nodes[nid]
        return nid in free and node.gpu_count >= g and (model is None or node.gpu_model == model)

    allowed = [
        run
        for key, run in sorted(cluster.runs.items())
        if key not in taken
        and _may_preempt(run, job, cv) is not None
        and any(eligible(p.node_id) for p in run.placements)
    ]
    zero = sorted(nid for nid in free if eligible(nid) and len(free[nid]) >= g)
    best: tuple[tuple[int, int, float], tuple[str, ...], tuple[RunKey, ...]] | None = None
    plan: tuple[list[str], tuple[Run, ...]] | None = None
    for victims in _subsets(allowed):
        made = sorted(
            nid
            for nid in free
            if eligible(nid) and nid not in zero and len(free[nid]) + sum(len(_on(r, nid)) for r in victims) >= g
        )
        if len(zero) + len(made) < k or len(zero) >= k:
            continue
        nodes = zero + made[: k - len(zero)]
        if not all(any(_on(r, nid) for nid in nodes if nid not in zero) for r in victims):
            continue  # a needless victim
        key = (cost(victims, cv.now_us), tuple(sorted(nodes)), tuple(sorted(r.key for r in victims)))
        if best is None or key < best:
            best, plan = key, (nodes, victims)
    return plan


def _take_with_victims(
    cluster: ClusterSnapshot, free: dict[str, list[int]], nodes: list[str], victims: Sequence[Run], g: int
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """J's GPUs on each node: the free ones first (lowest), then the victims' there (lowest); the freed
    GPUs J does not take stay with their stopping runs."""
    got = []
    for nid in nodes:
        mine = free[nid][:g]
        free[nid] = free[nid][len(mine) :]
        theirs = sorted(x for r in victims for x in _on(r, nid))
        got.append((nid, tuple(sorted(mine + theirs[: g - len(mine)]))))
    return tuple(got)
