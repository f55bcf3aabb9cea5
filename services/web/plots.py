"""SVG plots of the dashboard, drawn server-side with matplotlib (no JavaScript).

The drawing of "occupancy share against share" is the simulator report's
(:func:`apportion.sim.report.draw_shares`), and the comparison plots of a
``simulate --json`` file are its :func:`~apportion.sim.report.plot_goodput`
and :func:`~apportion.sim.report.plot_budget_shares`: one look for both.
"""

from __future__ import annotations

import io
from typing import Any

from services.web.logic import ShareSeries, time_axis


def _svg(draw: Any) -> str:
    """Run ``draw(buffer)`` and return the SVG text without its XML prologue (to inline it in a page)."""
    buf = io.BytesIO()
    draw(buf)
    text = buf.getvalue().decode("utf-8")
    return text[text.index("<svg") :]


def budget_svg(series: ShareSeries) -> str:
    """The occupancy share of one budget over the trailing window (solid) against its share (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from apportion.sim.report import draw_shares

    def draw(buf: Any) -> None:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        if series.points and series.end_us is not None:
            xs, unit = time_axis([t for t, _ in series.points], series.end_us)
            pts = list(zip(xs, [v for _, v in series.points]))
        else:
            pts, unit = [], "minutes"
        shares = {series.path: series.abs_share} if series.abs_share is not None else {}
        draw_shares(ax, {series.path: pts}, shares, until=0.0 if pts else None)
        ax.set_xlabel(f"{unit} before the newest snapshot")
        ax.set_ylabel("O_b / K")
        days = series.window_s / 86400
        ax.set_title(f"{series.path}: allocated occupancy share over the trailing {days:g}-day window (dashed: share)")
        fig.tight_layout()
        fig.savefig(buf, format="svg")
        plt.close(fig)

    return _svg(draw)


def simulate_svgs(doc: dict[str, Any]) -> dict[str, str]:
    """The comparison plots of one ``apportion simulate --json`` document: ``goodput`` and ``budgets``."""
    from apportion.sim.report import from_json, plot_budget_shares, plot_goodput

    reports = from_json(doc)
    if not reports:
        return {}
    return {
        "goodput": _svg(lambda buf: plot_goodput(reports, buf)),
        "budgets": _svg(lambda buf: plot_budget_shares(reports, buf)),
    }
