"""``slurm``: Slurm's multifactor priority with Fair Tree, backfill, and QOS preemption (PreemptMode=REQUEUE).

Re-implemented from SchedMD's documentation (slurm.schedmd.com; the same pages as
``doc/html/*.shtml`` in github:SchedMD/slurm):

* ``priority_multifactor.shtml``: ``priority = PriorityWeightAge * age_factor +
  PriorityWeightFairshare * fairshare_factor + ...``; the age factor is
  ``min(1, time waiting / PriorityMaxAge)`` (PriorityMaxAge default 7 days).
  We use the age and fair-share factors only, with the weights of
  :class:`SlurmConfig` (Slurm's own defaults are 0, a site sets them).
* ``fair_tree.shtml``: Fair Tree. Per association, level fair share
  ``LF = S / U`` with ``S = Sraw_self / Sraw_self+siblings`` (our shares) and
  ``U = Uraw_self / Uraw_self+siblings`` (decayed usage); ``LF = inf`` without
  usage. Siblings are sorted by LF descending and the tree is walked depth
  first; leaves ("users"; our leaf budgets) are ranked in pre-order with
  ``rank`` counting down from the number of leaves N, and get the fair-share
  factor ``rank / N`` (the first leaf 1.0). Ties: sibling leaves with equal LF
  share a rank (the rank of the first of them; the count still goes down), a
  leaf tied with a sibling account gets the rank of that account's first leaf.
* ``priority_multifactor.shtml`` / ``slurm.conf``: usage decays with
  ``PriorityDecayHalfLife`` (default 7 days): at each pass, ``U <- U *
  2**(-dt / half_life) + new usage``; passes run every ``PriorityCalcPeriod``
  (default 5 minutes), and priorities are computed at a pass and stay until
  the next (a cycle between two passes uses the last factors).
* ``preempt.shtml``: ``PreemptType=preempt/qos``, ``PreemptMode=REQUEUE``: a
  job of a QOS that may preempt another QOS requeues that QOS's running jobs
  when it cannot start otherwise, after ``GraceTime`` (30 s here: the
  config's grace). We map min-runtime-0 (unallocated) jobs to a preemptible
  ``scavenger`` QOS with ``UsageFactor=0`` (their usage is not charged) and
  ``PreemptExemptTime`` = the job's minimum runtime, i.e. 0; allocated jobs
  are ``normal`` QOS, which preempts ``scavenger`` and is never preempted.
  Slurm has no fair-share preemption: an allocated job is never preempted,
  whatever its account's usage.
* ``sched_config.shtml``, ``slurm.conf`` ``SchedulerParameters`` and
  ``src/plugins/sched/backfill/backfill.c`` (``SchedulerType=sched/backfill``,
  the default): the QOS priority puts every ``normal`` job before every
  ``scavenger`` job; within a class jobs go in priority order. Each pass looks
  at the first ``bf_max_job_test`` (500) pending jobs in that order and gives
  each its earliest start on a map of the nodes over the next ``bf_window``
  (1440 minutes) (:class:`NodeSpace`): running jobs free their GPUs at their
  start plus their time limit, rounded up to ``bf_resolution`` (60 s); a
  ``normal`` job counts ``scavenger`` runs as gone (it may requeue them). A job
  whose earliest start is now starts; one whose start is later, within the
  window, reserves whole nodes (Slurm's reservations are whole nodes) from then
  to its start plus its limit; a lower job starts now only on nodes where it
  ends, by its limit, before any such reservation begins. A job with no start
  within the window reserves nothing.
* Time limits (``SlurmConfig.time_limit_s``): the trace has none. By default a
  job's limit is its own duration (the user's estimate is exact), the most
  favourable case for backfill: a gap is used whenever the work fits it, and a
  reservation's start is the true one. Real estimates are longer (sites set a
  partition ``DefaultTime``/``MaxTime`` and users ask for about that), which
  makes starts look later and gaps shorter, so this peer is the strongest Slurm
  the trace allows. ``time_limit_s`` set gives every job that limit (a
  partition ``DefaultTime`` of, say, 7 days); a run past its limit is expected
  to end at the next ``bf_resolution`` step and is not killed (the trace's work
  is the same under every policy). A requeued job keeps its full limit
  (it resumes from its checkpoint and ends before it).

Simplified (say so when reading the figures):

* The backfill pass runs at every cycle of the simulator (on each event, and
  every 5 minutes while jobs wait), not on Slurm's ``bf_interval`` timer (30 s);
  it also stands for the main scheduler, which starts jobs strictly by
  priority. ``bf_continue``, ``bf_max_job_user``, ``bf_min_prio_reserve`` and
  the other per-user and per-partition limits are not modelled (their defaults
  are off). ``bf_max_job_test`` counts every job the pass looks at; Slurm
  counts only those it runs its will-run test on, and skips uncounted a job for
  which the reservations leave too few nodes free over the whole window, so
  where reservations fill the window Slurm's pass reaches deeper into the queue
  than this one. Among the nodes free at a reserved start, the fewest free GPUs
  first (then node id) are reserved, as best fit.
* ``SlurmConfig(backfill_reserve=False)`` is the simplified peer of earlier
  figures (policy ``slurm-fairtree-1``): no start times, no reservations, any
  job that fits starts, so a wide gang starts only when whole nodes happen to be
  free together.
* Usage is accrued at passes from the runs present: a run that ends between
  two passes is charged up to the last pass before its end (exact while jobs
  wait, as a cycle runs at every completion; a run that ends while the queue
  is empty can lose up to the time since the last pass). Passes run at cycle
  times (the first cycle at least ``PriorityCalcPeriod`` after the last).
* Fairshare is per account (leaf budget), not per user under it; no job-size,
  partition, nice or TRES factors; the age of a requeued job counts from its
  first submission.
* Victims among the ``scavenger`` runs: the youngest first, on the nodes that
  fit needing fewest victim GPUs (:func:`apportion.sim.peers._loop.plan_victims`;
  ``PreemptParameters=youngest_first``); the simplified peer takes the engine's
  least-cost set (:func:`apportion.domain.engine.search.plan_preemption`).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice

from apportion.domain.budgets import ROOT, BudgetTree, ancestors_of
from apportion.domain.cluster import Run, RunKey
from apportion.domain.engine.cycle import CycleSnapshot
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.domain.engine.search import PreemptionRequest, plan_preemption
from apportion.domain.engine.victims import CycleVictims
from apportion.events import Event, Placement
from apportion.sim.peers._loop import (
    Cycle,
    PeerPolicy,
    Seg,
    admission_loop,
    leaf_segments,
    plan_victims,
    run_gpus,
    victim_order,
)
from apportion.timeutil import WEEK_S, Micros, s_to_us

__all__ = ["NodeSpace", "SlurmConfig", "Slurm", "fair_tree_factors", "level_fairshare"]

POLICY_VERSION = "slurm-fairtree-2"
SIMPLIFIED_POLICY_VERSION = "slurm-fairtree-1"
"""The simplified peer's (``SlurmConfig.backfill_reserve=False``): its decisions are those of the first version."""
NEVER: Micros = 1 << 62


