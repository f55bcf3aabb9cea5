"""Seeded scenarios with the exact sequence of dispatcher decisions (rule D3.scheduling-cycle).

Budget tree used unless stated::

    lab (1.0)
    ├── a  0.5
    └── b  0.5

Node agents start workloads at once and take 5 s to stop one (SIGTERM).
``JobQueued`` lines are left out; times are offsets from T0.
"""

from __future__ import annotations

import pytest

from apportion.events import JobPlaced, JobRequeued
from tests.kit.simkit import at, decisions, job, nodes, run

pytestmark = pytest.mark.sim

AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
H = 3600.0


def test_two_budgets_contend_and_the_under_used_one_wins():
    # a0 holds the node 0-2 h; a1 (submitted 1 h) is older than b1 (1.5 h),
    # but at 2 h lab/a has r = 2 and lab/b r = 0, so b1 goes first.
    r = run(
        AB,
        nodes(("n0", 4)),
        [
            job("a0", "lab/a", gpus=4, duration_s=2 * H, min_runtime_s=2 * H),
            job("a1", "lab/a", gpus=4, submit=at(1)),
            job("b1", "lab/b", gpus=4, submit=at(1, 30)),
        ],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a0#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload a0#1 n0",
        "02:00:00 JobPlaced b1#1 n0[0, 1, 2, 3]",
        "02:00:00 StartWorkload b1#1 n0",
        # a1 has waited 2 h >= reservation_after: it is placed as the reservation holder
        "03:00:00 JobPlaced a1#1 n0[0, 1, 2, 3] reserved",
        "03:00:00 StartWorkload a1#1 n0",
    ]
    assert r.violations == []


def test_unallocated_job_is_preempted_when_an_allocated_job_arrives():
    r = run(
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
        # the victim exits 5 s later: requeued (same submitted_at, attempt 2), preemptor starts
        "00:10:05 JobRequeued u1#2",
        "00:10:05 StartWorkload b1#1 n0",
        "01:10:05 JobPlaced u1#2 n0[0, 1, 2, 3]",
        "01:10:05 StartWorkload u1#2 n0",
    ]
    placed = next(e for e in r.log if isinstance(e, JobPlaced) and e.job_id == "b1")
    (v,) = placed.decision.victims
    assert (v.rule, v.allocated, v.gpus, v.protected_until, v.lca) == ("unallocated", False, 4, None, None)
    requeued = next(e for e in r.log if isinstance(e, JobRequeued))
    assert requeued.submitted_at == placed.submitted_at.replace(minute=0)  # u1's own, T0


def test_protected_job_is_never_preempted_even_far_over_share():
    # a1 holds every GPU (r_a far above r_b = 0) with 4 h protection; b1 waits exactly until then.
    r = run(
        AB,
        nodes(("n0", 4)),
        [
            job("a1", "lab/a", gpus=4, min_runtime_s=4 * H, duration_s=5 * H),
            job("b1", "lab/b", gpus=4, submit=at(1)),
        ],
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload a1#1 n0",
        "04:00:00 JobPreempted a1#1 expired_behind by=b1",
        "04:00:00 StopWorkload a1#1 n0",
        "04:00:00 JobPlaced b1#1 n0[0, 1, 2, 3] victims=a1#1 reserved",
        "04:00:05 JobRequeued a1#2",
        "04:00:05 StartWorkload b1#1 n0",
        "05:00:05 JobPlaced a1#2 n0[0, 1, 2, 3] reserved",
        "05:00:05 StartWorkload a1#2 n0",
    ]
    assert r.violations == []


TWO = [("n0", 1), ("n1", 1)]


def _hysteresis_jobs(b1_submit):
    return [
        job("a1", "lab/a", duration_s=10 * H),
        job("b1", "lab/b", submit=b1_submit, duration_s=10 * H),
        job("b2", "lab/b", submit=at(0, 30)),
    ]


def test_no_preemption_after_expiry_when_inside_hysteresis():
    # At 1 h: K = 7200, E = 3600 each; O_a = 3600 (r 1.0), O_b = 3540 (r 0.983).
    # 1.0 < 0.983 + 0.05: a1 stays although its protection expired; b2 never takes b1 (same leaf).
    r = run(AB, [*nodes(*TWO)], _hysteresis_jobs(at(0, 1)), until_us=at(3))
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:01:00 JobPlaced b1#1 n1[0]",
        "00:01:00 StartWorkload b1#1 n1",
    ]


