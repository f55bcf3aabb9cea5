"""The ``slurm`` peer: exact sequences of Slurm's documented behaviour, and its Fair Tree maths.

Budget tree unless stated::

    lab (1.0)
    ├── lab/a (0.5)
    └── lab/b (0.5)
"""

from __future__ import annotations

import math

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.sim.core import SimConfig, simulate
from apportion.sim.peers.slurm import Slurm, SlurmConfig, fair_tree_factors, level_fairshare
from tests.kit.simkit import at, decisions, job, nodes

AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
H = 3600.0


def run_slurm(tree, cluster, jobs, policy=None, **kw):
    cfg = SimConfig(seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), stop_delay_s=5.0, sample_s=0, **kw)
    return simulate(BudgetTree.from_mapping(tree), cluster, jobs, cfg, scheduler=policy or Slurm())


def test_an_allocated_job_is_never_preempted_for_fair_share():
    # a1 holds the whole node far above a's share for 4 h; past its 1 h minimum runtime our policy
    # would preempt it for b1. Slurm has no fair-share preemption: b1 waits for a1 to end.
    r = run_slurm(
        AB,
        nodes(("n0", 4)),
        [job("a1", "lab/a", gpus=4, duration_s=4 * H), job("b1", "lab/b", gpus=2, submit=at(0, 10))],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload a1#1 n0",
        "04:00:00 JobPlaced b1#1 n0[0, 1]",
        "04:00:00 StartWorkload b1#1 n0",
    ]
    assert r.violations == [] and sum(r.preemptions.values()) == 0


def test_a_scavenger_job_is_requeued_at_once_for_a_normal_job_after_the_grace():
    # u1 (min runtime 0: the preemptible QOS, PreemptExemptTime 0) is requeued the moment b1 cannot start;
    # b1 starts when u1 has stopped (5 s here, within GraceTime 30 s); u1 runs again when b1 is done.
    r = run_slurm(
        AB,
        nodes(("n0", 4)),
        [
            job("u1", "lab/a", gpus=4, min_runtime_s=0, duration_s=2 * H),
            job("b1", "lab/b", gpus=2, submit=at(0, 10)),
        ],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced u1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload u1#1 n0",
        "00:10:00 JobPreempted u1#1 unallocated by=b1",
        "00:10:00 StopWorkload u1#1 n0",
        "00:10:00 JobPlaced b1#1 n0[0, 1] victims=u1#1",
        "00:10:05 JobRequeued u1#2",
        "00:10:05 StartWorkload b1#1 n0",
        "01:10:05 JobPlaced u1#2 n0[0, 1, 2, 3]",
        "01:10:05 StartWorkload u1#2 n0",
    ]
    stop = next(e for e in r.log if e.type == "StopWorkload")
    assert stop.grace_s == 30.0


def test_a_scavenger_job_never_preempts_and_a_normal_job_never_preempts_a_normal_one():
    # u2 (scavenger) waits behind a1 although u1 of its own class could be requeued; b1 (normal)
    # requeues u1 only, never a1.
    r = run_slurm(
        AB,
        nodes(("n0", 4)),
        [
            job("a1", "lab/a", gpus=2, duration_s=3 * H),
            job("u1", "lab/a", gpus=2, min_runtime_s=0, duration_s=3 * H),
            job("u2", "lab/b", gpus=2, min_runtime_s=0, submit=at(0, 5)),
            job("b1", "lab/b", gpus=4, submit=at(0, 10)),
        ],
        until_us=at(2),
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:00:00 JobPlaced u1#1 n0[2, 3]",
        "00:00:00 StartWorkload u1#1 n0",
    ]


