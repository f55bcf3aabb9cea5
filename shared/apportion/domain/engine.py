"""One scheduling cycle: placement, preemption, backfill, reservation (DESIGN section 3).

:func:`schedule` takes an immutable :class:`CycleSnapshot` (cluster, pending
jobs per leaf budget, budget tree, window occupancy) and the cycle's event
time, and returns decision events. It never mutates its input: a cycle
works on its own scratch indices built from the snapshot.

The cycle, exactly as DESIGN section 3 says:

1. Walk pending jobs in fair-share order (:class:`FairShareQueue`: leaf
   budgets by Fair-Tree order of r, jobs of one leaf by (submitted_at,
   job_id)). After each placement of an **allocated** job its budget gets the
   provisional charge ``g * k * min(min_runtime, W)`` before the rest are
   ranked (unallocated jobs are free and never charged).
2. Place a job on free GPUs if it fits: gang of k replicas on k *distinct*
   ``ready`` nodes of the right model with g free GPUs each. Best fit: nodes
   with the fewest free GPUs that fit, ties by node id; within a node the
   lowest free GPU indices. A job without a model constraint tries nodes of
   models no waiting job asks for first (:func:`spare_models`).
3. Else, for an **allocated** job J of leaf B, plan a preemption. Candidate
   victims (:func:`victim_rule`, the one home of the rule, with rule ids):
   (1) unallocated runs of any budget; (2) allocated runs whose protection
   has expired (``now >= started_at + protection``, :func:`protection_s`:
   the minimum runtime doubled per earlier preemption of the job, capped)
   whose leaf V is *behind* B (:func:`branch_rule`): at the lowest common
   ancestor, ``r(V's branch) >= r(B's branch) + delta``, and after the move
   B's branch with J's provisional charge is still at or below V's
   (``r_B_after <= r_V``), and the cycle has not already preempted B's
   branch's work for V's (no same-cycle reversal); every r from the one view
   of the cycle (all provisional charges so far). Never V == B, never a
   protected run, never a run already stopping. Cost of a victim set is
   (allocated GPUs, unallocated GPUs, GPU-seconds of work lost since each
   victim's last checkpoint), compared lexicographically, with each
   victim's *whole-run* GPUs (so a gang counts as large as it is;
   :func:`order_key`, :func:`~apportion.domain.cluster.work_lost_gpu_s`).
   Per node we take the cheapest victims first and then drop any that
   turned out unnecessary (a minimal set per node); the k cheapest nodes
   (ties by node id) form the plan. Preempt only if J is then placed; J is
   placed at once on the freed GPUs (``JobPlaced`` with the victims in its
   :class:`Decision`), so they are reserved for it; its ``StartWorkload``
   follows when the victims have stopped (dispatch).
4. Unallocated jobs only go on free GPUs.
5. A job that cannot be placed does not block the ones behind it
   (backfill), except: the highest-ranked blocked allocated job that has
   waited (since it was queued) at least ``reservation_after`` reserves k
   nodes (those with the most free GPUs, ties by id); no job ranked below it
   lands there in this cycle, except as :func:`backfill_rule` allows (a
   reservation never idles GPUs): unallocated work, and allocated work the
   holder could take back whose protection ends by the holder's earliest
   fit (:func:`earliest_fit_us`). Reservations are recomputed every cycle
   from the snapshot, so they need no events and replay identically.

No loop: within a cycle the after-move test and the reversal rule forbid
V->B and B->V; across cycles the preemptor's new run is protected (longer
each time the job was preempted), and B cannot preempt A back until A's run
has served its protection *and* the ratios have crossed by ``delta`` the
other way, with the move still not inverting the pair.

Speed (the benchmark is 10,000 GPUs, 20,000 pending jobs, 200 leaves):

* free capacity is indexed by (GPU model, free GPU count) -> sorted node
  ids, so a fit is a walk over at most 9 buckets, not all nodes;
* a failed shape (g, k, model) is remembered: a later job of at least that
  shape fails on free GPUs without looking (free capacity only shrinks
  within a cycle); preemption failures are remembered per leaf until
  another leaf is charged (a charge elsewhere can put more runs behind);
* when every remaining job of a leaf is at least as large as a remembered
  failure, the whole leaf is skipped for the rest of the cycle
  (:meth:`FairShareQueue.drop_leaf`); the next cycle looks again;
* the preemption search looks only at nodes holding candidate victims.

Event ids come from :func:`det_id`, times from ``now_us``: the same snapshot
and time always give the same events, byte for byte.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import islice
from operator import attrgetter, itemgetter
from typing import Any

from apportion.domain.budgets import BudgetTree, ancestors_of, parent_of
from apportion.domain.cluster import (
    UNTIL_STARTED,
    ClusterSnapshot,
    Node,
    Run,
    RunKey,
    protection_s,
    work_lost_gpu_s,
    work_ref_us,
)
from apportion.domain.fairshare import FairShareQueue
from apportion.domain.preemption import (
    REFUSED_AFTER_MOVE,
    RULE_EXPIRED_BEHIND,
    RULE_UNALLOCATED,
    Move,
    ShareView,
    VictimVerdict,
    backfill_rule,
    branch_rule,
    charge_of,
    victim_rule,
)
from apportion.domain.preemption import (
    branches_of as _branches,
)
from apportion.events import (
    Decision,
    Event,
    JobPlaced,
    JobPreempted,
    Placement,
    StartWorkload,
    StopWorkload,
    Victim,
    det_id,
)
from apportion.timeutil import WEEK_S, Micros, from_us, s_to_us, to_us

__all__ = [
    "EngineConfig",
    "PendingJob",
    "CycleSnapshot",
    "CycleResult",
    "schedule",
    "run_cycle",
    "victim_rule",
    "branch_rule",
    "VictimVerdict",
    "ShareView",
    "charge_of",
    "earliest_fit_us",
    "spare_models",
    "backfill_rule",
    "RULE_UNALLOCATED",
    "RULE_EXPIRED_BEHIND",
    "order_key",
    "preempt_events",
    "stop_event",
    "start_events",
    "pending_order",
    "POLICY_VERSION",
    "VictimIndex",
    "FreeIndex",
]

POLICY_VERSION = "fairtree-2"
"""fairtree-2: after-move test, no same-cycle reversal, protection grown per preemption,
cold-start capacity floor, reservation backfill, spare models first (issue 12)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler policy knobs.

    Attributes:
        delta: hysteresis for preempting an expired allocated run: its branch
            r must exceed the preemptor's by at least this (default 0.05).
        reservation_after_s: a blocked allocated job waiting at least this
            long (seconds since queued) reserves nodes (default 1 h).
        window_s: occupancy window W in seconds (for the provisional charge).
        grace_s: SIGTERM-to-SIGKILL grace of ``StopWorkload``, seconds.
        preemption: False disables preemption (baselines).
        policy_version: recorded in every :class:`Decision`.
        producer: ``producer`` of emitted events.
    """

    delta: float = 0.05
    reservation_after_s: float = 3600.0
    window_s: float = float(WEEK_S)
    grace_s: float = 30.0
    preemption: bool = True
    policy_version: str = POLICY_VERSION
    producer: str = "dispatcher"


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job waiting in the queue (one attempt).

    Attributes:
        job_id, attempt: identity of the run it would become.
        budget: leaf budget path charged.
        user: submitting user.
        gpus_per_replica, replicas: gang shape g x k.
        min_runtime_s: protection in seconds; 0 = unallocated.
        gpu_model: required model or ``None``.
        submitted_at_us: original submission (queue order), µs UTC.
        queued_at_us: when this attempt entered the queue (reservation wait), µs UTC.
        duration_s, command: the workload, passed on to ``StartWorkload``.
        preemptions: times the job was preempted before (``ClusterState.preemptions``),
            the input of :func:`~apportion.domain.cluster.protection_s`.
        progress_s: progress its last checkpoint saved, seconds (where this attempt resumes).
    """

    job_id: str
    attempt: int
    budget: str
    user: str
    gpus_per_replica: int
    replicas: int
    min_runtime_s: float
    submitted_at_us: Micros
    queued_at_us: Micros
    gpu_model: str | None = None
    duration_s: float | None = None
    command: tuple[str, ...] | None = None
    preemptions: int = 0
    progress_s: float = 0.0

    @property
    def allocated(self) -> bool:
        """True when charged (``min_runtime_s > 0``)."""
        return self.min_runtime_s > 0

    @property
    def gpus(self) -> int:
        """g * k."""
        return self.gpus_per_replica * self.replicas


