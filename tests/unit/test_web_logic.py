"""The dashboard's view logic (services/web/logic.py): occupancy-share series from snapshots, tree rows, axes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from apportion.events import BudgetUsage, OccupancySnapshot
from services.web.logic import fmt_gpu_h, gpu_totals, share_series, time_axis, tree_rows

T0 = datetime(2026, 1, 1, tzinfo=UTC)
DAY = 86400.0


def _snap(at_s: float, cap_gpu_s: float, occ: dict[str, float], share: float = 0.4) -> OccupancySnapshot:
    return OccupancySnapshot(
        ts=T0 + timedelta(seconds=at_s),
        producer="accounting",
        at=T0 + timedelta(seconds=at_s),
        window_s=7 * DAY,
        capacity_gpus=8,
        capacity_gpu_s=cap_gpu_s,
        budgets=tuple(
            BudgetUsage(path=p, abs_share=share, occupancy_gpu_s=o, unallocated_gpu_s=0.0, entitlement_gpu_s=0.0,
                        ratio=0.0)
            for p, o in occ.items()
        ),
    )  # fmt: skip


def test_share_series_is_occupancy_over_capacity_within_the_newest_window() -> None:
    snaps = [
        _snap(0, 0.0, {"lab/v": 0.0}),  # 8 days before the newest: outside its 7-day window
        _snap(1 * DAY, 1000.0, {"lab/v": 250.0}),
        _snap(8 * DAY, 4000.0, {"lab/v": 1000.0}, share=0.5),
        _snap(5 * DAY, 2000.0, {}),  # out of order, and without the budget: 0
    ]
    s = share_series(snaps, "lab/v")
    us = 1_000_000
    assert [v for _, v in s.points] == [0.25, 0.0, 0.25]
    assert [t for t, _ in s.points] == [int((T0 + timedelta(days=d)).timestamp() * us) for d in (1, 5, 8)]
    assert s.abs_share == 0.5  # the newest snapshot's
    assert s.window_s == 7 * DAY


def test_share_series_without_snapshots_or_with_zero_capacity() -> None:
    assert share_series([], "lab").points == []
    assert share_series([], "lab").end_us is None
    assert share_series([_snap(0, 0.0, {"lab": 5.0})], "lab").points[0][1] == 0.0


@pytest.mark.parametrize(
    ("span_s", "unit", "first"),
    [
        pytest.param(600, "minutes", -10.0, id="ten minutes"),
        pytest.param(7200, "hours", -2.0, id="two hours switch to hours"),
        pytest.param(3 * DAY, "days", -3.0, id="three days"),
    ],
)
def test_time_axis_picks_a_unit_for_the_span(span_s: float, unit: str, first: float) -> None:
    end = 10_000_000_000
    xs, got = time_axis([end - round(span_s * 1e6), end], end)
    assert (got, xs) == (unit, [first, 0.0])


def test_tree_rows_depth_and_name_in_path_order() -> None:
    rows = tree_rows([{"path": "lab/vision"}, {"path": "lab"}, {"path": "lab/prior/robotics"}])
    assert [(r["path"], r["depth"], r["name"]) for r in rows] == [
        ("lab", 0, "lab"),
        ("lab/prior/robotics", 2, "robotics"),
        ("lab/vision", 1, "vision"),
    ]


def test_gpu_totals_and_hours() -> None:
    assert gpu_totals([{"free_gpus": 3, "gpu_count": 8}, {"free_gpus": 0, "gpu_count": 4}]) == (3, 12)
    assert (fmt_gpu_h(5400.0), fmt_gpu_h(90.0), fmt_gpu_h(36000.0 * 12.34)) == ("1.50", "0.03", "123.4")


def test_for_user_and_history_rows_filter_and_order_exactly() -> None:
    from services.web.logic import for_user, history_rows

    rows = [
        {"job_id": "a", "user": "u1", "budget": "lab/x", "submitted_at": "2026-01-01T00:00:00+00:00"},
        {"job_id": "b", "user": "u2", "budget": "lab/x/y", "submitted_at": "2026-01-02T00:00:00+00:00"},
        {"job_id": "c", "user": "u1", "budget": "lab/xy", "submitted_at": "2026-01-02T00:00:00+00:00"},
    ]
    assert [r["job_id"] for r in for_user(rows, "u1")] == ["a", "c"]
    assert [r["job_id"] for r in for_user(rows, "")] == ["a", "b", "c"]
    assert [r["job_id"] for r in history_rows(rows)] == ["c", "b", "a"]  # newest first, ties by id (descending)
    assert [r["job_id"] for r in history_rows(rows, budget="lab/x")] == ["b", "a"]  # not lab/xy
    assert [r["job_id"] for r in history_rows(rows, user="u1", budget="lab/x")] == ["a"]
