"""``apportion usage --by-user``: GPU-hours per budget and user over the window, from the log, with the
accounting's own fold (a lost run is charged to its last heartbeat, as everywhere).

The log (all times from T0, hours):

* j1 alice, lab/a, allocated, 2 GPUs, 0 -> 3 h (completed): 6 GPU-h;
* j2 bob,   lab/a, allocated, 4 GPUs, 1 -> 2 h (lost at 2.5 h, charged until 2 h): 4 GPU-h;
* j3 bob,   lab/a, unallocated, 1 GPU, 0 -> 2 h (completed): 2 unallocated GPU-h;
* j4 carol, lab/b, allocated, 1 GPU, 0 -> 1 h, its JobPlaced without a user (an older record): the user
  comes from its JobQueued;
* j5 alice, lab/a, allocated, 8 GPUs, from -30 h to -26 h: outside a 24 h window at 3 h.
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.cli.history import usage_rows
from apportion.domain.user_usage import UserUsage, usage_by_user
from tests.kit.builders import completed, dt, h, job_lost, placed


def queued(job_id: str, user: str, budget: str) -> ev.JobQueued:
    return ev.JobQueued(
        job_id=job_id,
        budget=budget,
        user=user,
        allocated=True,
        gpus_per_replica=1,
        replicas=1,
        min_runtime_s=60.0,
        duration_s=60.0,
        submitted_at=dt(h(-30)),
        ts=dt(h(-30)),
        event_id=ev.det_id("q", job_id),
    )


LOG: list[ev.Event] = [
    placed("j5", user="alice", gpus=8, at=h(-30)),
    completed("j5", at=h(-26)),
    queued("j4", "carol", "lab/b"),
    placed("j1", user="alice", gpus=2, at=h(0)),
    placed("j3", user="bob", gpus=1, allocated=False, at=h(0)),
    placed("j4", user="", budget="lab/b", gpus=1, at=h(0)),
    placed("j2", user="bob", gpus=4, at=h(1)),
    completed("j4", at=h(1)),
    completed("j3", at=h(2)),
    job_lost("j2", charged_until=h(2), at=h(2.5)),
    completed("j1", at=h(3)),
]


def test_per_budget_and_user_over_the_window() -> None:
    rows = usage_by_user(LOG, window_s=24 * 3600.0, at_us=h(3))
    assert rows == [
        UserUsage("lab/a", "", 10.0, 2.0, 1.0),
        UserUsage("lab/a", "alice", 6.0, 0.0, 0.6),
        UserUsage("lab/a", "bob", 4.0, 2.0, 0.4),
        UserUsage("lab/b", "", 1.0, 0.0, 1.0),
        UserUsage("lab/b", "carol", 1.0, 0.0, 1.0),
    ]


def test_a_wider_window_counts_the_older_run() -> None:
    rows = usage_by_user(LOG, window_s=7 * 24 * 3600.0, at_us=h(3))
    assert [(r.user, r.allocated_gpu_h) for r in rows if r.budget == "lab/a"] == [
        ("", 42.0),  # 6 + 4 + 8 GPUs x 4 h
        ("alice", 38.0),
        ("bob", 4.0),
    ]


@pytest.mark.parametrize(
    "by_user,user,budget,expect",
    [
        (False, None, None, [("lab/a", ""), ("lab/b", "")]),
        (True, None, "lab/b", [("lab/b", ""), ("lab/b", "carol")]),
        (False, "bob", None, [("lab/a", "bob")]),
    ],
)
def test_the_rows_shown(by_user: bool, user: str | None, budget: str | None, expect: list[tuple[str, str]]) -> None:
    rows = usage_rows(usage_by_user(LOG, 24 * 3600.0, h(3)), by_user=by_user, user=user, budget=budget)
    assert [(r.budget, r.user) for r in rows] == expect


def test_an_empty_log_has_no_rows() -> None:
    assert usage_by_user([], 3600.0) == []