@dataclass(frozen=True, slots=True)
class CycleSnapshot:
    """Everything one cycle reads, frozen.

    Attributes:
        cluster: nodes and runs.
        pending: leaf budget -> its pending jobs, allocated ones first, each
            class in (submitted_at, job_id) order (sort key
            :func:`pending_order`). Keys that are not leaves of ``tree`` are
            skipped.
        tree: the budget tree.
        occupancy: window occupancy O per budget path incl. descendants, GPU-s.
        capacity_gpu_s: capacity integral K over the window, GPU-s.
    """

    cluster: ClusterSnapshot
    pending: Mapping[str, Sequence[PendingJob]]
    tree: BudgetTree
    occupancy: Mapping[str, float]
    capacity_gpu_s: float
    memo: dict[Any, Any] | None = field(default=None, compare=False, repr=False)
    """Optional cache the caller keeps across cycles: ``id(list) -> (list,
    {(lo, hi): (min g, min k) of list[lo:hi]})`` for the ``pending`` lists;
    only for callers whose pending sequences are never changed in place
    (``DispatchState``: copy-on-write, and it carries entries over to the
    list that replaces one)."""
    victims: VictimIndex | None = field(default=None, compare=False, repr=False)
    """Optional :class:`VictimIndex` of ``cluster.runs``, kept up to date across
    cycles by the caller (``DispatchState``); ``None``: the cycle indexes the
    runs itself. Either way the decisions are the same."""
    free: FreeIndex | None = field(default=None, compare=False, repr=False)
    """Optional :class:`FreeIndex` of ``cluster.nodes``, kept up to date the same way."""


@dataclass(slots=True)
class CycleResult:
    """What a cycle decided.

    Attributes:
        events: decisions and commands in emission order.
        reservation: ``(job_id, node_ids)`` of this cycle's reservation, or ``None``.
        considered: jobs taken from the queue (the rest were skipped in bulk).
        searches: preemption searches run.
        passed_over: of ``considered``, jobs passed over in a run without
            being looked at one by one: their shape was already known to be
            blocked in this cycle (see :func:`_blocked_run`).
    """

    events: list[Event] = field(default_factory=list)
    reservation: tuple[str, tuple[str, ...]] | None = None
    considered: int = 0
    searches: int = 0
    passed_over: int = 0


def schedule(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig | None = None) -> list[Event]:
    """Run one scheduling cycle (DESIGN section 3); see the module docstring.

    Args:
        snapshot: the frozen inputs.
        now_us: cycle event time, µs since the epoch UTC.
        config: policy knobs (defaults when ``None``).

    Returns:
        Events in order: for each placement, ``JobPreempted`` + ``StopWorkload``
        per victim replica, then ``JobPlaced``, then (placements on free GPUs
        only) ``StartWorkload`` per replica.
    """
    return run_cycle(snapshot, now_us, config).events


# --------------------------------------------------------------------------- rules (apportion.domain.preemption)


def earliest_fit_us(
    cluster: ClusterSnapshot, nodes: Sequence[str], g: int, now_us: Micros, taken: set[RunKey] | frozenset[RunKey]
) -> Micros:
    """A lower bound of when a reservation's holder can start on its ``nodes``, µs UTC (DESIGN section 3).

    Per node: the GPUs not held by running allocated runs are available now
    (free, unallocated work - evicted the moment the holder can start -,
    stopping runs, runs preempted in this cycle (``taken``) and GPUs taken
    earlier in this cycle, all counted as now: a lower bound); an allocated
    run's GPUs become available no earlier than its protection ends
    (:attr:`Run.protected_until_us`; for a run not yet started, its
    placement time plus its protection, which is earlier). The node fits
    the holder (``g`` GPUs) at the first time enough are available; the
    holder needs all of its nodes, so the answer is the latest of them.

    Returns ``now_us`` when every node fits now, and ``2**62`` when a node
    never can (fewer than ``g`` GPUs).
    """
    latest = now_us
    runs = cluster.runs
    for nid in nodes:
        node = cluster.nodes[nid]
        held: list[tuple[Micros, int]] = []
        busy = 0
        for key in cluster.node_runs.get(nid, ()):
            run = runs.get(key)
            if run is None or run.stopping or not run.allocated or key in taken:
                continue
            n = sum(len(run.placements[r].gpus) for r in run.open_replicas if run.placements[r].node_id == nid)
            until = run.protected_until_us
            if until is None or until >= UNTIL_STARTED:
                length = run.min_runtime_us if run.protection_us is None else run.protection_us
                until = run.placed_at_us + length
            held.append((until, n))
            busy += n
        avail = node.gpu_count - busy
        if avail >= g:
            continue
        t = UNTIL_STARTED
        for until, n in sorted(held):
            avail += n
            if avail >= g:
                t = until
                break
        if t > latest:
            latest = t
    return max(latest, now_us)


def spare_models(models: Sequence[str | None], pending: Mapping[str, Sequence[PendingJob]]) -> list[str | None] | None:
    """Models a job without a model constraint should try first (DESIGN section 3), or ``None``.

    "Jobs without a model constraint prefer nodes of models that no waiting
    job asks for, so scarce models stay free for the jobs that need them":
    the models of ``models`` that no job of ``pending`` names, sorted (an
    unknown model, ``None``, is never asked for). ``None`` (no preference)
    when no job names a model of ``models`` or every model is asked for.
    """
    present = {m for m in models if m is not None}
    if not present:
        return None
    asked: set[str] = set()
    for jobs in pending.values():
        asked.update(m for m in map(_MODEL, jobs) if m is not None)
        if present <= asked:
            return None
    if not (present & asked):
        return None
    return sorted((m for m in models if m not in asked), key=lambda m: (m is not None, m or ""))


def start_events(
    job_id: str,
    attempt: int,
    placements: Sequence[Placement],
    ts: Any,
    duration_s: float | None,
    command: tuple[str, ...] | None,
    producer: str,
) -> list[Event]:
    """``StartWorkload`` for every replica of a run (ids by :func:`det_id`)."""
    return [
        StartWorkload(
            event_id=det_id("StartWorkload", job_id, attempt, i),
            ts=ts,
            producer=producer,
            node_id=p.node_id,
            job_id=job_id,
            attempt=attempt,
            replica=i,
            gpus=p.gpus,
            command=command,
            duration_s=duration_s,
        )
        for i, p in enumerate(placements)
    ]


def preempt_events(
    run: Run,
    ts: Any,
    grace_s: float,
    producer: str,
    *,
    victim: Victim | None = None,
    by_job_id: str | None = None,
    by_budget: str | None = None,
    reason: str = "preempted",
) -> list[Event]:
    """``JobPreempted`` for ``run`` then ``StopWorkload`` to each open replica's node.

    ``JobPreempted.lost_gpu_s`` is :func:`~apportion.domain.cluster.work_lost_gpu_s`
    of the run at ``ts`` (DESIGN section 1).
    """
    out: list[Event] = [
        JobPreempted(
            event_id=det_id("JobPreempted", run.job_id, run.attempt),
            ts=ts,
            producer=producer,
            job_id=run.job_id,
            attempt=run.attempt,
            budget=run.budget,
            allocated=run.allocated,
            by_job_id=by_job_id,
            by_budget=by_budget,
            victim=victim,
            grace_s=grace_s,
            reason=reason,
            lost_gpu_s=work_lost_gpu_s(run, to_us(ts)),
        )
    ]
    out.extend(stop_event(run, r, ts, grace_s, producer, reason) for r in sorted(run.open_replicas))
    return out


def stop_event(run: Run, replica: int, ts: Any, grace_s: float, producer: str, reason: str) -> StopWorkload:
    """``StopWorkload`` of one replica of ``run`` to its node (id by :func:`det_id`: one per replica and attempt).

    Args:
        grace_s: SIGTERM-to-SIGKILL grace, seconds.
    """
    return StopWorkload(
        event_id=det_id("StopWorkload", run.job_id, run.attempt, replica),
        ts=ts,
        producer=producer,
        node_id=run.placements[replica].node_id,
        job_id=run.job_id,
        attempt=run.attempt,
        grace_s=grace_s,
        reason=reason,
    )