@dataclass(frozen=True, slots=True)
class SlurmConfig:
    """slurm.conf knobs (seconds).

    Attributes:
        half_life_s: ``PriorityDecayHalfLife`` (default 7 days).
        calc_period_s: ``PriorityCalcPeriod`` (default 5 minutes).
        weight_fairshare, weight_age: ``PriorityWeightFairshare``, ``PriorityWeightAge``.
        max_age_s: ``PriorityMaxAge`` (default 7 days).
        backfill_reserve: plan start times and reserve nodes for pending jobs (``sched/backfill``);
            ``False``: the simplified peer, where any job that fits starts (policy ``slurm-fairtree-1``).
        time_limit_s: every job's time limit (a partition's ``DefaultTime`` for jobs that give none);
            ``None``: each job's own duration, i.e. perfect user estimates.
        default_time_s: the limit of a job without a duration when ``time_limit_s`` is ``None``.
        bf_window_s: ``bf_window`` (default 1440 minutes): no reservation starts later than this ahead.
        bf_max_job_test: ``bf_max_job_test`` (default 500): pending jobs looked at per backfill pass.
        bf_resolution_s: ``bf_resolution`` (default 60 s): end times are rounded up to it.
    """

    half_life_s: float = float(WEEK_S)
    calc_period_s: float = 300.0
    weight_fairshare: float = 10000.0
    weight_age: float = 1000.0
    max_age_s: float = float(WEEK_S)
    backfill_reserve: bool = True
    time_limit_s: float | None = None
    default_time_s: float = float(WEEK_S)
    bf_window_s: float = 86400.0
    bf_max_job_test: int = 500
    bf_resolution_s: float = 60.0

    def __post_init__(self) -> None:
        if self.bf_max_job_test < 1 or self.bf_window_s <= 0 or self.bf_resolution_s <= 0:
            raise ValueError("bf_max_job_test must be >= 1, bf_window_s and bf_resolution_s > 0")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0 or None, not {self.time_limit_s}")

    def limit_s(self, job: PendingJob) -> float:
        """A job's time limit: ``time_limit_s`` when set, else its own duration (``default_time_s`` without one)."""
        if self.time_limit_s is not None:
            return self.time_limit_s
        return job.duration_s if job.duration_s is not None else self.default_time_s


