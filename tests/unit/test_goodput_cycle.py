"""Exact scheduling cycles for the goodput rules (design D2 and D3).

Each case builds a cluster by folding events, a queue and window occupancy,
runs one :func:`run_cycle` at ``NOW`` and compares the decisions with values
worked out by hand in the comments.

Default tree::

    lab (1.0)
    ├── a  0.5
    └── b  0.5
"""

from __future__ import annotations

from collections import Counter

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.timeutil import s_to_us
from tests.kit import engine_world
from tests.kit.builders import h
from tests.kit.goodput_world import NOW, World, explained, placed_jobs, placements, preempted

# ---------------------------------------------------------------- cold start (rule D2.cold-start)


def test_cold_start_splits_equal_demand_by_share_from_the_first_cycle():
    """Empty window (K = 0, no occupancy): 8 x 1-GPU jobs per budget on one 8-GPU node.

    K is floored at 1 GPU-s, so after a's first job (charge 1 * 3600 GPU-s) r_a = 3600 / 0.5 = 7200
    > r_b = 0: b goes next; then both are 7200 and the tie goes by path to a, and so on: a, b, a,
    b, ... 4 and 4. (With the old +inf ratios it was a, b, then a six more times: 7 and 1.)
    """
    w = World(capacity=0.0).node("n0", 8)
    for i in range(8):
        w.job(f"a{i}", "lab/a", submitted=h(1) + i).job(f"b{i}", "lab/b", submitted=h(1) + i)
    res = w.cycle()
    got = placed_jobs(res)
    assert got == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    assert Counter(j[0] for j in got) == {"a": 4, "b": 4}
    assert not preempted(res)


def test_cold_start_splits_by_unequal_shares():
    """a at 0.75, b at 0.25, K = 0: 8 free GPUs go 6 and 2 (r = charges / share: a's k-th job is
    ranked at (k-1) * 3600 / 0.75, b's at (k-1) * 3600 / 0.25)."""
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.75, "lab/b": 0.25})
    w = World(tree=tree, capacity=0.0).node("n0", 8)
    for i in range(8):
        w.job(f"a{i}", "lab/a", submitted=h(1) + i).job(f"b{i}", "lab/b", submitted=h(1) + i)
    got = placed_jobs(w.cycle())
    assert Counter(j[0] for j in got) == {"a": 6, "b": 2}


# ---------------------------------------------------------------- loop-free preemption (rule D3.consistent-view)


def test_same_cycle_reversal_is_refused():
    """K = 1e5: E_a = E_b = 5e4. r_a = 0.5 (O 25,000), r_b = 1.0 (O 50,000). delta 0.05.

    n0 (4 GPUs): bx, b's expired 4-GPU run; n1 (4): ax, a's expired 4-GPU run; n2: 2 free GPUs.
    a's queue: a1 (4 GPUs, 60 s: charge 240), a2 (2 GPUs, 20 h: charge 144,000). b's: b1 (4, 60 s).

    1. a1 (r_a 0.5 first): no 4 free GPUs; bx is behind (1.0 >= 0.55) and after the move
       r_a = 25,240 / 5e4 = 0.5048 <= 1.0: a1 preempts bx. r_a = 0.5048.
    2. a2 (r_a still lowest) fits n2: r_a = 169,240 / 5e4 = 3.3848.
    3. b1 (r_b 1.0 now lowest): ax is behind by 2.38 and r_b after = 1.0048 <= 3.3848, but the
       cycle already preempted b's work for a: b1 must not take a's work back. It waits.
    """
    w = (
        World(capacity=1e5)
        .node("n0", 4)
        .node("n1", 4)
        .node("n2", 2)
        .run("bx", "lab/b", {"n0": (0, 1, 2, 3)}, min_runtime_s=60)
        .run("ax", "lab/a", {"n1": (0, 1, 2, 3)}, min_runtime_s=60)
        .job("a1", "lab/a", 4, min_runtime_s=60, submitted=h(1))
        .job("a2", "lab/a", 2, min_runtime_s=20 * 3600, submitted=h(2))
        .job("b1", "lab/b", 4, min_runtime_s=60, submitted=h(1))
    )
    w.occupancy = {"lab/a": 25_000.0, "lab/b": 50_000.0, "lab": 75_000.0}
    res = w.cycle()
    assert preempted(res) == ["bx<-a1"]
    assert placements(res) == ["a1@n0[0, 1, 2, 3]", "a2@n2[0, 1]"]
    (vic,) = next(e for e in res.events if isinstance(e, ev.JobPlaced) and e.job_id == "a1").decision.victims
    assert (vic.victim_ratio, vic.preemptor_ratio) == (1.0, 0.5)
    assert vic.preemptor_ratio_after is not None and abs(vic.preemptor_ratio_after - 0.5048) < 1e-12