# --------------------------------------------------------------------------- the cycle


def _dominated(shapes: list[tuple[int, int]], g: int, k: int) -> bool:
    for fg, fk in shapes:
        if fg <= g and fk <= k:
            return True
    return False


def _build_free(
    nodes: Mapping[str, Node], ids: Sequence[str]
) -> tuple[dict[str, list[int]], dict[str, str | None], dict[str, int], dict[str | None, list[list[str]]], int]:
    """``(free, model, count, buckets, maxc)`` of the ``ready`` nodes among ``ids`` (sorted)."""
    fr: dict[str, list[int]] = {}
    mo: dict[str, str | None] = {}
    co: dict[str, int] = {}
    bk: dict[str | None, list[list[str]]] = {}
    maxc = 0
    for nid in ids:
        n = nodes[nid]
        if n.state != "ready":
            continue
        mo[nid] = n.gpu_model
        c = co[nid] = n.gpu_count
        if c > maxc:
            maxc = c
        b = bk.get(n.gpu_model)
        if b is None:
            b = bk[n.gpu_model] = []
        while len(b) <= c:
            b.append([])
        if n.free:
            f = fr[nid] = sorted(n.free)
            b[len(f)].append(nid)  # nid ascending: lists stay sorted
        else:
            fr[nid] = []
    for b in bk.values():
        while len(b) <= maxc:
            b.append([])
    return fr, mo, co, bk, maxc


class FreeIndex:
    """Free capacity of the ``ready`` nodes, kept across cycles (the base a cycle copies).

    ``free[node]`` (sorted free GPU indices), ``model``, ``count`` (GPUs) and
    ``buckets[model][c]`` (sorted ids of nodes with exactly c free GPUs, c >= 1),
    ``maxc`` (most GPUs of a node): exactly what :func:`_build_free` gives for
    the cluster's nodes. :meth:`sync` re-reads only the nodes in
    ``ClusterState.changed_nodes``; a change of a node's state, model or GPU
    count rebuilds from scratch (rare), a change of its free set moves it
    between buckets.
    """

    __slots__ = ("free", "model", "count", "buckets", "maxc", "_cluster")

    def __init__(self) -> None:
        self.free: dict[str, list[int]] = {}
        self.model: dict[str, str | None] = {}
        self.count: dict[str, int] = {}
        self.buckets: dict[str | None, list[list[str]]] = {}
        self.maxc = 0
        self._cluster: Any = None

    def _rebuild(self, cluster: Any) -> None:
        self.free, self.model, self.count, self.buckets, self.maxc = _build_free(cluster.nodes, sorted(cluster.nodes))
        self._cluster = cluster
        cluster.changed_nodes = set()

    def sync(self, cluster: Any) -> FreeIndex:
        """Update from ``cluster`` (a :class:`ClusterState`) and return self."""
        changed = cluster.changed_nodes
        if cluster is not self._cluster or changed is None:
            self._rebuild(cluster)
            return self
        if changed:
            nodes = cluster.nodes
            for nid in sorted(changed):
                n = nodes.get(nid)
                was = nid in self.model
                if (n is not None and n.state == "ready") != was or (
                    was and (self.model[nid] != n.gpu_model or self.count[nid] != n.gpu_count)
                ):  # type: ignore[union-attr]
                    self._rebuild(cluster)
                    return self
                if not was:
                    continue
                old = self.free[nid]
                new = sorted(n.free)  # type: ignore[union-attr]
                if old != new:
                    b = self.buckets[n.gpu_model]  # type: ignore[union-attr]
                    if old:
                        lst = b[len(old)]
                        del lst[bisect_left(lst, nid)]
                    if new:
                        insort(b[len(new)], nid)
                    self.free[nid] = new
            changed.clear()
        return self

    def as_tuple(self) -> tuple:
        """Contents for comparison with a rebuild (tests)."""
        return (self.free, self.model, self.count, self.buckets, self.maxc)


class _Free:
    """Free-capacity index of one cycle: (model, free count) -> sorted node ids.

    A copy of a :class:`FreeIndex` (``base``, the caller's, kept across cycles)
    or built from the snapshot's nodes; the cycle changes its copy only.
    """

    __slots__ = ("free", "model", "count", "buckets", "maxc", "reserved", "log", "prefer")

    def __init__(self, cluster: ClusterSnapshot, base: FreeIndex | None = None) -> None:
        self.reserved: set[str] = set()
        #: models a job without a model constraint tries first (:func:`spare_models`), or None
        self.prefer: list[str | None] | None = None
        self.log: list[str] = []  # nodes changed this cycle (free taken, victims taken, reserved), in order
        if base is None:
            ids = cluster.order if cluster.order is not None else sorted(cluster.nodes)
            self.free, self.model, self.count, self.buckets, self.maxc = _build_free(cluster.nodes, ids)
        else:
            self.free = dict(base.free)  # the lists are replaced, never changed in place
            self.model, self.count, self.maxc = base.model, base.count, base.maxc  # read only
            self.buckets = {m: [list(x) for x in b] for m, b in base.buckets.items()}

    def fit(self, g: int, k: int, model: str | None) -> list[str] | None:
        """k distinct nodes with >= g free GPUs, best fit (fewest free, then id).

        Without a model constraint, nodes of :attr:`prefer` (models no waiting
        job asks for) first; only when they cannot hold the job, all models.
        """
        if model is None and self.prefer is not None:
            got = self._fit(g, k, self.prefer)
            if got is not None:
                return got
        return self._fit(g, k, [model] if model is not None else list(self.buckets))

    def _fit(self, g: int, k: int, models: list[str | None]) -> list[str] | None:
        picked: list[str] = []
        for c in range(g, self.maxc + 1):
            if len(models) == 1:
                b = self.buckets.get(models[0])
                if b is None:
                    return None
                nodes = b[c]
            else:
                nodes = sorted(n for m in models if m in self.buckets for n in self.buckets[m][c])
            if nodes:
                need = k - len(picked)
                picked.extend(nodes[:need])
                if len(picked) == k:
                    return picked
        return None

    def _move(self, nid: str, old: int, new: int) -> None:
        b = self.buckets[self.model[nid]]
        if old and nid not in self.reserved:
            lst = b[old]
            del lst[bisect_left(lst, nid)]
        if new and nid not in self.reserved:
            insort(b[new], nid)

    def take(self, nid: str, n: int) -> tuple[int, ...]:
        """Take the n lowest free GPUs of ``nid``."""
        self.log.append(nid)
        f = self.free[nid]
        got, rest = f[:n], f[n:]
        self._move(nid, len(f), len(rest))
        self.free[nid] = rest
        return tuple(got)

    def reserve(self, nid: str) -> None:
        self.log.append(nid)
        f = self.free[nid]
        if f:
            self._move(nid, len(f), 0)
        self.reserved.add(nid)

    def unreserve_all(self) -> None:
        """Give the reserved nodes' free GPUs back to the buckets (for unallocated work, pass 2)."""
        for nid in sorted(self.reserved):
            self.log.append(nid)
            self.reserved.discard(nid)
            f = self.free[nid]
            if f:
                insort(self.buckets[self.model[nid]][len(f)], nid)

    def reserved_free(self) -> int:
        """Free GPUs on the reserved nodes."""
        return sum(len(self.free[n]) for n in self.reserved)

    def reserved_fits(self, g: int, model: str | None) -> bool:
        """Some reserved node of ``model`` (any when ``None``) has at least ``g`` free GPUs."""
        for n in self.reserved:
            if len(self.free[n]) >= g and (model is None or self.model[n] == model):
                return True
        return False

    def fit_with_reserved(self, g: int, k: int, model: str | None) -> list[str] | None:
        """:meth:`fit` over the unreserved nodes and the reserved ones together (best fit, then id)."""
        if not self.reserved_fits(g, model):
            return self.fit(g, k, model)
        cand: list[tuple[int, str]] = []
        models = [model] if model is not None else list(self.buckets)
        for c in range(g, self.maxc + 1):
            for m in models:
                b = self.buckets.get(m)
                if b is not None:
                    cand.extend((c, n) for n in b[c])
        for n in self.reserved:
            c = len(self.free[n])
            if c >= g and (model is None or self.model[n] == model):
                cand.append((c, n))
        if len(cand) < k:
            return None
        cand.sort()
        return [n for _, n in cand[:k]]


