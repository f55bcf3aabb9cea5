"""The ``kai`` peer: exact sequences of KAI's reclaim rules, and its time-aware fair share.

Budget tree unless stated, one node of 4 GPUs (deserved quota 2 GPUs each)::

    lab (1.0)
    ├── lab/a (0.5)
    └── lab/b (0.5)
"""

from __future__ import annotations

import pytest
from simkit import at, decisions, job, nodes

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.sim.core import SimConfig, simulate
from apportion.sim.peers.kai import Kai, fair_shares, saturation, time_aware_portions

AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
H = 3600.0


def run_kai(tree, jobs, until_us, cluster=None):
    cfg = SimConfig(
        seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), stop_delay_s=5.0, sample_s=0, until_us=until_us
    )
    return simulate(BudgetTree.from_mapping(tree), cluster or nodes(("n0", 4)), jobs, cfg, scheduler=Kai())


def a_jobs(n, leaf="lab/a", name="a"):
    """n one-GPU jobs, one a minute from 00:00, 4 h each, minimum runtime 1 h."""
    return [job(f"{name}{i}", leaf, submit=at(0, i - 1), duration_s=4 * H) for i in range(1, n + 1)]


def test_reclaim_waits_for_reclaim_min_runtime_then_takes_the_victim_whose_protection_ended():
    # a holds 4 GPUs, fair share 3 (deserved 2 + the 1 GPU b does not ask for); b1 (1 GPU) may reclaim
    # (b with it: 1 <= its fair share 1) but every run of a is inside its 1 h minimum runtime until 01:00,
    # when a1's ends: a1 goes (a at 4 > its fair share 3), b1 starts when it has stopped.
    r = run_kai(AB, [*a_jobs(4), job("b1", "lab/b", submit=at(0, 10))], until_us=at(1, 30))
    assert decisions(r, skip=("JobQueued", "StartWorkload"))[4:] == [
        "01:00:00 JobPreempted a1#1 expired_behind by=b1",
        "01:00:00 StopWorkload a1#1 n0",
        "01:00:00 JobPlaced b1#1 n0[0] victims=a1#1",
        "01:00:05 JobRequeued a1#2",
    ]
    assert r.violations == []


def test_no_reclaim_that_would_put_the_reclaimer_above_its_fair_share():
    # b1 wants 3 GPUs: fair shares a 2, b 2; b with b1 at 3 > 2, so b1 never reclaims and waits for 3 free GPUs.
    r = run_kai(AB, [*a_jobs(4), job("b1", "lab/b", gpus=3, submit=at(0, 10))], until_us=at(4, 30))
    assert decisions(r, skip=("JobQueued", "StartWorkload"))[4:] == ["04:02:00 JobPlaced b1#1 n0[0, 1, 2]"]
    assert sum(r.preemptions.values()) == 0


def test_reclaim_stops_where_the_victim_queue_would_fall_to_its_fair_share():
    # b1 and b2 (1 GPU each) both may reclaim (fair shares: a 2, b 2). At 01:00 a1 ends its protection:
    # a at 4 > 2, a1 goes for b1; at 01:01 a2 (a at 3 > 2) goes for b2; then a is at its fair share 2 and
    # b3 gets nothing (and could not: b with it at 3 > 2).
    r = run_kai(
        AB,
        [*a_jobs(4), *(job(f"b{i}", "lab/b", submit=at(0, 10)) for i in (1, 2, 3))],
        until_us=at(1, 30),
    )
    assert [x for x in decisions(r, skip=("JobQueued", "StartWorkload", "StopWorkload")) if x >= "01"] == [
        "01:00:00 JobPreempted a1#1 expired_behind by=b1",
        "01:00:00 JobPlaced b1#1 n0[0] victims=a1#1",
        "01:00:05 JobRequeued a1#2",
        "01:01:00 JobPreempted a2#1 expired_behind by=b2",
        "01:01:00 JobPlaced b2#1 n0[1] victims=a2#1",
        "01:01:05 JobRequeued a2#2",
    ]


def test_time_aware_portions_favour_the_queue_that_used_less():
    # P_a = max(.5 + 1 * (.5 - .5), 0) = .5, P_b = .5 + (.5 - 0) = 1.0 -> 1/3, 2/3
    assert time_aware_portions({"a": 1.0, "b": 1.0}, {"a": 0.5, "b": 0.0}, 1.0) == pytest.approx(
        {"a": 1 / 3, "b": 2 / 3}
    )
    # k = 0: the plain over-quota weights
    assert time_aware_portions({"a": 3.0, "b": 1.0}, {"a": 0.9, "b": 0.0}, 0.0) == {"a": 0.75, "b": 0.25}


def test_fair_shares_give_deserved_quota_first_and_divide_the_rest_by_time_aware_weight():
    #   lab ├── a (0.25, deserved 2)  requests 8, used half the window's capacity
    #       ├── b (0.25, deserved 2)  requests 8, no usage
    #       └── c (0.5, deserved 4)   requests nothing: its 4 GPUs are over-quota for a and b
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.25, "lab/b": 0.25, "lab/c": 0.5})
    req = {"lab": 16.0, "lab/a": 8.0, "lab/b": 8.0}
    fs = fair_shares(tree, 8.0, req, {"lab": 0.5, "lab/a": 0.5}, 1.0)
    assert fs["lab"] == 8.0 and fs["lab/c"] == 0.0
    assert fs["lab/a"] == pytest.approx(2 + 4 / 3) and fs["lab/b"] == pytest.approx(2 + 8 / 3)
    plain = fair_shares(tree, 8.0, req, {}, 1.0)
    assert plain["lab/a"] == pytest.approx(4.0) and plain["lab/b"] == pytest.approx(4.0)


def test_saturation_edge_cases():
    assert (saturation(3, 4), saturation(1, 0), saturation(0, 0)) == (0.75, float("inf"), 0)