def level_fairshare(s: float, u: float) -> float:
    """Fair Tree's level fair share ``LF = S / U`` (fair_tree.shtml), with its edge cases.

    ``S``, ``U``: normalised shares and usage among siblings, in [0, 1].
    ``U == 0``: ``inf`` (no usage); ``S == 0 < U``: 0.

    >>> level_fairshare(0.5, 0.25), level_fairshare(0.5, 0.0), level_fairshare(0.0, 0.5)
    (2.0, inf, 0.0)
    """
    if u <= 0.0:
        return math.inf
    return s / u


def fair_tree_factors(tree: BudgetTree, usage: dict[str, float]) -> dict[str, float]:
    """Fair Tree fair-share factor of every leaf budget (fair_tree.shtml, "Algorithm" and "Ties").

    Args:
        tree: the budget tree (accounts = inner budgets, users = leaves; shares
            relative to the parent are Slurm's raw shares).
        usage: leaf -> decayed usage (any unit; only ratios matter).

    Returns:
        leaf -> ``rank / N`` in (0, 1]: the depth-first pre-order rank of the
        leaf when siblings are sorted by :func:`level_fairshare` descending
        (ties by path), ranks counting down from N, tied leaves sharing the rank
        of the first of them, tied sibling accounts' children merged.
    """
    leaves = tree.leaves()
    n = len(leaves)
    sub: dict[str, float] = {}
    for leaf in leaves:
        for a in ancestors_of(leaf):
            sub[a] = sub.get(a, 0.0) + usage.get(leaf, 0.0)
    out: dict[str, float] = {}
    if n:
        _visit(tree, sub, [ROOT], False, out, [n, n], n)
    return out


def _visit(
    tree: BudgetTree,
    sub: dict[str, float],
    parents: list[str],
    account_tied: bool,
    out: dict[str, float],
    rank: list[int],
    n: int,
) -> None:
    """One step of :func:`fair_tree_factors`' depth-first walk: the children of ``parents`` (tied sibling
    accounts, merged before descending), sorted by LF descending; ``rank`` = [rank, rank of the current ties]."""
    kids: list[tuple[float, str]] = []
    for p in parents:
        cs = tree.children(p)
        s_tot = sum(tree.share(c) for c in cs)
        u_tot = sum(sub.get(c, 0.0) for c in cs)
        kids.extend(
            (level_fairshare(tree.share(c) / s_tot if s_tot > 0 else 0.0, sub.get(c, 0.0) / u_tot if u_tot else 0.0), c)
            for c in cs
        )
    kids.sort(key=lambda x: (-x[0], x[1]))
    prev: float | None = None
    i = 0
    while i < len(kids):
        lf, c = kids[i]
        tied = account_tied if i == 0 else lf == prev
        prev = lf
        if tree.is_leaf(c):
            if not tied:
                rank[1] = rank[0]
            out[c] = rank[1] / n
            rank[0] -= 1
            i += 1
            continue
        group = [c]
        while i + 1 < len(kids) and kids[i + 1][0] == lf and not tree.is_leaf(kids[i + 1][1]):
            i += 1
            group.append(kids[i][1])
        _visit(tree, sub, group, tied, out, rank, n)
        i += 1