#: A victim candidate on one node: ``(order, run, gpus of the run on that node)``.
#: ``order = (allocated GPUs, unallocated GPUs, -ref_us, job_id, attempt)`` of the
#: whole run (:func:`order_key`; ref = the later of start and last checkpoint). It sorts exactly as the
#: cost (allocated GPUs, unallocated GPUs, GPU-s of work lost at ``now``, job_id,
#: attempt): for equal GPU counts the work lost ``gpus * (now - ref) / 1e6`` is
#: strictly decreasing in ref (integer µs products below 2**53 divided by 1e6 stay
#: distinct as floats while they are below ~4.5e9 GPU-s), and it does not depend on
#: ``now``, so an index of candidates can live across cycles. The work lost is
#: computed from it where a plan is costed (:func:`_lost`).
Cand = tuple[tuple[int, int, int, str, int], Run, tuple[int, ...]]


def order_key(run: Run) -> tuple[int, int, int, str, int]:
    """Victim cost order of one run (DESIGN section 3), independent of the time of asking.

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


_order_key = order_key  # (the old private name, used by tests)


def _lost(order: tuple[int, int, int, str, int], now: Micros) -> float:
    """GPU-seconds of work lost at ``now`` by preempting the run with this order key
    (= :func:`~apportion.domain.cluster.work_lost_gpu_s` of the run, for ``now >= ref``)."""
    return (order[0] + order[1]) * (now + order[2]) / 1e6


_UNTIL = itemgetter(0)


class VictimIndex:
    """Preemption candidates kept across cycles, updated from the runs that changed.

    A pure function of ``cluster.runs`` (non-stopping runs only), independent of
    the cycle time:

    * ``unalloc[node]``: the unallocated runs with an open replica there, as
      :data:`Cand` sorted by order key (cheapest first); nodes without any
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
        self.unalloc: dict[str, list[Cand]] = {}
        self.alloc: dict[str, list[tuple[Micros, RunKey, Run]]] = {}
        self._indexed: dict[RunKey, Run] = {}
        self._cluster: Any = None

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
                ent = (run.protected_until_us, run.key, run)
                if lst is None:
                    alloc[run.budget] = [ent]  # type: ignore[list-item]
                else:
                    lst.append(ent)  # type: ignore[arg-type]
                continue
            order = _order_key(run)
            placements = run.placements
            for r in run.open_replicas:
                p = placements[r]
                lst2 = unalloc.get(p.node_id)
                if lst2 is None:
                    unalloc[p.node_id] = [(order, run, p.gpus)]
                else:
                    lst2.append((order, run, p.gpus))
        for lst2 in unalloc.values():
            lst2.sort(key=_first)
        for lst in alloc.values():
            lst.sort(key=_until_key)
        return idx

    def sync(self, cluster: Any) -> VictimIndex:
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
            ent = (run.protected_until_us, run.key, run)
            if lst is None:
                self.alloc[run.budget] = [ent]  # type: ignore[list-item]
            else:
                insort(lst, ent, key=_until_key)  # type: ignore[arg-type]
            return
        order = _order_key(run)
        for r in run.open_replicas:
            p = run.placements[r]
            lst2 = self.unalloc.get(p.node_id)
            if lst2 is None:
                self.unalloc[p.node_id] = [(order, run, p.gpus)]
            else:
                insort(lst2, (order, run, p.gpus), key=_first)

    def _remove(self, run: Run) -> None:
        if run.allocated:
            lst = self.alloc[run.budget]
            key = (run.protected_until_us, run.key)
            i = bisect_left(lst, key, key=_until_key)
            del lst[i]
            if not lst:
                del self.alloc[run.budget]
            return
        order = _order_key(run)
        for r in run.open_replicas:
            nid = run.placements[r].node_id
            lst2 = self.unalloc[nid]
            i = bisect_left(lst2, order, key=_first)
            del lst2[i]
            if not lst2:
                del self.unalloc[nid]

    def as_lists(self) -> tuple[dict[str, list[tuple]], dict[str, list[tuple]]]:
        """``(unalloc, alloc)`` with runs as keys, sorted by node / leaf (for tests)."""
        u = {n: [(c, r.key, g) for c, r, g in lst] for n, lst in sorted(self.unalloc.items())}
        a = {b: [(t, k) for t, k, _ in lst] for b, lst in sorted(self.alloc.items())}
        return u, a


def _until_key(x: tuple) -> Any:
    return (x[0], x[1])


class _Victims:
    """Preemption candidates of one cycle, indexed by node.

    ``unalloc[node]`` and ``expired_on(leaf)[node]`` hold :data:`Cand` entries
    sorted cheapest first. Built from a :class:`VictimIndex` (kept across
    cycles by the caller, ``CycleSnapshot.victims``) or, without one, from
    the snapshot's runs.
    """

    __slots__ = (
        "unalloc",
        "expired",
        "taken",
        "behind",
        "under",
        "u_opts",
        "u_seen",
        "narrowed",
        "_now",
        "_exp_runs",
    )

    def __init__(self, cluster: ClusterSnapshot, now: Micros, index: VictimIndex | None = None) -> None:
        if index is None:
            index = VictimIndex.build(cluster.runs)
        self.unalloc: dict[str, list[Cand]] = index.unalloc  # read only
        self.taken: set[RunKey] = set()
        # leaf -> (epoch, pairs allowed at charge 0, {charge: (behind_of's answer)})
        self.behind: dict[str, tuple[int, list[tuple[str, str, str, list[str]]], dict[float, Any]]] = {}
        self.under: dict[str, list[str]] | None = None
        self.u_opts: dict[tuple[int, str | None], dict[str, tuple]] = {}
        self.u_seen: dict[tuple[int, str | None], int] = {}  # position in the free index's log
        self.narrowed = False  # set by _plan: its last search depended on the job's charge
        self._now = now
        exp: dict[str, list[tuple[Micros, RunKey, Run]]] = {}
        for leaf, lst in index.alloc.items():
            if lst[0][0] <= now:  # protection expired: now >= protected_until_us
                exp[leaf] = lst[: bisect_right(lst, now, key=_UNTIL)]
        self._exp_runs = exp
        self.expired: dict[str, dict[str, list[Cand]]] = {v: {} for v in exp}  # filled by expired_on

    def expired_on(self, leaf: str) -> dict[str, list[Cand]]:
        """Node -> expired runs of ``leaf`` there, cheapest first (built on first use)."""
        by_node = self.expired[leaf]
        ents = self._exp_runs.get(leaf)
        if ents:
            for _, _, run in ents:
                order = _order_key(run)
                for r in run.open_replicas:
                    p = run.placements[r]
                    by_node.setdefault(p.node_id, []).append((order, run, p.gpus))
            for lst in by_node.values():
                lst.sort(key=_first)
            self._exp_runs[leaf] = []
        return by_node

    def behind_of(
        self,
        leaf: str,
        view: ShareView,
        delta: float,
        epoch: int,
        tree: BudgetTree | None = None,
        charge_gpu_s: float = 0.0,
        moves: frozenset[Move] | set[Move] = frozenset(),
    ) -> tuple[dict[str, tuple[str, float, float, float]], bool]:
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
        Recomputed when ``epoch`` (the cycle's charge count; ``moves`` only
        grow with a charge) or the charge moved on.
        """
        hit = self.behind.get(leaf)
        if hit is None or hit[0] != epoch:
            hit = self.behind[leaf] = (epoch, self._behind_at_zero(leaf, view, delta, tree, moves), {})
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
        self, leaf: str, view: ShareView, delta: float, tree: BudgetTree | None, moves: frozenset[Move] | set[Move]
    ) -> list[tuple[str, str, str, list[str]]]:
        """``(lca, victim branch, preemptor branch, leaves with expired runs under the victim branch)``
        that :func:`branch_rule` allows with no charge (see :meth:`behind_of`)."""
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
        for a in ancestors_of(leaf):
            par = parent_of(a)
            bar = None
            for sib in tree.children(par):
                if sib == a:
                    continue
                vs = under.get(sib)
                if not vs:
                    continue
                if bar is None:
                    bar = ratio(a) + delta
                if ratio(sib) < bar:
                    continue  # not behind by delta: branch_rule would refuse (a filter, not the rule)
                if branch_rule(par, sib, a, view, delta, 0.0, moves)[0] == RULE_EXPIRED_BEHIND:
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


def _first(x: tuple) -> Any:
    return x[0]


def _boundary(jobs: Sequence[PendingJob]) -> int:
    """Index of the first unallocated job (lists hold allocated jobs first)."""
    return bisect_left(jobs, True, key=_is_unallocated)


def _is_unallocated(j: PendingJob) -> bool:
    return j.min_runtime_s <= 0


def pending_order(j: PendingJob) -> tuple[bool, int, str]:
    """Sort key of a leaf's pending list: allocated jobs first, each class by (submitted_at, job_id)."""
    return (j.min_runtime_s <= 0, j.submitted_at_us, j.job_id)


