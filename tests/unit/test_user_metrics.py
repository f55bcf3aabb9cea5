"""Per-user usage gauges: the fold of ``share --users`` (apportion.domain.user_usage) -> samples -> the scrape.

The log is ``test_usage_by_user.LOG`` (hours from T0). Over a 24 h window:

* at 3 h: lab/a alice 6 GPU-h allocated (j1: 2 GPUs x 3 h; j5 left the window) = 21600 GPU-s;
  lab/a bob 4 GPU-h allocated (j2: 4 GPUs x 1 h, charged to its last heartbeat) = 14400 GPU-s and
  2 GPU-h unallocated (j3: 1 GPU x 2 h) = 7200 GPU-s; lab/b carol 1 GPU-h (j4, user from its JobQueued) = 3600.
* at 26 h the window is (2 h, 26 h]: alice's j1 counts from 2 h to 3 h (2 GPUs x 1 h = 7200 GPU-s); bob's
  and carol's runs ended at or before 2 h, so they drop out of the family.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from apportion.domain.user_usage import UserUsageFold
from apportion.metrics import BudgetCollector, Sample, user_samples
from services.accounting import logic
from tests.kit.builders import h, placed
from tests.unit.test_metrics_families import META, ROWS, _scrape
from tests.unit.test_usage_by_user import LOG, queued

DAY_S = 24 * 3600.0
NAME = "apportion_user_occupancy_gpu_seconds"


def lab(budget: str, user: str, kind: str) -> tuple[tuple[str, str], ...]:
    return (("budget", budget), ("user", user), ("kind", kind))


AT_3H = [
    Sample(NAME, lab("lab/a", "alice", "allocated"), 21600.0),
    Sample(NAME, lab("lab/a", "alice", "unallocated"), 0.0),
    Sample(NAME, lab("lab/a", "bob", "allocated"), 14400.0),
    Sample(NAME, lab("lab/a", "bob", "unallocated"), 7200.0),
    Sample(NAME, lab("lab/b", "carol", "allocated"), 3600.0),
    Sample(NAME, lab("lab/b", "carol", "unallocated"), 0.0),
]


def folded(window_s: float = DAY_S) -> UserUsageFold:
    fold = UserUsageFold(window_s)
    for e in LOG:
        fold.apply(e)
    return fold


def test_the_log_becomes_samples_per_budget_user_and_kind() -> None:
    assert user_samples(folded().parts(h(3))) == AT_3H


def test_a_user_whose_usage_left_the_window_disappears() -> None:
    fold = folded()
    assert fold.parts(h(26))["lab/a"]["bob"] == (0, 0)  # the fold keeps the pair, at 0
    assert user_samples(fold.parts(h(26))) == [
        Sample(NAME, lab("lab/a", "alice", "allocated"), 7200.0),
        Sample(NAME, lab("lab/a", "alice", "unallocated"), 0.0),
    ]
    assert user_samples(fold.parts(h(27))) == []  # j1 ended at 3 h: nobody left


def test_the_samples_are_the_figures_share_users_shows() -> None:
    fold = folded()
    by_pair = {(r.budget, r.user): r for r in fold.rows(h(3)) if r.user}
    for s in user_samples(fold.parts(h(3))):
        labels = dict(s.labels)
        row = by_pair[(labels["budget"], labels["user"])]
        gpu_h = row.allocated_gpu_h if labels["kind"] == "allocated" else row.unallocated_gpu_h
        assert s.value / 3600 == gpu_h


def test_the_bulk_rebuild_equals_the_fold_event_by_event() -> None:
    assert UserUsageFold.rebuild(LOG, DAY_S).parts(h(3)) == folded().parts(h(3))


def test_a_placement_naming_its_user_forgets_the_queued_one() -> None:
    fold = UserUsageFold(DAY_S)
    fold.apply(queued("j6", "dave", "lab/a"))
    assert fold._user_of == {"j6": "dave"}
    fold.apply(placed("j6", user="dave", at=h(0)))
    assert fold._user_of == {}


def test_accounting_folds_users_as_it_folds_the_log_and_its_rebuild_agrees() -> None:
    live = logic.Accounting(DAY_S)
    for e in LOG:
        live.apply(e)
    assert user_samples(live.users.parts(h(3))) == AT_3H
    assert logic.rebuild(LOG, DAY_S).users.parts(h(3)) == live.users.parts(h(3))


def test_the_collector_reports_the_users_beside_the_budgets_and_drops_the_ones_gone() -> None:
    reg = CollectorRegistry()
    c = BudgetCollector()
    reg.register(c)
    fold = folded()
    c.update(META, ROWS, fold.parts(h(3)))
    got = _scrape(reg)
    users = {k: v for k, v in got.items() if k[0] == NAME}
    assert users == {(NAME, tuple(sorted(s.labels))): s.value for s in AT_3H}
    assert got[("apportion_budget_share", (("budget", "lab/vision"),))] == 0.4
    c.update(META, ROWS, fold.parts(h(26)))
    users = {k: v for k, v in _scrape(reg).items() if k[0] == NAME}
    assert users == {
        (NAME, (("budget", "lab/a"), ("kind", "allocated"), ("user", "alice"))): 7200.0,
        (NAME, (("budget", "lab/a"), ("kind", "unallocated"), ("user", "alice"))): 0.0,
    }