def test_a_move_that_would_put_the_preemptor_ahead_is_refused():
    """The issue's two-job swap, one cycle: one 8-GPU node, a and b at 0.5, K = 8 GPUs x 1 h.

    b's 8-GPU job has run the whole hour (O_b = 28,800, r_b = 2.0); a has nothing (r_a = 0).
    a's 8-GPU job with min_runtime 60 s charges 480: r_a after = 480 / 14,400 = 0.0333 <= 2.0,
    so it may take the node. With min_runtime 2 h it would charge 57,600: r_a after = 4.0 >
    2.0 - a's job would put a further ahead than b is now: refused.
    """
    for min_rt, expected in ((60.0, ["bx<-j"]), (7200.0, [])):
        w = World(capacity=28_800.0).node("n0", 8).run("bx", "lab/b", {"n0": tuple(range(8))}, min_runtime_s=60)
        w.job("j", "lab/a", 8, min_runtime_s=min_rt)
        w.occupancy = {"lab/b": 28_800.0, "lab": 28_800.0}
        assert preempted(w.cycle()) == expected, min_rt


def test_a_gang_is_not_preempted_whole_for_a_small_job_when_another_victim_exists():
    """a (r 0) needs 1 GPU; b is far ahead (r 10) and has two expired runs:

    * G, a 2 x 8 gang on n0 + n1, started at 5 h;
    * s, a single 8-GPU run on n2, started at 0 h (more work lost per GPU than G's replica).

    The cost counts a victim's whole run: G costs 16 allocated GPUs, s 8, so s goes. (Counting
    only a victim's GPUs on the node, both would cost 8 and G, which lost less per node, would go.)
    Without s, G is the only victim and is still not preempted for a 1-GPU job
    (``preemption.gang_rule``: a gang is never preempted for a job smaller than it); j waits.
    """
    for with_s, expected in ((True, ["s<-j"]), (False, [])):
        w = World(capacity=10_000.0).node("n0", 8).node("n1", 8).node("n2", 8)
        w.run("G", "lab/b", {"n0": tuple(range(8)), "n1": tuple(range(8))}, min_runtime_s=60, started=h(5))
        if with_s:
            w.run("s", "lab/b", {"n2": tuple(range(8))}, min_runtime_s=60, started=h(0))
        else:
            w.run("t", "lab/a", {"n2": tuple(range(8))}, min_runtime_s=1e9)  # n2 busy and protected
        w.job("j", "lab/a", 1, min_runtime_s=60)
        w.occupancy = {"lab/b": 50_000.0, "lab": 50_000.0}
        assert preempted(w.cycle()) == expected, with_s