def run_cycle(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig | None = None) -> CycleResult:
    """:func:`schedule` with the cycle's reservation and counters (for audits, tests, benchmarks).

    Two passes over the fair-share order: first the allocated jobs (free GPUs,
    else preemption, provisional charge, reservation), then the unallocated
    jobs on whatever is still free, in the budget order the first pass left
    (they are not charged, so that order no longer changes). A GPU that an
    allocated job can use in this cycle is not idle, so an unallocated job
    placed there would only be preempted in the next cycle: in the Philly
    replay this ordering removes that churn (docs/simulation.md).
    """
    cfg = config or EngineConfig()
    res = CycleResult()
    tree = snapshot.tree
    pending = {leaf: jobs for leaf, jobs in snapshot.pending.items() if jobs and tree.is_leaf(leaf)}
    if not pending:
        return res
    cluster = snapshot.cluster
    ts = from_us(now_us)
    reservation_after_us = s_to_us(cfg.reservation_after_s)
    bound = {leaf: _boundary(jobs) for leaf, jobs in pending.items()}
    queue: FairShareQueue[int] = FairShareQueue(
        tree, snapshot.occupancy, snapshot.capacity_gpu_s, {leaf: range(b) for leaf, b in bound.items() if b}
    )
    budget_rank = {leaf: i for i, leaf in enumerate(queue.initial_order)}
    free = _Free(cluster, snapshot.free)
    if len(free.buckets) > 1:
        free.prefer = spare_models(list(free.buckets), pending)
    victims: _Victims | None = None
    out = res.events
    free_fail: dict[str | None, list[tuple[int, int]]] = {}
    # leaf -> (shapes failed for any charge, charges at record time, own charges at record time,
    #          (g, k, charge) failed for charges of at least that much)
    pre_fail: dict[str, tuple[list[tuple[int, int]], int, int, list[tuple[int, int, float]]]] = {}
    moves: set[Move] = set()  # this cycle's preemptions of allocated work (no same-cycle reversal)
    hold_fit: Micros = 0  # earliest_fit_us of this cycle's reservation when its nodes have free GPUs
    hold_leaf, hold_charge = "", 0.0  # the reservation holder's leaf and provisional charge
    min_rt: dict[str, float] = {}  # leaf -> smallest min_runtime_s of its allocated jobs (while hold_fit)

    def may_backfill(leaf: str, g: int, model: str | None) -> bool:
        """Some job of ``leaf`` of at least ``g`` GPUs might still backfill the reservation: a reserved
        node fits ``g`` and the leaf's shortest minimum runtime (a lower bound of any protection)
        ends by the holder's fit time."""
        if not hold_fit or not free.reserved_fits(g, model):
            return False
        m = min_rt.get(leaf)
        if m is None:
            m = min_rt[leaf] = min(map(_MIN_RT, islice(pending[leaf], 0, bound[leaf])), default=0.0)
        return backfill_rule(True, s_to_us(m), now_us, hold_fit)

    charges = 0
    own_charges: dict[str, int] = {}
    floors: dict[tuple[str, int], tuple[int, int]] = {}
    reserved_for: str | None = None
    memo = snapshot.memo
    rank = -1
    ratio = queue.ratio

    def pre_failed(leaf: str, g: int, k: int, charge: float | None = None) -> bool:
        """Known to fail: a search of a shape <= (g, k) failed for any charge, or (with ``charge``)
        for a charge <= this one (the after-move test only gets stricter as the charge grows)."""
        ent = pre_fail.get(leaf)
        if ent is None:
            return False
        shapes, c0, o0, charged = ent
        if charges - c0 != own_charges.get(leaf, 0) - o0:
            del pre_fail[leaf]  # another leaf was charged since: stale
            return False
        if _dominated(shapes, g, k):
            return True
        if charge is None or not charged:
            return False
        for fg, fk, fc in charged:
            if fg <= g and fk <= k and fc <= charge:
                return True
        return False

    def record_pre_fail(leaf: str, g: int, k: int, charge: float | None = None) -> None:
        """Remember a failed search; ``charge``: it failed only for charges of at least this much."""
        ent = pre_fail.get(leaf)
        if ent is None or charges - ent[1] != own_charges.get(leaf, 0) - ent[2]:
            ent = pre_fail[leaf] = ([], charges, own_charges.get(leaf, 0), [])
        if charge is None:
            ent[0].append((g, k))
        else:
            ent[3].append((g, k, charge))

    def floor_shape(leaf: str, lo: int, hi: int) -> tuple[int, int]:
        """Smallest g and smallest k in pending[leaf][lo:hi]: a lower bound of any job left there."""
        key = (leaf, lo)
        f = floors.get(key)
        if f is None:
            f = floors[key] = segment_floor(memo, pending[leaf], lo, hi)
        return f

    def blocked_shape(leaf: str) -> Callable[[int, int, str | None], bool]:
        """Whether a job of ``leaf`` with shape (g, k, model), taken now, would be blocked with no effect.

        Pass 1 for such a job: the free GPUs are known not to fit it
        (``free_fail``), its preemption search is known to fail
        (``pre_failed``, not stale), no reservation is left to take, and it
        does not end the leaf (``drop``). It then changes nothing but
        ``rank``. A stale entry is dropped, as the job itself would drop it.
        """
        ent = pre_fail.get(leaf)
        drop = (
            ent is not None
            and charges - ent[1] == own_charges.get(leaf, 0) - ent[2]
            and ((1, 1) in ent[0] or _dominated(ent[0], *floor_shape(leaf, 0, bound[leaf])))
        )

        def blocked(g: int, k: int, model: str | None) -> bool:
            if may_backfill(leaf, g, model):
                return False  # it may backfill the reservation's free GPUs (depending on its protection)
            ff = free_fail.get(model)
            if not ((ff and _dominated(ff, g, k)) or (model is not None and _dominated(free_fail.get(None, ()), g, k))):  # type: ignore[arg-type]
                return False
            if model is None:
                return not drop and leaf in pre_fail and pre_failed(leaf, g, k)
            mkey = leaf + "\x00" + model
            return (mkey in pre_fail and pre_failed(mkey, g, k)) or (leaf in pre_fail and pre_failed(leaf, g, k))

        return blocked

    # ---------------------------------------------------------------- pass 1: allocated jobs
    while True:
        item = queue.pop()
        if item is None:
            break
        leaf, idx = item
        job = pending[leaf][idx]
        rank += 1
        res.considered += 1
        g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
        nodes: list[str] | None = None
        ff = free_fail.get(model)
        if not ((ff and _dominated(ff, g, k)) or (model is not None and _dominated(free_fail.get(None, ()), g, k))):  # type: ignore[arg-type]
            nodes = free.fit(g, k, model)
            if nodes is None:
                if ff is None:
                    free_fail[model] = [(g, k)]
                else:
                    ff.append((g, k))
        if (
            nodes is None
            and hold_fit
            and now_us + s_to_us(job.min_runtime_s) <= hold_fit  # protection >= min_runtime: else no chance
            and free.reserved_fits(g, model)
        ):
            # backfill the waiting reservation's free GPUs (DESIGN section 3: a reservation never idles GPUs)
            prot = protection_s(job.min_runtime_s, job.preemptions, tree.max_min_runtime_s(job.budget), cfg.window_s)
            br = _branches(leaf, hold_leaf)
            may = br is not None and (
                branch_rule(br[0], br[1], br[2], queue, cfg.delta, hold_charge, moves)[0] == RULE_EXPIRED_BEHIND
            )
            if backfill_rule(True, s_to_us(prot), now_us, hold_fit, may):
                nodes = free.fit_with_reserved(g, k, model)
                if nodes is not None and not free.reserved_free():
                    hold_fit = 0  # the reservation's GPUs are all lent: nothing more to backfill
        holds_reservation = reserved_for is None and now_us - job.queued_at_us >= reservation_after_us
        mkey = leaf if model is None else leaf + "\x00" + model
        charge = charge_of(g, k, job.min_runtime_s, cfg.window_s)
        if nodes is not None:
            placements = tuple(Placement(node_id=n, gpus=free.take(n, g)) for n in nodes)
            _emit_placed(
                out, job, placements, (), leaf, rank, budget_rank, ratio(leaf), holds_reservation, ts, cfg, tree
            )
            out.extend(start_events(job.job_id, job.attempt, placements, ts, job.duration_s, job.command, cfg.producer))
        elif (
            cfg.preemption
            and not (mkey in pre_fail and pre_failed(mkey, g, k, charge))
            and (model is None or not (leaf in pre_fail and pre_failed(leaf, g, k, charge)))
        ):
            if victims is None:
                victims = _Victims(cluster, now_us, snapshot.victims)
            res.searches += 1
            plan = _plan(job, leaf, free, victims, now_us, queue, cfg.delta, charges, tree, charge, moves)
            if plan is None:
                record_pre_fail(mkey, g, k, charge if victims.narrowed else None)
            else:
                placements, chosen = plan
                vics = []
                for run, vic in chosen:
                    victims.taken.add(run.key)
                    if vic.rule == RULE_EXPIRED_BEHIND:
                        br = _branches(run.budget, leaf)
                        if br is not None:
                            moves.add(br)
                    out.extend(
                        preempt_events(
                            run, ts, cfg.grace_s, cfg.producer, victim=vic, by_job_id=job.job_id, by_budget=leaf
                        )
                    )
                    vics.append(vic)
                _emit_placed(
                    out,
                    job,
                    placements,
                    tuple(vics),
                    leaf,
                    rank,
                    budget_rank,
                    ratio(leaf),
                    holds_reservation,
                    ts,
                    cfg,
                    tree,
                )
                nodes = [p.node_id for p in placements]
        elif not cfg.preemption:
            record_pre_fail(mkey, g, k)
        if nodes is not None:
            queue.charge(leaf, charge)
            charges += 1
            own_charges[leaf] = own_charges.get(leaf, 0) + 1
            continue
        # blocked
        if holds_reservation:
            reserved_for = job.job_id
            unalloc_gpus: dict[str, int] | None = None
            if victims is not None:
                taken = victims.taken
                unalloc_gpus = {
                    n: sum(len(x[2]) for x in lst if x[1].key not in taken) for n, lst in victims.unalloc.items()
                }
            chosen_nodes = _reservation_nodes(free, g, k, model, unalloc_gpus)
            for n in chosen_nodes:
                free.reserve(n)
            res.reservation = (job.job_id, tuple(chosen_nodes))
            if free.reserved_free():
                hold_fit = earliest_fit_us(cluster, chosen_nodes, g, now_us, victims.taken if victims else set())
                hold_leaf, hold_charge = leaf, charge
            continue  # the reservation changed free capacity: no bulk skip on its account
        if model is None:
            ent = pre_fail.get(leaf)  # pre_failed(leaf, 1, 1) or pre_failed(leaf, *floor), inlined
            if ent is not None:
                if charges - ent[1] != own_charges.get(leaf, 0) - ent[2]:
                    del pre_fail[leaf]  # another leaf was charged since: stale
                elif ((1, 1) in ent[0] or _dominated(ent[0], *floor_shape(leaf, 0, bound[leaf]))) and not may_backfill(
                    leaf, 1, None
                ):
                    queue.drop_leaf(leaf)
                    continue
        if reserved_for is not None and cfg.preemption and idx + 1 < bound[leaf]:
            # The leaf's next jobs come next (nothing was charged). Pass over those that
            # would be blocked exactly like this one, with no effect but their rank.
            jobs = pending[leaf]
            n = _blocked_run(jobs, idx + 1, bound[leaf], blocked_shape(leaf), memo_codes(memo, jobs))
            if n:
                queue.skip(leaf, n)
                rank += n
                res.considered += n
                res.passed_over += n

    # ---------------------------------------------------------------- pass 2: unallocated jobs
    rest = [leaf for leaf, b in bound.items() if b < len(pending[leaf])]
    if not rest:
        return res
    order = queue.order()  # = budget_order of the occupancy after the provisional charges
    if free.reserved and free.reserved_free():
        # unallocated work may use a waiting reservation's free GPUs: the holder's preemption
        # search evicts it the moment it can start (DESIGN section 3)
        free.unreserve_all()
        free_fail.clear()
    any_free = free_fail.get(None, [])
    if _dominated(any_free, 1, 1):
        return res  # not even one GPU was free for a 1-GPU job: no unallocated job fits
    for leaf in order:
        jobs = pending.get(leaf)
        if not jobs or bound[leaf] >= len(jobs):
            continue
        if _dominated(any_free, 1, 1):
            break  # not one GPU is left for a 1-GPU job
        r_leaf = queue.ratio(leaf)
        mg, mk = floor_shape(leaf, bound[leaf], len(jobs))
        if _dominated(any_free, mg, mk):
            continue  # nothing of this leaf fits on what is free
        end = len(jobs)
        idx = bound[leaf] - 1
        while idx + 1 < end:
            idx += 1
            job = jobs[idx]
            rank += 1
            res.considered += 1
            g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
            if _dominated(free_fail.get(model, ()), g, k) or (  # type: ignore[arg-type]
                model is not None and _dominated(any_free, g, k)
            ):
                # known not to fit, and so are the next jobs of a shape that does not fit: pass over them
                def still_blocked(
                    g2: int, k2: int, m2: str | None, ff_now: Any = free_fail, af_now: Any = any_free
                ) -> bool:
                    return _dominated(ff_now.get(m2, ()), g2, k2) or (m2 is not None and _dominated(af_now, g2, k2))

                n = _blocked_run(jobs, idx + 1, end, still_blocked, memo_codes(memo, jobs))
                idx += n
                rank += n
                res.considered += n
                res.passed_over += n
                continue
            nodes = free.fit(g, k, model)
            if nodes is None:
                free_fail.setdefault(model, []).append((g, k))
                any_free = free_fail.get(None, [])
                if model is None and _dominated(any_free, mg, mk):
                    break
                continue
            placements = tuple(Placement(node_id=n, gpus=free.take(n, g)) for n in nodes)
            _emit_placed(out, job, placements, (), leaf, rank, budget_rank, r_leaf, False, ts, cfg, tree)
            out.extend(start_events(job.job_id, job.attempt, placements, ts, job.duration_s, job.command, cfg.producer))
    return res