class NodeSpace:
    """One backfill pass's map of when each node can take what (``backfill.c``'s ``node_space`` with the select
    plugin's will-run view of the running jobs, ``select/cons_tres/job_test.c``).

    A running job frees its GPUs at its expected end: its start plus its time limit, rounded up to
    ``bf_resolution``; a job already past it, at the next step (Slurm: "now + 1", rounded). A stopping job frees
    them after the grace period. A ``normal`` job sees the ``scavenger`` runs' GPUs as free now ("test with all
    preemptable jobs gone"). Jobs started in the pass hold their GPUs only; a reservation for a pending job, and
    the nodes of the runs a job preempts, are whole nodes over ``[start, end)`` (``slurm.conf``: "the backfill
    scheduler reserves whole nodes for jobs, not partial nodes"; "the whole nodes for those preempted jobs are
    reserved for the preemptor job").
    """

    def __init__(
        self, cyc: Cycle, now_us: Micros, end_of: Callable[[Run], Micros], resolution_us: int, grace_us: int
    ) -> None:
        self.cyc = cyc
        self.now = now_us
        self.res = resolution_us
        free = cyc.free
        self.ends: dict[str, list[tuple[Micros, int, bool, RunKey]]] = {n: [] for n in free.model}
        self.extra: dict[str, int] = {}
        self.resv: dict[str, list[tuple[Micros, Micros]]] = {}
        self._prof: dict[tuple[str, bool], tuple[int, list[Micros], list[int]]] = {}
        self._tau: dict[str, dict[tuple[int, bool], Micros | None]] = {}
        self._eligible: dict[tuple[int, str | None], list[str]] = {}
        runs = cyc.snapshot.cluster.runs
        for key in sorted(runs):
            run = runs[key]
            if run.stopping:
                end, scav = self.round_up(now_us + grace_us), False
            else:
                end, scav = self.round_up(max(end_of(run), now_us + 1)), not run.allocated
            for r in run.open_replicas:
                p = run.placements[r]
                if p.node_id in self.ends:
                    self.ends[p.node_id].append((end, len(p.gpus), scav, key))

    def round_up(self, t: Micros) -> Micros:
        """``t`` rounded up to a multiple of the resolution."""
        return -(-t // self.res) * self.res

    def _profile(self, nid: str, preemptor: bool) -> tuple[int, list[Micros], list[int]]:
        """(GPUs free now, release times ascending, GPUs freed by each time cumulated) of a node."""
        got = self._prof.get((nid, preemptor))
        if got is None:
            base = len(self.cyc.free.free[nid]) + self.extra.get(nid, 0)
            ts: list[Micros] = []
            cs: list[int] = []
            acc = 0
            for t, gpus, scav, _ in sorted(self.ends[nid]):
                if preemptor and scav:
                    base += gpus
                    continue
                acc += gpus
                ts.append(t)
                cs.append(acc)
            got = (base, ts, cs)
            self._prof[nid, preemptor] = got
        return got

    def gpus_at(self, nid: str, preemptor: bool, t: Micros) -> int:
        """GPUs of a node free at ``t`` (reservations aside)."""
        base, ts, cs = self._profile(nid, preemptor)
        i = bisect_right(ts, t)
        return base + (cs[i - 1] if i else 0)

    def free_from(self, nid: str, g: int, preemptor: bool) -> Micros | None:
        """When a node first has ``g`` GPUs free (reservations aside; they stay free once free), or ``None``."""
        memo = self._tau.setdefault(nid, {})
        key = (g, preemptor)
        if key in memo:
            return memo[key]
        base, ts, cs = self._profile(nid, preemptor)
        if base >= g:
            got: Micros | None = self.now
        else:
            i = bisect_left(cs, g - base)
            got = ts[i] if i < len(cs) else None
        memo[key] = got
        return got

    def _first(self, nid: str, cur: Micros, limit_us: Micros, stop: Micros) -> Micros | None:
        """The first start ``>= cur`` on a node whose ``[start, start + limit)`` meets no reservation, or ``None``
        past ``stop`` (reservations sorted by start: once one starts late enough, so do the rest)."""
        for s, e in self.resv.get(nid, ()):
            if e <= cur:
                continue
            if s - limit_us >= cur:
                return cur
            cur = e
            if cur > stop:
                return None
        return cur if cur <= stop else None

    def eligible(self, g: int, model: str | None) -> list[str]:
        """Nodes that could ever hold a replica of g GPUs of ``model`` (ready, unreserved, enough GPUs)."""
        key = (g, model)
        got = self._eligible.get(key)
        if got is None:
            free = self.cyc.free
            got = sorted(
                n
                for n in free.model
                if n not in free.reserved and free.count[n] >= g and (model is None or free.model[n] == model)
            )
            self._eligible[key] = got
        return got

    def earliest(
        self, g: int, k: int, limit_us: Micros, model: str | None, preemptor: bool, horizon: Micros
    ) -> tuple[Micros, list[str]] | None:
        """The earliest start ``t <= horizon`` at which k nodes each have g GPUs free and no reservation over
        ``[t, t + limit)``, with every node that has at ``t``; ``None`` when there is none within the horizon."""
        if k == 1:
            best: Micros | None = None
            found: list[str] = []
            for nid in self.eligible(g, model):
                stop = horizon if best is None else best
                cur = self.free_from(nid, g, preemptor)
                if cur is None or cur > stop:
                    continue
                t = self._first(nid, cur, limit_us, stop)
                if t is None:
                    continue
                if best is None or t < best:
                    best, found = t, [nid]
                else:
                    found.append(nid)
            return None if best is None else (best, found)
        events: list[tuple[Micros, int, str]] = []
        for nid in self.eligible(g, model):
            cur = self.free_from(nid, g, preemptor)
            if cur is None or cur > horizon:
                continue
            for s, e in self.resv.get(nid, ()):
                if e <= cur:
                    continue
                if s - limit_us >= cur:
                    events.append((cur, 0, nid))
                    events.append((s - limit_us, 1, nid))
                cur = e
                if cur > horizon:
                    break
            if cur <= horizon:
                events.append((cur, 0, nid))
        events.sort()
        active: set[str] = set()
        for i, (t, kind, nid) in enumerate(events):
            if kind:
                active.discard(nid)
                continue
            active.add(nid)
            if len(active) >= k:
                for t2, kind2, n2 in events[i + 1 :]:
                    if t2 != t or kind2:
                        break
                    active.add(n2)
                return t, sorted(active)
        return None

    def reserve(self, nodes: Iterator[str] | list[str] | set[str], start: Micros, end: Micros) -> None:
        """Reserve whole nodes over ``[start, end)``."""
        for nid in nodes:
            insort(self.resv.setdefault(nid, []), (start, end))

    def started(self, nodes: list[str], g: int, end: Micros, key: RunKey) -> None:
        """A job started on free GPUs of ``nodes``, g each, until ``end``."""
        for nid in nodes:
            self.ends[nid].append((end, g, False, key))
            self._touch(nid)

    def preempted(
        self,
        victims: list[Run],
        placements: tuple[Placement, ...],
        g: int,
        end: Micros,
        key: RunKey,
        free_before: dict[str, int],
    ) -> None:
        """A job placed over ``victims``: their GPUs are the preemptor's or free once they stop, and every node
        they or the preemptor hold is reserved whole until the preemptor's end."""
        nodes: set[str] = set()
        for v in victims:
            for r in v.open_replicas:
                p = v.placements[r]
                nid = p.node_id
                if nid not in self.ends:
                    continue
                self.ends[nid] = [x for x in self.ends[nid] if x[3] != v.key]
                self.extra[nid] = self.extra.get(nid, 0) + len(p.gpus)
                nodes.add(nid)
        for p in placements:
            nid = p.node_id
            taken = free_before[nid] - len(self.cyc.free.free[nid])
            self.extra[nid] = self.extra.get(nid, 0) - (g - taken)
            self.ends[nid].append((end, g, False, key))
            nodes.add(nid)
        for nid in nodes:
            self._touch(nid)
        self.reserve(sorted(nodes), self.now, end)

    def _touch(self, nid: str) -> None:
        self._prof.pop((nid, False), None)
        self._prof.pop((nid, True), None)
        self._tau.pop(nid, None)


class Slurm(PeerPolicy):
    """The ``slurm`` cycle (module docstring); keeps decayed usage per leaf across cycles."""

    name = "slurm"

    def __init__(self, config: SlurmConfig | None = None) -> None:
        super().__init__()
        self.config = config or SlurmConfig()
        self.reset()

    def reset(self) -> None:
        """Forget usage (a new simulation)."""
        self.usage: dict[str, float] = {}
        self.factors: dict[str, float] = {}
        self.last_pass_us: Micros | None = None
        self._accounted: dict[RunKey, Micros] = {}
        self._limits: dict[RunKey, Micros] = {}

    def decay_pass(self, snapshot: CycleSnapshot, now_us: Micros) -> None:
        """A ``PriorityCalcPeriod`` pass at ``now_us``: decay, charge the allocated runs' GPU-seconds since
        the last pass (``scavenger`` QOS: UsageFactor 0), recompute the Fair Tree factors."""
        cfg = self.config
        if self.last_pass_us is not None:
            f = 0.5 ** ((now_us - self.last_pass_us) / 1e6 / cfg.half_life_s)
            self.usage = {leaf: u * f for leaf, u in self.usage.items()}
        seen: dict[RunKey, Micros] = {}
        for key, run in snapshot.cluster.runs.items():
            if run.stopping or not run.allocated:
                continue
            start = run.started_at_us if run.started_at_us is not None else run.placed_at_us
            since = max(self._accounted.get(key, start), start)
            if now_us > since:
                self.usage[run.budget] = self.usage.get(run.budget, 0.0) + run_gpus(run) * (now_us - since) / 1e6
            seen[key] = max(now_us, since)
        self._accounted = seen
        self.factors = fair_tree_factors(snapshot.tree, self.usage)
        self.last_pass_us = now_us

    def priority(self, job: PendingJob, now_us: Micros) -> float:
        """Multifactor priority of a pending job: ``Wfs * F(leaf) + Wage * min(1, age / PriorityMaxAge)``."""
        cfg = self.config
        age = min(1.0, max(0.0, (now_us - job.submitted_at_us) / 1e6 / cfg.max_age_s))
        return cfg.weight_fairshare * self.factors.get(job.budget, 0.0) + cfg.weight_age * age

    def key(self, s: Seg, job: PendingJob, now_us: Micros) -> tuple[int, float, int, str]:
        """Scheduling order: ``normal`` QOS first, then priority descending, then submission, then job id."""
        return (0 if s.preempt else 1, -self.priority(job, now_us), job.submitted_at_us, job.job_id)

    def cycle(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """Pass if due, then the backfill pass (:meth:`backfill`), or the simplified one without reservations."""
        if self.last_pass_us is None or now_us >= self.last_pass_us + s_to_us(self.config.calc_period_s):
            self.decay_pass(snapshot, now_us)
        if self.config.backfill_reserve:
            return self.backfill(snapshot, now_us, config)
        return self.simplified(snapshot, now_us, config)

    def by_priority(self, segs: list[Seg], now_us: Micros) -> Iterator[tuple[Seg, PendingJob]]:
        """The pending jobs of ``segs`` in :meth:`key` order (each segment is in that order already)."""

        def walk(s: Seg) -> Iterator[tuple[tuple[int, float, int, str], Seg, PendingJob]]:
            for i in range(s.lo, s.hi):
                job = s.jobs[i]
                yield self.key(s, job, now_us), s, job

        for _, s, job in heapq.merge(*(walk(s) for s in segs), key=lambda x: x[0]):
            yield s, job

    def backfill(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """``sched/backfill``: the first ``bf_max_job_test`` pending jobs by priority, each given its earliest
        start on the :class:`NodeSpace`; a job whose start is now starts (a ``normal`` one requeueing
        ``scavenger`` runs if it must), one whose start is within ``bf_window`` reserves whole nodes from then
        until its time limit ends, and lower jobs start only where they do not overlap those reservations."""
        cfg = self.config
        cyc = Cycle(snapshot, now_us, config, POLICY_VERSION)
        runs = snapshot.cluster.runs
        self._limits = {key: lim for key, lim in self._limits.items() if key in runs}
        limits = self._limits
        unknown = s_to_us(cfg.time_limit_s if cfg.time_limit_s is not None else cfg.default_time_s)

        def end_of(run: Run) -> Micros:
            start = run.started_at_us if run.started_at_us is not None else run.placed_at_us
            return start + limits.get(run.key, unknown)

        ns = NodeSpace(cyc, now_us, end_of, s_to_us(cfg.bf_resolution_s), s_to_us(cyc.cfg.grace_s))
        horizon = now_us + s_to_us(cfg.bf_window_s)
        alloc, unalloc = leaf_segments(snapshot, split=True)
        beyond: dict[tuple[int, int, str | None, bool], Micros] = {}
        for _, job in islice(self.by_priority(alloc + unalloc, now_us), cfg.bf_max_job_test):
            cyc.considered += 1
            lim = s_to_us(cfg.limit_s(job))
            g, k, pre = job.gpus_per_replica, job.replicas, job.allocated
            shape = (g, k, job.gpu_model, pre)
            if lim >= beyond.get(shape, NEVER):
                continue  # a shorter job of its shape found no start within the window: nor will it
            got = ns.earliest(g, k, lim, job.gpu_model, pre, horizon)
            if got is None:
                beyond[shape] = lim
                continue
            t, fit = got
            if t > now_us:
                best = sorted(fit, key=lambda n: (ns.gpus_at(n, pre, t), n))[:k]
                ns.reserve(best, t, ns.round_up(t + lim))
            else:
                self._start(cyc, ns, job, fit, ns.round_up(now_us + lim))
                limits[job.job_id, job.attempt] = lim
        return cyc.out

    def _start(self, cyc: Cycle, ns: NodeSpace, job: PendingJob, fit: list[str], end: Micros) -> None:
        """Start ``job`` now on nodes of ``fit``: on free GPUs (best fit: fewest free, then node id) if k of them
        have g free, else (a ``normal`` job) over the ``scavenger`` runs there, youngest first."""
        g, k = job.gpus_per_replica, job.replicas
        ffree = cyc.free.free
        ratio = self.factors.get(job.budget, 0.0)
        free_nodes = sorted((len(ffree[n]), n) for n in fit if len(ffree[n]) >= g)
        key = (job.job_id, job.attempt)
        if len(free_nodes) >= k:
            nodes = [n for _, n in free_nodes[:k]]
            cyc.place_free(job, nodes, ratio)
            ns.started(nodes, g, end, key)
            return
        if not job.allocated:
            return
        before = {n: len(ffree[n]) for n in fit}
        scav = victim_order(r for leaf in sorted(cyc.runs) for r in cyc.candidates(leaf) if not r.allocated)
        plan = plan_victims(cyc, job, scav, nodes=set(fit))
        if plan is None:
            return
        placements, victims = plan
        cyc.place_over(job, placements, victims, ratio)
        ns.preempted(victims, placements, g, end, key, before)

    def simplified(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """``normal`` jobs by priority (preempting ``scavenger`` runs), then ``scavenger`` jobs; any job that fits
        starts, none reserves (``backfill_reserve=False``)."""
        cyc = Cycle(snapshot, now_us, config, SIMPLIFIED_POLICY_VERSION)
        alloc, unalloc = leaf_segments(snapshot, split=True)
        victims: list[CycleVictims] = []

        def planner(c: Cycle, job: PendingJob):
            if not victims:
                v = CycleVictims(snapshot.cluster, now_us, snapshot.victims)
                v.expired = {}  # only the scavenger QOS is preemptible
                v.taken = c.taken
                victims.append(v)
            plan = plan_preemption(PreemptionRequest(job, job.budget, c.free, victims[0], now_us))
            if plan is None:
                return None
            return plan[0], [run for run, _ in plan[1]]

        admission_loop(
            cyc,
            alloc + unalloc,
            lambda s, job: self.key(s, job, now_us),
            planner,
            ratio=lambda leaf: self.factors.get(leaf, 0.0),
        )
        return cyc.out
