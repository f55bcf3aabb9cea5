"""The fast cycle decides what the slow, literal reference cycle decides (``reference_cycle.py``).

Each example is a small random cluster: up to four nodes of 4 or 8 GPUs, models ``a`` and ``b``, some
cordoned; up to eight runs already on it (allocated or not, gangs of one or two replicas, started at random
hours, so some still protected, some of an earlier preemption with a longer protection); up to eight pending
jobs (gangs of 1-2 replicas of 1-8 GPUs, with or without a model, allocated or not) over three leaves of a
two-level tree; random window occupancy. Reservations, idle runs and the two waiting rules are out of the
reference's scope and off here.

Derandomized: the same examples every run, so the test cannot flake.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.budgets import BudgetTree, ancestors_of
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, pending_order, run_cycle
from apportion.timeutil import from_us
from tests.kit.builders import T0, h
from tests.kit.reference_cycle import Placed, cost, reference_cycle

#   lab
#   ├── x (0.5)
#   │   ├── p (0.5)
#   │   └── q (0.5)
#   └── y (0.5)
TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/x": 0.5, "lab/x/p": 0.5, "lab/x/q": 0.5, "lab/y": 0.5})
LEAVES = ["lab/x/p", "lab/x/q", "lab/y"]
NOW = h(10)
CFG = EngineConfig(reservation_after_s=1e9, patience_s=0.0, checkpoint_wait_s=0.0)

nodes_st = st.lists(
    st.tuples(st.sampled_from([4, 8]), st.sampled_from(["a", "b"]), st.sampled_from([False, False, True])),
    min_size=2,
    max_size=4,
)
runs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([1, 2, 4, 8]),  # GPUs per replica
        st.sampled_from([1, 1, 2]),  # replicas
        st.sampled_from([0.0, 60.0, 3600.0, 12 * 3600.0]),  # minimum runtime (0: unallocated)
        st.integers(0, 9),  # start hour
        st.sampled_from([0, 0, 2]),  # earlier preemptions (a longer protection)
    ),
    min_size=3,
    max_size=8,
)
jobs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([1, 2, 4, 8]),  # GPUs per replica
        st.sampled_from([1, 1, 2]),  # replicas
        st.sampled_from([0.0, 60.0, 3600.0]),  # minimum runtime
        st.sampled_from([None, None, "a", "b"]),  # model
    ),
    min_size=2,
    max_size=8,
)
# steps of 5,000 GPU-s: r steps of 0.025 at lab/x and lab/y (entitlement 200,000 GPU-s each), so branches
# fall on either side of delta (0.05)
occ_st = st.fixed_dictionaries({leaf: st.integers(0, 40).map(lambda i: i * 5_000.0) for leaf in LEAVES})


def world(nodes, runs, jobs, leaf_occ) -> CycleSnapshot:
    """The cycle's snapshot, folded from registrations, placements and starts."""
    cs = ClusterState()
    for i, (gpus, model, cordoned) in enumerate(nodes):
        cs.apply(ev.NodeRegistered(node_id=f"n{i}", gpu_count=gpus, gpu_model=model, ts=from_us(T0)))
        if cordoned:
            cs.apply(ev.NodeCordoned(node_id=f"n{i}", ts=from_us(T0)))
    for j, (leaf, g, k, min_rt, start, preempted) in enumerate(runs):
        hosts = [n for n in sorted(cs.nodes) if len(cs.nodes[n].free) >= g][:k]
        if len(hosts) < k:
            continue
        protection = min_rt * 2**preempted if min_rt else None
        cs.apply(
            ev.JobPlaced(
                job_id=f"r{j}",
                attempt=1 + preempted,
                budget=leaf,
                allocated=min_rt > 0,
                gpus_per_replica=g,
                replicas=k,
                min_runtime_s=min_rt,
                placements=tuple(ev.Placement(node_id=n, gpus=tuple(sorted(cs.nodes[n].free)[:g])) for n in hosts),
                submitted_at=from_us(T0),
                decision=ev.Decision(
                    rank=0,
                    budget_rank=0,
                    ratio=0.0,
                    protection_s=protection,
                    preemptions=preempted if protection is not None else None,
                ),
                ts=from_us(h(start)),
            )
        )
        for r, n in enumerate(hosts):
            cs.apply(ev.JobStarted(job_id=f"r{j}", attempt=1 + preempted, replica=r, node_id=n, ts=from_us(h(start))))
    pending: dict[str, list[PendingJob]] = {}
    for j, (leaf, g, k, min_rt, model) in enumerate(jobs):
        pending.setdefault(leaf, []).append(
            PendingJob(
                job_id=f"j{j}",
                attempt=1,
                budget=leaf,
                user="u",
                gpus_per_replica=g,
                replicas=k,
                min_runtime_s=min_rt,
                gpu_model=model,
                submitted_at_us=h(1) + j,
                queued_at_us=h(9),
                duration_s=60.0,
            )
        )
    for lst in pending.values():
        lst.sort(key=pending_order)
    occ: dict[str, float] = {}
    for leaf, v in leaf_occ.items():
        for a in ancestors_of(leaf):
            occ[a] = occ.get(a, 0.0) + v
    return CycleSnapshot(cs.snapshot(), pending, TREE, occ, 400_000.0)