def test_a_gang_may_be_preempted_for_a_job_at_least_its_size():
    """gang_rule: b's expired 2 x 8 gang G is the only victim. a's 2 x 8 job (16 GPUs, G's size) takes both
    nodes; a's 8-GPU job (half G's size) does not, and its failed search is not remembered for the larger
    job behind it in the same leaf (the larger one may take G: both jobs of a in one cycle, 8 GPUs first)."""
    for shapes, expected in (([(8, 2)], ["G<-j0"]), ([(8, 1)], []), ([(8, 1), (8, 2)], ["G<-j1"])):
        w = World(capacity=10_000.0).node("n0", 8).node("n1", 8)
        w.run("G", "lab/b", {"n0": tuple(range(8)), "n1": tuple(range(8))}, min_runtime_s=60, started=h(5))
        for i, (g, k) in enumerate(shapes):
            w.job(f"j{i}", "lab/a", g, k, min_runtime_s=60, submitted=h(1) + i)
        w.occupancy = {"lab/b": 50_000.0, "lab": 50_000.0}
        assert preempted(w.cycle()) == expected, shapes


def test_the_victim_with_the_least_work_lost_since_its_checkpoint_goes_first():
    """Two expired 4-GPU runs of b, both started at 0 h; only y checkpointed (at 9 h 50 min).
    Work lost at 10 h: x 4 * 36,000 = 144,000 GPU-s, y 4 * 600 = 2,400: y goes."""
    w = World(capacity=10_000.0).node("n0", 4).node("n1", 4)
    w.run("x", "lab/b", {"n0": (0, 1, 2, 3)}, min_runtime_s=60)
    w.run("y", "lab/b", {"n1": (0, 1, 2, 3)}, min_runtime_s=60, checkpoint=h(10) - 600_000_000)
    w.job("j", "lab/a", 4, min_runtime_s=60)
    w.occupancy = {"lab/b": 50_000.0, "lab": 50_000.0}
    res = w.cycle()
    assert preempted(res) == ["y<-j"]
    pre = next(e for e in res.events if isinstance(e, ev.JobPreempted))
    assert pre.lost_gpu_s == 2400.0 and pre.victim is not None and pre.victim.lost_gpu_s == 2400.0


# ---------------------------------------------------------------- reservations that do not idle GPUs


def reserved_world(*jobs: tuple[str, str, float]) -> World:
    """One scarce-model node n0 (8 x h100): x (lab/b) holds 2 GPUs, protected until 15 h (started
    at 0 h with min_runtime 15 h); 6 GPUs free. H (lab/a, 8 h100 GPUs) has waited since 8 h: it
    reserves n0. It can fit no earlier than 15 h (earliest_fit_us). Then the given 1-GPU h100 jobs
    (job id, budget, min_runtime_s) of lab/b, ranked below H."""
    w = World(capacity=1e6).node("n0", 8, model="h100")
    w.run("x", "lab/b", {"n0": (0, 1)}, min_runtime_s=15 * 3600)
    w.job("H", "lab/a", 8, model="h100", queued=h(8), submitted=h(1))
    for i, (jid, budget, min_rt) in enumerate(jobs):
        w.job(jid, budget, 1, model="h100", min_runtime_s=min_rt, submitted=h(2) + i)
    w.occupancy = {"lab/b": 600_000.0, "lab": 600_000.0}  # r_b = 1.2 > r_a = 0: H ranks first
    return w


def test_a_reservation_lends_its_free_gpus_to_unallocated_work():
    res = reserved_world(("u1", "lab/b", 0.0), ("u2", "lab/b", 0.0)).cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["u1@n0[2]", "u2@n0[3]"]


def test_a_reservation_lends_its_free_gpus_to_allocated_work_whose_protection_ends_before_the_holder_fits():
    # H fits at 15 h. s1's protection (1 h) ends at 11 h <= 15 h: it may run there. s5 (5 h) ends
    # at exactly 15 h: allowed. s6 (6 h) would end at 16 h, after H could start: it waits.
    res = reserved_world(("s1", "lab/b", 3600.0), ("s5", "lab/b", 5 * 3600.0), ("s6", "lab/b", 6 * 3600.0)).cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["s1@n0[2]", "s5@n0[3]"]


