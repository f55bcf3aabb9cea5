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
* ``sched_config.shtml`` / backfill: the QOS priority puts every ``normal``
  job before every ``scavenger`` job; within a class jobs go in priority order,
  and a job that does not fit does not block lower ones.

Simplified (say so when reading the figures):

* Backfill does not reserve start times: Slurm's backfill starts a lower job
  only if it does not delay the expected start of higher ones (by time
  limits); here any job that fits starts (the ``fifo`` baseline's backfill), so
  wide gangs can wait longer than under Slurm.
* Usage is accrued at passes from the runs present: a run that ends between
  two passes is charged up to the last pass before its end (exact while jobs
  wait, as a cycle runs at every completion; a run that ends while the queue
  is empty can lose up to the time since the last pass). Passes run at cycle
  times (the first cycle at least ``PriorityCalcPeriod`` after the last).
* Fairshare is per account (leaf budget), not per user under it; no job-size,
  partition, nice or TRES factors; the age of a requeued job counts from its
  first submission.
* Victims among the ``scavenger`` runs are the engine's least-cost set
  (:func:`apportion.domain.engine.search.plan_preemption`: fewest GPUs, then least work lost,
  i.e. youngest first, as ``PreemptParameters=youngest_first``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from apportion.domain.budgets import ROOT, BudgetTree, ancestors_of
from apportion.domain.cluster import RunKey
from apportion.domain.engine.cycle import CycleSnapshot
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.domain.engine.search import PreemptionRequest, plan_preemption
from apportion.domain.engine.victims import CycleVictims
from apportion.events import Event
from apportion.sim.peers._loop import Cycle, PeerPolicy, Seg, admission_loop, leaf_segments, run_gpus
from apportion.timeutil import WEEK_S, Micros, s_to_us

__all__ = ["SlurmConfig", "Slurm", "fair_tree_factors", "level_fairshare"]

POLICY_VERSION = "slurm-fairtree-1"


@dataclass(frozen=True, slots=True)
class SlurmConfig:
    """slurm.conf knobs (seconds).

    Attributes:
        half_life_s: ``PriorityDecayHalfLife`` (default 7 days).
        calc_period_s: ``PriorityCalcPeriod`` (default 5 minutes).
        weight_fairshare, weight_age: ``PriorityWeightFairshare``, ``PriorityWeightAge``.
        max_age_s: ``PriorityMaxAge`` (default 7 days).
    """

    half_life_s: float = float(WEEK_S)
    calc_period_s: float = 300.0
    weight_fairshare: float = 10000.0
    weight_age: float = 1000.0
    max_age_s: float = float(WEEK_S)


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

    def cycle(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """Pass if due, then ``normal`` jobs by priority (preempting ``scavenger`` runs), then ``scavenger`` jobs."""
        if self.last_pass_us is None or now_us >= self.last_pass_us + s_to_us(self.config.calc_period_s):
            self.decay_pass(snapshot, now_us)
        cyc = Cycle(snapshot, now_us, config, POLICY_VERSION)
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

        def key(s: Seg, job: PendingJob) -> tuple[int, float, int, str]:
            return (0 if s.preempt else 1, -self.priority(job, now_us), job.submitted_at_us, job.job_id)

        admission_loop(cyc, alloc + unalloc, key, planner, ratio=lambda leaf: self.factors.get(leaf, 0.0))
        return cyc.out
