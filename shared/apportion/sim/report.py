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
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimResult
from apportion.timeutil import US_PER_S, from_us, us_to_s

__all__ = ["BudgetStats", "PolicyReport", "percentile", "summarise", "to_json", "render_table", "plot"]


@dataclass
class BudgetStats:
    """Figures of one leaf budget (see module docstring)."""

    path: str
    share: float
    alloc_share: float
    free_share: float
    jobs: int
    placed: int
    never: int
    wait_p50_s: float | None
    wait_p95_s: float | None
    preemptions: int
    mean_deficit_pp: float
    backlogged_frac: float


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
    wall_s: float | None = None
    measured_until: str | None = None
    rejected: dict[str, int] = field(default_factory=dict)
    budgets: list[BudgetStats] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); ``None`` for no values."""
    if not values:
        return None
    v = sorted(values)
    k = max(1, math.ceil(q / 100 * len(v)))
    return v[k - 1]


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
    leaves = tree.leaves()
    used = sum(occ.get(p, 0.0) + una.get(p, 0.0) for p in leaves)
    waits: dict[str, list[float]] = {leaf: [] for leaf in leaves}
    alloc_w: list[float] = []
    unalloc_w: list[float] = []
    jobs_of: dict[str, int] = {leaf: 0 for leaf in leaves}
    never: dict[str, int] = {leaf: 0 for leaf in leaves}
    for job_id, sub in result.submitted.items():
        b = result.job_budget[job_id]
        jobs_of[b] = jobs_of.get(b, 0) + 1
        t = result.placed_first.get(job_id)
        if t is None:
            never[b] = never.get(b, 0) + 1
        else:
            w = (t - sub) / US_PER_S
            waits.setdefault(b, []).append(w)
            (alloc_w if result.job_allocated.get(job_id, True) else unalloc_w).append(w)
    warm = result.start_us
    deficits: dict[str, list[float]] = {leaf: [] for leaf in leaves}
    backlogged: dict[str, int] = {leaf: 0 for leaf in leaves}
    n_samples = 0
    for t, row in result.samples:
        n_samples += 1
        for leaf, (share_now, _running, _pending, pending_alloc) in row.items():
            if pending_alloc:
                backlogged[leaf] += 1
                if t >= warm:
                    deficits[leaf].append(max(0.0, tree.abs_share(leaf) - share_now) * 100)
    all_def = [d for v in deficits.values() for d in v]
    stats = []
    for leaf in leaves:
        w = waits.get(leaf, [])
        stats.append(
            BudgetStats(
                path=leaf,
                share=tree.abs_share(leaf),
                alloc_share=occ.get(leaf, 0.0) / cap if cap else 0.0,
                free_share=una.get(leaf, 0.0) / cap if cap else 0.0,
                jobs=jobs_of.get(leaf, 0),
                placed=len(w),
                never=never.get(leaf, 0),
                wait_p50_s=percentile(w, 50),
                wait_p95_s=percentile(w, 95),
                preemptions=result.preemptions.get(leaf, 0),
                mean_deficit_pp=sum(deficits[leaf]) / len(deficits[leaf]) if deficits[leaf] else 0.0,
                backlogged_frac=backlogged[leaf] / n_samples if n_samples else 0.0,
            )
        )
    series = {
        leaf: [(us_to_s(t - result.start_us) / 86400, row[leaf][0]) for t, row in result.samples] for leaf in leaves
    }
    return PolicyReport(
        policy=policy,
        seed=seed,
        start=from_us(result.start_us).isoformat(),
        end=from_us(end).isoformat(),
        jobs=len(result.submitted),
        measured_until=from_us(result.measured_until_us).isoformat() if result.measured_until_us else None,
        utilisation=used / cap if cap else 0.0,
        mean_deficit_pp=sum(all_def) / len(all_def) if all_def else 0.0,
        max_deficit_pp=max(all_def) if all_def else 0.0,
        wait_p50_s=percentile(alloc_w, 50),
        wait_p95_s=percentile(alloc_w, 95),
        unalloc_wait_p50_s=percentile(unalloc_w, 50),
        unalloc_wait_p95_s=percentile(unalloc_w, 95),
        never=sum(never.values()),
        preemptions=sum(result.preemptions.values()),
        violations=len(result.violations),
        cycles=result.cycles,
        events=result.events,
        wall_s=wall_s,
        rejected=dict(sorted((rejected or {}).items())),
        budgets=stats,
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
        "alloc wait p50",
        "alloc wait p95",
        "unalloc wait p50",
        "unalloc wait p95",
        "never placed",
        "preemptions",
        "protection violations",
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
            _fmt_s(r.wait_p50_s),
            _fmt_s(r.wait_p95_s),
            _fmt_s(r.unalloc_wait_p50_s),
            _fmt_s(r.unalloc_wait_p95_s),
            str(r.never),
            str(r.preemptions),
            str(r.violations),
        )
    console.print(t)
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
                f"{b.backlogged_frac:.0%}",
                f"{b.mean_deficit_pp:.2f}",
            )
        console.print(bt)


def markdown_table(reports: list[PolicyReport]) -> str:
    """The policy comparison as a Markdown table (for docs)."""
    lines = [
        "| policy | GPU utilisation | mean share deficit (pp) | max share deficit (pp) | "
        "allocated wait p50 / p95 | unallocated wait p50 / p95 | never placed | preemptions | "
        "protection violations |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in reports:
        lines.append(
            f"| {r.policy} | {r.utilisation:.1%} | {r.mean_deficit_pp:.2f} | {r.max_deficit_pp:.1f} | "
            f"{_fmt_s(r.wait_p50_s)} / {_fmt_s(r.wait_p95_s)} | "
            f"{_fmt_s(r.unalloc_wait_p50_s)} / {_fmt_s(r.unalloc_wait_p95_s)} | {r.never} | "
            f"{r.preemptions} | {r.violations} |"
        )
    return "\n".join(lines)


def plot(reports: list[PolicyReport], tree: BudgetTree, path: str) -> None:
    """PNG: occupancy share (trailing window) per budget over time, one panel per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(reports)
    fig, axes = plt.subplots(n, 1, figsize=(11, 3.2 * n), sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, r in zip(axes[:, 0], reports):
        for i, leaf in enumerate(tree.leaves()):
            pts = r.series.get(leaf, [])
            if not pts:
                continue
            color = cmap(i % 20)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.1, label=leaf.rsplit("/", 1)[-1])
            ax.axhline(tree.abs_share(leaf), color=color, lw=0.7, ls="--")
        ax.set_title(f"{r.policy}: allocated occupancy share over the trailing window (dashed: share)")
        ax.set_ylabel("O_b / K")
    axes[-1, 0].set_xlabel("days since start")
    axes[0, 0].legend(ncol=7, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