def test_the_holder_evicts_the_unallocated_backfill_the_moment_it_can_start():
    # x has finished; u1, u2 (unallocated) run on n0's GPUs 2 and 3: H preempts them at once.
    w = World(capacity=1e6).node("n0", 8, model="h100")
    w.run("u1", "lab/b", {"n0": (2,)}, allocated=False, started=h(9))
    w.run("u2", "lab/b", {"n0": (3,)}, allocated=False, started=h(9))
    w.job("H", "lab/a", 8, model="h100", queued=h(8), submitted=h(1))
    res = w.cycle()
    assert preempted(res) == ["u1<-H", "u2<-H"]
    assert placements(res) == ["H@n0[0, 1, 2, 3, 4, 5, 6, 7]"]


def test_earliest_fit_is_the_protection_end_of_the_runs_the_holder_needs():
    from apportion.domain.engine import earliest_fit_us

    w = World().node("n0", 8).node("n1", 8)
    w.run("x", "lab/b", {"n0": (0, 1)}, min_runtime_s=15 * 3600)  # protected to 15 h
    w.run("y", "lab/b", {"n1": (0, 1, 2, 3)}, min_runtime_s=12 * 3600)  # to 12 h
    w.run("z", "lab/b", {"n1": (4, 5)}, min_runtime_s=14 * 3600)  # to 14 h
    w.run("u", "lab/b", {"n1": (6, 7)}, allocated=False)  # evictable now
    snap = w.cluster.snapshot()
    assert earliest_fit_us(snap, ["n0"], 6, NOW, set()) == NOW  # 6 free
    assert earliest_fit_us(snap, ["n0"], 8, NOW, set()) == h(15)
    # n1 for 4 GPUs: u's 2 now, then y's 4 at 12 h -> 6 >= 4 at 12 h
    assert earliest_fit_us(snap, ["n1"], 4, NOW, set()) == h(12)
    assert earliest_fit_us(snap, ["n1"], 8, NOW, set()) == h(14)
    assert earliest_fit_us(snap, ["n0", "n1"], 8, NOW, set()) == h(15)  # the gang needs both
    assert earliest_fit_us(snap, ["n1"], 8, NOW, {("y", 1), ("z", 1)}) == NOW  # preempted this cycle


def test_earliest_fit_counts_only_the_runs_the_holder_may_take_back():
    from apportion.domain.cluster import UNTIL_STARTED
    from apportion.domain.engine import earliest_fit_us

    w = World().node("n1", 8)
    w.run("y", "lab/b", {"n1": (0, 1, 2, 3)}, min_runtime_s=12 * 3600)  # protected to 12 h
    w.run("z", "lab/b", {"n1": (4, 5)}, min_runtime_s=14 * 3600)  # to 14 h
    w.run("u", "lab/b", {"n1": (6, 7)}, allocated=False)  # evictable now
    snap = w.cluster.snapshot()
    seen: list[tuple[str, int]] = []

    def all_but_y(run, at_us):
        seen.append((run.job_id, at_us))
        return run.job_id != "y"

    # 4 GPUs: u's 2 now; y (12 h) may not be taken back; z's 2 at 14 h -> 4 at 14 h (with y: 12 h)
    assert earliest_fit_us(snap, ["n1"], 4, NOW, set()) == h(12)
    assert earliest_fit_us(snap, ["n1"], 4, NOW, set(), all_but_y) == h(14)
    assert sorted(seen) == [("y", h(12)), ("z", h(14))]  # asked at each run's protection end
    # 8 GPUs need y too: no known time
    assert earliest_fit_us(snap, ["n1"], 8, NOW, set(), all_but_y) == UNTIL_STARTED
    # 2 GPUs: u's now, whatever the rule says about the others
    assert earliest_fit_us(snap, ["n1"], 2, NOW, set(), lambda run, at: False) == NOW


