"""What `apportion budget set` says it set: the fields given, each as set, not the share whatever was given."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from apportion import events
from apportion.cli.budgets import budget_set_message
from apportion.domain.budgets import Budget

TS = datetime(2026, 1, 1, tzinfo=UTC)
CURRENT = Budget("lab/a", 0.4, frozenset({"ann"}), 8 * 3600.0, None, None, None)


def _ev(**fields: object) -> events.BudgetSet:
    base: dict[str, object] = {
        "share": 0.4,
        "members": ("ann",),
        "max_min_runtime_s": 8 * 3600.0,
    }
    base.update(fields)
    return events.BudgetSet(path="lab/a", by="cli", ts=TS, producer="cli", **base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        pytest.param({"max_min_runtime_s": 2 * 3600.0}, "max min runtime 2h", id="max-min-runtime"),
        pytest.param({"max_min_runtime_s": None}, "max min runtime inherited", id="inherit-max-min-runtime"),
        pytest.param({"share": 0.25}, "share 0.25", id="share"),
        pytest.param({"members": ("bob", "ann")}, "members ann,bob", id="members"),
        pytest.param({"members": None}, "members inherited", id="inherit-members"),
        pytest.param({"default_time_limit_s": 86400.0}, "default time limit 1d", id="default-time-limit"),
        pytest.param({"max_time_limit_s": 7 * 86400.0}, "max time limit 7d", id="max-time-limit"),
        pytest.param({"preempt_idle_after_s": 7200.0}, "preempt idle after 2h", id="preempt-idle-after"),
        pytest.param({}, "no change", id="same-values"),
    ],
)
def test_an_existing_budget_names_only_what_changed(fields: dict[str, object], said: str) -> None:
    assert budget_set_message(_ev(**fields), CURRENT) == f"budget [bold]lab/a[/] set: {said}"


def test_a_new_budget_names_every_field_it_sets() -> None:
    ev = _ev(members=None, max_min_runtime_s=3600.0, max_time_limit_s=86400.0)
    assert (
        budget_set_message(ev, None)
        == "budget [bold]lab/a[/] created: share 0.4, max min runtime 1h, max time limit 1d"
    )
