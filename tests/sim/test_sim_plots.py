"""The simulator's plots (apportion.sim.report): the share plot stops at the last submission unless asked,
labels each share, and the goodput/work-lost plot shows one bar per policy with the report's numbers."""

from __future__ import annotations

import io
import re

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from apportion.domain.budgets import BudgetTree
from apportion.sim.report import (
    PolicyReport,
    draw_shares,
    from_json,
    last_submission_days,
    plot,
    plot_budget_shares,
    plot_goodput,
    to_json,
)


def _report(policy: str, goodput: float, lost_gpu_h: float) -> PolicyReport:
    return PolicyReport(
        policy=policy, seed=1, start="2024-01-01T00:00:00+00:00", end="2024-01-04T00:00:00+00:00", jobs=3,
        utilisation=0.8, mean_deficit_pp=0.0, max_deficit_pp=0.0, wait_p50_s=None, wait_p95_s=None,
        unalloc_wait_p50_s=None, unalloc_wait_p95_s=None, never=0, preemptions=2, violations=0, cycles=1, events=9,
        goodput=goodput, lost_gpu_h=lost_gpu_h, lost_pct=1.5, measured_until="2024-01-02T12:00:00+00:00",
        series={"lab/a": [(0.0, 0.1), (1.0, 0.4), (1.5, 0.5), (2.0, 0.9), (3.0, 0.0)], "lab/b": [(0.0, 0.2)]},
    )  # fmt: skip


def test_last_submission_is_measured_from_the_start_in_days() -> None:
    assert last_submission_days(_report("fairshare", 0.7, 10.0)) == 1.5


def test_curves_stop_at_the_cut_and_each_share_is_a_labelled_dashed_line() -> None:
    fig, ax = plt.subplots()
    r = _report("fairshare", 0.7, 10.0)
    draw_shares(ax, r.series, {"lab/a": 0.5, "lab/b": 0.25}, until=1.5)
    solid = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
    dashed = sorted(np.asarray(ln.get_ydata())[0] for ln in ax.get_lines() if ln.get_linestyle() == "--")
    assert max(max(np.asarray(ln.get_xdata())) for ln in solid) == 1.5  # the drain-out after day 1.5 is not drawn
    assert ax.get_xlim()[1] == 1.5
    assert dashed == [0.25, 0.5]
    assert sorted(t.get_text() for t in ax.texts) == ["0.25 b", "0.50 a"]
    plt.close(fig)


def test_budgets_with_one_share_share_one_label() -> None:
    fig, ax = plt.subplots()
    draw_shares(ax, {}, {"lab/a": 0.2, "lab/b": 0.2, "lab/c": 0.1, "x/1": 0.3, "x/2": 0.3, "x/3": 0.3, "x/4": 0.3})
    assert sorted(t.get_text() for t in ax.texts) == ["0.10 c", "0.20 a, b", "0.30 (4 budgets)"]
    plt.close(fig)


def test_plot_stops_at_the_last_submission_unless_asked() -> None:
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})
    r = _report("fairshare", 0.7, 10.0)
    cut, full = io.BytesIO(), io.BytesIO()
    plot([r], tree, cut)
    plot([r], tree, full, to_end=True)
    assert b"to the last submission" in cut.getvalue() and b"to the end" in full.getvalue()
    assert cut.getvalue().startswith(b"<?xml")  # a file object gets SVG


def test_goodput_and_budget_plots_read_the_reports_back_from_simulate_json() -> None:
    reports = from_json(__import__("json").loads(to_json([_report("fairshare", 0.7, 10.0), _report("fifo", 0.8, 0.0)])))
    assert [(r.policy, r.goodput, r.lost_gpu_h) for r in reports] == [("fairshare", 0.7, 10.0), ("fifo", 0.8, 0.0)]
    out = io.BytesIO()
    plot_goodput(reports, out)
    svg = out.getvalue().decode()
    assert "utilisation and goodput" in svg and "work lost" in svg
    assert "fairshare" in svg and "fifo" in svg
    # one bar per policy labelled with its report's number: goodput 70.0 / 80.0 % (utilisation 80.0 % both),
    # work lost 10 and 0 GPU-h (matplotlib writes each text as a comment before its glyphs)
    labels = re.findall(r"<!-- (.*?) -->", svg)
    assert labels.count("70.0") == 1 and labels.count("80.0") == 3
    assert "10 (1.5%)" in labels and "0 (1.5%)" in labels
    out = io.BytesIO()
    plot_budget_shares(reports, out)
    assert "allocated occupancy share per budget" in out.getvalue().decode()
