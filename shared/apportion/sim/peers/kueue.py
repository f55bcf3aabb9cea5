"""``kueue``: Kueue's fair sharing (preemption-based), one ClusterQueue per leaf budget, one cohort tree.

Re-implemented from Kueue's documentation and design (github:kubernetes-sigs/kueue:
``site/content/en/docs/concepts/fair_sharing.md`` and ``preemption.md``,
``keps/1714-fair-sharing/README.md``, the ``FairSharing.PreemptionStrategies``
doc comment in ``apis/config/v1beta1/configuration_types.go``):

* Quotas: each leaf budget b is a ClusterQueue with ``nominalQuota = abs_share(b)
  * C`` GPUs (C: GPUs of the ``ready`` and ``draining`` nodes) and no borrowing
  limit; each inner budget is a cohort. Idle quota is borrowed freely: a job
  is admitted whenever it fits on free GPUs.
* Share value (KEP-1714, "Share value function and weights", a DRF variant):
  for a node c (CQ or cohort), ``T = max(0, usage(c) - nominal(c))`` (GPUs in
  use above its nominal quota; usage counts every admitted job, unallocated
  ones too), divided by the nominal quota of c's parent (the lendable
  resources of the hierarchy, C at the top) and by c's weight (``weights =
  shares``: the budget's share relative to its parent). Weight 0: infinite
  share while borrowing. One resource (GPUs), so "dominant" is GPUs.
* Admission: the head of the CQ with the lowest share value *with the head
  admitted* goes first (compared from the root down: the path's values in
  order), ties by submission time; within a CQ, higher priority first
  (allocated jobs are a higher WorkloadPriorityClass than unallocated ones),
  then creation time (BestEffortFIFO: a head that does not fit does not block
  the CQ).
* Preemption for a pending job w of CQ x that does not fit (KEP-1714,
  "Preemption algorithm"): candidates are the running jobs of CQs y whose
  branch below the lowest common ancestor (``AlmostLCA(y, x)``) is borrowing;
  taken one at a time from the CQ with the highest share value (path from the
  root, descending), within it lower priority first, then the most recently
  started. Per candidate z, with ``X = AlmostLCA(x, y)``, ``Y = AlmostLCA(y, x)``:
  S1 (reclaim) when X with w stays within its nominal quota: z may go while Y
  is borrowing; S2 otherwise, by the configured strategies in order, the next
  one only if w still does not fit: ``LessThanOrEqualToFinalShare`` (share of X
  with w <= share of Y without z) then ``LessThanInitialShare`` (share of X
  with w < share of Y with z). Then x's own lower-priority (unallocated) jobs
  (``withinClusterQueue: LowerPriority``). Preempted jobs are requeued
  (evicted workloads go back to the queue); "possibly undo some preemption":
  only the victims the placement needs are kept (:func:`plan_victims`).
* No usage history (fair sharing is point-in-time; Admission Fair Sharing is
  another, LocalQueue-level feature) and no minimum runtime: Kueue has no
  protection window, so an allocated job may be preempted at any time (our
  simulator counts that as a protection violation of *our* contract; it is
  not a violation of Kueue's own rules).

Simplified: quotas are not node-aware in Kueue (kube-scheduler places pods
after admission; we admit only what fits as a gang on free GPUs, which is what
Kueue with TopologyAwareScheduling or all-or-nothing placement achieves);
every CQ has one flavor; unallocated jobs never preempt (as in every policy
here, they run on idle GPUs only); a CQ whose preemption search failed tries
no more preemptions in the same cycle (Kueue tries one head per CQ per
scheduling cycle).
"""

from __future__ import annotations

import math

from apportion.domain.budgets import ROOT, BudgetTree, ancestors_of, parent_of
from apportion.domain.cluster import Run
from apportion.domain.engine.cycle import CycleSnapshot
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.domain.preemption import branches_of
from apportion.events import Event
from apportion.sim.peers._loop import (
    Cycle,
    PeerPolicy,
    Seg,
    admission_loop,
    capacity_gpus,
    leaf_segments,
    plan_victims,
    run_gpus,
    subtree_sums,
    take_in_turn,
    victim_pools,
)
from apportion.timeutil import Micros

__all__ = ["Kueue", "STRATEGIES", "share_value", "strategy_allows"]

POLICY_VERSION = "kueue-fairsharing-1"

LE_FINAL = "LessThanOrEqualToFinalShare"
LT_INITIAL = "LessThanInitialShare"
#: Kueue's default ``fairSharing.preemptionStrategies``, in order.
STRATEGIES = (LE_FINAL, LT_INITIAL)