def test_a_holder_that_may_not_take_back_the_expired_run_on_its_node_keeps_no_gpu_free():
    """x (lab/b, 2 GPUs of n0) is past its protection, but lab/b is not behind lab/a (r 1.0 each): H (lab/a,
    8 GPUs, waiting since 8 h) may not preempt it, so H has no known time to fit and keeps n0's 6 free GPUs for
    nobody: s1 and s6 (lab/b, allocated, 1 h and 6 h of protection) run there. Counting x's GPUs as available now
    (fit = now) kept them empty while s1 and s6 waited."""
    w = World(capacity=1e6).node("n0", 8)
    w.run("x", "lab/b", {"n0": (0, 1)}, min_runtime_s=3600)
    w.job("H", "lab/a", 8, queued=h(8), submitted=h(1))
    w.job("s1", "lab/b", 1, min_runtime_s=3600, submitted=h(2)).job(
        "s6", "lab/b", 1, min_runtime_s=6 * 3600, submitted=h(3)
    )
    w.occupancy = {"lab/a": 500_000.0, "lab/b": 500_000.0, "lab": 1_000_000.0}
    res = w.cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["s1@n0[2]", "s6@n0[3]"] and not preempted(res)


def test_a_holder_waiting_on_its_own_leafs_run_keeps_no_gpu_free():
    """t (lab/a, 2 GPUs of n0, protected to 15 h) is of H's own leaf: H never takes it back, so H fits only when t
    ends, which nobody knows. a1 (lab/a, 1 h) runs on n0's free GPUs; with a fit time of 15 h it waited."""
    w = World(capacity=1e6).node("n0", 8)
    w.run("t", "lab/a", {"n0": (0, 1)}, min_runtime_s=15 * 3600)
    w.job("H", "lab/a", 8, queued=h(8), submitted=h(1)).job("a1", "lab/a", 1, submitted=h(2))
    w.occupancy = {"lab/b": 600_000.0, "lab": 600_000.0}
    res = w.cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["a1@n0[2]"]


def _placed_before_the_holder(
    a1_min_runtime_s: float, a_occupancy: float, c1_min_runtime_s: float
) -> engine_world.World:
    """Tree a 0.5, b 0.25, c 0.25 (K = 1e6: E_a = 500,000, E_b = E_c = 250,000); one 8-GPU node n0, all free.
    a1 (lab/a, 1 GPU) ranks first and takes GPU 0; then H (lab/b, r_b = 250,000 / 250,000 = 1.0, 8 GPUs, waiting
    since 8 h) fits 7 free GPUs of 8, has nothing to preempt (a1 is placed in this cycle, not a run of the
    snapshot) and reserves n0; then c1 (lab/c, r_c = 300,000 / 250,000 = 1.2, 1 GPU)."""
    w = engine_world.World(capacity=1e6).node("n0", 8)
    w.job("a1", "lab/a", 1, min_runtime_s=a1_min_runtime_s, submitted=h(1))
    w.job("H", "lab/b", 8, queued=h(8), submitted=h(1))
    w.job("c1", "lab/c", 1, min_runtime_s=c1_min_runtime_s, submitted=h(1))
    w.occupancy = {"lab/a": a_occupancy, "lab/b": 250_000.0, "lab/c": 300_000.0, "lab": 550_000.0 + a_occupancy}
    return w


def test_a_run_placed_earlier_in_the_cycle_holds_its_gpus_against_the_holder_until_its_protection_ends():
    """a1's run is placed in this cycle, before H reserves n0: its GPU is not H's to use now. Counted as
    available now, H's fit time was now, so no allocated job's protection ended by it: c1 waited next to 6 free
    GPUs, left to unallocated work alone. H may not take a1 back (r_a = 3,600 / 500,000 = 0.0072 after its
    charge, not ahead of r_b = 1.0): H has no known time to fit and keeps no GPU free, c1 takes GPU 1."""
    res = _placed_before_the_holder(3600.0, 0.0, 3600.0).cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["a1@n0[0]", "c1@n0[1]"] and not preempted(res)


