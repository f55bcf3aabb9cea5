"""The ``kueue`` peer: exact sequences of Kueue's fair-sharing preemption, and its share value.

Budget tree (one ClusterQueue per leaf, one cohort), one node of 8 GPUs::

    lab (1.0)
    ├── lab/a (0.25)   nominal quota 2 GPUs
    ├── lab/b (0.25)   nominal quota 2 GPUs
    └── lab/c (0.5)    nominal quota 4 GPUs, idle: lends them

share value = max(0, usage - nominal) / 8 (the cohort's nominal quota) / weight (the share)
"""

from __future__ import annotations

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.sim.core import SimConfig, simulate
from apportion.sim.peers.kueue import Kueue, share_value
from tests.kit.simkit import at, decisions, job, nodes

ABC = {"lab": 1.0, "lab/a": 0.25, "lab/b": 0.25, "lab/c": 0.5}
H = 3600.0


def run_kueue(jobs, until_us, cluster=None):
    cfg = SimConfig(
        seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), stop_delay_s=5.0, sample_s=0, until_us=until_us
    )
    return simulate(BudgetTree.from_mapping(ABC), cluster or nodes(("n0", 8)), jobs, cfg, scheduler=Kueue())


def a_jobs(n, gpus=1):
    """a1..an, one a minute from 00:00, 4 h each (the newest is the first victim)."""
    return [job(f"a{i}", "lab/a", gpus=gpus, submit=at(0, i - 1), duration_s=4 * H) for i in range(1, n + 1)]


def test_a_queue_at_its_final_share_is_not_preempted_by_one_that_would_pass_it():
    # a uses 5 (share 3/8/0.25 = 1.5), b uses 3; b1 (2 GPUs) would put b at 5 (1.5). LessThanOrEqualToFinalShare:
    # 1.5 <= a without one job (4: 1.0)? no. LessThanInitialShare: 1.5 < 1.5? no. b1 waits for GPUs to free.
    r = run_kueue(
        [*a_jobs(5), job("b0", "lab/b", gpus=3, duration_s=4 * H), job("b1", "lab/b", gpus=2, submit=at(0, 10))],
        until_us=at(4, 0, 30),
    )
    assert decisions(r, skip=("JobQueued", "StartWorkload")) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 JobPlaced b0#1 n0[1, 2, 3]",
        "00:01:00 JobPlaced a2#1 n0[4]",
        "00:02:00 JobPlaced a3#1 n0[5]",
        "00:03:00 JobPlaced a4#1 n0[6]",
        "00:04:00 JobPlaced a5#1 n0[7]",
        "04:00:00 JobPlaced b1#1 n0[0, 1]",
    ]


def test_less_than_or_equal_to_final_share_preempts_the_newest_job_of_the_biggest_borrower():
    # b1 (1 GPU) puts b at 4 (share 1.0); a without a5 is at 4 (1.0): 1.0 <= 1.0, a5 goes at once, inside
    # its 1 h minimum runtime (Kueue has none: a violation of our contract, not of Kueue's rules).
    r = run_kueue(
        [*a_jobs(5), job("b0", "lab/b", gpus=3, duration_s=4 * H), job("b1", "lab/b", submit=at(0, 10))],
        until_us=at(0, 30),
    )
    assert decisions(r, skip=("JobQueued", "StartWorkload"))[6:] == [
        "00:10:00 JobPreempted a5#1 expired_behind by=b1",
        "00:10:00 StopWorkload a5#1 n0",
        "00:10:00 JobPlaced b1#1 n0[7] victims=a5#1",
        "00:10:05 JobRequeued a5#2",
    ]
    assert len(r.violations) == 1 and r.violations[0].startswith("a5#1 preempted at 2024-01-01T00:10:00")


def test_less_than_initial_share_comes_second_and_unneeded_victims_are_put_back():
    # a: a1 (1 GPU) + a2 (5 GPUs) = 6 (share 2.0); b0 2 GPUs; b1 (2 GPUs) puts b at 4 (1.0).
    # LessThanOrEqualToFinalShare allows only a1 (a without it: 5, 1.5 >= 1.0), which frees too little;
    # LessThanInitialShare then allows a2 (1.0 < 1.5). a2's GPUs suffice, so a1 is not preempted.
    r = run_kueue(
        [
            job("a1", "lab/a", duration_s=4 * H),
            job("b0", "lab/b", gpus=2, duration_s=4 * H),
            job("a2", "lab/a", gpus=5, submit=at(0, 1), duration_s=4 * H),
            job("b1", "lab/b", gpus=2, submit=at(0, 10)),
        ],
        until_us=at(0, 30),
    )
    assert decisions(r, skip=("JobQueued",)) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:00:00 JobPlaced b0#1 n0[1, 2]",
        "00:00:00 StartWorkload b0#1 n0",
        "00:01:00 JobPlaced a2#1 n0[3, 4, 5, 6, 7]",
        "00:01:00 StartWorkload a2#1 n0",
        "00:10:00 JobPreempted a2#1 expired_behind by=b1",
        "00:10:00 StopWorkload a2#1 n0",
        "00:10:00 JobPlaced b1#1 n0[3, 4] victims=a2#1",
        "00:10:05 JobRequeued a2#2",
        "00:10:05 StartWorkload b1#1 n0",
    ]


def test_a_queue_within_its_nominal_quota_reclaims_from_a_borrower_at_once():
    # b has nothing; b1 (2 GPUs) keeps b within its nominal quota (2): reclaim, newest first, until it fits.
    r = run_kueue([*a_jobs(8), job("b1", "lab/b", gpus=2, submit=at(0, 10))], until_us=at(0, 30))
    assert [x for x in decisions(r, skip=("JobQueued", "StartWorkload", "StopWorkload")) if x.startswith("00:1")] == [
        "00:10:00 JobPreempted a7#1 expired_behind by=b1",
        "00:10:00 JobPreempted a8#1 expired_behind by=b1",
        "00:10:00 JobPlaced b1#1 n0[6, 7] victims=a7#1,a8#1",
        "00:10:05 JobRequeued a7#2",
        "00:10:05 JobRequeued a8#2",
    ]


@pytest.mark.parametrize(
    ("path", "usage", "value"),
    [
        pytest.param("lab/a", 2, 0.0, id="at its nominal quota: 0"),
        pytest.param("lab/a", 5, 1.5, id="borrowing 3 of 8, weight 0.25"),
        pytest.param("lab/c", 6, 0.5, id="borrowing 2 of 8, weight 0.5"),
    ],
)
def test_share_value(path, usage, value):
    assert share_value(BudgetTree.from_mapping(ABC), 8, path, usage) == value