_SHAPE = attrgetter("gpus_per_replica", "replicas", "gpu_model")
Shape = tuple[int, int, "str | None"]

#: Process-wide interning of job shapes (g, k, model) to one-byte codes for
#: :func:`shape_codes`. Codes only encode; no decision depends on their values.
_CODE: dict[Shape, int] = {}
_SHAPE_OF: list[Shape] = []


def shape_code(g: int, k: int, model: str | None) -> int | None:
    """The one-byte code of shape ``(g, k, model)``, ``None`` once 256 shapes are interned."""
    shape = (g, k, model)
    c = _CODE.get(shape)
    if c is None:
        if len(_SHAPE_OF) >= 256:
            return None
        c = _CODE[shape] = len(_SHAPE_OF)
        _SHAPE_OF.append(shape)
    return c


def shape_codes(jobs: Sequence[PendingJob]) -> bytes | None:
    """``bytes`` with the :func:`shape_code` of each job in order, ``None`` past 256 shapes.

    Lets :func:`_blocked_run` find the next job of another shape with a
    regular-expression search in C instead of a Python loop over the jobs.
    """
    shapes = list(map(_SHAPE, jobs))
    codes = list(map(_CODE.get, shapes))
    if None in codes:
        for i, c in enumerate(codes):
            if c is None:
                c = shape_code(*shapes[i])
                if c is None:
                    return None
                codes[i] = c
    return bytes(codes)  # type: ignore[arg-type]


