"""Preemption candidates: the victim cost order and the indices the search walks (rule D3.victims).

* :func:`order_key`: the cost order of one victim (allocated GPUs,
  unallocated GPUs, work lost since its last checkpoint), independent of
  the time of asking, so an index of candidates can live across cycles;
* :class:`VictimIndex`: unallocated runs per node and allocated runs per
  leaf by protection end, kept across cycles by the caller
  (``DispatchState``) and updated from the runs that changed;
* :class:`CycleVictims`: one cycle's view of it: the runs taken so far, the
  expired runs per leaf and node, the idle ones among them (D3.idle-runs, by
  :func:`~apportion.domain.preemption.idle_rule`), and which leaves are behind a preemptor's
  leaf (:meth:`CycleVictims.behind_of`, by
  :func:`~apportion.domain.preemption.branch_rule`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Mapping
from itertools import islice
from operator import itemgetter

from apportion.domain.budgets import BudgetTree, ancestors_of, parent_of
from apportion.domain.cluster import ClusterSnapshot, ClusterState, Run, RunKey, work_ref_us
from apportion.domain.idle import IdleReports, run_idle
from apportion.domain.preemption import (
    REFUSED_AFTER_MOVE,
    RULE_EXPIRED_BEHIND,
    CheckpointVerdict,
    Move,
    ShareView,
    branch_rule,
    idle_rule,
)
from apportion.domain.preemption import (
    branches_of as _branches,
)
from apportion.timeutil import Micros

__all__ = [
    "AllocEntry",
    "Behind",
    "Candidate",
    "CycleVictims",
    "Option",
    "VictimIndex",
    "candidate_order",
    "order_key",
    "order_lost_gpu_s",
]

#: A victim candidate on one node: ``(order, run, gpus of the run on that node)``.
#: ``order = (allocated GPUs, unallocated GPUs, -ref_us, job_id, attempt)`` of the
#: whole run (:func:`order_key`; ref = the later of start and last checkpoint). It sorts exactly as the
#: cost (allocated GPUs, unallocated GPUs, GPU-s of work lost at ``now``, job_id,
#: attempt): for equal GPU counts the work lost ``gpus * (now - ref) / 1e6`` is
#: strictly decreasing in ref (integer µs products below 2**53 divided by 1e6 stay
#: distinct as floats while they are below ~4.5e9 GPU-s), and it does not depend on
#: ``now``, so an index of candidates can live across cycles. The work lost is
#: computed from it where a plan is costed (:func:`order_lost_gpu_s`).
Candidate = tuple[tuple[int, int, int, str, int], Run, tuple[int, ...]]


AllocEntry = tuple[Micros, RunKey, Run]
"""An allocated run in :attr:`VictimIndex.alloc`: ``(protected_until_us, key, run)``."""

Option = tuple[tuple[int, int, int, float], str, list[Candidate]]
"""A way to free a node for a preemptor: ``((busy allocated GPUs, idle allocated GPUs, unallocated GPUs, GPU-s
lost), node, victims)``; idle: the runs of :attr:`CycleVictims.idle_runs` (D3.idle-runs)."""

Behind = tuple[dict[str, tuple[str, float, float, float]], bool]
""":meth:`CycleVictims.behind_of`'s answer: ``({V: (lca, r_V branch, r_B branch, r_B after)}, narrowed)``."""


def order_key(run: Run) -> tuple[int, int, int, str, int]:
    """Victim cost order of one run (rule D3.victims), independent of the time of asking.

    ``(allocated GPUs, unallocated GPUs, -ref, job_id, attempt)`` of the whole
    run (g * k GPUs, not only those on one node, so a gang counts as large as
    it is), with ``ref`` = :func:`~apportion.domain.cluster.work_ref_us`, the
    later of its start and its last checkpoint: for equal GPUs, a later ref
    is less work lost, at any ``now >= ref``.
    """
    ref = work_ref_us(run)
    gpus = run.gpus_per_replica * run.replicas
    if run.allocated:
        return (gpus, 0, -ref, run.job_id, run.attempt)
    return (0, gpus, -ref, run.job_id, run.attempt)