def test_after_move_rule_refuses_a_swap_that_inverts_the_pair():
    # Same history with delta 0.01: at 1 h r_a = 1.0 >= r_b 0.983 + 0.01 (hysteresis holds), but
    # b2's charge (1 GPU x min(1 h, W) = 3600 GPU-s) gives B r = (3540 + 3600) / 3600 = 1.98 after
    # the move, ahead of r_a = 1.0: the move would invert the pair (rule D3.consistent-view, the
    # "LessThanOrEqualToFinalShare" test of engine.branch_rule), so nobody is preempted.
    r = run(AB, [*nodes(*TWO)], _hysteresis_jobs(at(0, 1)), until_us=at(3), delta=0.01)
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:01:00 JobPlaced b1#1 n1[0]",
        "00:01:00 StartWorkload b1#1 n1",
    ]


def test_hysteresis_default_with_a_larger_gap_still_refuses_an_inverting_move():
    # b1 starts at 0:10: at 1 h r_a = 1.0, r_b = 3000/3600 = 0.833 (gap 0.167 >= 0.05), but with
    # b2 charged r_b = (3000 + 3600) / 3600 = 1.83 > 1.0: refused, as above.
    r = run(AB, [*nodes(*TWO)], _hysteresis_jobs(at(0, 10)), until_us=at(1, 5))
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:10:00 JobPlaced b1#1 n1[0]",
        "00:10:00 StartWorkload b1#1 n1",
    ]


GANG = [
    job("b1", "lab/b", gpus=4, duration_s=2 * H, min_runtime_s=2 * H),
    job("b2", "lab/b", gpus=4, duration_s=4 * H, min_runtime_s=4 * H),
    job("G", "lab/a", gpus=4, replicas=2, submit=at(0, 10)),
    job("c1", "lab/a", gpus=1, submit=at(1, 30), duration_s=3 * H),
]


def test_gang_waits_gets_a_reservation_and_starts():
    # G (2 x 4 GPUs) cannot preempt protected b1/b2. From 1:10 it holds a reservation
    # (waited >= 1 h), so c1 (ranked below it) does not take n0 when b1 ends at 2 h;
    # G starts on both nodes when b2 ends at 4 h.
    r = run(AB, nodes(("n0", 4), ("n1", 4)), GANG)
    assert decisions(r) == [
        "00:00:00 JobPlaced b1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload b1#1 n0",
        "00:00:00 JobPlaced b2#1 n1[0, 1, 2, 3]",
        "00:00:00 StartWorkload b2#1 n1",
        "04:00:00 JobPlaced G#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3] reserved",
        "04:00:00 StartWorkload G#1 n0",
        "04:00:00 StartWorkload G#1 n1",
        "05:00:00 JobPlaced c1#1 n0[0] reserved",
        "05:00:00 StartWorkload c1#1 n0",
    ]


def test_without_reservation_backfill_delays_the_gang():
    r = run(AB, nodes(("n0", 4), ("n1", 4)), GANG, reservation_after_s=1e9)
    assert [x for x in decisions(r) if "JobPlaced" in x][2:] == [
        "02:00:00 JobPlaced c1#1 n0[0]",
        "05:00:00 JobPlaced G#1 n0[0, 1, 2, 3] n1[0, 1, 2, 3]",
    ]


def test_drain_waits_for_protection_then_drains():
    r = run(
        AB,
        nodes(("n0", 4), ("n1", 4)),
        [
            job("a1", "lab/a", gpus=2, min_runtime_s=2 * H, duration_s=10 * H),
            job("u1", "lab/b", gpus=2, min_runtime_s=0, duration_s=10 * H),
        ],
        drains=(("n0", at(1)),),
        until_us=at(4),
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:00:00 JobPlaced u1#1 n0[2, 3]",
        "00:00:00 StartWorkload u1#1 n0",
        "01:00:00 JobPreempted u1#1 drain",  # unallocated: at once
        "01:00:00 StopWorkload u1#1 n0",
        "01:00:05 JobRequeued u1#2",
        "01:00:05 JobPlaced u1#2 n1[0, 1]",
        "01:00:05 StartWorkload u1#2 n1",
        "02:00:00 JobPreempted a1#1 drain",  # allocated: when its protection expires
        "02:00:00 StopWorkload a1#1 n0",
        "02:00:05 JobRequeued a1#2",
        "02:00:05 NodeDrained n0",
        "02:00:05 JobPlaced a1#2 n1[2, 3]",
        "02:00:05 StartWorkload a1#2 n1",
    ]
    assert r.violations == []


