"""The bursting claim, measured: GPU-hours each budget ran above its share, and its GPU-hours against static partitions.

The seed's claim was that bursting on idle capacity "felt like an extra 30%
compute". Per leaf budget b and policy, over the span with sustained demand
(first to last submission, as utilisation):

* ``gpu_h``: GPU-hours its runs held (allocated and unallocated), from the
  simulator's whole-run ledger at the last submission (``SimResult.measured``);
* ``burst_gpu_h``: GPU-hours it ran above its share, ``sum over samples of
  max(0, running_b - abs_share(b) * C) * (time to the next sample)`` with C the
  cluster's GPUs and ``running_b`` the GPUs of its non-stopping runs at each
  sample (hourly by default: ``SimConfig.sample_s``; the last sample before
  the last submission counts up to it). GPUs above a budget's share are GPUs
  the other budgets' shares left idle at that moment, or that the policy lent
  it and may take back;
* ``ratio``: ``gpu_h`` under the policy / ``gpu_h`` under static partitions
  (``None`` without a static run, or when static gave it nothing): above 1 the
  budget gained compute against owning its slice, below 1 it lost some.

Pure: functions of simulation results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.sim.core import SimResult

__all__ = ["BurstRow", "burst_rows", "with_ratios", "to_dicts", "render_bursting"]


@dataclass(frozen=True, slots=True)
class BurstRow:
    """One leaf budget's bursting figures under one policy (module docstring)."""

    budget: str
    share: float
    gpu_h: float
    burst_gpu_h: float
    static_gpu_h: float | None = None
    ratio: float | None = None


def burst_rows(result: SimResult, tree: BudgetTree) -> list[BurstRow]:
    """``gpu_h`` and ``burst_gpu_h`` of every leaf (no ratio yet: :func:`with_ratios`), leaves in path order."""
    cap = result.capacity_gpus
    until = result.measured_until_us if result.measured_until_us is not None else result.end_us
    occ, una, _k = result.measured if result.measured is not None else ({}, {}, 0.0)
    burst: dict[str, float] = {}
    samples = [s for s in result.samples if s[0] <= until]
    for i, (t, row) in enumerate(samples):
        nxt = samples[i + 1][0] if i + 1 < len(samples) else until
        dt_h = max(0, nxt - t) / 3.6e9
        for leaf, (_share_now, running, _pending, _pending_alloc) in row.items():
            over = running - tree.abs_share(leaf) * cap
            if over > 0:
                burst[leaf] = burst.get(leaf, 0.0) + over * dt_h
    return [
        BurstRow(
            budget=leaf,
            share=tree.abs_share(leaf),
            gpu_h=(occ.get(leaf, 0.0) + una.get(leaf, 0.0)) / 3600.0,
            burst_gpu_h=burst.get(leaf, 0.0),
        )
        for leaf in sorted(tree.leaves())
    ]


def with_ratios(rows: dict[str, list[BurstRow]], baseline: str = "static") -> dict[str, list[BurstRow]]:
    """Each policy's rows with ``static_gpu_h`` and ``ratio`` against ``baseline``'s rows (unchanged without one)."""
    base = {r.budget: r.gpu_h for r in rows.get(baseline, [])}
    if not base:
        return rows
    out: dict[str, list[BurstRow]] = {}
    for policy, lst in rows.items():
        out[policy] = [
            BurstRow(
                r.budget,
                r.share,
                r.gpu_h,
                r.burst_gpu_h,
                base.get(r.budget),
                r.gpu_h / base[r.budget] if base.get(r.budget) else None,
            )
            for r in lst
        ]
    return out


def to_dicts(rows: dict[str, list[BurstRow]], baseline: str = "static") -> dict[str, Any]:
    """The ``bursting`` key of ``apportion simulate --json``: ``{"baseline", "policies": {policy: [row, ...]}}``."""
    return {"baseline": baseline, "policies": {p: [asdict(r) for r in lst] for p, lst in rows.items()}}


def render_bursting(rows: dict[str, list[BurstRow]], console: Any, policy: str = "fairshare") -> None:
    """Print the bursting table of ``policy`` (with its ratios against static partitions when there are any)."""
    from rich.table import Table

    lst = rows.get(policy)
    if not lst:
        return
    t = Table(title=f"bursting: {policy} against static partitions (first to last submission)")
    for col in ("budget", "share", "GPU-h", "GPU-h above share", "static GPU-h", "ratio to static"):
        t.add_column(col, justify="left" if col == "budget" else "right", no_wrap=col == "budget")
    for r in lst:
        t.add_row(
            r.budget,
            f"{r.share:.3f}",
            f"{r.gpu_h:,.0f}",
            f"{r.burst_gpu_h:,.0f}",
            "-" if r.static_gpu_h is None else f"{r.static_gpu_h:,.0f}",
            "-" if r.ratio is None else f"{r.ratio:.2f}",
        )
    console.print(t)