def order_lost_gpu_s(order: tuple[int, int, int, str, int], now: Micros) -> float:
    """GPU-seconds of work lost at ``now`` by preempting the run with this order key
    (= :func:`~apportion.domain.cluster.work_lost_gpu_s` of the run, for ``now >= ref``)."""
    return (order[0] + order[1]) * (now + order[2]) / 1e6


_UNTIL = itemgetter(0)

candidate_order = itemgetter(0)
"""Sort key of :data:`Candidate` lists: the order key (cheapest first)."""


class VictimIndex:
    """Preemption candidates kept across cycles, updated from the runs that changed.

    A pure function of ``cluster.runs`` (non-stopping runs only), independent of
    the cycle time:

    * ``unalloc[node]``: the unallocated runs with an open replica there, as
      :data:`Candidate` sorted by order key (cheapest first); nodes without any
      are absent (lists are never empty);
    * ``alloc[leaf]``: the allocated runs of the leaf as ``(protected_until_us,
      run key, run)`` sorted ascending, so the runs whose protection has expired
      at ``now`` (``now >= protected_until_us``) are a prefix.

    :meth:`sync` brings it up to date with a :class:`ClusterState`: the first
    time (or for another cluster) it rebuilds from scratch and switches on the
    cluster's change tracking (``ClusterState.changed``); afterwards it
    re-indexes only the changed run keys (in sorted order) and clears the set.
    The result equals :meth:`build` of the same runs (property-tested), so a
    cycle decides the same with or without it.
    """

    __slots__ = ("unalloc", "alloc", "_indexed", "_cluster")

    def __init__(self) -> None:
        self.unalloc: dict[str, list[Candidate]] = {}
        self.alloc: dict[str, list[AllocEntry]] = {}
        self._indexed: dict[RunKey, Run] = {}
        self._cluster: ClusterState | None = None

    @classmethod
    def build(cls, runs: Mapping[RunKey, Run]) -> VictimIndex:
        """A fresh index of ``runs`` (any order: lists are sorted by unique keys)."""
        idx = cls()
        unalloc, alloc = idx.unalloc, idx.alloc
        for run in runs.values():
            if run.stopping:
                continue
            idx._indexed[run.key] = run
            if run.allocated:
                lst = alloc.get(run.budget)
                until = run.protected_until_us
                assert until is not None  # allocated: its protection end is known (for mypy; no cost to speak of)
                ent = (until, run.key, run)
                if lst is None:
                    alloc[run.budget] = [ent]
                else:
                    lst.append(ent)
                continue
            order = order_key(run)
            placements = run.placements
            for r in run.open_replicas:
                p = placements[r]
                lst2 = unalloc.get(p.node_id)
                if lst2 is None:
                    unalloc[p.node_id] = [(order, run, p.gpus)]
                else:
                    lst2.append((order, run, p.gpus))
        for lst2 in unalloc.values():
            lst2.sort(key=candidate_order)
        for lst in alloc.values():
            lst.sort(key=_until_key)
        return idx

    def sync(self, cluster: ClusterState) -> VictimIndex:
        """Update from ``cluster`` (a :class:`ClusterState`) and return self (see the class doc)."""
        changed = cluster.changed
        if cluster is not self._cluster or changed is None:
            fresh = VictimIndex.build(cluster.runs)
            self.unalloc, self.alloc, self._indexed = fresh.unalloc, fresh.alloc, fresh._indexed
            self._cluster = cluster
            cluster.changed = set()
            return self
        if changed:
            runs = cluster.runs
            for key in sorted(changed):
                old = self._indexed.pop(key, None)
                if old is not None:
                    self._remove(old)
                run = runs.get(key)
                if run is not None and not run.stopping:
                    self._indexed[key] = run
                    self._add(run)
            changed.clear()
        return self

    def _add(self, run: Run) -> None:
        if run.allocated:
            lst = self.alloc.get(run.budget)
            until = run.protected_until_us
            assert until is not None  # allocated: its protection end is known
            ent = (until, run.key, run)
            if lst is None:
                self.alloc[run.budget] = [ent]
            else:
                insort(lst, ent, key=_until_key)
            return
        order = order_key(run)
        for r in run.open_replicas:
            p = run.placements[r]
            lst2 = self.unalloc.get(p.node_id)
            if lst2 is None:
                self.unalloc[p.node_id] = [(order, run, p.gpus)]
            else:
                insort(lst2, (order, run, p.gpus), key=candidate_order)

    def _remove(self, run: Run) -> None:
        if run.allocated:
            lst = self.alloc[run.budget]
            key = (run.protected_until_us, run.key)
            i = bisect_left(lst, key, key=_until_key)
            del lst[i]
            if not lst:
                del self.alloc[run.budget]
            return
        order = order_key(run)
        for r in run.open_replicas:
            nid = run.placements[r].node_id
            lst2 = self.unalloc[nid]
            i = bisect_left(lst2, order, key=candidate_order)
            del lst2[i]
            if not lst2:
                del self.unalloc[nid]

    def as_lists(
        self,
    ) -> tuple[
        dict[str, list[tuple[tuple[int, int, int, str, int], RunKey, tuple[int, ...]]]],
        dict[str, list[tuple[Micros, RunKey]]],
    ]:
        """``(unalloc, alloc)`` with runs as keys, sorted by node / leaf (for tests)."""
        u = {n: [(c, r.key, g) for c, r, g in lst] for n, lst in sorted(self.unalloc.items())}
        a = {b: [(t, k) for t, k, _ in lst] for b, lst in sorted(self.alloc.items())}
        return u, a


