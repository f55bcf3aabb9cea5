"""Time limits: a budget's default and maximum (inherited), admission against the maximum, and the limit in
force carried from the queue to every replica's start.

Tree::

    lab             share 1.0   default 4 h, max 24 h
    ├── short       share 0.5   default 30 m, max 1 h (the 4 h default inherited would be above the max)
    └── long        share 0.5   default 12 h (max 24 h inherited)
    open            (no limits)
"""

from __future__ import annotations

import json

import pytest

from apportion import events as ev
from apportion.cli.budgets import _limit_option
from apportion.domain.admission import admit, time_limit_in_force
from apportion.domain.budgets import Budget, BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.timeutil import from_us, to_us
from tests.kit.builders import T0, m, submitted
from tests.kit.narrowing import narrow

TREE = BudgetTree.from_mapping(
    {
        "lab": {"share": 0.5, "default_time_limit_s": 4 * 3600.0, "max_time_limit_s": 24 * 3600.0},
        "lab/short": {"share": 0.5, "default_time_limit_s": 1800.0, "max_time_limit_s": 3600.0},
        "lab/long": {"share": 0.5, "default_time_limit_s": 12 * 3600.0},
        "open": 0.5,
    }
)
CFG = DispatchConfig(heartbeat_timeout_s=None)


def job(budget: str, limit_s: float | None, job_id: str = "j1") -> ev.JobSubmitted:
    return submitted(job_id, budget=budget, user="bob").model_copy(update={"time_limit_s": limit_s})


def test_limits_are_inherited_down_the_tree() -> None:
    assert TREE.time_limits_s("lab/short") == (1800.0, 3600.0)
    assert TREE.time_limits_s("lab/long") == (12 * 3600.0, 24 * 3600.0)
    assert TREE.time_limits_s("open") == (None, None)
    assert TREE.to_mapping()["lab/short"] == {"share": 0.5, "default_time_limit_s": 1800.0, "max_time_limit_s": 3600.0}


@pytest.mark.parametrize(
    "budget,limit,in_force",
    [
        ("lab/long", None, 12 * 3600.0),  # the leaf's default
        ("lab/long", 600.0, 600.0),  # the job's own
        ("open", None, None),  # none anywhere
        ("open", 90.0, 90.0),
    ],
)
def test_the_limit_in_force_is_the_jobs_own_else_the_budgets_default(
    budget: str, limit: float | None, in_force: float | None
) -> None:
    assert time_limit_in_force(TREE, job(budget, limit)) == in_force
    assert admit(TREE, job(budget, limit), []) is None


def test_a_limit_above_the_max_is_rejected_with_a_machine_readable_reason() -> None:
    own = admit(TREE, job("lab/long", 25 * 3600.0), [])
    assert own is not None and own.reason is ev.RejectReason.TIME_LIMIT_TOO_LONG
    assert own.reason.value == "time_limit_above_max"
    assert own.message == "time limit 1d1h (its time_limit_s) is above the max_time_limit 1d of budget 'lab/long'"
    # a tree where lab/short inherits the 4 h default above its 1 h max: every change that makes one is refused
    # (BudgetTree.apply, bad_time_limit), so only the unchecked constructor builds it; admission still refuses
    nodes = {p: b for p in TREE.paths() if (b := TREE.get(p)) is not None}
    unchecked = BudgetTree({**nodes, "lab/short": Budget("lab/short", 0.5, max_time_limit_s=3600.0)})
    default = admit(unchecked, job("lab/short", None), [])
    assert default is not None and default.message == (
        "time limit 4h (the default 4h of budget 'lab/short') is above the max_time_limit 1h of budget 'lab/short'"
    )
    assert admit(TREE, job("lab/short", 3600.0), []) is None  # at the max: allowed


def test_the_start_of_every_replica_carries_the_limit_in_force() -> None:
    state = DispatchState(TREE)
    reg = ev.NodeRegistered(node_id="n0", gpu_count=4, ts=from_us(T0), event_id=ev.det_id("reg", "n0"))
    out: list[ev.Event] = []
    for e in (reg, job("lab/long", None), job("open", None, "j2")):
        out += step(state, e, to_us(e.ts), CFG)
    queued = {q.job_id: q.time_limit_s for q in out if isinstance(q, ev.JobQueued)}
    assert queued == {"j1": 12 * 3600.0, "j2": None}
    starts = [narrow(ev.StartWorkload, e) for e in step(state, Tick(m(1)), m(1), CFG) if e.type == "StartWorkload"]
    assert {(s.job_id, s.time_limit_s) for s in starts} == {("j1", 12 * 3600.0), ("j2", None)}


def test_a_rejected_time_limit_is_answered_by_the_dispatcher() -> None:
    state = DispatchState(TREE)
    out = step(state, job("lab/short", 7200.0), T0, CFG)
    rej = narrow(ev.JobRejected, out[0])
    assert (rej.reason.value, rej.message) == (
        "time_limit_above_max",
        "time limit 2h (its time_limit_s) is above the max_time_limit 1h of budget 'lab/short'",
    )


def test_a_non_positive_limit_is_refused_by_the_reader() -> None:
    obj = json.loads(ev.encode(submitted("j1")))
    obj["time_limit_s"] = 0
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(json.dumps(obj))
    assert err.value.field == "time_limit_s"


def test_budget_set_keeps_drops_or_sets_a_limit() -> None:
    assert _limit_option(None, 3600.0) == 3600.0
    assert _limit_option("inherit", 3600.0) is None
    assert _limit_option("4h", None) == 14400.0
    with pytest.raises(ValueError):
        _limit_option("soon", None)
