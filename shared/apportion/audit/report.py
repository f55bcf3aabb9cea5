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
  violations (:func:`apportion.audit.replay.preemption_report`, must be 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from apportion import events
from apportion.audit.replay import decoded, preemption_report
from apportion.domain.budgets import BudgetTree
from apportion.domain.occupancy import OccupancyLedger
from apportion.sim.report import percentile
from apportion.timeutil import Micros, to_us, us_to_s


@dataclass
class BudgetRow:
    """Figures of one leaf budget over the span (shares are fractions of K)."""

    path: str
    abs_share: float
    alloc_share: float
    free_share: float
    jobs: int
    placed: int
    wait_p50_s: float | None
    wait_p95_s: float | None
    preemptions: int


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def log_report(log: Iterable[Any], tree: BudgetTree, start_us: Micros, end_us: Micros) -> LogReport:
    """Figures of ``log`` (events or log records, in log order) over [start_us, end_us).

    Raises:
        ValueError: ``end_us <= start_us``.
    """
    if end_us <= start_us:
        raise ValueError("the span must not be empty")
    evs = decoded(log)
    ledger = OccupancyLedger(us_to_s(end_us - start_us))
    submitted: dict[str, tuple[Micros, str]] = {}
    first_placed: dict[str, Micros] = {}
    pre_by_budget: dict[str, int] = {}
    for ev in evs:
        t = to_us(ev.ts)
        if t > end_us:
            continue
        ledger.apply(ev)
        if isinstance(ev, events.JobSubmitted):
            sub = to_us(ev.submitted_at)
            if start_us <= sub < end_us:
                submitted.setdefault(ev.job_id, (sub, ev.budget))
        elif isinstance(ev, events.JobPlaced):
            first_placed.setdefault(ev.job_id, t)
        elif isinstance(ev, events.JobPreempted) and t >= start_us and ev.reason != "cancelled":
            pre_by_budget[ev.budget] = pre_by_budget.get(ev.budget, 0) + 1
    at = max(end_us, ledger.clock or end_us)
    occ, una, cap = ledger.occupancy(at), ledger.unallocated(at), ledger.capacity_gpu_s(at)
    waits: dict[str, list[float]] = {}
    jobs_of: dict[str, int] = {}
    for job_id, (sub, budget) in submitted.items():
        jobs_of[budget] = jobs_of.get(budget, 0) + 1
        p = first_placed.get(job_id)
        if p is not None and p < end_us:
            waits.setdefault(budget, []).append(us_to_s(p - sub))
    rows = []
    for leaf in tree.leaves():
        w = waits.get(leaf, [])
        rows.append(
            BudgetRow(
                path=leaf,
                abs_share=tree.abs_share(leaf),
                alloc_share=occ.get(leaf, 0.0) / cap if cap else 0.0,
                free_share=una.get(leaf, 0.0) / cap if cap else 0.0,
                jobs=jobs_of.get(leaf, 0),
                placed=len(w),
                wait_p50_s=percentile(w, 50),
                wait_p95_s=percentile(w, 95),
                preemptions=pre_by_budget.get(leaf, 0),
            )
        )
    all_w = [x for w in waits.values() for x in w]
    used = sum(occ.get(p, 0.0) + una.get(p, 0.0) for p in tree.leaves())
    viol = preemption_report(evs, since=start_us, until=end_us)
    return LogReport(
        start_us=start_us,
        end_us=end_us,
        capacity_gpu_s=cap,
        utilisation=used / cap if cap else 0.0,
        jobs=len(submitted),
        placed=len(all_w),
        never=len(submitted) - len(all_w),
        wait_p50_s=percentile(all_w, 50),
        wait_p95_s=percentile(all_w, 95),
        preemptions=sum(pre_by_budget.values()),
        violations=len(viol.violations),
        budgets=rows,
        violation_detail=viol.violations,
    )