def _until_key(x: AllocEntry) -> tuple[Micros, RunKey]:
    return (x[0], x[1])


class CycleVictims:
    """Preemption candidates of one cycle, indexed by node.

    ``unalloc[node]`` and ``expired_on(leaf)[node]`` hold :data:`Candidate` entries
    sorted cheapest first. Built from a :class:`VictimIndex` (kept across
    cycles by the caller, ``CycleSnapshot.victims``) or, without one, from
    the snapshot's runs.

    With the node agents' idle reports (``idle``) and the budget ``tree``, ``idle_runs`` holds the
    allocated runs past their protection that :func:`~apportion.domain.preemption.idle_rule` allows
    (run -> ``(idle_s, preempt_idle_after_s)``) and ``idle_on[node]`` them as :data:`Candidate` entries,
    cheapest first (D3.idle-runs); both empty without reports or without a budget that sets the setting.
    """

    __slots__ = (
        "unalloc",
        "expired",
        "taken",
        "behind",
        "under",
        "unalloc_options",
        "unalloc_seen",
        "narrowed",
        "spared",
        "waits",
        "checkpoint_waits",
        "idle_runs",
        "idle_on",
        "_now",
        "_exp_runs",
        "_levels",
    )

    def __init__(
        self,
        cluster: ClusterSnapshot,
        now: Micros,
        index: VictimIndex | None = None,
        idle: IdleReports | None = None,
        tree: BudgetTree | None = None,
    ) -> None:
        if index is None:
            index = VictimIndex.build(cluster.runs)
        self.unalloc: dict[str, list[Candidate]] = index.unalloc  # read only
        self.taken: set[RunKey] = set()
        # leaf -> (charge_count, pairs allowed at charge 0, {charge: (behind_of's answer)})
        self.behind: dict[str, tuple[int, list[tuple[str, str, str, list[str]]], dict[float, Behind]]] = {}
        self.under: dict[str, list[str]] | None = None
        # parent -> (charge_count, its children's r in order, (r, child's index, child, leaves with expired runs
        # under it) sorted) of the children with expired runs beneath (_behind_at_zero)
        self._levels: dict[str, tuple[int, list[float], list[tuple[float, int, str, list[str]]]]] = {}
        self.unalloc_options: dict[tuple[int, str | None], dict[str, Option]] = {}
        self.unalloc_seen: dict[tuple[int, str | None], int] = {}  # position in the free index's log
        self.narrowed = False  # set by plan_preemption: its last search depended on the job's charge
        self.spared = False  # set by plan_preemption: its last search left out a gang larger than the job (gang_rule)
        self.waits: dict[str, float] = {}  # job id -> work lost (GPU-s) of the plan patience_rule refused
        self.checkpoint_waits: dict[str, CheckpointVerdict] = {}  # job id -> checkpoint_rule's wait verdict
        self._now = now
        # leaf -> its allocated runs (the index's list, read only), whose prefix up to now has expired;
        # the prefix is cut where it is used (expired_on, the idle runs), not for every leaf here
        # (protection expired: now >= protected_until_us)
        exp: dict[str, list[AllocEntry]] = {leaf: lst for leaf, lst in index.alloc.items() if lst[0][0] <= now}
        self._exp_runs = exp
        # the leaves with expired runs; each one's node -> runs made by expired_on on first use
        self.expired: dict[str, dict[str, list[Candidate]] | None] = dict.fromkeys(exp)
        self.idle_runs: dict[RunKey, tuple[float, float]] = {}
        self.idle_on: dict[str, list[Candidate]] = {}
        if idle is not None and idle.by_node and tree is not None:
            for leaf in sorted(exp):
                after = tree.preempt_idle_after_s(leaf)
                if after is None:
                    continue
                ents = exp[leaf]
                for _, key, run in islice(ents, bisect_right(ents, now, key=_UNTIL)):
                    ri = run_idle(idle, run)
                    if ri is None or not idle_rule(ri.idle_s, after):
                        continue
                    self.idle_runs[key] = (ri.idle_s, after)
                    order = order_key(run)
                    for r in run.open_replicas:
                        p = run.placements[r]
                        self.idle_on.setdefault(p.node_id, []).append((order, run, p.gpus))
            for lst2 in self.idle_on.values():
                lst2.sort(key=candidate_order)

    def expired_on(self, leaf: str) -> dict[str, list[Candidate]]:
        """Node -> expired runs of ``leaf`` there, cheapest first (built on first use)."""
        by_node = self.expired[leaf]
        if by_node is None:
            by_node = self.expired[leaf] = {}
        ents = self._exp_runs.pop(leaf, None)
        if ents:
            for _, _, run in islice(ents, bisect_right(ents, self._now, key=_UNTIL)):
                order = order_key(run)
                for r in run.open_replicas:
                    p = run.placements[r]
                    by_node.setdefault(p.node_id, []).append((order, run, p.gpus))
            for lst in by_node.values():
                lst.sort(key=candidate_order)
        return by_node

    def behind_of(
        self,
        leaf: str,
        view: ShareView,
        delta: float,
        charge_count: int,
        tree: BudgetTree | None = None,
        charge_gpu_s: float = 0.0,
        moves: frozenset[Move] | set[Move] = frozenset(),
    ) -> Behind:
        """Leaves whose expired runs ``leaf`` may preempt, by :func:`branch_rule`.

        Returns ``({V: (lca, r_V branch, r_B branch, r_B branch after)},
        narrowed)``; ``narrowed`` is True when the after-move test
        (:data:`REFUSED_AFTER_MOVE`) left out a leaf that is behind by
        delta, i.e. when the answer depends on ``charge_gpu_s``.

        Walks up from ``leaf``: at each ancestor A (parent P), every sibling
        S of A with expired runs beneath is judged once by
        ``branch_rule(P, S, A, ...)``, which decides for all leaves under S
        (their LCA with ``leaf`` is P). Without ``tree``, each leaf with
        expired runs is judged on its own (the same answer; tested).
        Recomputed when ``charge_count`` (provisional charges so far in the cycle; ``moves`` only
        grow with a charge) or the charge moved on.
        """
        hit = self.behind.get(leaf)
        if hit is None or hit[0] != charge_count:
            hit = self.behind[leaf] = (
                charge_count,
                self._behind_at_zero(leaf, view, delta, tree, moves, charge_count),
                {},
            )
        per_charge = hit[2]
        got = per_charge.get(charge_gpu_s)
        if got is not None:
            return got
        # The after-move test only refuses more as the charge grows, so the pairs allowed at
        # charge 0 are the only ones to judge again with this charge (by the same rule).
        out: dict[str, tuple[str, float, float, float]] = {}
        narrowed = False
        for lca, vb, bb, vs in hit[1]:
            rule, rv, rb, after = branch_rule(lca, vb, bb, view, delta, charge_gpu_s, moves)
            if rule == RULE_EXPIRED_BEHIND:
                for v in vs:
                    out[v] = (lca, rv, rb, after)
            elif rule == REFUSED_AFTER_MOVE:
                narrowed = True
        got = per_charge[charge_gpu_s] = (out, narrowed)
        return got

    def _behind_at_zero(
        self,
        leaf: str,
        view: ShareView,
        delta: float,
        tree: BudgetTree | None,
        moves: frozenset[Move] | set[Move],
        charge_count: int = -1,
    ) -> list[tuple[str, str, str, list[str]]]:
        """``(lca, victim branch, preemptor branch, leaves with expired runs under the victim branch)``
        that :func:`branch_rule` allows with no charge (see :meth:`behind_of`).

        Per ancestor A of ``leaf`` (parent P), only the siblings of A with r >= r(A) + delta are judged (those
        below are not behind by delta: branch_rule would refuse them), in P's order of children; the siblings
        with expired runs beneath are kept sorted by r per P while ``charge_count`` stays (no r moves without
        a charge), so that the leaves of one cycle share them (speed only; ``charge_count`` -1: not kept)."""
        out: list[tuple[str, str, str, list[str]]] = []
        if tree is None:
            for v in sorted(self.expired):
                if v == leaf:
                    continue
                br = _branches(v, leaf)
                if br is None:
                    continue
                lca, vb, bb = br
                if branch_rule(lca, vb, bb, view, delta, 0.0, moves)[0] == RULE_EXPIRED_BEHIND:
                    out.append((lca, vb, bb, [v]))
            return out
        under = self._under()
        ratio = view.ratio
        levels = self._levels
        for a in ancestors_of(leaf):
            par = parent_of(a)
            level = levels.get(par) if charge_count >= 0 else None
            if level is None or level[0] != charge_count:
                ents = sorted(
                    (ratio(sib), i, sib, vs) for i, sib in enumerate(tree.children(par)) if (vs := under.get(sib))
                )
                level = (charge_count, [e[0] for e in ents], ents)
                if charge_count >= 0:
                    levels[par] = level
            ents = level[2]
            if not ents:
                continue
            # not behind by delta below the bar: branch_rule would refuse them (a filter, not the rule)
            first = bisect_left(level[1], ratio(a) + delta)
            if first == len(ents):
                continue
            for _, _, sib, vs in sorted(ents[first:], key=itemgetter(1)):
                if sib != a and branch_rule(par, sib, a, view, delta, 0.0, moves)[0] == RULE_EXPIRED_BEHIND:
                    out.append((par, sib, a, vs))
        return out

    def _under(self) -> dict[str, list[str]]:
        """Budget path -> leaves below it (itself included) that hold expired runs."""
        if self.under is None:
            under: dict[str, list[str]] = {}
            for v in sorted(self.expired):
                for a in ancestors_of(v):
                    under.setdefault(a, []).append(v)
            self.under = under
        return self.under