@lru_cache(maxsize=4096)
def _other_than(codes: frozenset[int]) -> re.Pattern[bytes]:
    """A pattern matching one byte that is none of ``codes``."""
    return re.compile(b"[^" + b"".join(b"\\x%02x" % c for c in sorted(codes)) + b"]")


def _blocked_run(
    jobs: Sequence[PendingJob],
    lo: int,
    hi: int,
    blocked: Callable[[int, int, str | None], bool],
    codes: bytes | None = None,
) -> int:
    """How many of ``jobs[lo:hi]``, from ``lo`` on, have a shape ``(g, k, model)`` for which ``blocked`` holds.

    ``blocked`` is asked once per distinct shape met (a handful per leaf).
    With ``codes`` (:func:`shape_codes` of ``jobs``) the next job of a shape
    not yet known blocked is found by a byte search (O(run) in C); without,
    by a scan that costs one tuple lookup per job.
    """
    if codes is not None:
        known: set[int] = set()
        pos = lo
        while pos < hi:
            c = codes[pos]
            if not blocked(*_SHAPE_OF[c]):
                return pos - lo
            known.add(c)
            m = _other_than(frozenset(known)).search(codes, pos + 1, hi)
            if m is None:
                return hi - lo
            pos = m.start()
        return hi - lo
    seen: dict[tuple[int, int, str | None], bool] = {}
    n = 0
    for shape in map(_SHAPE, islice(jobs, lo, hi)):
        b = seen.get(shape)
        if b is None:
            b = seen[shape] = blocked(*shape)
        if not b:
            return n
        n += 1
    return n


_G = attrgetter("gpus_per_replica")
_MIN_RT = attrgetter("min_runtime_s")
_MODEL = attrgetter("gpu_model")
_K = attrgetter("replicas")
_BIG = 1 << 30


def _floor(jobs: Sequence[PendingJob], lo: int, hi: int) -> tuple[int, int]:
    """``(min g, min k)`` over ``jobs[lo:hi]`` (``(2**30, 2**30)`` when empty).

    Scans a short prefix first and stops at a 1 x 1 job (g, k >= 1: the
    event schema validates it), else takes the minima over the whole slice.
    """
    if lo >= hi:
        return (_BIG, _BIG)
    mg = mk = _BIG
    for i in range(lo, min(hi, lo + 32)):
        j = jobs[i]
        g, k = j.gpus_per_replica, j.replicas
        if g < mg:
            mg = g
        if k < mk:
            mk = k
        if mg == 1 and mk == 1:
            return (1, 1)
    if hi > lo + 32:
        seg = jobs[lo:hi]
        return (min(map(_G, seg)), min(map(_K, seg)))
    return (mg, mk)


def _memo_entry(memo: dict[Any, Any], jobs: Sequence[PendingJob]) -> list[Any]:
    """The memo entry ``[jobs, {(lo, hi): floor}, codes or None]`` of a pending list (created empty)."""
    ent = memo.get(id(jobs))
    if ent is None or ent[0] is not jobs:
        ent = memo[id(jobs)] = [jobs, {}, None]
    return ent  # type: ignore[no-any-return]


def memo_codes(memo: dict[Any, Any] | None, jobs: Sequence[PendingJob]) -> bytes | None:
    """:func:`shape_codes` of ``jobs``, kept in ``memo`` (see ``CycleSnapshot.memo``).

    ``None`` without a memo (callers then scan the jobs) or past 256 shapes
    (kept as ``b""`` so that it is not rebuilt for the same list).
    """
    if memo is None:
        return None
    ent = _memo_entry(memo, jobs)
    c = ent[2]
    if c is None:
        c = ent[2] = shape_codes(jobs) or b""
    return c or None


def segment_floor(memo: dict[Any, Any] | None, jobs: Sequence[PendingJob], lo: int, hi: int) -> tuple[int, int]:
    """``(min g, min k)`` over ``jobs[lo:hi]`` (a lower bound of every job's shape there).

    Kept in ``memo`` when there is one (``CycleSnapshot.memo``: the dispatcher
    carries it over to the list that replaces one), from the distinct shapes
    of the list's shape codes; computed by a scan otherwise. ``(2**30,
    2**30)`` for an empty slice.
    """
    if memo is None:
        return _floor(jobs, lo, hi)
    ent = _memo_entry(memo, jobs)
    f = ent[1].get((lo, hi))
    if f is None:
        codes = memo_codes(memo, jobs)
        f = ent[1][(lo, hi)] = _floor(jobs, lo, hi) if codes is None else _floor_of_codes(codes, lo, hi)
    return f  # type: ignore[no-any-return]


def _floor_of_codes(codes: bytes, lo: int, hi: int) -> tuple[int, int]:
    """:func:`_floor` of the jobs whose :func:`shape_codes` are ``codes``: from the distinct shapes in the slice."""
    if lo >= hi:
        return (_BIG, _BIG)
    shapes = [_SHAPE_OF[c] for c in set(codes[lo:hi])]
    return (min(s[0] for s in shapes), min(s[1] for s in shapes))


def _emit_placed(
    out: list[Event],
    job: PendingJob,
    placements: tuple[Placement, ...],
    victims: tuple[Victim, ...],
    leaf: str,
    rank: int,
    budget_rank: Mapping[str, int],
    r: float,
    reservation: bool,
    ts: Any,
    cfg: EngineConfig,
    tree: BudgetTree | None = None,
) -> None:
    """Append the ``JobPlaced`` of ``job``. With ``tree`` its decision records the
    protection (:func:`protection_s` of the job's preemptions, capped by the budget's
    ``max_min_runtime`` and ``W / 4``); without (baseline policies), none: the
    protection is then the minimum runtime."""
    protection = None
    if job.min_runtime_s > 0 and tree is not None:
        protection = protection_s(job.min_runtime_s, job.preemptions, tree.max_min_runtime_s(job.budget), cfg.window_s)
    out.append(
        JobPlaced(
            event_id=det_id("JobPlaced", job.job_id, job.attempt),
            ts=ts,
            producer=cfg.producer,
            job_id=job.job_id,
            attempt=job.attempt,
            budget=job.budget,
            user=job.user,
            allocated=job.min_runtime_s > 0,
            gpus_per_replica=job.gpus_per_replica,
            replicas=job.replicas,
            min_runtime_s=job.min_runtime_s,
            placements=placements,
            submitted_at=from_us(job.submitted_at_us),
            decision=Decision(
                rank=rank,
                budget_rank=budget_rank.get(leaf, -1),
                ratio=r,
                victims=victims,
                reservation=reservation,
                policy_version=cfg.policy_version,
                protection_s=protection,
                preemptions=job.preemptions if protection is not None else None,
            ),
        )
    )


def _reservation_nodes(
    free: _Free, g: int, k: int, model: str | None, unalloc: Mapping[str, int] | None = None
) -> list[str]:
    """k eligible nodes for a blocked job: most GPUs available to it now first, ties by id.

    Available: free, plus (``unalloc``: node -> GPUs) those of unallocated
    runs, which the holder evicts as soon as it can start; so a node whose
    free GPUs the reservation lent to unallocated work in the last cycle
    ranks as it did and the reservation stays put. Eligible: not reserved,
    the model matches, at least g GPUs. Nodes with c >= 1 free GPUs that are
    not reserved are exactly ``buckets[model][c]``, so without unallocated
    runs they are walked from the most free down; nodes with no free GPU are
    looked for only when fewer than k were found.
    """
    out: list[str] = []
    count = free.count
    if unalloc:
        ffree, reserved, fmodel = free.free, free.reserved, free.model
        avail: dict[str, int] = {}
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            for c in range(1, len(b)):
                for n in b[c]:
                    if count[n] >= g:
                        avail[n] = c
        for n, u in unalloc.items():
            if n in fmodel and n not in reserved and count[n] >= g and (model is None or fmodel[n] == model):
                avail[n] = len(ffree[n]) + u
        out = [n for _, n in sorted((-a, n) for n, a in avail.items())[:k]]
        if len(out) == k:
            return out
        have = set(out)
        zero = sorted(
            n
            for n, m in fmodel.items()
            if n not in have and not ffree[n] and n not in reserved and (model is None or m == model) and count[n] >= g
        )
        out.extend(zero[: k - len(out)])
        return out
    several = model is None and len(free.buckets) > 1
    for c in range(free.maxc, 0, -1):
        cand: list[str] = []
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            cand.extend(n for n in b[c] if count[n] >= g)
        if cand:
            if several:
                cand.sort()
            out.extend(cand[: k - len(out)])
            if len(out) == k:
                return out
    ffree, reserved = free.free, free.reserved
    zero = sorted(
        n
        for n, m in free.model.items()
        if not ffree[n] and n not in reserved and (model is None or m == model) and count[n] >= g
    )
    out.extend(zero[: k - len(out)])
    return out


