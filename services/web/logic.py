"""Pure view logic of the dashboard: rows in, what the pages show out (no Redis, Kafka or clock).

The numbers themselves come from the functions the CLI prints (``share_data``, ``queue_rows``,
``node_rows`` of :mod:`apportion.cli.main`, :func:`apportion.audit.explain.explain`); this module only
arranges them (tree depth, GPU totals) and derives the one series the CLI has no command for: a budget's
occupancy share over time from the log's ``OccupancySnapshot`` events.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from apportion.events import OccupancySnapshot
from apportion.timeutil import to_us


def fmt_gpu_h(gpu_s: Any) -> str:
    """GPU-seconds as GPU-hours: one decimal as the CLI's ``O GPU-h`` columns, two below 10 GPU-h (a young
    window is not all zeros). The exact GPU-seconds are the cell's ``data-value``."""
    h = float(gpu_s or 0.0) / 3600
    return f"{h:.2f}" if h < 10 else f"{h:.1f}"


def tree_rows(budgets: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Budget rows in path order with ``depth`` (0 for a top-level budget) and ``name`` (the last part).

    Args:
        budgets: rows of ``share_data(...)["budgets"]``.
    """
    out = []
    for row in sorted(budgets, key=lambda r: str(r.get("path", ""))):
        path = str(row.get("path", ""))
        out.append({**row, "depth": path.count("/"), "name": path.rsplit("/", 1)[-1]})
    return out


def gpu_totals(nodes: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """``(free, total)`` GPUs over ``nodes`` rows (``free_gpus``, ``gpu_count``)."""
    free = total = 0
    for n in nodes:
        free += int(n.get("free_gpus", 0) or 0)
        total += int(n.get("gpu_count", 0) or 0)
    return free, total


@dataclass(frozen=True)
class ShareSeries:
    """A budget's occupancy share over the trailing window, from the log's snapshots.

    Attributes:
        path: the budget.
        points: ``(snapshot time µs, O_b / K)`` in time order (K = 0 gives 0).
        abs_share: the budget's absolute share in the newest snapshot (None: not in it).
        window_s: the window W of the newest snapshot.
        end_us: time of the newest snapshot (the right edge).
    """

    path: str
    points: list[tuple[int, float]]
    abs_share: float | None
    window_s: float
    end_us: int | None


def share_series(snapshots: Iterable[OccupancySnapshot], path: str) -> ShareSeries:
    """Occupancy share ``O_b / K`` of ``path`` at each snapshot within the trailing window of the newest one.

    The window is the newest snapshot's ``window_s``: points older than ``end - W`` are left out, so the
    plot covers the same trailing window the share table reports. A snapshot without the budget counts 0.

    Args:
        snapshots: ``OccupancySnapshot`` events in any order (duplicates by ``at`` are kept once, the last).
        path: the budget.
    """
    by_at: dict[int, OccupancySnapshot] = {}
    for s in snapshots:
        by_at[to_us(s.at)] = s
    if not by_at:
        return ShareSeries(path, [], None, 0.0, None)
    end = max(by_at)
    newest = by_at[end]
    start = end - round(newest.window_s * 1e6)
    pts = []
    for t in sorted(by_at):
        if t < start:
            continue
        s = by_at[t]
        occ = next((b.occupancy_gpu_s for b in s.budgets if b.path == path), 0.0)
        pts.append((t, occ / s.capacity_gpu_s if s.capacity_gpu_s > 0 else 0.0))
    share = next((b.abs_share for b in newest.budgets if b.path == path), None)
    return ShareSeries(path, pts, share, newest.window_s, end)


def time_axis(points_us: list[int], end_us: int) -> tuple[list[float], str]:
    """x values relative to ``end_us`` (<= 0) in a unit that suits the span: minutes, hours or days.

    Returns:
        ``(xs, unit)`` with unit ``"minutes"``, ``"hours"`` or ``"days"``.
    """
    span_s = (end_us - min(points_us)) / 1e6 if points_us else 0.0
    unit, div = ("minutes", 60.0) if span_s < 7200 else ("hours", 3600.0) if span_s < 172800 else ("days", 86400.0)
    return [(t - end_us) / 1e6 / div for t in points_us], unit


def data_value(v: Any) -> str:
    """``data-value`` text: the JSON the CLI prints for ``v`` (``Infinity`` for +inf, ``null`` for None)."""
    if isinstance(v, float) and math.isinf(v):
        return "Infinity"
    if isinstance(v, str):
        return v
    return json.dumps(v)


def for_user(rows: Iterable[Mapping[str, Any]], user: str | None) -> list[dict[str, Any]]:
    """``?user=U`` ("my jobs"): the rows of that user, in their order; every row when ``user`` is empty."""
    return [dict(r) for r in rows if not user or r.get("user") == user]


def history_rows(
    jobs: Iterable[Mapping[str, Any]], *, user: str | None = None, budget: str | None = None
) -> list[dict[str, Any]]:
    """``/history``: every job the log tells (``apportion history --json`` rows: :meth:`JobHistory.to_dict`),
    newest submission first (ties by job id), of ``user`` and of ``budget`` or below when given."""
    rows = [
        dict(j)
        for j in jobs
        if (not user or j.get("user") == user)
        and (not budget or j.get("budget") == budget or str(j.get("budget", "")).startswith(budget + "/"))
    ]
    rows.sort(key=lambda r: (str(r.get("submitted_at", "")), str(r.get("job_id", ""))), reverse=True)
    return rows
