"""The ``slurm`` peer: exact sequences of Slurm's documented behaviour, and its Fair Tree maths.

Budget tree unless stated::

    lab (1.0)
    ├── lab/a (0.5)
    └── lab/b (0.5)
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine.inputs import PendingJob
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


# Backfill with reservations (sched/backfill). Two 4-GPU nodes; a1 (4 GPUs) holds n0 until 02:00, a2 (3 GPUs)
# holds n1 until 03:00; time limits are the jobs' durations. At 00:10 the gang g (2 x 4, lab/b: no usage, so
# first by Fair Tree) can start at 03:00 at the earliest, when both nodes are whole: it reserves n0 and n1 over
# [03:00, 04:00). x (1 GPU, 4 h) fits now on n1's free GPU but would run into 03:00; y (1 GPU, 2 h) ends at
# 02:30, before the reservation, and is backfilled there.
GANG_WORLD = (
    job("a1", "lab/a", gpus=4, duration_s=2 * H),
    job("a2", "lab/a", gpus=3, duration_s=3 * H),
    job("g", "lab/b", gpus=4, replicas=2, duration_s=1 * H, submit=at(0, 10)),
    job("x", "lab/a", duration_s=4 * H, submit=at(0, 20)),
    job("y", "lab/a", duration_s=2 * H, submit=at(0, 30)),
)
STARTS = (
    "00:00:00 JobPlaced a1#1 n0[0, 1, 2, 3]",
    "00:00:00 StartWorkload a1#1 n0",
    "00:00:00 JobPlaced a2#1 n1[0, 1, 2]",
    "00:00:00 StartWorkload a2#1 n1",
)
# without a reservation (the simplified peer, or the gang's start past bf_window): x takes n1's free GPU at
# 00:20, y waits for a1's end, and the gang for x's end at 04:20
NO_RESERVATION = [
    *STARTS,
    "00:20:00 JobPlaced x#1 n1[3]",
    "00:20:00 StartWorkload x#1 n1",
    "02:00:00 JobPlaced y#1 n0[0]",
    "02:00:00 StartWorkload y#1 n0",
    "04:20:00 JobPlaced g#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3]",
    "04:20:00 StartWorkload g#1 n0",
    "04:20:00 StartWorkload g#1 n1",
]


def test_a_gang_at_the_top_reserves_its_start_and_only_jobs_ending_before_it_are_backfilled():
    r = run_slurm(AB, nodes(("n0", 4), ("n1", 4)), list(GANG_WORLD))
    assert decisions(r) == [
        *STARTS,
        "00:30:00 JobPlaced y#1 n1[3]",  # ends 02:30, before the gang's 03:00
        "00:30:00 StartWorkload y#1 n1",
        "03:00:00 JobPlaced g#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3]",  # its reserved start
        "03:00:00 StartWorkload g#1 n0",
        "03:00:00 StartWorkload g#1 n1",
        "04:00:00 JobPlaced x#1 n0[0]",  # would have ended at 04:20, into the gang's reservation: after it
        "04:00:00 StartWorkload x#1 n0",
    ]
    assert {e.decision.policy_version for e in r.log if e.type == "JobPlaced"} == {"slurm-fairtree-2"}


def test_the_simplified_peer_starts_any_job_that_fits():
    r = run_slurm(AB, nodes(("n0", 4), ("n1", 4)), list(GANG_WORLD), policy=Slurm(SlurmConfig(backfill_reserve=False)))
    assert decisions(r) == NO_RESERVATION
    assert {e.decision.policy_version for e in r.log if e.type == "JobPlaced"} == {"slurm-fairtree-1"}


def test_a_start_past_bf_window_reserves_nothing():
    # a 2 h window: at 00:10 the gang's 03:00 is 2 h 50 min ahead, so x and y go as without reservations; at
    # 03:00 (a2's end) its start 04:20 (x's end) is within 2 h, reserved, and kept
    r = run_slurm(AB, nodes(("n0", 4), ("n1", 4)), list(GANG_WORLD), policy=Slurm(SlurmConfig(bf_window_s=2 * H)))
    assert decisions(r) == NO_RESERVATION


def test_time_limits_longer_than_the_work_hold_backfill_back():
    # every limit 10 h (a partition's DefaultTime): a2 is expected until 10:00, so at 00:10 the gang reserves
    # [10:00, 20:00) and neither x nor y (10 h each) fits before it; when a1 and a2 really end, the gang starts
    # at 03:00 and x and y follow it at 04:00
    r = run_slurm(AB, nodes(("n0", 4), ("n1", 4)), list(GANG_WORLD), policy=Slurm(SlurmConfig(time_limit_s=10 * H)))
    assert decisions(r) == [
        *STARTS,
        "03:00:00 JobPlaced g#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3]",
        "03:00:00 StartWorkload g#1 n0",
        "03:00:00 StartWorkload g#1 n1",
        "04:00:00 JobPlaced x#1 n0[0]",
        "04:00:00 StartWorkload x#1 n0",
        "04:00:00 JobPlaced y#1 n0[1]",
        "04:00:00 StartWorkload y#1 n0",
    ]


@pytest.mark.parametrize(
    ("max_test", "a2_at"),
    [
        pytest.param(500, "00:20:00", id="default 500: a2 is looked at and ends before b1's reservation"),
        pytest.param(1, "03:00:00", id="1: only b1 is looked at until it runs; a2 waits for its end"),
    ],
)
def test_bf_max_job_test_bounds_the_jobs_looked_at_per_pass(max_test, a2_at):
    # One 2-GPU node. a1 (1 GPU) runs 00:00-02:00; b1 (2 GPUs, lab/b first by Fair Tree) reserves [02:00, 03:00);
    # a2 (1 GPU, 30 min) would fit now on the free GPU and end at 00:50.
    r = run_slurm(
        AB,
        nodes(("n0", 2)),
        [
            job("a1", "lab/a", duration_s=2 * H),
            job("b1", "lab/b", gpus=2, submit=at(0, 10)),
            job("a2", "lab/a", duration_s=1800.0, submit=at(0, 20)),
        ],
        policy=Slurm(SlurmConfig(bf_max_job_test=max_test)),
    )
    placed = [x for x in decisions(r) if "JobPlaced" in x]
    a2 = f"{a2_at} JobPlaced a2#1 n0[{0 if max_test == 1 else 1}]"
    b1 = "02:00:00 JobPlaced b1#1 n0[0, 1]"
    assert placed == ["00:00:00 JobPlaced a1#1 n0[0]", *([a2, b1] if max_test == 500 else [b1, a2])]


def test_the_time_limit_is_the_jobs_duration_unless_a_fixed_one_is_set():
    j = PendingJob("a", 1, "lab/a", "u", 1, 1, 3600.0, at(0), at(0), duration_s=5 * H)
    assert SlurmConfig().limit_s(j) == 5 * H
    assert SlurmConfig(time_limit_s=7 * 24 * H).limit_s(j) == 7 * 24 * H
    assert SlurmConfig(default_time_s=2 * H).limit_s(replace(j, duration_s=None)) == 2 * H
    with pytest.raises(ValueError, match="time_limit_s"):
        SlurmConfig(time_limit_s=0.0)
    with pytest.raises(ValueError, match="bf_max_job_test"):
        SlurmConfig(bf_max_job_test=0)


def test_a_normal_gang_counts_scavenger_gpus_as_free_and_requeues_them_to_start_now():
    # u1 (scavenger) holds half of n0; the gang g (2 x 4, normal) sees it as gone ("all preemptable jobs gone"):
    # its earliest start is now, over u1, which runs again when g is done
    r = run_slurm(
        AB,
        nodes(("n0", 4), ("n1", 4)),
        [
            job("u1", "lab/a", gpus=2, min_runtime_s=0, duration_s=2 * H),
            job("g", "lab/b", gpus=4, replicas=2, submit=at(0, 10)),
        ],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced u1#1 n0[0, 1]",
        "00:00:00 StartWorkload u1#1 n0",
        "00:10:00 JobPreempted u1#1 unallocated by=g",
        "00:10:00 StopWorkload u1#1 n0",
        "00:10:00 JobPlaced g#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3] victims=u1#1",
        "00:10:05 JobRequeued u1#2",
        "00:10:05 StartWorkload g#1 n0",
        "00:10:05 StartWorkload g#1 n1",
        "01:10:05 JobPlaced u1#2 n0[0, 1]",
        "01:10:05 StartWorkload u1#2 n0",
    ]
