"""Simulation reports: per-policy and per-budget figures, as a table, JSON and a PNG.

Definitions (all over the simulated span ``[start, end]``):

* **utilisation**: GPU-seconds held by running runs (allocated and
  unallocated) / capacity GPU-seconds, from the first to the last
  submission (the drain-out tail after the last submission is left out).
* **occupancy share** of a budget: its allocated GPU-seconds / capacity
  GPU-seconds over the same span (``alloc``), and its unallocated ones
  (``free``).
* **share deficit** (the promise budgets make): at every sample time
  (hourly, until the queue is empty), for every budget with allocated work
  waiting, ``max(0, share - O_b/K)`` over the trailing window. Reported as
  the mean over those (sample, budget) pairs and the max, in percentage
  points. 0 means no budget that wanted its share was held below it.
* **wait**: first placement minus submission, per job, p50 and p95 in
  seconds over placed jobs, for allocated jobs (the ones budgets promise
  to serve) and unallocated ones (free, idle GPUs only) separately;
  ``never`` counts jobs still unplaced at the end, including the ones
  admission rejected (``rejected``: reason -> count, e.g. ``unknown_budget``,
  ``not_a_leaf``, ``shape_impossible``; such a job is never queued).
* **preemptions**: ``JobPreempted`` events (victims, incl. drains).
* **protection violations**: preemptions of a run inside its minimum runtime
  (must be 0).
* **attainable share deficit** (``mean_attainable_deficit_pp``): the share deficit with each budget's share
  replaced by its attainable share ``min(share, u_b)``, where ``u_b`` is the fraction of the cluster's GPUs
  on models that some allocated job the budget has waiting can use (a job without a model constraint: every
  GPU, so ``u_b = 1``; :func:`apportion.sim.core.usable_fraction`); equal to the plain deficit on a cluster of
  one model.
* **idle while waiting** (``idle_waiting_alloc_gpu_h``, ``idle_waiting_unalloc_gpu_h``): GPU-hours
  idle while a job that fits them waits, allocated and unallocated waiting jobs separately, over the
  whole run; "fits" and the formula are in :mod:`apportion.sim.conservation`. 0 is work-conserving.
* **goodput**: (GPU-seconds held - work lost) / capacity GPU-seconds over the
  span of utilisation (first to last submission; work lost by stops in that
  span), so ``utilisation - goodput`` is the share of capacity thrown away.
* **work lost** (``lost_gpu_h``) and ``lost_pct`` (of the GPU-hours held,
  ``held_gpu_h``), **completed**, **job completion time** (``jct_p50_s`` /
  ``jct_p95_s``, completion - submission of completed jobs),
  ``preemptions_per_job_hour`` and ``max_preemptions_per_job``: over the whole
  run (until every job is done, or the clock's stop), from the log's events
  (:mod:`apportion.report`, which defines them); ``unfinished`` counts the
  admitted jobs not completed by the end.
* **deficit by day** (``deficit_by_day_pp``): per budget, per day of the run (day 0 from its start), the
  deficits of its (sample, budget) pairs of that day summed and divided by the number of pairs of the whole
  run: where the mean accrues; over every budget and day they add up to ``mean_deficit_pp``.
* **censored job completion time** (``jct_censored_p50_s`` / ``jct_censored_p95_s``): over every
  submitted job, completion - submission for a completed one and (end of the run - submission) for one
  not completed (:func:`censored_jct_s`), so a policy that leaves jobs unplaced or unfinished is not
  rewarded by their absence from the plain figure.

Per-budget rows come from :func:`apportion.report.budget_rows`, the function
the log report (:func:`apportion.audit.report.log_report`) uses too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.report import BudgetRow, JobLedger, budget_rows, percentile, share_deficit_pp
from apportion.sim.core import SimResult
from apportion.timeutil import US_PER_S, Micros, from_us, us_to_s

__all__ = [
    "BudgetStats",
    "PolicyReport",
    "censored_jct_s",
    "percentile",
    "summarise",
    "to_json",
    "from_json",
    "render_table",
    "plot",
    "plot_goodput",
    "plot_budget_shares",
    "draw_shares",
]

DAY_US = 86_400 * US_PER_S

#: Per-budget figures (one definition with the log report: :class:`apportion.report.BudgetRow`).
BudgetStats = BudgetRow


@dataclass
class PolicyReport:
    """Figures of one policy run."""

    policy: str
    seed: int
    start: str
    end: str
    jobs: int
    utilisation: float
    mean_deficit_pp: float
    max_deficit_pp: float
    wait_p50_s: float | None
    wait_p95_s: float | None
    unalloc_wait_p50_s: float | None
    unalloc_wait_p95_s: float | None
    never: int
    preemptions: int
    violations: int
    cycles: int
    events: int
    goodput: float = 0.0
    completed: int = 0
    unfinished: int = 0
    jct_p50_s: float | None = None
    jct_p95_s: float | None = None
    jct_censored_p50_s: float | None = None
    jct_censored_p95_s: float | None = None
    held_gpu_h: float = 0.0
    lost_gpu_h: float = 0.0
    lost_pct: float = 0.0
    preemptions_per_job_hour: float = 0.0
    max_preemptions_per_job: int = 0
    max_preemptions_allocated: int = 0
    checkpoints: int = 0
    mean_attainable_deficit_pp: float = 0.0
    idle_waiting_alloc_gpu_h: float = 0.0
    idle_waiting_unalloc_gpu_h: float = 0.0
    horizon: str | None = None
    wall_s: float | None = None
    measured_until: str | None = None
    rejected: dict[str, int] = field(default_factory=dict)
    deficit_by_day_pp: dict[str, list[float]] = field(default_factory=dict)
    budgets: list[BudgetStats] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def censored_jct_s(
    submitted: Mapping[str, tuple[Micros, str, bool]], completed: Mapping[str, Micros], end_us: Micros
) -> list[float]:
    """Completion time of every submitted job in seconds, censored at the run's end: completion - submission
    for a job in ``completed``, ``end_us`` - submission for any other (module docstring)."""
    return [us_to_s(completed.get(job_id, end_us) - sub) for job_id, (sub, _budget, _alloc) in submitted.items()]


def summarise(
    result: SimResult,
    tree: BudgetTree,
    policy: str,
    seed: int,
    wall_s: float | None = None,
    rejected: dict[str, int] | None = None,
) -> PolicyReport:
    """Figures of one run (definitions in the module docstring); ``rejected``: reason -> jobs refused at admission."""
    end = result.end_us
    occ, una, cap = result.measured if result.measured is not None else ({}, {}, 0.0)
    measured_until = result.measured_until_us
    total = result.total
    at = max(end, total.clock or end)
    if not cap and total.clock is not None and total.capacity_gpu_s(at) > 0:
        # every submission at one instant: the span to the last submission is empty, so measure the whole run
        occ, una, cap, measured_until = total.occupancy(at), total.unallocated(at), total.capacity_gpu_s(at), at
    leaves = tree.leaves()
    used = sum(occ.get(p, 0.0) + una.get(p, 0.0) for p in leaves)
    jobs = result.jobs_ledger
    if not jobs.submitted and result.log:  # a result built without the live fold: fold its log
        jobs = JobLedger().apply_all(result.log)
    alloc_w: list[float] = []
    unalloc_w: list[float] = []
    for job_id, sub in result.submitted.items():
        t = result.placed_first.get(job_id)
        if t is not None:
            (alloc_w if result.job_allocated.get(job_id, True) else unalloc_w).append(us_to_s(t - sub))
    warm = result.start_us
    deficits: dict[str, list[float]] = {leaf: [] for leaf in leaves}
    backlogged: dict[str, int] = {leaf: 0 for leaf in leaves}
    by_day: dict[str, dict[int, float]] = {leaf: {} for leaf in leaves}  # leaf -> day -> deficits summed
    n_samples = 0
    for t, row in result.samples:
        n_samples += 1
        for leaf, (share_now, _running, _pending, pending_alloc) in row.items():
            if pending_alloc:
                backlogged[leaf] += 1
                if t >= warm:
                    d = share_deficit_pp(tree.abs_share(leaf), share_now)
                    deficits[leaf].append(d)
                    day = (t - result.start_us) // DAY_US
                    by_day[leaf][day] = by_day[leaf].get(day, 0.0) + d
    all_def = [d for v in deficits.values() for d in v]
    days = 1 + max((day for v in by_day.values() for day in v), default=-1)
    deficit_by_day = {leaf: [by_day[leaf].get(day, 0.0) / len(all_def) for day in range(days)] for leaf in leaves}
    attainable: list[float] = []  # the same (sample, budget) pairs, against the attainable share
    for i, (t, row) in enumerate(result.samples):
        bound = result.usable[i] if i < len(result.usable) else {}
        for leaf, (share_now, _running, _pending, pending_alloc) in row.items():
            if pending_alloc and t >= warm:
                share = tree.abs_share(leaf)
                attainable.append(share_deficit_pp(min(share, bound.get(leaf, 1.0)), share_now))
    held_a, held_u = total.occupancy(at), total.unallocated(at)
    held = {p: held_a.get(p, 0.0) + held_u.get(p, 0.0) for p in leaves}
    tot = budget_rows(
        tree,
        jobs,
        occ=occ,
        una=una,
        cap=cap,
        held=held,
        measured_until_us=measured_until,
        end_us=end,
        deficits=deficits,
        backlogged={leaf: backlogged[leaf] / n_samples if n_samples else 0.0 for leaf in leaves},
    )
    series = {
        leaf: [(us_to_s(t - result.start_us) / 86400, row[leaf][0]) for t, row in result.samples] for leaf in leaves
    }
    never = sum(1 for job_id in result.submitted if job_id not in result.placed_first)  # unknown budgets too
    censored = censored_jct_s(jobs.submitted, jobs.completed, end)
    n_rejected = sum((rejected or {}).values())
    return PolicyReport(
        policy=policy,
        seed=seed,
        start=from_us(result.start_us).isoformat(),
        end=from_us(end).isoformat(),
        jobs=len(result.submitted),
        measured_until=from_us(measured_until).isoformat() if measured_until else None,
        utilisation=used / cap if cap else 0.0,
        mean_deficit_pp=sum(all_def) / len(all_def) if all_def else 0.0,
        max_deficit_pp=max(all_def) if all_def else 0.0,
        mean_attainable_deficit_pp=sum(attainable) / len(attainable) if attainable else 0.0,
        wait_p50_s=percentile(alloc_w, 50),
        wait_p95_s=percentile(alloc_w, 95),
        unalloc_wait_p50_s=percentile(unalloc_w, 50),
        unalloc_wait_p95_s=percentile(unalloc_w, 95),
        never=never,
        preemptions=sum(result.preemptions.values()),
        violations=len(result.violations),
        cycles=result.cycles,
        events=result.events,
        goodput=tot.goodput,
        completed=tot.completed,
        unfinished=len(result.submitted) - n_rejected - tot.completed,
        jct_p50_s=tot.jct_p50_s,
        jct_p95_s=tot.jct_p95_s,
        jct_censored_p50_s=percentile(censored, 50),
        jct_censored_p95_s=percentile(censored, 95),
        held_gpu_h=tot.held_gpu_h,
        lost_gpu_h=tot.lost_gpu_h,
        lost_pct=tot.lost_pct,
        preemptions_per_job_hour=tot.preemptions_per_job_hour,
        max_preemptions_per_job=tot.max_preemptions_per_job,
        max_preemptions_allocated=tot.max_preemptions_allocated,
        checkpoints=jobs.checkpoints,
        idle_waiting_alloc_gpu_h=result.idle_waiting_gpu_s[0] / 3600,
        idle_waiting_unalloc_gpu_h=result.idle_waiting_gpu_s[1] / 3600,
        wall_s=wall_s,
        rejected=dict(sorted((rejected or {}).items())),
        deficit_by_day_pp=deficit_by_day,
        budgets=tot.rows,
        series=series,
    )


def to_json(reports: list[PolicyReport], *, series: bool = False, **meta: Any) -> str:
    """Reports as a JSON document (``series`` adds the sampled share curves)."""
    docs = []
    for r in reports:
        d = asdict(r)
        if not series:
            d.pop("series")
        docs.append(d)
    return json.dumps({**meta, "policies": docs}, indent=2, sort_keys=False)


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    if v < 120:
        return f"{v:.0f}s"
    if v < 7200:
        return f"{v / 60:.0f}m"
    return f"{v / 3600:.1f}h"


def render_table(reports: list[PolicyReport], console: Any = None, budgets: bool = True) -> None:
    """Print the comparison (and per-budget tables) with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="policies side by side")
    for col in (
        "policy",
        "util",
        "mean deficit pp",
        "max deficit pp",
        "attainable deficit pp",
        "alloc wait p50",
        "alloc wait p95",
        "unalloc wait p50",
        "unalloc wait p95",
        "never placed",
        "preemptions",
        "protection violations",
        "idle while waiting GPU-h (alloc / unalloc)",
    ):
        if col == "policy":  # names are never cut ("fai…")
            t.add_column(col, no_wrap=True, min_width=max(len(r.policy) for r in reports) if reports else None)
        else:
            t.add_column(col, justify="right")
    for r in reports:
        t.add_row(
            r.policy,
            f"{r.utilisation:.1%}",
            f"{r.mean_deficit_pp:.2f}",
            f"{r.max_deficit_pp:.1f}",
            f"{r.mean_attainable_deficit_pp:.2f}",
            _fmt_s(r.wait_p50_s),
            _fmt_s(r.wait_p95_s),
            _fmt_s(r.unalloc_wait_p50_s),
            _fmt_s(r.unalloc_wait_p95_s),
            str(r.never),
            str(r.preemptions),
            str(r.violations),
            f"{r.idle_waiting_alloc_gpu_h:,.0f} / {r.idle_waiting_unalloc_gpu_h:,.0f}",
        )
    console.print(t)
    g = Table(title="goodput and work lost (whole run; goodput over utilisation's span)")
    for col in (
        "policy",
        "util",
        "goodput",
        "held GPU-h",
        "lost GPU-h",
        "lost %",
        "checkpoints",
        "completed",
        "unfinished",
        "JCT p50",
        "JCT p95",
        "JCT p95 censored",
        "preempt / job-h",
        "max preempt / job",
        "max (allocated)",
    ):
        if col == "policy":
            g.add_column(col, no_wrap=True, min_width=max(len(r.policy) for r in reports) if reports else None)
        else:
            g.add_column(col, justify="right")
    for r in reports:
        g.add_row(
            r.policy,
            f"{r.utilisation:.1%}",
            f"{r.goodput:.1%}",
            f"{r.held_gpu_h:,.0f}",
            f"{r.lost_gpu_h:,.0f}",
            f"{r.lost_pct:.1f}%",
            str(r.checkpoints),
            str(r.completed),
            str(r.unfinished),
            _fmt_s(r.jct_p50_s),
            _fmt_s(r.jct_p95_s),
            _fmt_s(r.jct_censored_p95_s),
            f"{r.preemptions_per_job_hour:.3f}",
            str(r.max_preemptions_per_job),
            str(r.max_preemptions_allocated),
        )
    console.print(g)
    for r in reports:
        if r.rejected:
            why = ", ".join(f"{n} {reason}" for reason, n in r.rejected.items())
            console.print(
                f"{r.policy}: {sum(r.rejected.values())} jobs rejected at admission ({why}); counted in never placed"
            )
    if not budgets:
        return
    for r in reports:
        bt = Table(title=f"{r.policy}: per budget")
        for col in (
            "budget",
            "share",
            "alloc",
            "free",
            "jobs",
            "never",
            "wait p50",
            "wait p95",
            "preempted",
            "backlogged",
            "mean deficit pp",
            "goodput",
            "lost GPU-h",
            "lost %",
            "completed",
            "JCT p50",
            "JCT p95",
            "preempt / job-h",
            "max preempt / job",
        ):
            if col == "budget":  # paths are never cut
                bt.add_column(col, no_wrap=True, min_width=max((len(b.path) for b in r.budgets), default=6))
            else:
                bt.add_column(col, justify="right")
        for b in r.budgets:
            bt.add_row(
                b.path,
                f"{b.share:.3f}",
                f"{b.alloc_share:.3f}",
                f"{b.free_share:.3f}",
                str(b.jobs),
                str(b.never),
                _fmt_s(b.wait_p50_s),
                _fmt_s(b.wait_p95_s),
                str(b.preemptions),
                f"{b.backlogged_frac or 0.0:.0%}",
                f"{b.mean_deficit_pp or 0.0:.2f}",
                f"{b.goodput:.3f}",
                f"{b.lost_gpu_h:,.0f}",
                f"{b.lost_pct:.1f}%",
                str(b.completed),
                _fmt_s(b.jct_p50_s),
                _fmt_s(b.jct_p95_s),
                f"{b.preemptions_per_job_hour:.3f}",
                str(b.max_preemptions_per_job),
            )
        console.print(bt)


