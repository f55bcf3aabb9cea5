"""One report over any event log: the live stack's, the simulator's, an export's.

:func:`log_report` computes, for a time span [start, end) of a log, the
figures the main job prints and compares between the live run and the
simulator, with one definition for both so a difference is a difference in
behaviour, not in bookkeeping:

* per leaf budget: ``alloc_share = O_b / K`` and ``free_share = U_b / K``
  over the span (O, U, K from an :class:`~apportion.domain.occupancy.OccupancyLedger`
  whose window is the span), next to ``abs_share``;
* ``utilisation = sum over leaves of (O_b + U_b) / K``;
* wait = first ``JobPlaced`` time - ``submitted_at`` for jobs submitted in
  the span and placed before ``end`` (p50/p95, nearest rank); ``never`` counts
  the others;
* preemptions by victim budget (``JobPreempted`` in the span) and protection
  violations (:func:`apportion.audit.replay.preemption_report`, must be 0);
* goodput, work lost, completions, job completion time and preemptions per
  job-hour / per job as the simulator reports them (definitions:
  :mod:`apportion.report`), over the span;
* the share deficit (:func:`share_deficits`, the simulator's definition,
  :mod:`apportion.sim.report`): at every sample time (hourly from the start of
  the span), for every leaf with allocated work waiting, ``max(0, share -
  O_b/K)`` over the trailing window W, in percentage points; mean and max over
  those (sample, leaf) pairs, and per leaf.

The per-budget rows are :func:`apportion.report.budget_rows`, the function
the simulator's report (:func:`apportion.sim.report.summarise`) uses too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from apportion.audit.replay import decoded, preemption_report
from apportion.domain.budgets import BudgetTree
from apportion.domain.occupancy import OccupancyLedger
from apportion.report import BudgetRow, JobLedger, budget_rows, percentile, share_deficit_pp
from apportion.timeutil import WEEK_S, Micros, s_to_us, to_us, us_to_s

__all__ = ["BudgetRow", "LogReport", "log_report", "share_deficits"]


@dataclass
class LogReport:
    """Figures of a log over [start, end) (see module docstring)."""

    start_us: Micros
    end_us: Micros
    capacity_gpu_s: float
    utilisation: float
    jobs: int
    placed: int
    never: int
    wait_p50_s: float | None
    wait_p95_s: float | None
    preemptions: int
    violations: int
    budgets: list[BudgetRow] = field(default_factory=list)
    violation_detail: list[dict[str, Any]] = field(default_factory=list)
    goodput: float = 0.0
    completed: int = 0
    jct_p50_s: float | None = None
    jct_p95_s: float | None = None
    held_gpu_h: float = 0.0
    lost_gpu_h: float = 0.0
    lost_pct: float = 0.0
    preemptions_per_job_hour: float = 0.0
    max_preemptions_per_job: int = 0
    mean_deficit_pp: float | None = None
    max_deficit_pp: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


#: Period of the share-deficit samples, seconds (the simulator's ``SimConfig.sample_s`` default).
DEFICIT_SAMPLE_S = 3600.0


def share_deficits(
    evs: Sequence[Any],
    tree: BudgetTree,
    start_us: Micros,
    end_us: Micros,
    window_s: float = WEEK_S,
    sample_s: float = DEFICIT_SAMPLE_S,
) -> dict[str, list[float]]:
    """Per leaf budget, its share deficits in percentage points at the sample times it had allocated work
    waiting (the simulator's definition, :mod:`apportion.sim.report`, from a log instead of its state).

    Samples at ``start_us + i * sample_s`` in [start_us, end_us], each on the events stamped up to it (folded
    in event-time order): ``max(0, share - O_b/K) * 100`` with O_b and K over the trailing ``window_s``
    (:class:`~apportion.domain.occupancy.OccupancyLedger`; O_b/K is 0 while K is 0, as the simulator's
    ``_sample``). Waiting: a ``JobQueued`` or ``JobRequeued`` of an allocated job not placed (``JobPlaced``)
    or cancelled since; a requeue of a job completed by then (:class:`~apportion.report.JobLedger`, in log order:
    a lost run whose completion stamped before the loss was read while the requeued attempt waited, rule
    D3.completed-before-loss, which finishes the job with no event) is no wait. A sample before the ledger's
    first event is skipped.
    """
    from apportion.events import JobCancelled, JobPlaced, JobQueued, JobRequeued

    ledger = OccupancyLedger(window_s)
    leaves = tree.leaves()
    share = {leaf: tree.abs_share(leaf) for leaf in leaves}
    out: dict[str, list[float]] = {leaf: [] for leaf in leaves}
    spec: dict[str, tuple[str, bool]] = {}  # job -> (budget, allocated)
    waiting: dict[str, set[str]] = {}
    done = JobLedger().apply_all(evs).completed  # judged in log order, where the dispatcher read the reports
    step = s_to_us(sample_s)
    t = start_us

    def sample(at: Micros) -> None:
        if ledger.clock is None or at < ledger.clock:
            return
        cap = ledger.capacity_gpu_s(at)
        occ = ledger.occupancy(at)
        for leaf in leaves:
            if waiting.get(leaf):
                out[leaf].append(share_deficit_pp(share[leaf], occ.get(leaf, 0.0) / cap if cap > 0 else 0.0))

    for ev in sorted(evs, key=lambda x: to_us(x.ts)):  # stable: same-instant events keep their log order
        ts = to_us(ev.ts)
        while t <= end_us and t < ts:  # a sample sees every event stamped at or before it
            sample(t)
            t += step
        if ts > end_us:
            break
        ledger.apply(ev)
        if isinstance(ev, JobQueued):
            spec[ev.job_id] = (ev.budget, ev.allocated)
            if ev.allocated:
                waiting.setdefault(ev.budget, set()).add(ev.job_id)
        elif isinstance(ev, JobRequeued) and spec.get(ev.job_id, ("", False))[1]:
            if done.get(ev.job_id, ts + 1) > ts:  # not a job its lost run had finished
                waiting.setdefault(spec[ev.job_id][0], set()).add(ev.job_id)
        elif isinstance(ev, JobPlaced | JobCancelled) and ev.job_id in spec:
            waiting.get(spec[ev.job_id][0], set()).discard(ev.job_id)
    while t <= end_us:
        sample(t)
        t += step
    return out


def log_report(
    log: Iterable[Any], tree: BudgetTree, start_us: Micros, end_us: Micros, *, window_s: float = WEEK_S
) -> LogReport:
    """Figures of ``log`` (events or log records, in log order) over [start_us, end_us); the share deficit
    over the trailing ``window_s`` (seconds; :func:`share_deficits`).

    Raises:
        ValueError: ``end_us <= start_us``.
    """
    if end_us <= start_us:
        raise ValueError("the span must not be empty")
    evs = decoded(log)
    ledger = OccupancyLedger(us_to_s(end_us - start_us))
    jobs = JobLedger()
    for ev in evs:
        if to_us(ev.ts) > end_us:
            continue
        ledger.apply(ev)
        jobs.apply(ev)
    at = max(end_us, ledger.clock or end_us)
    occ, una, cap = ledger.occupancy(at), ledger.unallocated(at), ledger.capacity_gpu_s(at)
    leaves = tree.leaves()
    held = {p: occ.get(p, 0.0) + una.get(p, 0.0) for p in leaves}
    tot = budget_rows(
        tree,
        jobs,
        occ=occ,
        una=una,
        cap=cap,
        held=held,
        span=(start_us, end_us),
        measured_until_us=end_us,
        end_us=end_us,
    )
    rows = tot.rows
    submitted = [j for j, (sub, _b, _a) in jobs.submitted.items() if start_us <= sub < end_us]
    all_w = [
        us_to_s(jobs.first_placed[j] - jobs.submitted[j][0])
        for j in submitted
        if j in jobs.first_placed and jobs.first_placed[j] < end_us
    ]
    viol = preemption_report(evs, since=start_us, until=end_us)
    deficits = share_deficits(evs, tree, start_us, end_us, window_s)
    every = [d for ds in deficits.values() for d in ds]
    rows = [replace(b, mean_deficit_pp=sum(ds) / len(ds)) if (ds := deficits.get(b.path)) else b for b in rows]
    return LogReport(
        start_us=start_us,
        end_us=end_us,
        capacity_gpu_s=cap,
        utilisation=sum(held.values()) / cap if cap else 0.0,
        jobs=len(submitted),
        placed=len(all_w),
        never=len(submitted) - len(all_w),
        wait_p50_s=percentile(all_w, 50),
        wait_p95_s=percentile(all_w, 95),
        preemptions=sum(b.preemptions for b in rows),
        violations=len(viol.violations),
        budgets=rows,
        violation_detail=viol.violations,
        goodput=tot.goodput,
        completed=tot.completed,
        jct_p50_s=tot.jct_p50_s,
        jct_p95_s=tot.jct_p95_s,
        held_gpu_h=tot.held_gpu_h,
        lost_gpu_h=tot.lost_gpu_h,
        lost_pct=tot.lost_pct,
        preemptions_per_job_hour=tot.preemptions_per_job_hour,
        max_preemptions_per_job=tot.max_preemptions_per_job,
        mean_deficit_pp=sum(every) / len(every) if every else None,
        max_deficit_pp=max(every) if every else None,
    )