def test_the_account_with_less_decayed_usage_goes_first_whatever_the_submit_order():
    # One GPU. a1 runs 00:00-01:00, so lab/a has usage; a2 (a) is submitted before b1 (b). At 01:00 Fair Tree
    # gives b (no usage, LF = inf) factor 1.0 and a 0.5: b1 first, although FIFO would run a2.
    r = run_slurm(
        AB,
        nodes(("n0", 1)),
        [
            job("a1", "lab/a"),
            job("a2", "lab/a", submit=at(0, 30)),
            job("b1", "lab/b", submit=at(0, 40)),
        ],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "01:00:00 JobPlaced b1#1 n0[0]",
        "01:00:00 StartWorkload b1#1 n0",
        "02:00:00 JobPlaced a2#1 n0[0]",
        "02:00:00 StartWorkload a2#1 n0",
    ]


def test_usage_decays_with_the_half_life_and_is_charged_at_passes():
    # a1 (2 GPUs) runs from 00:00; passes at 00:00 (first cycle), then at the first cycles >= 5 min later.
    policy = Slurm(SlurmConfig(half_life_s=H, calc_period_s=300.0))
    r = run_slurm(
        AB,
        nodes(("n0", 2)),
        [
            job("a1", "lab/a", gpus=2, duration_s=4 * H),
            job("b1", "lab/b", submit=at(1)),
            job("b2", "lab/b", submit=at(2)),
        ],
        policy=policy,
        until_us=at(2, 30),
        cycle_s=None,
    )
    assert r.cycles >= 3
    # passes at 00:00 (nothing run yet), 01:00 (2 GPUs x 3600 s), 02:00 (x 1/2, + 7200)
    assert policy.last_pass_us == at(2)
    assert policy.usage == {"lab/a": pytest.approx(7200.0 * 0.5 + 7200.0)}


@pytest.mark.parametrize(
    ("s", "u", "lf"),
    [
        pytest.param(0.5, 0.25, 2.0, id="under-served: above 1"),
        pytest.param(0.5, 1.0, 0.5, id="over-served: below 1"),
        pytest.param(0.5, 0.0, math.inf, id="no usage: infinity"),
        pytest.param(0.0, 0.5, 0.0, id="zero shares with usage: 0"),
    ],
)
def test_level_fairshare_edge_cases(s, u, lf):
    assert level_fairshare(s, u) == lf


def test_fair_tree_ranks_depth_first_and_ties_share_a_rank():
    #   root
    #   ├── x (0.5)   usage 10 -> LF 0.5 / (10/20) = 1.0
    #   │   ├── x/p (0.5)  usage 10 -> LF 0.5 / 1 = 0.5
    #   │   └── x/q (0.5)  usage 0  -> LF inf
    #   └── y (0.5)   usage 10 -> LF 1.0: tied with x, so their children are merged before descending
    #       ├── y/r (0.5)  usage 5 -> LF 1.0
    #       └── y/s (0.5)  usage 5 -> LF 1.0  (tied with y/r: the same rank)
    # merged order: q (inf), r (1), s (1), p (0.5); ranks 4, 3, 3 (tie), 1 of N = 4
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 0.5, "x/q": 0.5, "y": 0.5, "y/r": 0.5, "y/s": 0.5})
    f = fair_tree_factors(tree, {"x/p": 10.0, "y/r": 5.0, "y/s": 5.0})
    assert f == {"x/q": 4 / 4, "y/r": 3 / 4, "y/s": 3 / 4, "x/p": 1 / 4}


def test_fair_tree_orders_a_whole_account_before_another():
    # x under-served (LF 2) ranks both its leaves above y's, whatever y's leaves' own LF
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 0.5, "x/q": 0.5, "y": 0.5, "y/r": 0.5, "y/s": 0.5})
    f = fair_tree_factors(tree, {"x/p": 4.0, "x/q": 1.0, "y/r": 15.0})
    assert f == {"x/q": 1.0, "x/p": 3 / 4, "y/s": 2 / 4, "y/r": 1 / 4}


def test_fair_tree_without_any_usage_ties_everyone_at_the_top():
    tree = BudgetTree.from_mapping(AB)
    assert fair_tree_factors(tree, {}) == {"lab/a": 1.0, "lab/b": 1.0}