def test_the_holder_fits_when_the_protection_of_a_run_placed_earlier_in_the_cycle_ends():
    """a at r_a = 500,000 / 500,000 = 1.0 ties b and ranks first by path; a1 (20 h) charges 72,000 GPU-s: r_a =
    1.144. H may take a1 back once its protection ends (1.144 >= r_b + delta = 1.05, and r_b with H's charge
    of 8 x 3,600 = 1.1152 <= 1.144), at 10 h + 20 h = 30 h: H's fit time. c1 backfills when its protection ends
    by then (20 h: at 30 h exactly), not after (21 h: 31 h)."""
    for c1_h, want in ((20, ["a1@n0[0]", "c1@n0[1]"]), (21, ["a1@n0[0]"])):
        res = _placed_before_the_holder(20 * 3600.0, 500_000.0, c1_h * 3600.0).cycle()
        assert res.reservation == ("H", ("n0",)), c1_h
        assert placements(res) == want, c1_h


# ---------------------------------------------------------------- scarce models stay free


def test_jobs_without_a_model_prefer_nodes_of_models_no_waiting_job_asks_for():
    """n0 (h100, 2 free) and n1 (a100, 8 free). A waiting job asks for h100 (8 GPUs: it cannot
    fit now). The 1-GPU job j without a model would go to n0 by best fit (fewer free GPUs); it
    goes to the a100 node, which no waiting job asks for."""
    w = World().node("n0", 8, model="h100").node("n1", 8, model="a100")
    w.run("x", "lab/b", {"n0": (0, 1, 2, 3, 4, 5)}, min_runtime_s=1e9)
    w.job("h", "lab/b", 8, model="h100", min_runtime_s=0).job("j", "lab/a", 1)
    assert placements(w.cycle()) == ["j@n1[0]"]


def test_without_room_on_spare_models_the_scarce_one_is_used():
    w = World().node("n0", 8, model="h100").node("n1", 8, model="a100")
    w.run("x", "lab/b", {"n0": (0, 1, 2, 3, 4, 5)}, min_runtime_s=1e9)
    w.run("y", "lab/b", {"n1": tuple(range(8))}, min_runtime_s=1e9)
    w.job("h", "lab/b", 8, model="h100", min_runtime_s=0).job("j", "lab/a", 1)
    assert placements(w.cycle()) == ["j@n0[6]"]


def test_with_no_model_asked_for_best_fit_is_unchanged():
    w = World().node("n0", 8, model="h100").node("n1", 8, model="a100")
    w.run("x", "lab/b", {"n0": (0, 1, 2, 3, 4, 5)}, min_runtime_s=1e9)
    w.job("j", "lab/a", 1)
    assert placements(w.cycle()) == ["j@n0[6]"]


def test_allocated_work_the_holder_could_not_take_back_does_not_backfill():
    # a1 is of the holder's own leaf (never preemptible by it): its 1 h protection would end in
    # time, but it could then keep the GPU until it finished. It waits; u (unallocated) may go.
    res = reserved_world(("a1", "lab/a", 3600.0), ("u", "lab/b", 0.0)).cycle()
    assert res.reservation == ("H", ("n0",))
    assert placements(res) == ["u@n0[2]"]


def test_the_reservation_stays_on_the_node_whose_free_gpus_it_lent_to_unallocated_work():
    """H (8 GPUs) waits. n0 has 2 free and 4 GPUs of unallocated backfill (u), 2 held by x
    (protected); n1 has 3 free, 5 held by y (protected). Available to H now: n0 2 + 4 = 6, n1 3:
    H keeps n0 (counting only free GPUs it would move to n1)."""
    w = World(capacity=1e6).node("n0", 8).node("n1", 8)
    w.run("x", "lab/b", {"n0": (0, 1)}, min_runtime_s=15 * 3600)
    w.run("u", "lab/b", {"n0": (2, 3, 4, 5)}, allocated=False, started=h(9))
    w.run("y", "lab/b", {"n1": (0, 1, 2, 3, 4)}, min_runtime_s=15 * 3600)
    w.job("H", "lab/a", 8, queued=h(8), submitted=h(1))
    res = w.cycle()
    assert res.reservation == ("H", ("n0",))
    assert not preempted(res)


