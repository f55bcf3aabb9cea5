"""``kai``: NVIDIA KAI Scheduler's hierarchical fair share with time-aware fairness and reclaim.

Re-implemented from KAI's documentation and code (github:NVIDIA/KAI-Scheduler:
``docs/fairness/README.md``, ``docs/time-based-fairshare/README.md``,
``docs/developer/designs/time-based-fairshare/time-based-fairshare.md``,
``docs/plugins/minruntime.md``, ``pkg/scheduler/plugins/proportion/reclaimable/``):

* Queues: one per budget (leaves hold jobs), ``deserved = abs_share * C`` GPUs
  (C: GPUs of the ``ready`` and ``draining`` nodes), over-quota weight = the
  share relative to the parent, one priority.
* Fair share, every cycle, top down (fairness/README.md, "Fair-Share
  Algorithm"): a parent's amount (C at the top) goes first to each child's
  ``min(deserved, requested)`` (requested = GPUs held + GPUs of its pending
  jobs), then the rest in rounds to the children whose request is not met, in
  proportion to (time-based-fairshare.md, "Design Details")
  ``P_i = max(W'_i + k * (W'_i - U'_i), 0)`` normalised over those children,
  capped by what each still requests; ``W'_i`` is the over-quota weight
  normalised over them, ``U'_i`` the queue's usage over the window normalised
  to the cluster's capacity over the window, ``k`` = ``kValue`` (default 1.0).
  Window: 1 week, sliding, no half-life (KAI's defaults, time-based-fairshare
  README): exactly our occupancy window, so ``U'_i = O_i / K`` from the
  snapshot (allocated work; unallocated work is not in the window).
* Allocation: queues in order of saturation ``allocated / fair share``
  (lowest first, compared from the root down), jobs of a queue by priority
  (allocated before unallocated) then age; idle GPUs are used freely, above
  the fair share too ("idle resources are reclaimable").
* Reclaim for an allocated job J of queue x that does not fit
  (``reclaimable.go``): only if x's allocation with J stays within its fair
  share (``CanReclaimResources``); victims one at a time from the most
  saturated queue, lower priority first, then the newest; a victim of queue y,
  compared at the level below their lowest common ancestor (``X``, ``Y``), may
  go when Y, before losing it, is above its fair share (``MaintainFairShare``)
  or X with J stays within its deserved quota while Y is above its deserved
  quota (``GuaranteeDeservedQuota``); and the reclaimer stays below its
  siblings' saturation (``isFairShareUtilizationLowerPerResource``: at every
  level of x's path, if ``(allocated + J) / fair share > 1``, it must be below
  every involved sibling's ``remaining / fair share`` times
  ``reclaimerUtilizationMultiplier`` = 1.0). Then x's own unallocated runs
  (the preempt action, by priority within the queue).
* ``reclaim-min-runtime`` (minruntime.md) = the job's minimum runtime: an
  allocated run is never reclaimed before it has run that long since its
  start; unallocated runs (minimum runtime 0) may go at any time.

Simplified: GPUs only (no CPU/memory vectors), one queue priority, every job
preemptible (KAI's non-preemptible jobs must fit in deserved quota), no
consolidation or elastic jobs; unallocated jobs never reclaim (they run on
idle GPUs only, as in every policy here); a queue whose reclaim search failed
tries no more in the same cycle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

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

__all__ = ["Kai", "fair_shares", "saturation", "time_aware_portions"]

POLICY_VERSION = "kai-timeaware-1"
_EPS = 1e-9


def saturation(allocated: float, fair_share: float) -> float:
    """KAI's saturation ratio ``allocated / fair share`` (reclaimable.go ``fairShareSaturationRatio``).

    Fair share 0: ``inf`` when something is allocated, else 0.

    >>> saturation(3, 4), saturation(1, 0), saturation(0, 0)
    (0.75, inf, 0)
    """
    if fair_share <= 0:
        return math.inf if allocated > 0 else 0
    return allocated / fair_share


def time_aware_portions(weights: Mapping[str, float], usage: Mapping[str, float], k: float) -> dict[str, float]:
    """``P'_i`` of time-based-fairshare.md: ``P_i = max(W'_i + k (W'_i - U'_i), 0)``, normalised to sum 1.

    ``weights``: over-quota weights of the queues in this round (normalised
    here); ``usage``: their usage normalised to the cluster capacity over the
    window. All ``P_i`` zero (or no weight): the plain weights ``W'``.

    >>> time_aware_portions({"a": 1, "b": 1}, {"a": 0.5, "b": 0.0}, 1.0)
    {'a': 0.0, 'b': 1.0}
    >>> time_aware_portions({"a": 1, "b": 1}, {"a": 0.2, "b": 0.0}, 1.0)
    {'a': 0.375, 'b': 0.625}
    """
    total = sum(weights.values())
    if total <= 0:
        n = len(weights)
        return {q: 1.0 / n for q in weights} if n else {}
    w = {q: v / total for q, v in weights.items()}
    p = {q: max(w[q] + k * (w[q] - usage.get(q, 0.0)), 0.0) for q in w}
    s = sum(p.values())
    if s <= 0:
        return w
    return {q: v / s for q, v in p.items()}


def fair_shares(
    tree: BudgetTree, capacity: float, requested: Mapping[str, float], usage: Mapping[str, float], k: float
) -> dict[str, float]:
    """Fair share in GPUs of every budget (fairness/README.md "Fair-Share Algorithm", time-aware over-quota).

    Args:
        tree: the queue tree.
        capacity: GPUs to divide at the top.
        requested: path -> GPUs held + GPUs pending, subtree sums.
        usage: path -> windowed usage / windowed capacity, subtree sums.
        k: ``kValue``.
    """
    out: dict[str, float] = {ROOT: capacity}
    todo = [(ROOT, capacity)]  # (no recursion: a recursive closure would be a reference cycle)
    while todo:
        parent, amount = todo.pop()
        kids = tree.children(parent)
        if not kids:
            continue
        give = {c: min(tree.abs_share(c) * capacity, requested.get(c, 0.0)) for c in kids}
        total = sum(give.values())
        if total > amount > 0:
            give = {c: v * amount / total for c, v in give.items()}
        elif amount <= 0:
            give = dict.fromkeys(kids, 0.0)
        rest = amount - sum(give.values())
        while rest > _EPS:
            open_ = [c for c in kids if requested.get(c, 0.0) - give[c] > _EPS]
            if not open_:
                break
            portions = time_aware_portions({c: tree.share(c) for c in open_}, {c: usage.get(c, 0.0) for c in open_}, k)
            given = 0.0
            for c in open_:
                x = min(rest * portions[c], requested.get(c, 0.0) - give[c])
                give[c] += x
                given += x
            rest -= given
            if given <= _EPS:
                break
        for c in kids:
            out[c] = give[c]
            todo.append((c, give[c]))
    return out


class Kai(PeerPolicy):
    """The ``kai`` cycle (module docstring); the usage history is the snapshot's occupancy window."""

    name = "kai"

    def __init__(self, k_value: float = 1.0, multiplier: float = 1.0) -> None:
        super().__init__()
        self.k_value = k_value
        self.multiplier = multiplier
        self._pending: dict[int, tuple[object, int]] = {}

    def reset(self) -> None:
        """Drop the per-list cache of pending GPUs."""
        self._pending = {}

    def _pending_gpus(self, jobs: Sequence[PendingJob]) -> int:
        hit = self._pending.get(id(jobs))
        if hit is None or hit[0] is not jobs:
            hit = self._pending[id(jobs)] = (jobs, sum(j.gpus for j in jobs))
        return hit[1]

    def cycle(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """Fair shares, then allocation by saturation, reclaiming within the rules of the module docstring."""
        tree = snapshot.tree
        cap = float(capacity_gpus(snapshot))
        cyc = Cycle(snapshot, now_us, config, POLICY_VERSION)
        pend = {leaf: self._pending_gpus(lst) for leaf, lst in snapshot.pending.items() if lst}
        if len(self._pending) > 4 * len(snapshot.pending) + 16:
            cur = {id(lst) for lst in snapshot.pending.values()}
            self._pending = {i: v for i, v in self._pending.items() if i in cur}
        req = subtree_sums({leaf: cyc.held.get(leaf, 0) + pend.get(leaf, 0) for leaf in set(cyc.held) | set(pend)})
        kk = snapshot.capacity_gpu_s
        use = {p: o / kk for p, o in snapshot.occupancy.items()} if kk > 0 else {}
        fs = fair_shares(tree, cap, req, use, self.k_value)

        def key(s: Seg, job: PendingJob) -> tuple[tuple[float, ...], int, str]:
            agg = subtree_sums(cyc.held)
            path = tuple(saturation(agg.get(a, 0.0), fs.get(a, 0.0)) for a in ancestors_of(s.leaf))
            return (path, job.submitted_at_us, s.leaf)

        def planner(c: Cycle, job: PendingJob):
            x, w = job.budget, job.gpus
            agg = subtree_sums(c.held)
            if agg.get(x, 0.0) + w > fs.get(x, 0.0) + _EPS:
                return None  # CanReclaimResources: the reclaimer would pass its fair share

            def can_give(yb: str, _xb: str) -> bool:
                # the rule can ever accept a run of Y (the search only lowers its allocation): above its fair
                # share, or above its deserved quota
                return agg.get(yb, 0.0) > min(fs.get(yb, 0.0), tree.abs_share(yb) * cap) + _EPS

            pools = victim_pools(c, job, can_give, lambda r: not r.protected(now_us))
            if pools is None:
                return None
            involved: set[str] = set()

            def take(run: Run) -> None:
                for a in ancestors_of(run.budget):
                    agg[a] = agg.get(a, 0.0) - run_gpus(run)
                br = branches_of(run.budget, x)
                if br is not None:
                    involved.add(br[1])

            def rank(leaf: str) -> float:
                return saturation(agg.get(leaf, 0.0), fs.get(leaf, 0.0))

            def within_boundaries(extra: set[str], gone: Run | None) -> bool:
                for level in ancestors_of(x):
                    mine = saturation(agg.get(level, 0.0) + w, fs.get(level, 0.0))
                    if mine <= 1.0:
                        continue
                    for sib in sorted(involved | extra):
                        if parent_of(sib) != parent_of(level) or sib == level:
                            continue
                        left = agg.get(sib, 0.0)
                        if gone is not None and sib in ancestors_of(gone.budget):
                            left -= run_gpus(gone)
                        f = fs.get(sib, 0.0)
                        if f > 0 and mine * self.multiplier >= saturation(left, f):
                            return False
                return True

            def allowed(z: Run) -> bool:
                if z.budget == x:
                    return not z.allocated
                br = branches_of(z.budget, x)
                assert br is not None  # z's leaf is not x: two distinct leaves meet at an LCA
                _lca, yb, xb = br
                y_left = agg.get(yb, 0.0)
                fair_ok = y_left > fs.get(yb, 0.0) + _EPS
                quota_ok = (
                    agg.get(xb, 0.0) + w <= tree.abs_share(xb) * cap + _EPS and y_left > tree.abs_share(yb) * cap + _EPS
                )
                return (fair_ok or quota_ok) and within_boundaries({yb}, z)

            return plan_victims(c, job, take_in_turn(pools, rank, allowed, take, last=x))

        alloc, _ = leaf_segments(snapshot, split=False)
        admission_loop(
            cyc, alloc, key, planner, ratio=lambda leaf: saturation(cyc.held.get(leaf, 0), fs.get(leaf, 0.0))
        )
        return cyc.out
