"""Per-job and per-budget figures of any event log: the one report the simulator and the log report share.

Two pieces, both pure (events in, numbers out):

* :class:`JobLedger`, a fold over job events (``JobSubmitted``,
  ``JobPlaced``, ``JobStarted``, ``JobCheckpointed``, ``JobPreempted``,
  ``JobLost``, ``JobCompleted``, ``JobFailed``, ``JobCancelled``, and the
  ``JobRequeued`` that ends a refused start): per job its
  submission, first placement, completion and preemptions; per run (attempt)
  its GPUs, start, checkpoints and how it ended; and every stop that lost
  work (:class:`Stop`). It reads the log only, so it gives the same figures
  whether or not ``JobPreempted.lost_gpu_s`` / ``JobLost.lost_gpu_s`` are
  filled; when they are, :meth:`JobLedger.disagreements` lists the stops where
  the recorded value and the log's differ.
* :func:`budget_rows`, the per-budget table (one function for
  :func:`apportion.sim.report.summarise` and
  :func:`apportion.audit.report.log_report`).

Definitions (design D1):

* **Work lost** of a run stopped by preemption, drain (``JobPreempted``) or
  node loss (``JobLost``): ``GPUs x (stop - mark)`` GPU-seconds, where the
  stop is the ``JobPreempted`` time (the occupancy ledger stops charging the
  run there) or ``JobLost.charged_until``, and ``mark`` is the run's last
  checkpoint, else its start (the latest replica ``JobStarted``, as the
  cluster's protection counts it), else its placement (a run stopped before it
  started). GPUs are the replicas still open at the stop x GPUs per replica.
  A checkpoint of a gang is the whole run's when ``replica`` is ``None``,
  else the oldest of its replicas' latest ones once every replica reported.
  A checkpoint of the same attempt that arrives after the stop (written on
  SIGTERM, within the grace period) saves the run up to the stop: its work
  lost becomes 0 (unless the job's next attempt was placed before it came:
  that attempt could not resume from it). Cancels and failures are not work lost (nobody took the
  GPUs away).
* **Completed**: every replica of an attempt reported ``JobCompleted``; of a
  run preempted or lost, stamped at or before the stop and read while it
  stops or (lost) before the next attempt is placed, else the next attempt
  cancelled with reason ``completed_before_loss`` (then at that cancel: rule
  D3.completed-before-loss); **job completion time** (JCT) = that time -
  ``submitted_at``.
* **Preemptions**: ``JobPreempted`` events (drains included, ``reason ==
  "cancelled"`` excluded); ``preemptions_per_job_hour`` = preemptions / the
  hours runs held GPUs (one per run, whatever its GPUs, placement to end);
  ``max_preemptions_per_job`` = the most any one job had;
  ``max_preemptions_allocated`` = the most any one allocated job had (the
  bounded-churn promise of rule D3.bounded-churn is about those: an unallocated
  job is preemptible at any time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import COMPLETED_BEFORE_LOSS, LostRun, lost_run_report
from apportion.domain.occupancy import requeued_end_us
from apportion.events import (
    Event,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    JobSubmitted,
)
from apportion.timeutil import US_PER_S, Micros, to_us

__all__ = ["BudgetRow", "JobLedger", "Stop", "Totals", "budget_rows", "percentile", "share_deficit_pp"]

#: A recorded ``lost_gpu_s`` and the log's own figure agree when within this many GPU-seconds.
AGREE_GPU_S = 1.0


def share_deficit_pp(share: float, window_share: float) -> float:
    """The share deficit of one budget at one sample, in percentage points: ``max(0, share - O_b/K) * 100``,
    with ``window_share`` = O_b/K over the trailing window (the definition of :mod:`apportion.sim.report`;
    the simulator's samples and :func:`apportion.audit.report.share_deficits` both use it)."""
    return max(0.0, share - window_share) * 100


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); ``None`` for no values."""
    if not values:
        return None
    v = sorted(values)
    k = max(1, math.ceil(q / 100 * len(v)))
    return v[k - 1]


@dataclass(slots=True)
class Stop:
    """One run stopped by preemption, drain or node loss, and the work it lost.

    Attributes:
        job_id, attempt: the run.
        budget: its budget path; ``allocated``: min runtime > 0.
        reason: ``JobPreempted.reason`` (``preempted``, ``drain``) or ``node lost``.
        at_us: the stop (``JobPreempted`` time or ``JobLost.charged_until``), µs.
        gpus: GPUs it held at the stop.
        mark_us: its last checkpoint (clamped to the stop), else its start, µs.
        lost_gpu_s: ``gpus * (at_us - mark_us)`` in GPU-seconds (module docstring).
        recorded_lost_gpu_s: the event's own ``lost_gpu_s`` (``None`` when not recorded).
    """

    job_id: str
    attempt: int
    budget: str
    allocated: bool
    reason: str
    at_us: Micros
    gpus: int
    mark_us: Micros
    recorded_lost_gpu_s: float | None = None

    @property
    def lost_gpu_s(self) -> float:
        """Work lost, GPU-seconds."""
        return self.gpus * max(0, self.at_us - self.mark_us) / US_PER_S


class _Run:
    """What the ledger keeps of one run (attempt) while it may still matter."""

    __slots__ = (
        "budget",
        "allocated",
        "g",
        "replicas",
        "placed",
        "started",
        "ckpt",
        "ckpt_r",
        "open",
        "done",
        "stop",
        "finishing",
        "lost",
    )

    def __init__(self, ev: JobPlaced, t: Micros) -> None:
        self.budget = ev.budget
        self.allocated = ev.allocated
        self.g = ev.gpus_per_replica
        self.replicas = len(ev.placements) or ev.replicas
        self.placed = t
        self.started: Micros | None = None
        self.ckpt: Micros | None = None  # latest whole-run checkpoint
        self.ckpt_r: dict[int, Micros] | None = None  # replica -> latest checkpoint
        self.open = set(range(self.replicas))
        self.done: set[int] = set()  # replicas that completed
        self.stop: Stop | None = None
        # stopped: the replicas whose completion stamped at or before the stop would show the run had finished
        # (rule D3.completed-before-loss); ``lost``: the stop was a loss (its report counts until the next
        # placement, a preemption's only until its requeue)
        self.finishing: LostRun | None = None
        self.lost = False

    def mark(self) -> Micros:
        """Last checkpoint, else start, else placement (µs)."""
        m = self.started if self.started is not None else self.placed
        c = self.ckpt
        if self.ckpt_r is not None and len(self.ckpt_r) >= self.replicas:
            oldest = min(self.ckpt_r.values())
            c = oldest if c is None else max(c, oldest)
        return m if c is None else max(m, c)


class JobLedger:
    """Fold of job events into per-job and per-run figures (module docstring). Apply events in log order.

    Attributes:
        submitted: job id -> (submitted_at µs, budget, allocated) from ``JobSubmitted``.
        first_placed: job id -> first ``JobPlaced`` time, µs.
        completed: job id -> completion time, µs.
        preempted: job id -> ``JobPreempted`` count; ``preempted_at``: their times (µs) and budgets.
        stops: every stop that lost work, in log order.
        checkpoints: ``JobCheckpointed`` events folded.
    """

    __slots__ = (
        "submitted",
        "first_placed",
        "completed",
        "preempted",
        "preempted_at",
        "stops",
        "checkpoints",
        "_runs",
        "_run_us",
        "_clock",
    )

    def __init__(self) -> None:
        self.submitted: dict[str, tuple[Micros, str, bool]] = {}
        self.first_placed: dict[str, Micros] = {}
        self.completed: dict[str, Micros] = {}
        self.preempted: dict[str, int] = {}
        self.preempted_at: list[tuple[Micros, str]] = []
        self.stops: list[Stop] = []
        self.checkpoints = 0
        self._runs: dict[tuple[str, int], _Run] = {}
        self._run_us: dict[str, int] = {}  # budget -> µs runs held GPUs (ended runs)
        self._clock: Micros | None = None

    # ------------------------------------------------------------------ fold

    def apply(self, ev: Event) -> None:
        """Fold one event (other types are ignored)."""
        h = _HANDLERS.get(type(ev))
        if h is not None:
            t = to_us(ev.ts)
            if self._clock is None or t > self._clock:
                self._clock = t
            h(self, ev, t)

    def apply_all(self, evs: Iterable[Event]) -> JobLedger:
        """Fold every event in order; returns ``self``."""
        for ev in evs:
            self.apply(ev)
        return self

    def _submitted(self, ev: JobSubmitted, t: Micros) -> None:
        for job_id in ev.job_ids:  # an array's elements, each its own job
            self.submitted.setdefault(job_id, (to_us(ev.submitted_at), ev.budget, ev.allocated))

    def _placed(self, ev: JobPlaced, t: Micros) -> None:
        key = (ev.job_id, ev.attempt)
        runs = self._runs
        if key not in runs:
            runs[key] = _Run(ev, t)
            self.first_placed.setdefault(ev.job_id, t)
            old = runs.get((ev.job_id, ev.attempt - 1))
            if old is not None and old.stop is not None:  # a later checkpoint of it can no longer be resumed from
                del runs[(ev.job_id, ev.attempt - 1)]

    def _started(self, ev: JobStarted, t: Micros) -> None:
        run = self._runs.get((ev.job_id, ev.attempt))
        if run is not None and run.stop is None and (run.started is None or t > run.started):
            run.started = t

    def _checkpointed(self, ev: JobCheckpointed, t: Micros) -> None:
        self.checkpoints += 1
        run = self._runs.get((ev.job_id, ev.attempt))
        if run is None:
            return
        stop = run.stop
        if stop is not None:
            t = min(t, stop.at_us)  # written on SIGTERM: saves the run up to the stop
        if ev.replica is None:
            run.ckpt = t if run.ckpt is None else max(run.ckpt, t)
        else:
            if run.ckpt_r is None:
                run.ckpt_r = {}
            run.ckpt_r[ev.replica] = max(t, run.ckpt_r.get(ev.replica, t))
        if stop is not None:
            stop.mark_us = max(stop.mark_us, min(run.mark(), stop.at_us))

    def _stopped(
        self, run: _Run, key: tuple[str, int], at: Micros, reason: str, recorded: float | None, bound: Micros
    ) -> None:
        at = max(at, run.placed)
        run.stop = Stop(
            job_id=key[0],
            attempt=key[1],
            budget=run.budget,
            allocated=run.allocated,
            reason=reason,
            at_us=at,
            gpus=run.g * len(run.open),
            mark_us=min(run.mark(), at),
            recorded_lost_gpu_s=recorded,
        )
        self.stops.append(run.stop)
        run.finishing = LostRun(key[1], bound, frozenset(run.open))
        self._ended(run, at)

    def _preempted(self, ev: JobPreempted, t: Micros) -> None:
        if ev.reason == "cancelled":
            return
        key = (ev.job_id, ev.attempt)
        run = self._runs.get(key)
        self.preempted[ev.job_id] = self.preempted.get(ev.job_id, 0) + 1
        self.preempted_at.append((t, ev.budget))
        if run is None or run.stop is not None:
            return
        rec = ev.lost_gpu_s
        if rec is None and ev.victim is not None:
            rec = ev.victim.lost_gpu_s
        self._stopped(run, key, t, ev.reason, rec, t)

    def _lost(self, ev: JobLost, t: Micros) -> None:
        key = (ev.job_id, ev.attempt)
        run = self._runs.get(key)
        if run is None:
            return
        run.lost = True  # preempted first: its completion bound stays the preemption's
        if run.stop is None:
            self._stopped(run, key, min(to_us(ev.charged_until), t), "node lost", ev.lost_gpu_s, t)

    def _report(self, ev: JobCompleted | JobFailed, t: Micros) -> None:
        key = (ev.job_id, ev.attempt)
        run = self._runs.get(key)
        if run is None:
            return
        if run.stop is not None:
            self._stopped_report(run, ev, t)
            return
        which = set(run.open) if ev.replica is None else {ev.replica} & run.open
        run.open -= which
        if type(ev) is JobCompleted:
            run.done |= which
        if not run.open:
            if len(run.done) >= run.replicas:
                self.completed.setdefault(ev.job_id, t)
            self._ended(run, t)
            del self._runs[key]

    def _stopped_report(self, run: _Run, ev: JobCompleted | JobFailed, t: Micros) -> None:
        """A report of a stopped run: the job is completed when every replica's completion is stamped at or
        before the stop (rule D3.completed-before-loss; a preemption's while it stops)."""
        if run.finishing is None:
            return
        after = lost_run_report(run.finishing, ev, t)
        run.finishing = after if after is not None and after.replicas_left else None
        if after is not None and not after.replicas_left:
            self.completed.setdefault(ev.job_id, t)

    def _cancelled(self, ev: JobCancelled, t: Micros) -> None:
        if ev.reason == COMPLETED_BEFORE_LOSS:  # the lost run had finished: this attempt ends the job, done
            self.completed.setdefault(ev.job_id, t)
        if ev.attempt is None:
            return
        run = self._runs.pop((ev.job_id, ev.attempt), None)
        if run is not None and run.stop is None:
            self._ended(run, t)

    def _requeued(self, ev: JobRequeued, t: Micros) -> None:
        """A requeue ends a run nothing else ended: a refused start, at the refusal (``D3.refused-starts``)."""
        key = (ev.job_id, ev.attempt - 1)
        run = self._runs.get(key)
        if run is not None and run.stop is not None and not run.lost:
            run.finishing = None  # a preempted run's stop is done: a later report no longer ends the job
        if run is not None and run.stop is None and run.open:
            self._ended(run, requeued_end_us(ev))
            del self._runs[key]

    def _ended(self, run: _Run, t: Micros) -> None:
        self._run_us[run.budget] = self._run_us.get(run.budget, 0) + max(0, t - run.placed)
        run.open = set()

    # ------------------------------------------------------------------ queries

    def run_hours(self, at_us: Micros | None = None) -> dict[str, float]:
        """Budget -> hours runs held GPUs (one per run, placement to end; open runs up to ``at_us``)."""
        at = at_us if at_us is not None else (self._clock or 0)
        out = dict(self._run_us)
        for run in self._runs.values():
            if run.stop is None and run.open:
                out[run.budget] = out.get(run.budget, 0) + max(0, at - run.placed)
        return {b: us / (3600 * US_PER_S) for b, us in out.items()}

    def lost_gpu_s(self, since_us: Micros | None = None, until_us: Micros | None = None) -> dict[str, float]:
        """Budget -> work lost (GPU-s) by stops in [since_us, until_us] (``None``: open)."""
        out: dict[str, float] = {}
        for s in self.stops:
            if (since_us is None or s.at_us >= since_us) and (until_us is None or s.at_us <= until_us):
                out[s.budget] = out.get(s.budget, 0.0) + s.lost_gpu_s
        return out

    def disagreements(self, tolerance_gpu_s: float = AGREE_GPU_S) -> list[Stop]:
        """Stops whose recorded ``lost_gpu_s`` differs from the log's figure by more than ``tolerance_gpu_s``."""
        return [
            s
            for s in self.stops
            if s.recorded_lost_gpu_s is not None and abs(s.recorded_lost_gpu_s - s.lost_gpu_s) > tolerance_gpu_s
        ]

    def jct_s(self) -> dict[str, list[float]]:
        """Budget -> job completion times (s) of the completed jobs."""
        out: dict[str, list[float]] = {}
        for job_id, t in self.completed.items():
            sub = self.submitted.get(job_id)
            if sub is not None:
                out.setdefault(sub[1], []).append((t - sub[0]) / US_PER_S)
        return out


_HANDLERS: dict[type, Any] = {
    JobSubmitted: JobLedger._submitted,
    JobPlaced: JobLedger._placed,
    JobStarted: JobLedger._started,
    JobCheckpointed: JobLedger._checkpointed,
    JobPreempted: JobLedger._preempted,
    JobLost: JobLedger._lost,
    JobCompleted: JobLedger._report,
    JobFailed: JobLedger._report,
    JobCancelled: JobLedger._cancelled,
    JobRequeued: JobLedger._requeued,
}


@dataclass
class BudgetRow:
    """Figures of one leaf budget (definitions: module docstring and the callers').

    Attributes:
        path, share: the leaf and its absolute share.
        alloc_share, free_share: its allocated / unallocated GPU-s over the span's capacity GPU-s.
        goodput: (GPU-s it held - work it lost) / capacity GPU-s, over the same span.
        jobs, placed, never: jobs submitted in the span; placed by its end; the others.
        wait_p50_s, wait_p95_s: first placement - submission (placed jobs).
        preemptions: ``JobPreempted`` of its runs (drains included).
        completed, jct_p50_s, jct_p95_s: jobs completed; completion - submission.
        lost_gpu_h: work lost; ``lost_pct``: of the GPU-hours it held (``held_gpu_h``).
        preemptions_per_job_hour, max_preemptions_per_job: see module docstring.
        mean_deficit_pp, backlogged_frac: from the simulator's samples (``None`` in a log report).
    """

    path: str
    share: float
    alloc_share: float
    free_share: float
    goodput: float
    jobs: int
    placed: int
    never: int
    wait_p50_s: float | None
    wait_p95_s: float | None
    preemptions: int
    completed: int
    jct_p50_s: float | None
    jct_p95_s: float | None
    held_gpu_h: float
    lost_gpu_h: float
    lost_pct: float
    preemptions_per_job_hour: float
    max_preemptions_per_job: int
    mean_deficit_pp: float | None = None
    backlogged_frac: float | None = None

    @property
    def abs_share(self) -> float:
        """Its absolute share (the log report's name for ``share``)."""
        return self.share


@dataclass
class Totals:
    """The cluster row of the same figures (sums over budgets; percentiles over all jobs)."""

    goodput: float
    completed: int
    jct_p50_s: float | None
    jct_p95_s: float | None
    held_gpu_h: float
    lost_gpu_h: float
    lost_pct: float
    preemptions_per_job_hour: float
    max_preemptions_per_job: int
    max_preemptions_allocated: int = 0
    rows: list[BudgetRow] = field(default_factory=list)


def budget_rows(
    tree: BudgetTree,
    ledger: JobLedger,
    *,
    occ: Mapping[str, float],
    una: Mapping[str, float],
    cap: float,
    held: Mapping[str, float],
    span: tuple[Micros | None, Micros | None] = (None, None),
    measured_until_us: Micros | None = None,
    end_us: Micros | None = None,
    deficits: Mapping[str, list[float]] | None = None,
    backlogged: Mapping[str, float] | None = None,
) -> Totals:
    """Per-leaf rows and the cluster totals: the one per-budget report.

    Args:
        tree: the budget tree (rows for its leaves, in its order).
        ledger: the job events of the log, folded.
        occ, una, cap: allocated and unallocated GPU-s per budget and capacity GPU-s over the
            measured span (utilisation's span): ``alloc_share``, ``free_share``, ``goodput``.
        held: GPU-s held per budget over the whole span (``lost_pct``'s denominator).
        span: ``[since, until)`` of the report: jobs submitted in it count; placements, stops,
            completions and preemptions after ``until`` do not (``None``: open).
        measured_until_us: end of the measured span (stops after it are not in ``goodput``).
        end_us: the log's end (open runs count up to it in the job-hours).
        deficits, backlogged: per leaf, the simulator's deficit samples (pp) and backlogged fraction.
    """
    since, until = span

    def inside(t: Micros) -> bool:
        return (since is None or t >= since) and (until is None or t < until)

    leaves = tree.leaves()
    jobs_of: dict[str, int] = {}
    waits: dict[str, list[float]] = {}
    for job_id, (sub, budget, _alloc) in ledger.submitted.items():
        if not inside(sub):
            continue
        jobs_of[budget] = jobs_of.get(budget, 0) + 1
        p = ledger.first_placed.get(job_id)
        if p is not None and (until is None or p < until):
            waits.setdefault(budget, []).append((p - sub) / US_PER_S)
    jct: dict[str, list[float]] = {}
    max_pre: dict[str, int] = {}
    max_alloc = 0
    for job_id, t in ledger.completed.items():
        rec = ledger.submitted.get(job_id)
        if rec is not None and inside(rec[0]) and (until is None or t < until):
            jct.setdefault(rec[1], []).append((t - rec[0]) / US_PER_S)
    for job_id, n in ledger.preempted.items():
        rec = ledger.submitted.get(job_id)
        if rec is not None and inside(rec[0]):
            max_pre[rec[1]] = max(max_pre.get(rec[1], 0), n)
            if rec[2]:
                max_alloc = max(max_alloc, n)
    pre: dict[str, int] = {}
    for t, b in ledger.preempted_at:
        if inside(t):
            pre[b] = pre.get(b, 0) + 1
    lost_all = ledger.lost_gpu_s(since, None if until is None else until - 1)
    lost_measured = ledger.lost_gpu_s(since, measured_until_us)
    hours = ledger.run_hours(end_us)
    rows = []
    for leaf in leaves:
        w = waits.get(leaf, [])
        j = jct.get(leaf, [])
        h = held.get(leaf, 0.0)
        lost = lost_all.get(leaf, 0.0)
        rh = hours.get(leaf, 0.0)
        rows.append(
            BudgetRow(
                path=leaf,
                share=tree.abs_share(leaf),
                alloc_share=occ.get(leaf, 0.0) / cap if cap else 0.0,
                free_share=una.get(leaf, 0.0) / cap if cap else 0.0,
                goodput=(occ.get(leaf, 0.0) + una.get(leaf, 0.0) - lost_measured.get(leaf, 0.0)) / cap if cap else 0.0,
                jobs=jobs_of.get(leaf, 0),
                placed=len(w),
                never=jobs_of.get(leaf, 0) - len(w),
                wait_p50_s=percentile(w, 50),
                wait_p95_s=percentile(w, 95),
                preemptions=pre.get(leaf, 0),
                completed=len(j),
                jct_p50_s=percentile(j, 50),
                jct_p95_s=percentile(j, 95),
                held_gpu_h=h / 3600,
                lost_gpu_h=lost / 3600,
                lost_pct=100 * lost / h if h else 0.0,
                preemptions_per_job_hour=pre.get(leaf, 0) / rh if rh else 0.0,
                max_preemptions_per_job=max_pre.get(leaf, 0),
                mean_deficit_pp=(sum(deficits[leaf]) / len(deficits[leaf]) if deficits[leaf] else 0.0)
                if deficits is not None and leaf in deficits
                else None,
                backlogged_frac=backlogged.get(leaf) if backlogged is not None else None,
            )
        )
    all_jct = [x for v in jct.values() for x in v]
    held_all = sum(held.get(p, 0.0) for p in leaves)
    lost_sum = sum(lost_all.get(p, 0.0) for p in leaves)
    used = sum(occ.get(p, 0.0) + una.get(p, 0.0) - lost_measured.get(p, 0.0) for p in leaves)
    pre_all = sum(pre.get(p, 0) for p in leaves)
    rh_all = sum(hours.get(p, 0.0) for p in leaves)
    return Totals(
        goodput=used / cap if cap else 0.0,
        completed=len(all_jct),
        jct_p50_s=percentile(all_jct, 50),
        jct_p95_s=percentile(all_jct, 95),
        held_gpu_h=held_all / 3600,
        lost_gpu_h=lost_sum / 3600,
        lost_pct=100 * lost_sum / held_all if held_all else 0.0,
        preemptions_per_job_hour=pre_all / rh_all if rh_all else 0.0,
        max_preemptions_per_job=max((max_pre.get(p, 0) for p in leaves), default=0),
        max_preemptions_allocated=max_alloc,
        rows=rows,
    )
