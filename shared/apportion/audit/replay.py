"""Pure replays over a decoded log: occupancy at T, preemptions, squatting.

Inputs are :class:`~apportion.logrecord.LogRecord` lists in log order (see
:mod:`apportion.audit.source`); outputs are plain rows for tables and JSON.
The same code answers for Kafka and for export files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from apportion import events
from apportion.domain.budgets import BUDGET_CHANGES, BudgetTree, fold_budget_event, fold_budget_log
from apportion.domain.cluster import (
    PROTECTION_CAP_W,
    PROTECTION_CHURN_BOUND,
    PROTECTION_DOUBLINGS,
    PROTECTION_GROW_OVER_SHARE,
    UNTIL_STARTED,
    ClusterState,
    protection_s,
)
from apportion.domain.fairshare import budget_order
from apportion.domain.occupancy import OccupancyLedger
from apportion.domain.usage import usage_snapshot
from apportion.logrecord import LogRecord
from apportion.timeutil import WEEK_S, Micros, from_us, s_to_us, to_us


def decoded(records: Iterable[LogRecord | events.Event]) -> list[events.Event]:
    """The events of ``records`` that decoded, in the same order (events pass through)."""
    out: list[events.Event] = []
    for r in records:
        if isinstance(r, events.Event):
            out.append(r)
        elif r.event is not None:
            out.append(r.event)
    return out


def occupancy_at(
    records: Sequence[LogRecord | events.Event],
    at: Micros,
    *,
    window_s: float = WEEK_S,
    progress: Callable[[int], None] | None = None,
) -> tuple[events.OccupancySnapshot, dict[str, int]]:
    """Rebuild the windows from the log and evaluate them at event time ``at``.

    Every event with ``ts <= at`` is folded into a fresh
    :class:`~apportion.domain.occupancy.OccupancyLedger`; the tree is
    :func:`~apportion.domain.budgets.fold_budget_log` up to ``at``.

    Returns:
        ``(snapshot, ranks)``: the ``OccupancySnapshot`` the accounting
        service would publish at ``at``, and each leaf's 0-based fair-share
        rank.
    """
    ledger = OccupancyLedger(window_s)
    evs = decoded(records)
    for i, ev in enumerate(evs):
        if to_us(ev.ts) > at:
            break
        ledger.apply(ev)
        if progress is not None and i % 50_000 == 0:
            progress(i)
    tree = fold_budget_log(evs, until_us=at)
    snap = usage_snapshot(tree, ledger, at, producer="audit")
    occ = {u.path: u.occupancy_gpu_s for u in snap.budgets}
    ranks = {p: i for i, p in enumerate(budget_order(tree, occ, snap.capacity_gpu_s))}
    return snap, ranks


@dataclass
class PreemptionReport:
    """Preemptions in a time range.

    Attributes:
        pairs: ``{(victim_budget, preemptor_budget): count}``.
        rules: ``{rule: count}`` (``unallocated``, ``expired_behind``, ``drain``...).
        violations: preemptions of a run before its protection ended (must be 0),
            as dicts with job, attempt, at, protected_until.
        thrash: jobs preempted more than the threshold, ``{job_id: count}``.
        total: number of preemptions.
        mismatches: placements whose recorded ``Decision.protection_s`` is not what
            :func:`~apportion.domain.cluster.protection_s` gives from the log (must be empty).
        jobs: one row per ``JobPreempted`` in the range, in log order: ``{job_id, attempt,
            budget, by_job_id, by_budget, rule, lost_gpu_h, at}``; ``lost_gpu_h`` is the
            event's ``lost_gpu_s`` / 3600 (the victim's work lost since its last checkpoint,
            rule D1.work-lost), ``None`` in records written before it was recorded.
    """

    pairs: dict[tuple[str, str], int] = field(default_factory=dict)
    rules: dict[str, int] = field(default_factory=dict)
    violations: list[dict[str, Any]] = field(default_factory=list)
    thrash: dict[str, int] = field(default_factory=dict)
    total: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self, *, jobs: bool = False) -> dict[str, Any]:
        """JSON-friendly form; ``jobs=True`` adds the per-preemption rows under ``"jobs"``."""
        doc: dict[str, Any] = {
            "total": self.total,
            "pairs": [
                {"victim_budget": v, "preemptor_budget": p, "count": n} for (v, p), n in sorted(self.pairs.items())
            ],
            "rules": dict(sorted(self.rules.items())),
            "protection_violations": self.violations,
            "protection_mismatches": self.mismatches,
            "thrash": dict(sorted(self.thrash.items())),
        }
        if jobs:
            doc["jobs"] = self.jobs
        return doc


def preemption_report(
    records: Iterable[LogRecord | events.Event],
    *,
    since: Micros | None = None,
    until: Micros | None = None,
    thrash_over: int = 3,
    window_s: float = WEEK_S,
) -> PreemptionReport:
    """Count preemptions by victim and preemptor budget and check protection.

    A protection violation is a ``JobPreempted`` of an allocated run at an
    event time before the end of its protection window, read by the one
    rule, :attr:`apportion.domain.cluster.Run.protected_until_us`, of the run
    as the dispatcher's own fold (:class:`~apportion.domain.cluster.ClusterState`)
    holds it at that point of the log: from the latest replica start, and
    outright while not every replica has started. Its length is
    :func:`apportion.domain.cluster.protection_s` - the function the
    scheduler uses - recomputed from the facts in the log: the job's minimum
    runtime, how many times the fold counted it preempted before the
    placement, the budget's ``max_min_runtime`` in the budget tree folded up
    to the placement, and the window and protection knobs of the
    ``DispatcherConfigured`` record in force, with the budget's r its decision records. A placement whose decision
    records no ``protection_s`` was decided before protection grew with
    preemptions: its protection is the minimum runtime. A placement whose
    recorded ``protection_s`` differs from the recomputed one is listed in
    ``mismatches``. Rule D3.bounded-churn: neither may happen.

    Args:
        records: the log in log order.
        since, until: count (and judge) only preemptions in ``[since, until]``, µs UTC.
        thrash_over: a job preempted more often than this is listed in ``thrash``.
        window_s: W, seconds, until a ``DispatcherConfigured`` record says otherwise.
    """
    fold = ClusterState()
    recomputed: dict[tuple[str, int], Micros] = {}  # (job, attempt) -> protection recomputed from the log, µs
    rep = PreemptionReport()
    per_job: dict[str, int] = defaultdict(int)
    evs = decoded(records)
    rejected = {e.rejected_event_id for e in evs if isinstance(e, events.BudgetRejected)}
    tree = BudgetTree.empty()
    cap_w = PROTECTION_CAP_W  # the dispatcher's record in force says otherwise (an older policy: W / 4)
    doublings: int | None = PROTECTION_DOUBLINGS
    bound: int | None = PROTECTION_CHURN_BOUND
    grow = PROTECTION_GROW_OVER_SHARE
    for ev in evs:
        if isinstance(ev, BUDGET_CHANGES):
            if ev.event_id not in rejected:
                tree = fold_budget_event(tree, ev)
        elif isinstance(ev, events.DispatcherConfigured):
            window_s, cap_w, doublings = ev.window_s, ev.protection_cap_w, ev.protection_doublings
            bound, grow = ev.churn_bound, ev.grow_over_share
        elif isinstance(ev, events.JobPlaced):
            if ev.allocated and ev.decision.protection_s is not None:
                n = fold.preemptions.get(ev.job_id, 0)  # what the dispatcher's fold gives the new Run
                mmr = tree.max_min_runtime_s(ev.budget)
                want = protection_s(
                    ev.min_runtime_s,
                    n,
                    mmr,
                    window_s,
                    cap_w,
                    doublings,
                    bound,
                    ratio=ev.decision.ratio,
                    grow_over_share=grow,
                )
                if abs(want - ev.decision.protection_s) > 1e-6:
                    rep.mismatches.append(
                        {
                            "job_id": ev.job_id,
                            "attempt": ev.attempt,
                            "recorded_protection_s": ev.decision.protection_s,
                            "protection_s": want,
                            "preemptions": n,
                        }
                    )
                recomputed[(ev.job_id, ev.attempt)] = s_to_us(want)
        elif isinstance(ev, events.JobPreempted):
            t = to_us(ev.ts)
            if (since is None or t >= since) and (until is None or t <= until):
                _count_preemption(rep, per_job, ev, t)
                run = fold.runs.get((ev.job_id, ev.attempt))
                if ev.allocated and run is not None and run.allocated and not run.stopping:
                    length = recomputed.get(run.key)
                    if length is not None:
                        run = replace(run, protection_us=length)
                    end = run.protected_until_us
                    if end is not None and t < end:
                        rep.violations.append(
                            {
                                "job_id": ev.job_id,
                                "attempt": ev.attempt,
                                "at": from_us(t).isoformat(),
                                "protected_until": None if end >= UNTIL_STARTED else from_us(end).isoformat(),
                            }
                        )
        fold.apply(ev)
    rep.thrash = {j: n for j, n in per_job.items() if n > thrash_over}
    return rep


def _count_preemption(rep: PreemptionReport, per_job: dict[str, int], ev: events.JobPreempted, t: Micros) -> None:
    """Add one ``JobPreempted`` (at ``t``, µs UTC) to the report's counts and rows."""
    rep.total += 1
    per_job[ev.job_id] += 1
    pre = ev.by_budget or ("(drain)" if ev.by_job_id is None else "?")
    rep.pairs[(ev.budget, pre)] = rep.pairs.get((ev.budget, pre), 0) + 1
    rule = ev.victim.rule if ev.victim is not None else ev.reason
    rep.rules[rule] = rep.rules.get(rule, 0) + 1
    rep.jobs.append(
        {
            "job_id": ev.job_id,
            "attempt": ev.attempt,
            "budget": ev.budget,
            "by_job_id": ev.by_job_id,
            "by_budget": pre,
            "rule": rule,
            "lost_gpu_h": None if ev.lost_gpu_s is None else ev.lost_gpu_s / 3600,
            "at": from_us(t).isoformat(),
        }
    )