def fast(snap: CycleSnapshot, cfg: EngineConfig = CFG) -> list[Placed]:
    """The fast cycle's placements, as the reference writes them."""
    return [
        Placed(
            e.job_id,
            tuple(sorted((p.node_id, p.gpus) for p in e.placements)),
            tuple((v.job_id, v.attempt) for v in e.decision.victims),
        )
        for e in run_cycle(snap, NOW, cfg).events
        if isinstance(e, ev.JobPlaced)
    ]


def first_difference(got: list[Placed], want: list[Placed]) -> tuple[Placed | None, Placed | None] | None:
    """The first decision where the two cycles differ (the later ones follow from it), or ``None``."""
    for i in range(max(len(got), len(want))):
        a = got[i] if i < len(got) else None
        b = want[i] if i < len(want) else None
        if a != b:
            return a, b
    return None


def split_gang_overcounted(snap: CycleSnapshot, got: Placed | None, want: Placed | None) -> bool:
    """The known divergence (``reference_cycle``, KNOWN DIVERGENCE): the engine's victims include a gang on
    two of the nodes it frees for the job, and the reference's set costs less, each victim counted once."""
    if got is None or want is None:
        return False
    runs = {r.key: r for r in snap.cluster.runs.values()}
    nodes = {n for n, _ in got.placements}
    split = any(len({p.node_id for p in runs[v].placements} & nodes) > 1 for v in got.victims)
    return (
        got.job_id == want.job_id
        and split
        and cost([runs[v] for v in want.victims], NOW) < cost([runs[v] for v in got.victims], NOW)
    )


ONE_NODE = [(8, "a", False)]
Y_RUN = [("lab/y", 8, 1, 3600.0, 0, 0)]  # expired allocated run of lab/y holding the one node