def last_submission_days(report: PolicyReport) -> float | None:
    """Days from the run's start to its last submission (``measured_until``), the span figures are measured on."""
    if not report.measured_until:
        return None
    start, until = datetime.fromisoformat(report.start), datetime.fromisoformat(report.measured_until)
    return (until - start).total_seconds() / 86400


def draw_shares(
    ax: Any,
    series: dict[str, list[tuple[float, float]]],
    shares: dict[str, float],
    *,
    until: float | None = None,
    labels: bool = True,
) -> None:
    """Draw each budget's occupancy share (solid) and its share (dashed, labelled at the right edge) on ``ax``.

    The one drawing of "occupancy share against share": the simulator's report (:func:`plot`) and the web
    dashboard's budget page both use it, so the two read alike.

    Args:
        ax: a matplotlib ``Axes``.
        series: budget path -> ``[(x, occupancy share), ...]`` in x order (x: days, or any time unit).
        shares: budget path -> its absolute share (the promise), drawn as a dashed line; budgets with a share
            and no series still get their line.
        until: cut the curves at this x (e.g. the last submission), None for all of them.
        labels: write ``name share`` at the right end of each dashed line.
    """
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10" if len(shares) <= 10 else "tab20")
    xs = [x for pts in series.values() for x, _ in pts if until is None or x <= until]
    right = until if until is not None else (max(xs) if xs else 1.0)
    same: dict[float, list[tuple[str, Any]]] = {}  # budgets with one share get one label
    for i, path in enumerate(sorted(set(series) | set(shares))):
        color = cmap(i % cmap.N)
        name = path.rsplit("/", 1)[-1]
        pts = [p for p in series.get(path, []) if until is None or p[0] <= until]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.4, label=name)
        share = shares.get(path)
        if share is not None:
            ax.axhline(share, color=color, lw=0.9, ls="--")
            same.setdefault(round(share, 4), []).append((name, color))
    if labels and same:
        ax.set_ylim(bottom=0)
        lo, hi = ax.get_ylim()
        gap, last = 0.045 * (hi - lo), None
        for share in sorted(same):  # bottom up, each label at least `gap` above the one below it
            names = same[share]
            y = share if last is None else max(share, last + gap)
            last = y
            text = f"{share:.2f} " + (", ".join(n for n, _ in names) if len(names) <= 3 else f"({len(names)} budgets)")
            ax.annotate(
                text,
                (right, y),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color=names[0][1] if len(names) == 1 else "black",
                annotation_clip=False,
            )
    ax.set_ylim(bottom=0)
    if xs or until is not None:
        ax.set_xlim(left=min(xs) if xs else 0.0, right=right)
    ax.grid(alpha=0.3)


