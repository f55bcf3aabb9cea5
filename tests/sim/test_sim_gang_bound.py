"""The gang rule is bounded by the protection cap (rule D3.gangs): a week-long 2 x 8 gang against a smaller job."""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.timeutil import to_us
from tests.kit.simkit import T0, at, job, nodes, run

H = 3600
AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
CYCLE_S = 300  # the simulator's periodic cycle while jobs wait


@pytest.mark.parametrize(
    "engine",
    [pytest.param({}, id="policy"), pytest.param({"grow_over_share": True}, id="every job grown (fairtree-9)")],
)
def test_a_week_long_gang_holds_the_other_budget_off_for_at_most_the_cap_and_one_cycle(engine):
    """lab/a's 2 x 8 gang (7 days of work, minimum runtime 2 h) takes both nodes at 0 h; lab/b (r = 0) asks for
    8 GPUs at 1 h. The gang's protection ends at 2 h, but the gang rule spares it for the smaller job until it
    has run W / 4 = 42 h; then it is a victim like any other. lab/b waits 42 h - 1 h = 41 h, within
    W / 4 + one cycle; without the bound it waited for the whole gang (167.5 h when measured on a 7-day gang).
    The same with every job's protection grown (``EngineConfig.grow_over_share`` True, up to policy fairtree-9):
    the gang, never preempted before, has its minimum runtime either way."""
    jobs = [
        job("g", "lab/a", gpus=8, replicas=2, min_runtime_s=2 * H, duration_s=7 * 24 * H),
        job("b", "lab/b", gpus=8, min_runtime_s=2 * H, duration_s=10 * H, submit=at(1)),
    ]
    r = run(AB, nodes(("n0", 8), ("n1", 8)), jobs, until_us=at(60), engine=engine)
    waited_s = (r.placed_first["b"] - at(1)) / 1e6
    assert waited_s <= 42 * H + CYCLE_S
    assert waited_s >= 41 * H  # not before the gang has run the cap: 42 h from its start at 0 h
    preempted = [e for e in r.log if isinstance(e, ev.JobPreempted)]
    assert [(e.job_id, to_us(e.ts) - T0) for e in preempted] == [("g", r.placed_first["b"] - T0)]
    assert r.violations == []


def test_with_the_bound_at_twice_the_gangs_protection_the_other_budget_waits_that_long():
    """The same case with ``EngineConfig.gang_bound_x = 2``: the gang (protection 2 h from 0 h) is spared for the
    smaller job until it has run 2 x 2 h = 4 h, then goes. lab/b waits 4 h - 1 h = 3 h, within one cycle."""
    jobs = [
        job("g", "lab/a", gpus=8, replicas=2, min_runtime_s=2 * H, duration_s=7 * 24 * H),
        job("b", "lab/b", gpus=8, min_runtime_s=2 * H, duration_s=10 * H, submit=at(1)),
    ]
    r = run(AB, nodes(("n0", 8), ("n1", 8)), jobs, until_us=at(60), engine={"gang_bound_x": 2.0})
    waited_s = (r.placed_first["b"] - at(1)) / 1e6
    assert 3 * H <= waited_s <= 3 * H + CYCLE_S
    assert r.violations == []
