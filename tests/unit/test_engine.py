"""Table cases for one scheduling cycle (rule D3.scheduling-cycle).

Tree for every case unless stated (shares of parent, window capacity K given)::

    lab (1.0)
    ├── a  0.5
    ├── b  0.25
    └── c  0.25

Clusters are built by folding events into :class:`ClusterState`; the cycle
is :func:`run_cycle` at ``NOW``. Expected values are worked out by hand in
each case's comment.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import PROTECTION_UNTIL_DONE_S
from apportion.domain.engine import (
    CycleMemo,
    CycleSnapshot,
    EngineConfig,
    PendingJob,
    ShapeTable,
    VictimIndex,
    blocked_run,
    run_cycle,
    shape_floor,
)
from apportion.domain.engine.cycle import first_las_queue
from apportion.domain.engine.shapes import memo_allocated
from apportion.timeutil import s_to_us
from tests.kit.builders import h
from tests.kit.engine_world import NOW, TREE, World, placed, preempted

# ---------------------------------------------------------------- placement on free GPUs

PLACEMENT_CASES = [
    pytest.param(
        World()
        .node("n0", 8)
        .node("n1", 8)
        .node("n2", 8)
        .run("x", "lab/b", {"n1": (0, 1, 2, 3, 4, 5)})
        .run("y", "lab/b", {"n2": (0, 1, 2, 3)})
        .job("j", "lab/a", 2),
        ["j@n1[6, 7]"],
        id="best fit: fewest free GPUs that fit (n1 has 2, n2 4, n0 8)",
    ),
    pytest.param(
        World().node("n1", 8).node("n0", 8).job("j", "lab/a", 3),
        ["j@n0[0, 1, 2]"],
        id="ties by node id, lowest GPU indices",
    ),
    pytest.param(
        World()
        .node("n0", 8)
        .node("n1", 8)
        .node("n2", 8)
        .run("x", "lab/b", {"n0": (0, 1, 2, 3, 4, 5)})
        .job("g", "lab/a", 4, 2),
        ["g@n1[0, 1, 2, 3]+n2[0, 1, 2, 3]"],
        id="gang: k distinct nodes with g free each",
    ),
    pytest.param(
        World()
        .node("n0", 8)
        .node("n1", 8)
        .run("x", "lab/b", {"n0": (0, 1, 2, 3, 4, 5)})
        .job("g", "lab/a", 4, 2, min_runtime_s=0),
        [],
        id="gang: nothing when fewer than k nodes fit (no partial placement)",
    ),
    pytest.param(
        World().node("n0", 8, model="a100").node("n1", 8, model="h100").job("j", "lab/a", 8, model="h100"),
        ["j@n1[0, 1, 2, 3, 4, 5, 6, 7]"],
        id="model must match",
    ),
    pytest.param(
        World()
        .node("n0", 8, state="draining")
        .node("n1", 8, state="cordoned")
        .node("n2", 2)
        .job("j", "lab/a", 2)
        .job("k", "lab/a", 1, submitted=h(2)),
        ["j@n2[0, 1]"],
        id="draining and cordoned nodes take no new work",
    ),
    pytest.param(
        World().node("n0", 4).run("v", "lab/b", {"n0": (0, 1)}, allocated=False, stopping=True).job("j", "lab/a", 3),
        [],
        id="a stopping victim's GPUs are not free",
    ),
    pytest.param(
        World().node("n0", 2).job("big", "lab/a", 4, min_runtime_s=0).job("small", "lab/a", 1, submitted=h(2)),
        ["small@n0[0]"],
        id="backfill: a blocked job does not block smaller ones behind it",
    ),
]


@pytest.mark.parametrize("world, expected", PLACEMENT_CASES)
def test_placement(world, expected):
    assert placed(world.cycle()) == expected


# ---------------------------------------------------------------- preemption

PREEMPTION_CASES = [
    pytest.param(
        World()
        .node("n0", 4)
        .node("n1", 4)
        .run("u", "lab/c", {"n0": (0, 1, 2, 3)}, allocated=False)
        .run("e", "lab/b", {"n1": (0, 1, 2, 3)}, min_runtime_s=60)
        .job("j", "lab/a", 4),
        {"b": 1.0, "lab/b": 1000.0},
        ["u<-j"],
        ["j@n0[0, 1, 2, 3]"],
        id="unallocated victims before expired allocated ones",
    ),
    pytest.param(
        World()
        .node("n0", 4)
        .node("n1", 4)
        .run("u4", "lab/c", {"n0": (0, 1, 2, 3)}, allocated=False)
        .run("u1", "lab/c", {"n1": (0,)}, allocated=False)
        .run("p", "lab/c", {"n1": (1, 2, 3)}, min_runtime_s=1e6)
        .job("j", "lab/a", 1),
        {},
        ["u1<-j"],
        ["j@n1[0]"],
        id="least cost: fewest unallocated GPUs lost",
    ),
    pytest.param(
        World()
        .node("n0", 1)
        .node("n1", 1)
        .run("old", "lab/c", {"n0": (0,)}, allocated=False, started=h(1))
        .run("new", "lab/c", {"n1": (0,)}, allocated=False, started=h(9))
        .job("j", "lab/a", 1),
        {},
        ["new<-j"],
        ["j@n1[0]"],
        id="then least work lost (latest start)",
    ),
    pytest.param(
        World().node("n0", 4).run("e", "lab/a", {"n0": (0, 1, 2, 3)}, min_runtime_s=60).job("j", "lab/a", 4),
        {"lab/a": 1000.0, "lab": 1000.0},
        [],
        [],
        id="never a run of the same leaf budget",
    ),
    pytest.param(
        World().node("n0", 4).run("p", "lab/b", {"n0": (0, 1, 2, 3)}, min_runtime_s=20 * 3600).job("j", "lab/a", 4),
        {"lab/b": 1e6, "lab": 1e6},
        [],
        [],
        id="never a protected run, however far over share",
    ),
    pytest.param(
        # K = 1e6: E_a = 5e5, E_b = 2.5e5. O_b = 262500 -> r_b = 1.05, r_a = 1.0: gap 0.05 exactly.
        # (K was 1000 before the after-move test: j's charge 4 * 3600 GPU-s then put r_a at 29.8.)
        # After the move r_a = (5e5 + 14400) / 5e5 = 1.0288 <= r_b: allowed.
        World(capacity=1e6)
        .node("n0", 4)
        .run("e", "lab/b", {"n0": (0, 1, 2, 3)}, min_runtime_s=60)
        .job("j", "lab/a", 4),
        {"lab/a": 5e5, "lab/b": 262500.0, "lab": 762500.0},
        ["e<-j"],
        ["j@n0[0, 1, 2, 3]"],
        id="expired allocated run behind by exactly delta",
    ),
    pytest.param(
        # O_b = 262000 -> r_b = 1.048 < 1.0 + 0.05.
        World(capacity=1e6)
        .node("n0", 4)
        .run("e", "lab/b", {"n0": (0, 1, 2, 3)}, min_runtime_s=60)
        .job("j", "lab/a", 4),
        {"lab/a": 5e5, "lab/b": 262000.0, "lab": 762000.0},
        [],
        [],
        id="expired but inside the hysteresis",
    ),
    pytest.param(
        World()
        .node("n0", 4)
        .node("n1", 4)
        .run("u", "lab/c", {"n0": (0, 1, 2, 3)}, allocated=False)
        .run("p", "lab/c", {"n1": (0, 1, 2, 3)}, min_runtime_s=1e6)
        .job("g", "lab/a", 4, 2),
        {},
        [],
        [],
        id="preempt only if the job can then be placed (gang needs 2 nodes)",
    ),
    pytest.param(
        World()
        .node("n0", 4)
        .run("u", "lab/c", {"n0": (0, 1, 2, 3)}, allocated=False)
        .job("j", "lab/a", 4, min_runtime_s=0),
        {},
        [],
        [],
        id="an unallocated job never preempts",
    ),
    pytest.param(
        World()
        .node("n0", 8)
        .node("n1", 8)
        .run("ug", "lab/c", {"n0": (0, 1, 2, 3), "n1": (0, 1, 2, 3)}, allocated=False)
        .run("x", "lab/c", {"n0": (4, 5, 6, 7), "n1": (4, 5, 6, 7)}, min_runtime_s=1e6)
        .job("g", "lab/a", 4, 2),
        {},
        ["ug<-g"],
        ["g@n0[0, 1, 2, 3]+n1[0, 1, 2, 3]"],
        id="one gang victim frees both nodes",
    ),
]


@pytest.mark.parametrize("world, occupancy, victims, expected", PREEMPTION_CASES)
def test_preemption(world, occupancy, victims, expected):
    # the candidate rule and the cost order alone: patience_rule (its own cases below) off
    world.occupancy = occupancy
    res = world.cycle(patience_s=0.0)
    assert preempted(res) == victims
    assert placed(res) == expected


def test_preemption_emits_stop_then_placement_and_no_start():
    w = World().node("n0", 2).run("u", "lab/c", {"n0": (0, 1)}, allocated=False).job("j", "lab/a", 2)
    res = w.cycle()
    assert [e.type for e in res.events] == ["JobPreempted", "StopWorkload", "JobPlaced"]
    pre, stop, pl = res.events
    assert (pre.by_job_id, pre.by_budget, pre.victim.rule, stop.node_id, stop.grace_s) == (
        "j",
        "lab/a",
        "unallocated",
        "n0",
        30.0,
    )
    assert pl.decision.victims[0].job_id == "u"


# ---------------------------------------------------------------- patience: is the least-cost plan worth its loss?
# lab/a at exactly its share (O_a = E_a = 0.5 x 1000 GPU-s: r = 1), so patience_rule applies (2 h by default).
# Victim u: 8 GPUs, unallocated, started at h(0), no checkpoint: at NOW = h(10) its work lost is 8 x 36000 GPU-s.


def _over_share_world(queued: int, occupancy_a: float = 500.0) -> World:
    w = World().node("n0", 8).run("u", "lab/c", {"n0": tuple(range(8))}, allocated=False)
    w.occupancy = {"lab/a": occupancy_a, "lab": occupancy_a}
    return w.job("j", "lab/a", 1, queued=queued)


def test_a_job_at_its_share_waits_rather_than_throw_away_80_gpu_hours():
    res = _over_share_world(queued=NOW).cycle()
    assert (preempted(res), placed(res)) == ([], [])


def test_after_waiting_patience_it_preempts_whatever_the_loss():
    assert preempted(_over_share_world(queued=NOW - s_to_us(7199)).cycle()) == []
    res = _over_share_world(queued=NOW - s_to_us(7200)).cycle()
    assert (preempted(res), placed(res)) == (["u<-j"], ["j@n0[0]"])


def test_a_job_under_its_share_preempts_at_once():
    res = _over_share_world(queued=NOW, occupancy_a=499.0).cycle()  # r_a = 0.998
    assert (preempted(res), placed(res)) == (["u<-j"], ["j@n0[0]"])


def test_patience_repaid_when_the_wait_covers_the_loss():
    # victim v: 2 GPUs started 1 h before NOW: 7200 GPU-s lost; a 2-GPU job repays it after 3600 s of waiting
    def world(waited_s: int) -> World:
        w = World().node("n0", 2).run("v", "lab/c", {"n0": (0, 1)}, allocated=False, started=NOW - s_to_us(3600))
        w.occupancy = {"lab/a": 500.0, "lab": 500.0}
        return w.job("j", "lab/a", 2, queued=NOW - s_to_us(waited_s))

    assert preempted(world(3599).cycle()) == []
    assert preempted(world(3600).cycle()) == ["v<-j"]


def test_a_wait_refusal_is_not_taken_for_a_failure_of_the_shape():
    # j1 (first in the queue, waited 0) must wait; j2 of the same shape has waited 2 h and preempts u
    w = _over_share_world(queued=NOW)
    w.job("j2", "lab/a", 1, submitted=h(2), queued=NOW - s_to_us(7200))
    res = w.cycle()
    assert (preempted(res), placed(res)) == (["u<-j2"], ["j2@n0[0]"])


def test_patience_0_turns_the_rule_off():
    res = _over_share_world(queued=NOW).cycle(patience_s=0.0)
    assert preempted(res) == ["u<-j"]


# ---------------------------------------------------------------- order and provisional charge


def test_provisional_charge_alternates_budgets_within_a_cycle():
    # K = 1000, r_a = r_b = 0. Each 1-GPU job charges 1 x min(100 s, W) = 100 GPU-s:
    # a -> r_a = 100/500 = 0.2; then b (r 0) -> r_b = 100/250 = 0.4; then a (0.2) -> 0.4;
    # tie at 0.4: by path, a; then b. So a1, b1, a2, a3, b2 for 5 GPUs.
    w = World().node("n0", 5)
    for i in (1, 2, 3):
        w.job(f"a{i}", "lab/a", min_runtime_s=100, submitted=h(i))
        w.job(f"b{i}", "lab/b", min_runtime_s=100, submitted=h(i))
    res = w.cycle()
    assert [p.split("@")[0] for p in placed(res)] == ["a1", "b1", "a2", "a3", "b2"]
    ranks = [
        (e.job_id, e.decision.rank, e.decision.budget_rank, e.decision.ratio)
        for e in res.events
        if isinstance(e, ev.JobPlaced)
    ]
    assert ranks == [("a1", 0, 0, 0.0), ("b1", 1, 1, 0.0), ("a2", 2, 0, 0.2), ("a3", 3, 0, 0.4), ("b2", 4, 1, 0.4)]


def test_unallocated_jobs_are_not_charged():
    w = World().node("n0", 3)
    for i in (1, 2):
        w.job(f"a{i}", "lab/a", min_runtime_s=0, submitted=h(i))
    w.job("b1", "lab/b", min_runtime_s=0, submitted=h(3))
    # r stays 0 for both: leaf by leaf in budget order, a (tie by path) keeps the lead for both of its jobs
    assert [p.split("@")[0] for p in placed(w.cycle())] == ["a1", "a2", "b1"]
    # D3.free-order: a 0 and b 0 tie, a first -> a1 (a: 1 / 0.5 = 2); b 0 -> b1 (b: 4); a 2 -> a2
    assert [p.split("@")[0] for p in placed(w.cycle(free_order=True))] == ["a1", "b1", "a2"]


def test_reservation_keeps_lower_ranked_work_off_the_reserved_nodes():
    # g waits since 8 h (>= 1 h), needs 2 x 4: n0 has 4 free, n1 2 free (x holds 2, protected).
    # It reserves n0 and n1 (most free first); k (ranked after g) cannot use them; n2 is not reserved.
    w = (
        World()
        .node("n0", 4)
        .node("n1", 4)
        .node("n2", 1)
        .run("x", "lab/b", {"n1": (0, 1)}, min_runtime_s=1e6)
        .job("g", "lab/a", 4, 2, queued=h(8))
        .job("k", "lab/a", 1, submitted=h(2))
    )
    res = w.cycle()
    assert res.reservation == ("g", ("n0", "n1"))
    assert placed(res) == ["k@n2[0]"]


def test_no_reservation_before_reservation_after():
    w = (
        World()
        .node("n0", 4)
        .node("n1", 4)
        .run("x", "lab/b", {"n1": (0, 1)}, min_runtime_s=1e6)
        .job("g", "lab/a", 4, 2, queued=h(9.5))
        .job("k", "lab/a", 1, submitted=h(2))
    )
    res = w.cycle()
    assert res.reservation is None
    assert placed(res) == ["k@n1[2]"]


def test_same_snapshot_same_events():
    def build():
        w = World().node("n0", 4).node("n1", 4).run("u", "lab/c", {"n0": (0, 1)}, allocated=False)
        for i in range(6):
            w.job(f"j{i}", ("lab/a", "lab/b")[i % 2], 1 + i % 3, submitted=h(i))
        return w.cycle().events

    one, two = build(), build()
    assert [ev.encode(e) for e in one] == [ev.encode(e) for e in two]


def test_skipped_leaf_after_smallest_shape_fails():
    # No free GPU and nothing to preempt: the first 1-GPU failure of each leaf skips the rest.
    w = World().node("n0", 2).run("p", "lab/c", {"n0": (0, 1)}, min_runtime_s=1e6)
    for i in range(50):
        w.job(f"a{i}", "lab/a", 1, submitted=h(1) + i)
        w.job(f"b{i}", "lab/b", 1, submitted=h(1) + i)
    res = w.cycle()
    assert res.events == [] and res.considered == 2


def test_blocked_run_of_one_shape_is_passed_over_with_exact_ranks():
    # n0 (8 GPUs) is full with a protected run p; n1 (2 GPUs): unallocated u on GPU 0, protected x on 1.
    # lab/a: r (8 x 2, waiting 10 h) is blocked and takes the reservation (n0: the only node with 8 GPUs);
    # b0 (4 GPUs) is blocked (free: none; preemption: only u's 1 GPU on n1) -> shape (4, 1) known blocked;
    # b1..b9 have that shape and come next: passed over (9), each still counted in rank;
    # s (1 GPU) preempts u on n1 at rank 1 + 10 = 11.
    w = (
        World()
        .node("n0", 8)
        .node("n1", 2)
        .run("p", "lab/c", {"n0": tuple(range(8))}, min_runtime_s=1e6)
        .run("u", "lab/b", {"n1": (0,)}, allocated=False)
        .run("x", "lab/c", {"n1": (1,)}, min_runtime_s=1e6)
        .job("r", "lab/a", 8, 2, submitted=h(0), queued=h(0))
    )
    for i in range(10):
        w.job(f"b{i}", "lab/a", 4, submitted=h(1) + i)
    w.job("s", "lab/a", 1, submitted=h(2))
    res = w.cycle()
    assert res.reservation == ("r", ("n0",))
    assert placed(res) == ["s@n1[0]"] and preempted(res) == ["u<-s"]
    pl = [e for e in res.events if isinstance(e, ev.JobPlaced)][0]
    assert pl.decision.rank == 11
    assert (res.considered, res.passed_over, res.searches) == (12, 9, 3)


def test_unallocated_jobs_that_cannot_fit_are_passed_over_with_exact_ranks():
    # n0 has 3 free GPUs. lab/a's unallocated jobs: w0..w5 need 4 GPUs each. w0 fails the fit;
    # w1 is known not to fit, and w2..w5 (same shape, next in line) are passed over with it (4);
    # t (2 GPUs) fits at rank 6; v (4 GPUs) is known not to fit and is the last.
    w = World().node("n0", 3)
    for i in range(6):
        w.job(f"w{i}", "lab/a", 4, min_runtime_s=0, submitted=h(1) + i)
    w.job("t", "lab/a", 2, min_runtime_s=0, submitted=h(2))
    w.job("v", "lab/a", 4, min_runtime_s=0, submitted=h(3))
    res = w.cycle()
    assert placed(res) == ["t@n0[0, 1]"]
    pl = [e for e in res.events if isinstance(e, ev.JobPlaced)][0]
    assert pl.decision.rank == 6
    assert (res.considered, res.passed_over) == (8, 4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.sampled_from([None, "a100"])), max_size=60
    ),
    st.sets(st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]), st.sampled_from([None, "a100"]))),
    st.integers(0, 60),
)
def test_blocked_run_by_byte_search_equals_the_scan(shapes, blocked, lo):
    """The run length is the index of the first job at or after lo whose shape is not blocked."""
    jobs = [
        PendingJob(
            job_id=f"j{i}",
            attempt=1,
            budget="lab/a",
            user="u",
            gpus_per_replica=g,
            replicas=k,
            min_runtime_s=1.0,
            submitted_at_us=i,
            queued_at_us=i,
            gpu_model=m,
        )
        for i, (g, k, m) in enumerate(shapes)
    ]
    asked = []

    def is_blocked(g, k, m):
        asked.append((g, k, m))
        return (g, k, m) in blocked

    lo = min(lo, len(jobs))
    expected = next((i for i in range(lo, len(jobs)) if shapes[i] not in blocked), len(jobs)) - lo
    assert blocked_run(jobs, lo, len(jobs), is_blocked) == expected
    assert len(asked) == len(set(asked))  # once per distinct shape
    asked.clear()
    memo = CycleMemo()
    assert blocked_run(jobs, lo, len(jobs), is_blocked, memo) == expected
    assert len(asked) == len(set(asked))
    assert memo[id(jobs)][2] == memo.shapes.codes(jobs)  # the codes the byte search read are kept with the list


def test_behind_set_by_tree_walk_equals_the_lca_rule():
    # The engine groups candidate leaves by their branch at the LCA; it must give exactly
    # the pairwise rule r(V branch) >= r(B branch) + delta of rule D3.victims.
    import random

    from apportion.domain.engine import CycleVictims
    from apportion.domain.fairshare import FairShareQueue
    from apportion.domain.preemption import branches_of as _branches

    rng = random.Random(11)
    spec = {"o": 1.0}
    for i in range(3):
        spec[f"o/g{i}"] = 0.3
        for j in range(3):
            spec[f"o/g{i}/l{j}"] = 0.3
            if j == 0:
                for q in range(2):
                    spec[f"o/g{i}/l{j}/x{q}"] = 0.5
    tree = BudgetTree.from_mapping(spec)
    leaves = tree.leaves()
    for trial in range(50):
        occ: dict[str, float] = {}
        for leaf in leaves:
            v = rng.uniform(0, 300)
            for a in tree.ancestors(leaf):
                occ[a] = occ.get(a, 0.0) + v
        view: FairShareQueue[int] = FairShareQueue(tree, occ, 1000.0, {})
        vic = CycleVictims.__new__(CycleVictims)
        vic.expired = {leaf: {} for leaf in rng.sample(leaves, 8)}
        vic.behind, vic.under, vic._levels = {}, None, {}
        # with the after-move test (a random charge) and some moves already made this cycle
        moves = {m for m in [_branches(*rng.sample(leaves, 2)) for _ in range(3)] if m is not None}
        for b in leaves:
            charge = rng.choice([0.0, 10.0, 100.0])
            by_lca = vic.behind_of(b, view, 0.05, trial, None, charge, moves)
            vic.behind.clear()
            by_walk = vic.behind_of(b, view, 0.05, trial, tree, charge, moves)
            vic.behind.clear()
            assert by_walk == by_lca


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 4), st.sampled_from([None, "a100"])), max_size=80),
    st.integers(0, 80),
    st.integers(0, 80),
)
def test_floor_from_shape_codes_equals_the_floor_of_the_jobs(shapes, lo, hi):
    jobs = [
        PendingJob(
            job_id=f"j{i}",
            attempt=1,
            budget="lab/a",
            user="u",
            gpus_per_replica=g,
            replicas=k,
            min_runtime_s=1.0,
            submitted_at_us=i,
            queued_at_us=i,
            gpu_model=m,
        )
        for i, (g, k, m) in enumerate(shapes)
    ]
    lo, hi = min(lo, len(jobs)), min(hi, len(jobs))
    expected = (
        min((g for g, _, _ in shapes[lo:hi]), default=2**30),
        min((k for _, k, _ in shapes[lo:hi]), default=2**30),
    )
    assert shape_floor(jobs, lo, hi) == expected
    table = ShapeTable()
    codes = table.codes(jobs)
    assert codes is not None and table.floor(codes, lo, hi) == expected


def test_each_shape_table_interns_its_own_codes_in_order_of_first_sight():
    # Two tables (two dispatchers or simulations in one process) share nothing: the same shape may
    # get different codes, and each decodes its own. Codes are given in order of first sight, 256 at most.
    a, b = ShapeTable(), ShapeTable()
    assert (a.code(1, 1, None), a.code(8, 2, "a100"), a.code(1, 1, None)) == (0, 1, 0)
    assert (b.code(8, 2, "a100"), b.code(1, 1, None)) == (0, 1)
    assert (a.shape(1), b.shape(1)) == ((8, 2, "a100"), (1, 1, None))
    full = ShapeTable()
    assert [full.code(g, 1, None) for g in range(1, 257)] == list(range(256))
    assert full.code(300, 1, None) is None and full.code(256, 1, None) == 255
    assert ShapeTable().code(300, 1, None) == 0  # a full table fills no other


def _free_order_world() -> World:
    # n0 (8 GPUs): lab/a's unallocated u holds 4, 4 are free. Pending, all unallocated, 1 GPU each:
    # a1, a2 (lab/a, share 0.5), b1..b3 (lab/b, 0.25), c1 (lab/c, 0.25). Occupancy 0: budget order a, b, c.
    w = World().node("n0", 8).run("u", "lab/a", {"n0": (0, 1, 2, 3)}, allocated=False)
    for leaf, names in (("lab/a", ("a1", "a2")), ("lab/b", ("b1", "b2", "b3")), ("lab/c", ("c1",))):
        for i, name in enumerate(names):
            w.job(name, leaf, min_runtime_s=0, submitted=h(1) + i)
    return w


@pytest.mark.parametrize("indexed", [False, True], ids=["runs walked", "victim index kept by the caller"])
def test_free_order_gives_free_gpus_to_the_leaf_with_the_fewest_unallocated_gpus_per_share(indexed):
    # D3.free-order, key = unallocated GPUs in use / abs share, ties by budget order (a, b, c):
    # a 4 / 0.5 = 8, b 0, c 0 -> b1 (b: 1 / 0.25 = 4); c 0 -> c1 (c has no more); b 4 -> b2 (b: 8);
    # a 8 and b 8 tie, a first in budget order -> a1. The 4 free GPUs are gone.
    w = _free_order_world()
    cs = w.cluster.snapshot()
    snap = CycleSnapshot(
        cs, w.pending, TREE, w.occupancy, w.capacity, victims=VictimIndex.build(cs.runs) if indexed else None
    )
    res = run_cycle(snap, NOW, EngineConfig(free_order=True))
    assert [p.split("@")[0] for p in placed(res)] == ["b1", "c1", "b2", "a1"]


def test_without_free_order_unallocated_jobs_go_leaf_by_leaf_in_budget_order():
    assert [p.split("@")[0] for p in placed(_free_order_world().cycle(free_order=False))] == ["a1", "a2", "b1", "b2"]


def test_free_order_does_not_count_stopping_unallocated_runs():
    # u is stopping: lab/a holds 0 unallocated GPUs, so a, b, c all start at key 0 and the
    # budget order breaks the ties: a1 (a: 2), b1 (b: 4), c1; then a (2) before b (4): a2.
    # u's 4 GPUs are still held while it stops, so only 4 are free.
    w = World().node("n0", 8).run("u", "lab/a", {"n0": (0, 1, 2, 3)}, allocated=False, stopping=True)
    for leaf, names in (("lab/a", ("a1", "a2")), ("lab/b", ("b1", "b2", "b3")), ("lab/c", ("c1",))):
        for i, name in enumerate(names):
            w.job(name, leaf, min_runtime_s=0, submitted=h(1) + i)
    assert [p.split("@")[0] for p in placed(w.cycle(free_order=True))] == ["a1", "b1", "c1", "a2"]


def _las_world() -> World:
    # n0 (8 GPUs): lab/a's unallocated u holds 4, 4 are free. Pending, all unallocated, 1 GPU each, budget order
    # a, b, c (occupancy 0): a1 (lab/a, 7,200 GPU-s held by its earlier attempts), a2 (0); b1 (3,600), b2 (0), b3
    # (1,800); c1 (0). Without D3.free-las, leaf by leaf in submission order: a1, a2, b1, b2.
    w = _free_order_world()
    held = {"a1": 7200.0, "b1": 3600.0, "b3": 1800.0}
    w.pending = {
        leaf: [replace(j, attempt=2, attained_gpu_s=held[j.job_id]) if j.job_id in held else j for j in jobs]
        for leaf, jobs in w.pending.items()
    }
    return w


LAS_CASES = [
    pytest.param(
        {"free_las": False},
        ["a1", "a2", "b1", "b2"],
        id="off: leaf by leaf in budget order, in submission order within a leaf",
    ),
    pytest.param(
        {"free_las": True, "free_order": True},
        # D3.free-order decides instead (key unallocated GPUs in use / abs share): b1, c1, b2, a1 as without the
        # GPU-seconds held
        ["b1", "c1", "b2", "a1"],
        id="with free_order on, rule D3.free-order orders them",
    ),
    pytest.param(
        {"free_las": True},
        # the jobs not yet run first in the same order (a2, b2, c1), then the requeued ones by GPU-seconds held:
        # b3 (1,800) before b1 (3,600) and a1 (7,200); 4 free GPUs: a2, b2, c1, b3
        ["a2", "b2", "c1", "b3"],
        id="on: never run first in budget order, then the least GPU-seconds held",
    ),
]


@pytest.mark.parametrize(("cfg", "expected"), LAS_CASES)
def test_free_las_orders_unallocated_jobs_by_attained_service(cfg, expected):
    assert [p.split("@")[0] for p in placed(_las_world().cycle(**cfg))] == expected


def test_free_las_ties_in_attained_service_go_by_budget_order():
    # every job requeued with 3,600 GPU-s: the tie keeps the order without the rule (a1, a2, b1, b2)
    w = _free_order_world()
    w.pending = {leaf: [replace(j, attained_gpu_s=3600.0) for j in jobs] for leaf, jobs in w.pending.items()}
    assert [p.split("@")[0] for p in placed(w.cycle(free_las=True))] == ["a1", "a2", "b1", "b2"]


def test_free_las_requeued_job_waits_behind_the_jobs_not_yet_run():
    # n0 has 2 free GPUs; a1 (lab/a, first in budget order) was requeued after 7,200 GPU-s, b2 and b3 (lab/b)
    # never ran: with D3.free-las b2 and b3 take both GPUs and a1 waits; without it a1 goes first, then b2
    w = World().node("n0", 2)
    w.job("a1", "lab/a", min_runtime_s=0, submitted=h(1))
    w.job("b2", "lab/b", min_runtime_s=0, submitted=h(2))
    w.job("b3", "lab/b", min_runtime_s=0, submitted=h(3))
    w.pending["lab/a"] = [replace(w.pending["lab/a"][0], attempt=3, attained_gpu_s=7200.0)]
    # never run: b2, b3 take both GPUs; the requeued a1 waits
    assert [p.split("@")[0] for p in placed(w.cycle())] == ["b2", "b3"]  # (the default)
    assert [p.split("@")[0] for p in placed(w.cycle(free_las=False))] == ["a1", "b2"]


def _aged_world() -> World:
    # n0 (3 GPUs free), now 10:00; pending, all unallocated, 1 GPU each, budget order a, b, c (occupancy 0):
    #   lab/a: a1 submitted 6:00, never run
    #   lab/b: b1 submitted 2:00, requeued after 7,200 GPU-s; b2 submitted 8:00, never run
    #   lab/c: c1 submitted 1:00, requeued after 3,600 GPU-s
    w = World().node("n0", 3)
    w.job("a1", "lab/a", min_runtime_s=0, submitted=h(6))
    w.job("b1", "lab/b", min_runtime_s=0, submitted=h(2)).job("b2", "lab/b", min_runtime_s=0, submitted=h(8))
    w.job("c1", "lab/c", min_runtime_s=0, submitted=h(1))
    held = {"b1": 7200.0, "c1": 3600.0}
    w.pending = {
        leaf: [replace(j, attempt=2, attained_gpu_s=held[j.job_id]) if j.job_id in held else j for j in jobs]
        for leaf, jobs in w.pending.items()
    }
    return w


AGED_CASES = [
    pytest.param(None, ["a1", "b2", "c1"], id="off: never run first (a1, b2), then the least GPU-seconds held (c1)"),
    pytest.param(5 * 3600.0, ["c1", "b1", "a1"], id="5 h: c1 (9 h old) and b1 (8 h) first, oldest first, then a1"),
    pytest.param(8.5 * 3600.0, ["c1", "a1", "b2"], id="8.5 h: only c1 is aged; the rest by rule D3.free-las"),
    pytest.param(9 * 3600.0, ["c1", "a1", "b2"], id="9 h: c1 submitted exactly 9 h ago counts as aged"),
]


@pytest.mark.parametrize(("age_s", "expected"), AGED_CASES)
def test_free_age_places_aged_free_work_first_across_leaves_oldest_first(age_s, expected):
    assert [p.split("@")[0] for p in placed(_aged_world().cycle(free_age_s=age_s))] == expected


def _las_queue_world() -> World:
    # n0 (2 GPUs free), budget order a, b (occupancy 0); pending, all unallocated, 1 GPU each:
    #   lab/a: a1 submitted 1:00, requeued after 1,800 GPU-s; a2 submitted 5:00, never run
    #   lab/b: b1 submitted 3:00, never run
    w = World().node("n0", 2)
    w.job("a1", "lab/a", min_runtime_s=0, submitted=h(1)).job("a2", "lab/a", min_runtime_s=0, submitted=h(5))
    w.job("b1", "lab/b", min_runtime_s=0, submitted=h(3))
    w.pending["lab/a"][0] = replace(w.pending["lab/a"][0], attempt=2, attained_gpu_s=1800.0)
    return w


LAS_QUEUE_CASES = [
    pytest.param(None, ["a2", "b1"], id="off: the jobs never run (a2, b1) take both GPUs; requeued a1 waits"),
    pytest.param(1800.0, ["a2", "b1"], id="Q = 1,800 GPU-s: a1 held exactly Q, second queue, waits"),
    pytest.param(1801.0, ["a1", "a2"], id="Q = 1,801 GPU-s: a1 in the first queue, first of lab/a by submission"),
    pytest.param(1e12, ["a1", "a2"], id="Q past any service: the order without rule D3.free-las"),
]


@pytest.mark.parametrize(("queue_gpu_s", "expected"), LAS_QUEUE_CASES)
def test_free_las_queue_keeps_a_job_preempted_early_in_its_leafs_submission_order(queue_gpu_s, expected):
    assert [p.split("@")[0] for p in placed(_las_queue_world().cycle(free_las_queue_gpu_s=queue_gpu_s))] == expected


def test_free_las_queue_past_any_service_is_the_order_without_least_attained_service():
    w = _las_queue_world()
    assert placed(w.cycle(free_las_queue_gpu_s=1e12)) == placed(w.cycle(free_las=False))


def test_free_las_queue_leaves_the_second_queue_by_fewest_gpu_seconds():
    # the aged world (3 GPUs; a1 and b2 never run, b1 held 7,200 GPU-s, c1 3,600), Q = 3,601 GPU-s: c1 joins the
    # first queue (walk a1, b2, c1: lab/c last in budget order); b1 (7,200 >= Q) is left, no GPU remaining
    assert [p.split("@")[0] for p in placed(_aged_world().cycle(free_las_queue_gpu_s=3601.0))] == ["a1", "b2", "c1"]
    # Q = 7,201 GPU-s: b1 too, in lab/b's submission order before b2; c1 (walked last) finds no GPU
    assert [p.split("@")[0] for p in placed(_aged_world().cycle(free_las_queue_gpu_s=7201.0))] == ["a1", "b1", "b2"]


FIRST_QUEUE_CASES = [
    pytest.param(0.0, None, True, id="never run, knob off: first queue"),
    pytest.param(0.5, None, False, id="any service held, knob off: second queue"),
    pytest.param(3599.0, 3600.0, True, id="below Q: first queue"),
    pytest.param(3600.0, 3600.0, False, id="exactly Q: second queue"),
    pytest.param(0.0, 0.0, True, id="Q = 0: never run only"),
    pytest.param(1.0, 0.0, False, id="Q = 0: as off"),
]


@pytest.mark.parametrize(("held", "queue_gpu_s", "expected"), FIRST_QUEUE_CASES)
def test_first_las_queue_at_its_boundary(held, queue_gpu_s, expected):
    assert first_las_queue(held, queue_gpu_s) is expected


def test_progress_after_records_the_progress_saved_as_the_protection():
    # a job of min_runtime 2 h preempted once, its last checkpoint 30 h of work: placed on a free GPU, its decision
    # records 2 h x 2 = 4 h by default, and with EngineConfig.progress_after = 1 the 30 h saved (under W / 4 = 42 h)
    w = World().node("n0", 1).job("j", "lab/a", min_runtime_s=7200.0)
    w.pending["lab/a"] = [replace(w.pending["lab/a"][0], attempt=2, preemptions=1, progress_s=30 * 3600.0)]

    def recorded(**cfg) -> list[float | None]:
        return [e.decision.protection_s for e in w.cycle(**cfg).events if isinstance(e, ev.JobPlaced)]

    assert recorded() == [4 * 3600.0]
    assert recorded(progress_after=1) == [30 * 3600.0]


def _thrice_preempted_placed(occupancy: float, **cfg) -> list[tuple[float, float | None]]:
    """(r, protection_s) of the ``JobPlaced`` of lab/a's job of min_runtime 2 h preempted 3 times, lab/a and lab
    holding ``occupancy`` GPU-s."""
    w = World().node("n0", 1).job("j", "lab/a", min_runtime_s=7200.0)
    w.pending["lab/a"] = [replace(w.pending["lab/a"][0], attempt=4, preemptions=3)]
    w.occupancy = {"lab/a": occupancy, "lab": occupancy}
    return [(e.decision.ratio, e.decision.protection_s) for e in w.cycle(**cfg).events if isinstance(e, ev.JobPlaced)]


def test_at_share_bound_protects_a_job_under_its_share_until_done():
    # min_runtime 2 h, preempted 3 times: 2 h x 8 = 16 h under its share. K = 1000, lab/a's entitlement 500 GPU-s:
    # with no occupancy its r when the job is placed is 0 (under its share): until done with at_share_bound 3;
    # with 7200 GPU-s its r is 7200 / 500 = 14.4 (over its share): the bound does not apply, and the policy
    # (grow_over_share False) keeps it at its minimum runtime, 2 h; growing every job, 16 h
    recorded = _thrice_preempted_placed
    assert recorded(0.0) == [(0.0, 16 * 3600.0)]
    assert recorded(0.0, at_share_bound=3) == [(0.0, PROTECTION_UNTIL_DONE_S)]
    assert recorded(7200.0, at_share_bound=3) == [(14.4, 2 * 3600.0)]
    assert recorded(7200.0, at_share_bound=3, grow_over_share=True) == [(14.4, 16 * 3600.0)]


def test_protection_grows_only_for_a_job_at_or_under_its_share():
    # rule D3.bounded-churn (policy fairtree-10, grow_over_share False by default): min_runtime 2 h, preempted 3
    # times. K = 1000, lab/a's entitlement 500 GPU-s: at r 0 it grows to 2 h x 8 = 16 h; with 7200 GPU-s r is 14.4
    # (over its share): its minimum runtime, 2 h; with grow_over_share True (up to fairtree-9) 16 h
    recorded = _thrice_preempted_placed
    assert recorded(0.0) == [(0.0, 16 * 3600.0)]
    assert recorded(7200.0) == [(14.4, 2 * 3600.0)]
    assert recorded(7200.0, grow_over_share=True) == [(14.4, 16 * 3600.0)]


def test_allocated_count_is_kept_in_the_memo_and_read_from_it():
    def job(i: int, rt: float) -> PendingJob:
        return PendingJob(
            job_id=f"j{i}",
            attempt=1,
            budget="lab/a",
            user="u",
            gpus_per_replica=1,
            replicas=1,
            min_runtime_s=rt,
            submitted_at_us=i,
            queued_at_us=i,
        )

    jobs = [job(0, 60.0), job(1, 60.0), job(2, 60.0), job(3, 0.0), job(4, 0.0)]
    assert memo_allocated(None, jobs) == 3
    memo = CycleMemo()
    assert memo_allocated(memo, jobs) == 3
    assert memo[id(jobs)][3] == 3  # kept with the list
    memo[id(jobs)][3] = 1
    assert memo_allocated(memo, jobs) == 1  # a kept count is used as it is
    memo[id(jobs)] = [list(jobs), {}, None, 1]  # an entry of another list under a reused id
    assert memo_allocated(memo, jobs) == 3