# ---------------------------------------------------------------- checkpoint_rule: wait for the victims' checkpoint?
# lab/a under its share (r_a = 0: patience_rule never applies); victim v of lab/b (r_b = 800/500 = 1.6, behind by
# far more than delta): 8 GPUs, minimum runtime 1800 s (its protection is over), checkpoint interval as given.
# The preemptor j: 8 GPUs, minimum runtime 10 s.


def _checkpoint_world(started_ago_s: int, every_s: float | None, checkpoint_ago_s: int | None = None) -> World:
    w = World().node("n0", 8)
    w.run(
        "v",
        "lab/b",
        {"n0": tuple(range(8))},
        min_runtime_s=1800.0,
        started=NOW - s_to_us(started_ago_s),
        checkpoint=None if checkpoint_ago_s is None else NOW - s_to_us(checkpoint_ago_s),
        checkpoint_every_s=every_s,
    )
    w.occupancy = {"lab/b": 800.0, "lab": 800.0}
    return w.job("j", "lab/a", 8, min_runtime_s=10.0, queued=NOW)  # charge 80 GPU-s: r_a after 0.16 < 1.6


def test_checkpoint_rule_waits_when_the_victim_checkpoints_sooner_than_its_loss_is_worth():
    # v started 2700 s ago, interval 3000 s: next checkpoint in 300 s. Lost now 8 x 2700 = 21600 GPU-s; j's wait
    # costs 8 x 300 = 2400 GPU-s < 21600: j waits, and says so with the time it preempts
    from apportion.domain.engine import CheckpointSoon

    w = _checkpoint_world(2700, 3000.0)
    res = w.cycle()
    assert (preempted(res), placements(res)) == ([], [])
    assert explained(w)["j"] == CheckpointSoon(21600.0, 8, NOW + s_to_us(300))


def test_checkpoint_rule_preempts_once_the_victim_has_checkpointed_and_loses_nothing():
    # the same victim 300 s later, its checkpoint logged: work lost 0, so nothing to wait for
    res = _checkpoint_world(3000, 3000.0, checkpoint_ago_s=0).cycle()
    assert (preempted(res), placements(res)) == (["v<-j"], ["j@n0[0, 1, 2, 3, 4, 5, 6, 7]"])
    assert res.events[0].lost_gpu_s == 0.0


def test_checkpoint_rule_does_not_wait_longer_than_the_work_it_saves():
    # interval 7200 s, started 1800 s ago: lost 8 x 1800 = 14400 GPU-s, waiting 8 x 5400 = 43200 GPU-s: preempt now
    res = _checkpoint_world(1800, 7200.0).cycle()
    assert preempted(res) == ["v<-j"] and res.events[0].lost_gpu_s == 14400.0


def test_checkpoint_rule_ignores_an_overdue_checkpoint_and_a_run_without_interval():
    # interval 2000 s, started 2700 s ago, no checkpoint logged: overdue (due 700 s ago), nothing to wait for
    assert preempted(_checkpoint_world(2700, 2000.0).cycle()) == ["v<-j"]
    assert preempted(_checkpoint_world(2700, None).cycle()) == ["v<-j"]


def test_checkpoint_wait_0_turns_the_rule_off_and_the_cap_bounds_the_wait():
    assert preempted(_checkpoint_world(2700, 3000.0).cycle(checkpoint_wait_s=0.0)) == ["v<-j"]
    assert preempted(_checkpoint_world(2700, 3000.0).cycle(checkpoint_wait_s=299.0)) == ["v<-j"]
    assert preempted(_checkpoint_world(2700, 3000.0).cycle(checkpoint_wait_s=300.0)) == []