def share_value(tree: BudgetTree, capacity: float, path: str, usage: float) -> float:
    """KEP-1714 share value of budget ``path`` using ``usage`` GPUs: ``max(0, usage - nominal) / lendable / weight``.

    ``nominal = abs_share(path) * capacity``; ``lendable`` = the parent's
    nominal (``capacity`` at the top); ``weight`` = the share relative to the
    parent. Named edge cases: not borrowing -> 0; borrowing with weight 0 or
    nothing lendable -> ``inf``.

    >>> t = BudgetTree.from_mapping({"a": 1.0, "a/x": 0.25, "a/y": 0.75})
    >>> share_value(t, 8, "a/x", 2), share_value(t, 8, "a/x", 4), share_value(t, 8, "a/y", 8)
    (0.0, 1.0, 0.3333333333333333)
    """
    nominal = tree.abs_share(path) * capacity
    over = usage - nominal
    if over <= 0:
        return 0.0
    parent = parent_of(path)
    lendable = capacity if parent == ROOT else tree.abs_share(parent) * capacity
    weight = tree.share(path)
    if lendable <= 0 or weight <= 0:
        return math.inf
    return over / lendable / weight


def strategy_allows(strategy: str, preemptor_with: float, victim_with: float, victim_without: float) -> bool:
    """Kueue's fair-sharing preemption strategies (configuration_types.go), on share values.

    ``LessThanOrEqualToFinalShare``: the preemptor's share with its workload is
    <= the preemptee's share without the workload to be preempted.
    ``LessThanInitialShare``: the preemptor's share with its workload is
    strictly < the preemptee's share before the preemption.

    >>> strategy_allows(LE_FINAL, 0.5, 0.8, 0.5), strategy_allows(LE_FINAL, 0.5, 0.8, 0.4)
    (True, False)
    >>> strategy_allows(LT_INITIAL, 0.5, 0.8, 0.4), strategy_allows(LT_INITIAL, 0.8, 0.8, 0.4)
    (True, False)
    """
    if strategy == LE_FINAL:
        return preemptor_with <= victim_without
    return preemptor_with < victim_with


class Kueue(PeerPolicy):
    """The ``kueue`` cycle (module docstring); point-in-time, keeps nothing across cycles."""

    name = "kueue"

    def cycle(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """Admit by lowest share value with the head; preempt by the fair-sharing strategies."""
        tree = snapshot.tree
        cap = float(capacity_gpus(snapshot))
        cyc = Cycle(snapshot, now_us, config, POLICY_VERSION)
        memo: dict[tuple[str, float], float] = {}

        def value(path: str, usage: float) -> float:  # share_value, memoised for the cycle
            v = memo.get((path, usage))
            if v is None:
                v = memo[(path, usage)] = share_value(tree, cap, path, usage)
            return v

        def path_share(leaf: str, extra: int, usage: dict[str, float]) -> tuple[float, ...]:
            return tuple(value(a, usage.get(a, 0.0) + extra) for a in ancestors_of(leaf))

        def key(s: Seg, job: PendingJob) -> tuple[tuple[float, ...], int, str]:
            return (path_share(s.leaf, job.gpus, subtree_sums(cyc.held)), job.submitted_at_us, s.leaf)

        def planner(c: Cycle, job: PendingJob):
            x, w = job.budget, job.gpus
            agg = subtree_sums(c.held)

            def nominal(p: str) -> float:
                return tree.abs_share(p) * cap

            def can_give(yb: str, xb: str) -> bool:
                # the rule can ever accept a run of Y (the search only lowers its usage): Y borrowing, and
                # either S1 or a share above X's with w (both strategies need that)
                y_now, x_with = agg.get(yb, 0.0), agg.get(xb, 0.0) + w
                return y_now > nominal(yb) and (x_with <= nominal(xb) or value(yb, y_now) > value(xb, x_with))

            pools = victim_pools(c, job, can_give)
            if pools is None:
                return None

            def take(run: Run) -> None:
                for a in ancestors_of(run.budget):
                    agg[a] = agg.get(a, 0.0) - run_gpus(run)

            def rank(leaf: str) -> tuple[float, ...]:
                return path_share(leaf, 0, agg)

            def rule(strategy: str):
                def allowed(z: Run) -> bool:
                    if z.budget == x:
                        return not z.allocated  # withinClusterQueue: LowerPriority
                    br = branches_of(z.budget, x)
                    assert br is not None  # z's leaf is not x: two distinct leaves meet at an LCA
                    _lca, yb, xb = br
                    y_now = agg.get(yb, 0.0)
                    if y_now <= nominal(yb):
                        return False  # Y is not borrowing: nothing of it is reclaimable
                    x_with = agg.get(xb, 0.0) + w
                    if x_with <= nominal(xb):
                        return True  # S1: X stays within its nominal quota (reclaim)
                    return strategy_allows(
                        strategy, value(xb, x_with), value(yb, y_now), value(yb, y_now - run_gpus(z))
                    )

                return allowed

            def accepted():
                for strategy in STRATEGIES:
                    yield from take_in_turn(pools, rank, rule(strategy), take, last=x)

            return plan_victims(c, job, accepted())

        alloc, _ = leaf_segments(snapshot, split=False)
        admission_loop(cyc, alloc, key, planner)
        return cyc.out