def plot(reports: list[PolicyReport], tree: BudgetTree, path: Any, *, to_end: bool = False) -> None:
    """Occupancy share (trailing window) per budget over time, one panel per policy; dashed lines mark shares.

    Args:
        reports: the policies' reports (with their ``series``).
        tree: the budget tree (leaf shares).
        path: file name (the format follows the suffix: ``.png``, ``.svg``) or a binary file object (SVG).
        to_end: draw the drain-out after the last submission too (default: stop at the last submission,
            the span the figures are measured on, so an emptying queue does not read as unfairness).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(reports)
    fig, axes = plt.subplots(n, 1, figsize=(11, 3.2 * n), sharex=True, squeeze=False)
    leaves = tree.leaves()
    for ax, r in zip(axes[:, 0], reports):
        until = None if to_end else last_submission_days(r)
        draw_shares(
            ax, {leaf: r.series.get(leaf, []) for leaf in leaves}, {p: tree.abs_share(p) for p in leaves}, until=until
        )
        span = "to the end" if until is None else "to the last submission"
        ax.set_title(f"{r.policy}: allocated occupancy share over the trailing window, {span} (dashed: share)")
        ax.set_ylabel("O_b / K")
    axes[-1, 0].set_xlabel("days since start")
    axes[0, 0].legend(ncol=7, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=None if isinstance(path, str) else "svg")
    plt.close(fig)


def plot_goodput(reports: list[PolicyReport], path: Any) -> None:
    """Per policy: utilisation and goodput (bars, % of capacity) and work lost (bars, GPU-hours), side by side.

    The gap between a policy's utilisation and its goodput is the capacity its preemptions threw away
    (definitions in the module docstring).

    Args:
        reports: the policies' reports.
        path: file name (format from the suffix) or a binary file object (SVG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in reports]
    x = list(range(len(reports)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    w = 0.38
    util = [100 * r.utilisation for r in reports]
    good = [100 * r.goodput for r in reports]
    b1 = left.bar([i - w / 2 for i in x], util, w, label="utilisation", color="#9ecae1")
    b2 = left.bar([i + w / 2 for i in x], good, w, label="goodput", color="#3182bd")
    left.bar_label(b1, fmt="%.1f", fontsize=7)
    left.bar_label(b2, fmt="%.1f", fontsize=7)
    left.set_ylabel("% of capacity GPU-seconds")
    left.set_title("utilisation and goodput")
    left.set_ylim(0, 100)
    left.legend(fontsize=8, loc="lower right")
    lost = [r.lost_gpu_h for r in reports]
    b3 = right.bar(x, lost, 0.6, color="#de2d26")
    right.bar_label(b3, labels=[f"{r.lost_gpu_h:,.0f} ({r.lost_pct:.1f}%)" for r in reports], fontsize=7)
    right.set_ylim(0, max(lost) * 1.15 if any(lost) else 1.0)
    right.set_ylabel("GPU-hours")
    right.set_title("work lost (since each preempted run's last checkpoint)")
    for ax in (left, right):
        ax.set_xticks(x, names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=None if isinstance(path, str) else "svg")
    plt.close(fig)


def from_json(doc: dict[str, Any]) -> list[PolicyReport]:
    """The reports of a :func:`to_json` document (``apportion simulate --json``), for the plots."""
    out = []
    for d in doc.get("policies", []):
        fields = {k: v for k, v in d.items() if k in PolicyReport.__dataclass_fields__}
        fields["budgets"] = [BudgetStats(**b) for b in d.get("budgets", [])]
        fields["series"] = {k: [tuple(p) for p in v] for k, v in (d.get("series") or {}).items()}
        out.append(PolicyReport(**fields))
    return out


def plot_budget_shares(reports: list[PolicyReport], path: Any) -> None:
    """Per budget: its share (black tick) and each policy's allocated occupancy share (bars), over the span.

    ``alloc_share`` of :class:`~apportion.report.BudgetRow`: allocated GPU-seconds over capacity GPU-seconds
    from the first to the last submission, so a bar below the tick is a budget served less than its share
    (when it had the demand).

    Args:
        reports: the policies' reports (their ``budgets`` rows).
        path: file name (format from the suffix) or a binary file object (SVG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({b.path for r in reports for b in r.budgets})
    share = {b.path: b.share for r in reports for b in r.budgets}
    fig, ax = plt.subplots(figsize=(11, 3.6))
    n = max(1, len(reports))
    w = 0.8 / n
    cmap = plt.get_cmap("tab10")
    for i, r in enumerate(reports):
        alloc = {b.path: b.alloc_share for b in r.budgets}
        xs = [j - 0.4 + w * (i + 0.5) for j in range(len(paths))]
        ax.bar(xs, [alloc.get(p, 0.0) for p in paths], w, label=r.policy, color=cmap(i % 10))
    for j, p in enumerate(paths):
        ax.hlines(share[p], j - 0.45, j + 0.45, colors="black", lw=1.6)
    ax.set_xticks(range(len(paths)), [p.rsplit("/", 1)[-1] for p in paths], fontsize=8, rotation=30, ha="right")
    ax.set_ylabel("allocated GPU-s / capacity GPU-s")
    ax.set_title("allocated occupancy share per budget, to the last submission (black: share)")
    ax.legend(fontsize=8, ncol=len(reports))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format=None if isinstance(path, str) else "svg")
    plt.close(fig)