def _plan(
    job: PendingJob,
    leaf: str,
    free: _Free,
    victims: _Victims,
    now: Micros,
    ratio: ShareView | Callable[[str], float],
    delta: float,
    epoch: int = 0,
    tree: BudgetTree | None = None,
    charge_gpu_s: float = 0.0,
    moves: frozenset[Move] | set[Move] = frozenset(),
) -> tuple[tuple[Placement, ...], list[tuple[Run, Victim]]] | None:
    """Least-cost preemption plan for allocated ``job`` of ``leaf``, or ``None`` (DESIGN section 3).

    ``ratio`` is the cycle's :class:`ShareView` (or a plain ``path -> r``
    callable, for which a charge changes no r: the baselines). After the
    call, ``victims.narrowed`` tells whether the expired-behind candidates
    depended on the job's charge (see :meth:`_Victims.behind_of`): a failure
    then says nothing about a job with a smaller charge.

    Cost of a set: (allocated GPUs, unallocated GPUs, GPU-s of work lost),
    lexicographic. Any node that needs no allocated victim is cheaper than
    one that does, so nodes reachable with unallocated victims alone are
    tried first and the expired-behind runs are looked at only when fewer
    than k such nodes exist. Per node the cheapest victims are taken first,
    then unnecessary ones dropped (most expensive first); the k cheapest
    nodes (ties by node id) form the plan.

    Returns the placements of J (free GPUs first, then victims' GPUs) and the
    victims with their :class:`Victim` audit records; the free index is
    updated (J's GPUs taken) when a plan is returned.
    """
    view: ShareView = (
        ratio  # type: ignore[assignment]
        if type(ratio) is FairShareQueue or hasattr(ratio, "ratio_after")
        else _CallableView(ratio)  # type: ignore[arg-type]
    )
    victims.narrowed = False
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    taken = victims.taken
    fmodel, fcount, reserved, ffree = free.model, free.count, free.reserved, free.free

    def eligible(nid: str) -> bool:
        return nid in fmodel and nid not in reserved and fcount[nid] >= g and (model is None or fmodel[nid] == model)

    def evaluate(nid: str, lst: list) -> tuple | None:
        have = len(ffree[nid])
        reach = have
        for x in lst:
            reach += len(x[2])
            if reach >= g:
                break
        else:
            if reach < g:
                return None
        chosen = []
        got = have
        for x in lst:
            if got >= g:
                break
            chosen.append(x)
            got += len(x[2])
        for x in sorted(chosen, key=_first, reverse=True):
            if got - len(x[2]) >= g:
                chosen.remove(x)
                got -= len(x[2])
        a = u = 0
        lost = 0.0
        for x in chosen:
            c = x[0]
            a += c[0]
            u += c[1]
            lost += (c[0] + c[1]) * (now + c[2]) / 1e6  # _lost(c, now), inlined
        return ((a, u, lost), nid, chosen)

    u_nodes = victims.unalloc
    log = free.log
    ckey = (g, model)
    cached = victims.u_opts.get(ckey)
    todo: Any
    if cached is None:
        todo = u_nodes
        cached = victims.u_opts[ckey] = {}
    else:
        # options depend on g, the model and each node's state, not on the preemptor:
        # re-evaluate only the nodes touched (free.log) since they were last looked at
        pos = victims.u_seen[ckey]
        if pos == len(log):
            todo = ()
        else:
            touched = set(log[pos:])
            for nid in touched:
                cached.pop(nid, None)
            todo = [nid for nid in touched if nid in u_nodes]
    victims.u_seen[ckey] = len(log)
    for nid in todo:
        if not eligible(nid):  # (static in a cycle but for reservations, which are logged)
            continue
        lst = u_nodes[nid]
        if taken:
            cands = [x for x in lst if (x[1].job_id, x[1].attempt) not in taken]
        else:
            cands = lst  # evaluate() only reads it
        if cands:
            opt = evaluate(nid, cands)
            if opt is not None:
                cached[nid] = opt
    options = list(cached.values())
    for c in range(g, free.maxc + 1):
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            for nid in b[c]:
                # (u_nodes lists are never empty: with nothing taken, only nodes without them qualify)
                if nid not in u_nodes or (taken and not any(x[1].key not in taken for x in u_nodes[nid])):
                    if fcount[nid] >= g:
                        options.append(((0, 0, 0.0), nid, []))
    behind = None
    if len(options) < k:
        behind, victims.narrowed = victims.behind_of(leaf, view, delta, epoch, tree, charge_gpu_s, moves)
        if not behind:
            return None
        per_node: dict[str, list] = {}
        for v in behind:
            for nid, lst in victims.expired_on(v).items():
                if not eligible(nid):
                    continue
                bucket = per_node.get(nid)
                if bucket is None:
                    bucket = per_node[nid] = []
                bucket.extend(x for x in lst if x[1].key not in taken)
        if not per_node:
            return None
        seen = {o[1] for o in options}
        for nid, lst in per_node.items():
            if not lst:
                continue
            if nid in u_nodes:
                lst.extend(x for x in u_nodes[nid] if x[1].key not in taken)
            lst.sort(key=_first)
            opt = evaluate(nid, lst)
            if opt is not None:
                if nid in seen:
                    options = [o for o in options if o[1] != nid]
                options.append(opt)
        if len(options) < k:
            return None
    options.sort(key=lambda o: (o[0], o[1]))
    best = options[:k]
    placements = []
    picked: dict[RunKey, tuple[Run, Victim]] = {}
    for _, nid, chosen in best:
        for x in chosen:
            for p in x[1].placements:
                log.append(p.node_id)
        log.append(nid)
        gpus = list(free.take(nid, min(g, len(ffree[nid]))))
        extra = sorted(gg for x in chosen for gg in x[2])
        gpus.extend(extra[: g - len(gpus)])
        placements.append(Placement(node_id=nid, gpus=tuple(sorted(gpus))))
        for x in chosen:
            run = x[1]
            if run.key not in picked:
                verdict = victim_rule(run, leaf, now, view, delta, charge_gpu_s, moves)
                if not verdict.allowed:  # the search and the rule disagree: a bug, never a decision
                    raise AssertionError(f"victim {run.key} of {leaf}'s plan refused by victim_rule: {verdict}")
                picked[run.key] = (run, _victim(run, now, verdict))
    return tuple(placements), [picked[key] for key in sorted(picked)]


class _CallableView:
    """A :class:`ShareView` of a plain ``path -> r`` function (a charge changes nothing)."""

    __slots__ = ("ratio",)

    def __init__(self, fn: Callable[[str], float]) -> None:
        self.ratio = fn

    def ratio_after(self, path: str, gpu_s: float) -> float:
        return self.ratio(path)


def _victim(run: Run, now: Micros, verdict: VictimVerdict) -> Victim:
    until = run.protected_until_us
    return Victim(
        job_id=run.job_id,
        attempt=run.attempt,
        budget=run.budget,
        allocated=run.allocated,
        gpus=run.gpus,
        protected_until=from_us(until) if until is not None else None,
        rule=verdict.rule,
        lca=verdict.lca,
        victim_ratio=verdict.victim_ratio,
        preemptor_ratio=verdict.preemptor_ratio,
        preemptor_ratio_after=verdict.preemptor_ratio_after,
        lost_gpu_s=work_lost_gpu_s(run, now),
    )  # type: ignore[arg-type]