@dataclass
class SquattingReport:
    """What :func:`squatting_report` found, and what it could see.

    Attributes:
        rows: ``{job_id, attempt, budget, node_id, idle_s, since, idle, source}`` per idle stretch
            longer than the threshold, longest first. ``source``: ``agent`` when the stretch is the node
            agent's own ``idle_s`` report, ``samples`` when the audit computed it from utilisation samples;
            ``idle``: the agent reported the run ``idle`` (past its node's ``idle_after_s``) in at least one
            heartbeat (``False`` where only samples spoke).
        heartbeats: ``NodeHeartbeat`` events read.
        heartbeats_with_utilisation: those in which at least one GPU reports a
            utilisation or a running replica an ``idle_s``; 0 means the log cannot show squatting at all (no
            NVML, or simulated nodes whose agent reports none), not that nobody squats.
        heartbeats_with_idle_report: those in which a running replica carries the agent's ``idle_s``.
    """

    rows: list[dict[str, Any]]
    heartbeats: int
    heartbeats_with_utilisation: int
    heartbeats_with_idle_report: int = 0

    @property
    def blind(self) -> bool:
        """True when no heartbeat carried utilisation: an empty ``rows`` proves nothing."""
        return self.heartbeats_with_utilisation == 0


def squatting_report(
    records: Iterable[LogRecord | events.Event], *, threshold_s: float = 1800.0, util_below_pct: float = 5.0
) -> SquattingReport:
    """Runs whose GPUs showed near-zero utilisation for longer than a threshold.

    From ``NodeHeartbeat`` events, for each running replica listed in a heartbeat:

    * where the entry carries the agent's ``idle_s`` (agents that sample utilisation), that report is
      used as it stands: the stretch lasts ``idle_s`` up to the heartbeat (the agent counts a GPU idle
      below 1 % in each of its samples, whatever ``util_below_pct``), and ``idle`` marks runs the agent
      reported past its node's ``idle_after_s``;
    * otherwise, a heartbeat where every GPU it holds reports utilisation below ``util_below_pct``
      extends its idle stretch, as computed here from the samples; any other heartbeat ends it.

    Heartbeats with neither (no NVML; simulated nodes whose agent reports none, ``--sim-util-seed``
    unset) say nothing; the report counts them (:class:`SquattingReport`).
    """
    budget_of: dict[tuple[str, int], str] = {}
    idle_since: dict[tuple[str, int, str], Micros] = {}
    longest: dict[tuple[str, int, str], tuple[float, Micros]] = {}
    source: dict[tuple[str, int, str], str] = {}
    flagged: set[tuple[str, int, str]] = set()
    beats = measured = reported = 0
    for ev in decoded(records):
        if isinstance(ev, events.JobPlaced):
            budget_of[(ev.job_id, ev.attempt)] = ev.budget
        elif isinstance(ev, events.NodeHeartbeat):
            beats += 1
            agent = any(w.idle_s is not None for w in ev.running)
            reported += agent
            measured += agent or any(g.utilization_pct is not None for g in ev.gpus)
            t = to_us(ev.ts)
            util = {g.index: g.utilization_pct for g in ev.gpus}
            for w in ev.running:
                key = (w.job_id, w.attempt, ev.node_id)
                if w.idle_s is not None:  # the agent's own count
                    idle_since.pop(key, None)
                    if w.idle_s > longest.get(key, (0.0, 0))[0]:
                        longest[key] = (w.idle_s, t - s_to_us(w.idle_s))
                        source[key] = "agent"
                    if w.idle:
                        flagged.add(key)
                    continue
                vals = [util.get(i) for i in w.gpus]
                known = [v for v in vals if v is not None]
                if not vals or len(known) < len(vals):
                    continue
                if all(v < util_below_pct for v in known):
                    start = idle_since.setdefault(key, t)
                    dur = (t - start) / 1e6
                    if dur > longest.get(key, (0.0, 0))[0]:
                        longest[key] = (dur, start)
                        source[key] = "samples"
                else:
                    idle_since.pop(key, None)
    stretches = sorted(
        ((key, d, s) for key, (d, s) in longest.items() if d > threshold_s), key=lambda x: (-x[1], x[0][0])
    )  # longest first, ties by job id (a stable sort: equal keys keep the order they were met)
    rows = [
        {
            "job_id": j,
            "attempt": a,
            "node_id": n,
            "budget": budget_of.get((j, a), "?"),
            "idle_s": d,
            "since": from_us(s).isoformat(),
            "idle": (j, a, n) in flagged,
            "source": source[(j, a, n)],
        }
        for (j, a, n), d, s in stretches
    ]
    return SquattingReport(rows, beats, measured, reported)