@settings(max_examples=150, deadline=None, derandomize=True)
@given(nodes_st, runs_st, jobs_st, occ_st)
# D3.consistent-view, after-move test: x is behind y by 0.1 >= delta, but x with the 8 x 3600 s job charged
# (28,800 GPU-s: r 0.144) would pass y (0.1): no preemption
@example(ONE_NODE, Y_RUN, [("lab/x/p", 8, 1, 3600.0, None)], {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": 20_000.0})
# D3.victims, hysteresis: y is ahead of x by 0.025 < delta (0.05): no preemption; by 0.05: the run is preempted
@example(ONE_NODE, Y_RUN, [("lab/x/p", 8, 1, 60.0, None)], {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": 5_000.0})
@example(ONE_NODE, Y_RUN, [("lab/x/p", 8, 1, 60.0, None)], {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": 11_000.0})
def test_the_fast_cycle_decides_what_the_reference_cycle_decides(nodes, runs, jobs, leaf_occ):
    snap = world(nodes, runs, jobs, leaf_occ)
    got, want = fast(snap), reference_cycle(snap, NOW, CFG)
    diff = first_difference(got, want)
    assert diff is None or split_gang_overcounted(snap, *diff), diff


def test_known_divergence_a_gang_victim_on_two_freed_nodes_counts_once_per_node():
    # three 4-GPU nodes of model a: n0 holds four unallocated 1-GPU runs (r0-r3), n1 and n2 one unallocated
    # 4 x 2 gang (r4). A 1 x 2 allocated job of lab/x/p must preempt.
    #   D3.victims, least cost: r4 alone frees n1 and n2: 8 unallocated GPUs.
    #   The engine prices each node on its own (n0: r0, 1 GPU; n1: r4, 8 GPUs; n2: r4, 8 GPUs) and takes the
    #   two cheapest, n0 and n1: r0 and r4, 9 unallocated GPUs (r4 counted in full on n1 and not at all as
    #   a second node it frees).
    runs = [("lab/x/p", 1, 1, 0.0, 0, 0)] * 4 + [("lab/x/p", 4, 2, 0.0, 0, 0)]
    snap = world([(4, "a", False)] * 3, runs, [("lab/x/p", 1, 2, 60.0, None)], dict.fromkeys(LEAVES, 0.0))
    assert reference_cycle(snap, NOW, CFG) == [Placed("j0", (("n1", (0,)), ("n2", (0,))), (("r4", 1),))]
    assert fast(snap) == [Placed("j0", (("n0", (0,)), ("n1", (0,))), (("r0", 1), ("r4", 1)))]


def test_the_fast_and_reference_cycles_share_free_gpus_among_unallocated_work_alike():
    # D3.free-order. One 8-GPU node: lab/x/p's unallocated r0 holds 4 GPUs, 4 are free. Unallocated 1-GPU jobs:
    # j0, j1 of lab/x/p (abs 0.25: key 4 / 0.25 = 16), j2, j3, j4 of lab/y (abs 0.5: 0). lab/y first:
    # j2 (y: 2), j3 (4), j4 (6); y is out of jobs; lab/x/p gets the last free GPU: j0.
    runs = [("lab/x/p", 4, 1, 0.0, 0, 0)]
    jobs = [("lab/x/p", 1, 1, 0.0, None)] * 2 + [("lab/y", 1, 1, 0.0, None)] * 3
    snap = world([(8, "a", False)], runs, jobs, dict.fromkeys(LEAVES, 0.0))
    cfg = replace(CFG, free_order=True)
    want = ["j2", "j3", "j4", "j0"]
    assert [p.job_id for p in reference_cycle(snap, NOW, cfg)] == want
    assert [e.job_id for e in run_cycle(snap, NOW, cfg).events if isinstance(e, ev.JobPlaced)] == want
    # without the rule, leaf by leaf in the budget order (x/p, x/q, y): j0, j1, then y's j2 and j3
    assert (
        [p.job_id for p in reference_cycle(snap, NOW, CFG)]
        == [p.job_id for p in fast(snap)]
        == ["j0", "j1", "j2", "j3"]
    )


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    nodes_st, runs_st, jobs_st, occ_st, st.lists(st.sampled_from([0.0, 0.0, 1800.0, 3600.0]), min_size=8, max_size=8)
)
@example(  # 4 free GPUs, budget order x/p, x/q, y: j2, j3, j5 never ran, then j1 (1,800 GPU-s) before j0 and j4
    [(4, "a", False), (4, "a", True)],
    [],
    [("lab/x/p", 1, 1, 0.0, None)] * 3 + [("lab/y", 1, 1, 0.0, None)] * 3,
    dict.fromkeys(LEAVES, 0.0),
    [3600.0, 1800.0, 0.0, 0.0, 3600.0, 0.0, 0.0, 0.0],
)
def test_the_fast_and_reference_cycles_order_free_work_by_attained_service_alike(nodes, runs, jobs, leaf_occ, held):
    # D3.free-las on random clusters, the pending job j<i> requeued after held[i] GPU-seconds (0: never run)
    snap = world(nodes, runs, jobs, leaf_occ)
    pending = {
        leaf: [replace(j, attained_gpu_s=held[int(j.job_id[1:])]) for j in lst] for leaf, lst in snap.pending.items()
    }
    snap = replace(snap, pending=pending)
    cfg = replace(CFG, free_las=True)
    got = fast(snap, cfg)
    diff = first_difference(got, reference_cycle(snap, NOW, cfg))
    assert diff is None or split_gang_overcounted(snap, *diff), diff
    if not runs:  # the example
        assert [p.job_id for p in got] == ["j2", "j3", "j5", "j1"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(nodes_st, runs_st, jobs_st, occ_st)
def test_the_fast_and_reference_cycles_run_a_leafs_free_work_within_its_share_alike(nodes, runs, jobs, leaf_occ):
    # D3.owner-free on random clusters: the same placements and victims, in the same order
    snap = world(nodes, runs, jobs, leaf_occ)
    cfg = replace(CFG, owner_free=True)
    diff = first_difference(fast(snap, cfg), reference_cycle(snap, NOW, cfg))
    assert diff is None or split_gang_overcounted(snap, *diff), diff


TWO_NODES = [(4, "a", False), (4, "a", False)]
Y_AHEAD = {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": 20_000.0}  # r: x 0, y 0.1 at lab: y ahead by 0.1 >= delta


@pytest.mark.parametrize(
    ("start_h", "knobs", "preempted"),
    [
        pytest.param(8, {}, False, id="the cap alone: a gang 2 h old is spared until 42 h"),
        pytest.param(8, {"gang_bound_x": 2.0}, True, id="bound 2 x its 1 h protection: at exactly 2 h a victim"),
        pytest.param(9, {"gang_bound_x": 2.0}, False, id="bound 2 x its 1 h protection: 1 h old, spared"),
        pytest.param(9, {"gang_min_gpus": 8}, False, id="a gang of exactly the least size (8 GPUs): spared"),
        pytest.param(9, {"gang_min_gpus": 9}, True, id="a gang one GPU under the least size: a victim"),
    ],
)
def test_the_gang_rules_scope_decides_whether_a_small_job_takes_an_expired_gang(start_h, knobs, preempted):
    # D3.gangs. Two 4-GPU nodes held by lab/y's 2 x 4 gang r0 (minimum runtime 1 h, started at start_h; now
    # 10 h: its protection has ended). lab/x/p (r 0, behind lab/y by 0.1) asks for 1 x 4 GPUs: the gang is
    # the only victim, larger than the job
    snap = world(TWO_NODES, [("lab/y", 4, 2, 3600.0, start_h, 0)], [("lab/x/p", 4, 1, 60.0, None)], Y_AHEAD)
    cfg = replace(CFG, **knobs)
    got = fast(snap, cfg)
    assert got == reference_cycle(snap, NOW, cfg)
    assert got == ([Placed("j0", (("n0", (0, 1, 2, 3)),), (("r0", 1),))] if preempted else [])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(nodes_st, runs_st, jobs_st, occ_st)
def test_the_fast_and_reference_cycles_scope_the_gang_rule_alike(nodes, runs, jobs, leaf_occ):
    # D3.gangs scoped: gangs of fewer than 9 GPUs are not spared, the others until twice their own protection.
    # Judged on the worlds where the two cycles agree under the default knobs (the unallocated gangs split over
    # nodes that the engine prices per node differ there whatever the gang rule, as in the known divergence)
    snap = world(nodes, runs, jobs, leaf_occ)
    assume(first_difference(fast(snap), reference_cycle(snap, NOW, CFG)) is None)
    cfg = replace(CFG, gang_min_gpus=9, gang_bound_x=2.0)
    assert first_difference(fast(snap, cfg), reference_cycle(snap, NOW, cfg)) is None


def test_the_gang_rules_last_resort_takes_a_spared_gang_only_when_no_other_victim_frees_the_job():
    # D3.gangs, "while other victims exist" (EngineConfig.gang_last_resort). lab/y's 2 x 4 gang r0 (minimum
    # runtime 1 h, started at 8 h; now 10 h: past its protection, 2 h old, under the 42 h cap). lab/x/p (r 0,
    # behind lab/y by 0.1) asks for 1 x 4 GPUs. On two nodes the gang is the only victim: spared by the rule,
    # taken as its last resort.
    snap = world(TWO_NODES, [("lab/y", 4, 2, 3600.0, 8, 0)], [("lab/x/p", 4, 1, 60.0, None)], Y_AHEAD)
    assert fast(snap) == []
    assert fast(snap, replace(CFG, gang_last_resort=True)) == [Placed("j0", (("n0", (0, 1, 2, 3)),), (("r0", 1),))]
    # A third node with lab/y's 1 x 4 run r1 (same age): another victim exists, so the gang is spared and r1
    # goes, with or without the last resort.
    three = [*TWO_NODES, (4, "a", False)]
    runs = [("lab/y", 4, 2, 3600.0, 8, 0), ("lab/y", 4, 1, 3600.0, 8, 0)]
    snap = world(three, runs, [("lab/x/p", 4, 1, 60.0, None)], Y_AHEAD)
    took_r1 = [Placed("j0", (("n2", (0, 1, 2, 3)),), (("r1", 1),))]
    assert fast(snap) == took_r1
    assert fast(snap, replace(CFG, gang_last_resort=True)) == took_r1


def test_the_last_resort_over_share_spares_the_gang_of_a_budget_within_its_share():
    # EngineConfig.gang_last_resort_over_share: the same world as above, lab/y's 2 x 4 gang r0 the only
    # victim of lab/x/p's 1 x 4 job. With lab/y at r 0.1 (20,000 of its 200,000 GPU-s entitlement: within its
    # share) the gang stays spared; with lab/y at r 1.2 (240,000 GPU-s: over its share) it is the last resort.
    only_r0 = [Placed("j0", (("n0", (0, 1, 2, 3)),), (("r0", 1),))]
    scoped = replace(CFG, gang_last_resort=True, gang_last_resort_over_share=True)
    for occ_y, want in ((20_000.0, []), (240_000.0, only_r0)):
        occ = {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": occ_y}
        snap = world(TWO_NODES, [("lab/y", 4, 2, 3600.0, 8, 0)], [("lab/x/p", 4, 1, 60.0, None)], occ)
        assert fast(snap, replace(CFG, gang_last_resort=True)) == only_r0  # the last resort alone takes it
        assert fast(snap, scoped) == want
        assert fast(snap) == []  # the policy spares it until its 42 h bound
