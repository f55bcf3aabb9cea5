"""The ``kai`` peer: exact sequences of KAI's reclaim rules, and its time-aware fair share.

Budget tree unless stated, one node of 4 GPUs (deserved quota 2 GPUs each)::

    lab (1.0)
    ├── lab/a (0.5)
    └── lab/b (0.5)
"""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.sim.core import SimConfig, simulate
from apportion.sim.peers.kai import Kai, fair_shares, saturation, time_aware_portions
from tests.kit.simkit import at, decisions, job, nodes

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


# The sibling-saturation check (reclaimable.go ``reclaimingQueuesRemainWithinBoundaries``): at each level of the
# reclaimer's path whose allocation with J would pass its fair share, its saturation must stay strictly below
# that of every sibling it reclaims from. One node of 8 GPUs::
#
#     lab (1.0)
#     ├── lab/a (0.5, deserved 4)
#     │   ├── lab/a/x (0.75, deserved 3)   x1 asks for GPUs at 00:10
#     │   └── lab/a/z (0.25, deserved 1)   z1-z3 hold 3, protected until 04:00
#     └── lab/b (0.5, deserved 4)          b1 (2 GPUs, ends 02:00) and b2-b4 hold 5, protected until 01:00
#
# Requests a 5, b 5: fair shares a 4, b 4 (no rest at the top). Inside a (4 to divide): x min(3, asked),
# z min(1, 3), the rest to z.
NEST = {"lab": 1.0, "lab/a": 0.5, "lab/a/x": 0.75, "lab/a/z": 0.25, "lab/b": 0.5}


def nest_jobs(x_gpus):
    return [
        *(job(f"z{i}", "lab/a/z", min_runtime_s=4 * H, duration_s=8 * H) for i in (1, 2, 3)),
        job("b1", "lab/b", gpus=2, duration_s=2 * H),
        *(job(f"b{i}", "lab/b", duration_s=8 * H) for i in (2, 3, 4)),
        job("x1", "lab/a/x", gpus=x_gpus, submit=at(0, 10)),
    ]


def test_kai_reclaims_while_the_reclaimers_parent_stays_within_its_fair_share():
    # x1 asks 1 GPU: fair shares x 1, z 3. At 01:00 (b's protection over) x with x1 is 1 <= 1, b (5) is above
    # its fair share 4, and a with x1 is 4 = its fair share: not above it, so no sibling comparison. x1 takes
    # the first run of b's victim order (all started at 00:00: the run key decides, b1), and b1 starts again
    # when x1 ends.
    r = run_kai(NEST, nest_jobs(1), until_us=at(2, 30), cluster=nodes(("n0", 8)))
    assert [x for x in decisions(r, skip=("JobQueued", "StartWorkload", "StopWorkload")) if x >= "00:01"] == [
        "01:00:00 JobPreempted b1#1 expired_behind by=x1",
        "01:00:00 JobPlaced x1#1 n0[0] victims=b1#1",
        "01:00:05 JobRequeued b1#2",
        "02:00:05 JobPlaced b1#2 n0[0, 1]",
    ]


def test_kai_refuses_the_reclaim_that_would_put_the_reclaimer_above_its_siblings_saturation():
    # x1 asks 2 GPUs: fair shares x 2, z 2. The other rules accept at 01:00: x with x1 is 2 <= 2
    # (CanReclaimResources) and b, at 5, is above its fair share 4 (MaintainFairShare). But a with x1 would be
    # (3 + 2) / 4 = 1.25 > 1, and b after losing b1 (2 GPUs) would be 3 / 4 = 0.75 (after b4 alone 4 / 4 = 1.0):
    # 1.25 is not below either, so nothing is reclaimed. x1 starts at 02:00 on the 2 GPUs b1 frees by finishing.
    r = run_kai(NEST, nest_jobs(2), until_us=at(2, 30), cluster=nodes(("n0", 8)))
    assert [x for x in decisions(r, skip=("JobQueued", "StartWorkload", "StopWorkload")) if x >= "00:01"] == [
        "02:00:00 JobPlaced x1#1 n0[0, 1]",
    ]
    assert sum(r.preemptions.values()) == 0
    # the same reclaim with the reclaimer's saturation weighed at half (reclaimerUtilizationMultiplier 0.5):
    # 1.25 x 0.5 = 0.625 < 0.75, so the one rule that refused it above now lets it through
    cfg = SimConfig(
        seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), stop_delay_s=5.0, sample_s=0, until_us=at(2, 30)
    )
    lax = simulate(BudgetTree.from_mapping(NEST), nodes(("n0", 8)), nest_jobs(2), cfg, scheduler=Kai(multiplier=0.5))
    assert [x for x in decisions(lax, skip=("JobQueued", "StartWorkload", "StopWorkload")) if "x1" in x] == [
        "01:00:00 JobPreempted b1#1 expired_behind by=x1",
        "01:00:00 JobPlaced x1#1 n0[0, 1] victims=b1#1",
    ]