def test_node_lost_requeues_and_charges_to_the_last_heartbeat():
    # Heartbeats every 10 s; n0 dies at 1:00:05, its last heartbeat was 1:00:00.
    # Lost when 30 s have passed since it (first tick after 1:00:30).
    r = run(
        AB,
        nodes(("n0", 4), ("n1", 4)),
        [
            job("a1", "lab/a", gpus=4, min_runtime_s=2 * H, duration_s=10 * H),
        ],
        heartbeat_s=10,
        node_failures=(("n0", at(1, 0, 5)),),
        until_us=at(1, 5),
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload a1#1 n0",
        "01:00:30.000001 NodeLost n0",
        "01:00:30.000001 JobLost a1#1 n0",
        "01:00:30.000001 JobRequeued a1#2",
        "01:00:30.000001 JobPlaced a1#2 n1[0, 1, 2, 3]",
        "01:00:30.000001 StartWorkload a1#2 n1",
    ]
    # 4 GPUs x 3600 s up to the last heartbeat + 4 x 269.999999 s of attempt 2 by 1:05
    assert r.state.ledger.occupancy_us(at(1, 5))["lab/a"] == 4 * 3600 * 10**6 + 4 * 269_999_999


def test_no_preemption_cascade():
    # b1 takes a1's GPU at 1 h (r_a 2.0 vs r_b 0). a1#2 cannot take it back while b1 is
    # protected (to 2:00:05), nor while the move would invert the pair: with t seconds since T0,
    # O_a = 3600, O_b = t - 3600, E = t/2, and a1#2 charged 3600 GPU-s, the after-move test
    # (3600 + 3600) <= t - 3600 needs t >= 3 h. Until 2:06 b1 keeps the GPU: no swap back.
    r = run(
        AB,
        nodes(("n0", 1)),
        [
            job("a1", "lab/a", duration_s=10 * H),
            job("b1", "lab/b", submit=at(0, 30), duration_s=10 * H),
            job("a2", "lab/a", submit=at(2, 1)),
        ],
        until_us=at(2, 6),
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0]",
        "00:00:00 StartWorkload a1#1 n0",
        "01:00:00 JobPreempted a1#1 expired_behind by=b1",
        "01:00:00 StopWorkload a1#1 n0",
        "01:00:00 JobPlaced b1#1 n0[0] victims=a1#1",
        "01:00:05 JobRequeued a1#2",
        "01:00:05 StartWorkload b1#1 n0",
    ]


def test_cancel_pending_and_running():
    r = run(
        AB,
        nodes(("n0", 2)),
        [
            job("a1", "lab/a", gpus=2, duration_s=10 * H),
            job("a2", "lab/a", gpus=2, submit=at(0, 1)),
            job("a3", "lab/a", gpus=2, submit=at(0, 2)),
        ],
        cancels=(("a2", at(0, 5)), ("a1", at(1))),
        until_us=at(3),
    )
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1]",
        "00:00:00 StartWorkload a1#1 n0",
        "00:05:00 JobCancelled a2#None",
        "01:00:00 StopWorkload a1#1 n0",
        "01:00:00 JobCancelled a1#1",
        "01:00:00 JobPlaced a3#1 n0[0, 1]",
        "01:00:00 StartWorkload a3#1 n0",
    ]


def test_same_seed_gives_a_byte_identical_decision_log():
    jobs = [
        job(
            f"j{i}",
            "lab/a" if i % 3 else "lab/b",
            gpus=1 + i % 4,
            submit=at(0, i),
            min_runtime_s=0 if i % 4 == 0 else 1800,
            duration_s=600 + 97 * i,
        )
        for i in range(40)
    ]
    one = run(AB, nodes(("n0", 4), ("n1", 8)), jobs, seed=7, stop_delay_s=None)
    two = run(AB, nodes(("n0", 4), ("n1", 8)), jobs, seed=7, stop_delay_s=None)
    assert one.decision_log() == two.decision_log()
    assert len(one.decision_log()) > 1000
