"""The simulator's baseline policies (``apportion.sim.baselines``).

* the helpers of the cycle: shape cover, blocked-shape antichain, segment
  floors (kept in the dispatcher memo), the k-way merge that drops segments,
  ranks by bisection;
* differential: FIFO, static partitions and strict priority decide exactly
  as the straightforward loop they replaced (``_ref_*`` below: every job
  tried in turn, a preemption search for each allocated job that does not
  fit, snapshots copied without the kept indices), byte for byte on the
  decision logs of random seeded simulations.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterSnapshot
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import (
    CycleFree,
    CycleMemo,
    CycleSnapshot,
    CycleVictims,
    EngineConfig,
    PendingJob,
    PreemptionRequest,
    emit_placed,
    pending_start_events,
    plan_preemption,
    preempt_events,
)
from apportion.events import Event, Placement
from apportion.sim import baselines as bl
from apportion.sim import capacity
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
from apportion.timeutil import from_us

T0 = 1_704_067_200_000_000  # 2024-01-01T00:00:00Z in µs


def pj(
    job_id: str,
    g: int = 1,
    k: int = 1,
    *,
    sub: int = 0,
    alloc: bool = True,
    budget: str = "org/a",
    model: str | None = None,
) -> PendingJob:
    return PendingJob(
        job_id=job_id,
        attempt=1,
        budget=budget,
        user="u",
        gpus_per_replica=g,
        replicas=k,
        min_runtime_s=3600.0 if alloc else 0.0,
        submitted_at_us=T0 + sub,
        queued_at_us=T0 + sub,
        gpu_model=model,
    )


# --------------------------------------------------------------------------- helpers


def test_covers_needs_smaller_or_equal_g_and_k_and_a_matching_or_any_model() -> None:
    assert capacity.covers((2, 1, None), 2, 1, None) is True
    assert capacity.covers((2, 1, None), 4, 3, "A100") is True
    assert capacity.covers((2, 1, "A100"), 4, 3, "A100") is True
    assert capacity.covers((2, 1, "A100"), 4, 3, None) is False  # a job of any model has more options
    assert capacity.covers((2, 1, "A100"), 4, 3, "V100") is False
    assert capacity.covers((2, 2, None), 4, 1, None) is False
    assert capacity.covers((3, 1, None), 2, 5, None) is False


def test_blocked_asks_every_shape() -> None:
    shapes = [(4, 1, None), (1, 3, "V100")]
    assert capacity.is_blocked(shapes, 4, 1, "A100") is True
    assert capacity.is_blocked(shapes, 1, 3, "V100") is True
    assert capacity.is_blocked(shapes, 2, 4, "V100") is True
    assert capacity.is_blocked(shapes, 2, 4, None) is False
    assert capacity.is_blocked(shapes, 3, 2, "V100") is False
    assert capacity.is_blocked([], 1, 1, None) is False


def test_add_blocked_keeps_an_antichain() -> None:
    shapes: list = []
    capacity.add_blocked(shapes, (4, 2, "V100"))
    assert shapes == [(4, 2, "V100")]
    capacity.add_blocked(shapes, (8, 2, "V100"))  # covered: not added
    assert shapes == [(4, 2, "V100")]
    capacity.add_blocked(shapes, (2, 4, None))  # neither covers the other
    assert shapes == [(4, 2, "V100"), (2, 4, None)]
    capacity.add_blocked(shapes, (2, 2, None))  # covers both: replaces them
    assert shapes == [(2, 2, None)]
    capacity.add_blocked(shapes, (1, 1, "A100"))
    assert shapes == [(2, 2, None), (1, 1, "A100")]
    capacity.add_blocked(shapes, (1, 1, None))
    assert shapes == [(1, 1, None)]


def test_segments_split_each_list_at_the_first_unallocated_job() -> None:
    a = [pj("a1", sub=5), pj("a2", sub=9), pj("a3", sub=1, alloc=False)]
    b = [pj("b1", sub=3, alloc=False, budget="org/b")]
    snap = CycleSnapshot(
        cluster=ClusterSnapshot({}, {}, {}),
        pending={"org/a": a, "org/b": b},
        tree=BudgetTree(),
        occupancy={},
        capacity_gpu_s=0.0,
    )
    alloc, unalloc = bl._segments(snap)
    assert alloc == [("org/a", a, 0, 2)]
    assert unalloc == [("org/a", a, 2, 3), ("org/b", b, 0, 1)]


def test_floor_of_reads_and_fills_the_engine_memo() -> None:
    lst = [pj("a1", 4, 2), pj("a2", 2, 3), pj("a3", 8, 1, alloc=False), pj("a4", 3, 3, alloc=False)]
    assert bl._floor_of(None, ("org/a", lst, 0, 2)) == (2, 2)
    memo = CycleMemo()
    assert bl._floor_of(memo, ("org/a", lst, 2, 4)) == (3, 1)
    # the shape codes of the list are kept with it (the floor came from its distinct shapes)
    assert memo == {id(lst): [lst, {(2, 4): (3, 1)}, memo.shapes.codes(lst), -1]}
    memo[id(lst)][1][(0, 2)] = (1, 1)  # a kept entry is used as it is
    assert bl._floor_of(memo, ("org/a", lst, 0, 2)) == (1, 1)
    other = list(lst)
    memo[id(other)] = [lst, {(0, 2): (7, 7)}, None]  # an entry of another list under a reused id
    assert bl._floor_of(memo, ("org/a", other, 0, 2)) == (2, 2)
    assert memo[id(other)] == [other, {(0, 2): (2, 2)}, memo.shapes.codes(other), -1]


def test_merge_orders_by_submit_then_id_and_drops_dead_segments() -> None:
    a = [pj("a1", sub=1), pj("a2", sub=4), pj("a3", sub=6)]
    b = [pj("b2", sub=2), pj("b1", sub=4), pj("b3", sub=5)]
    c = [pj("c1", sub=3)]
    segs: list[bl.Segment] = [("org/a", a, 0, 3), ("org/b", b, 0, 3), ("org/c", c, 0, 1)]
    got = [(i, j.job_id) for i, j in bl._merge(segs, [True, True, True])]
    assert got == [(0, "a1"), (1, "b2"), (2, "c1"), (0, "a2"), (1, "b1"), (1, "b3"), (0, "a3")]
    assert [j.job_id for _, j in bl._merge(segs, [True, False, True])] == ["a1", "c1", "a2", "a3"]
    live = [True, True, True]
    out = []
    for _i, j in bl._merge(segs, live):
        out.append(j.job_id)
        if j.job_id == "b2":
            live[0] = False  # a's next job is already in the heap: taken, then no more of a
    assert out == ["a1", "b2", "c1", "a2", "b1", "b3"]
    assert [j.job_id for _, j in bl._merge([("org/a", a, 1, 2)], [True])] == ["a2"]


def test_rank_counts_the_jobs_of_all_segments_before_the_job() -> None:
    a = [pj("a1", sub=1), pj("a2", sub=4), pj("a3", sub=6)]
    b = [pj("x", sub=0), pj("b2", sub=2), pj("b1", sub=4), pj("b3", sub=5)]
    segs: list[bl.Segment] = [("org/a", a, 0, 3), ("org/b", b, 1, 4)]
    assert [bl._rank(segs, j) for j in a] == [0, 2, 5]  # a2 before b1: same submit, id order
    assert [bl._rank(segs, j) for j in b[1:]] == [1, 3, 4]


def test_baselines_may_read_the_live_view() -> None:
    assert getattr(bl.fifo, "reads_snapshot_only", False) is True  # as dispatch._cycle reads it
    assert getattr(bl.static_partitions, "reads_snapshot_only", False) is True
    assert getattr(bl.strict_priority, "reads_snapshot_only", False) is True


# --------------------------------------------------------------------------- the replaced loop (reference)


def _ref_key(j: PendingJob) -> tuple[int, str]:
    return (j.submitted_at_us, j.job_id)


def _ref_segments(snapshot: CycleSnapshot) -> tuple[list, list]:
    alloc, unalloc = [], []
    for lst in snapshot.pending.values():
        b = bisect_left(lst, True, key=lambda j: not j.allocated)
        if b:
            alloc.append(lst[:b])
        if b < len(lst):
            unalloc.append(lst[b:])
    return alloc, unalloc


def _ref_greedy(
    snapshot: CycleSnapshot,
    now_us: int,
    config: EngineConfig,
    jobs: Iterable[PendingJob],
    policy: str,
    admit: Callable | None = None,
    on_place: Callable | None = None,
    preempt: bool = False,
) -> list[Event]:
    free = CycleFree(snapshot.cluster)
    out: list[Event] = []
    ts = from_us(now_us)
    cfg = EngineConfig(
        delta=config.delta,
        reservation_after_s=config.reservation_after_s,
        window_s=config.window_s,
        grace_s=config.grace_s,
        preemption=preempt,
        policy_version=policy,
        producer=config.producer,
    )
    victims = None
    for rank, job in enumerate(jobs):
        if admit is not None and not admit(job):
            continue
        shape = (job.gpus_per_replica, job.replicas, job.gpu_model)
        nodes = free.fit(*shape)
        if nodes is not None:
            pl = tuple(Placement(node_id=n, gpus=free.take(n, job.gpus_per_replica)) for n in nodes)
            emit_placed(out, job, pl, (), job.budget, rank, {}, 0.0, False, ts, cfg)
            out.extend(pending_start_events(job, pl, ts, cfg.producer))
        elif preempt and job.allocated:
            if victims is None:
                victims = CycleVictims(snapshot.cluster, now_us)
                victims.expired = {}
            plan = plan_preemption(PreemptionRequest(job, job.budget, free, victims, now_us))
            if plan is None:
                continue
            pl, chosen = plan
            for run, vic in chosen:
                victims.taken.add(run.key)
                out.extend(
                    preempt_events(
                        run, ts, cfg.grace_s, cfg.producer, victim=vic, by_job_id=job.job_id, by_budget=job.budget
                    )
                )
            emit_placed(out, job, pl, tuple(v for _, v in chosen), job.budget, rank, {}, 0.0, False, ts, cfg)
        else:
            continue
        if on_place is not None:
            on_place(job)
    return out


def _ref_fifo(snapshot: CycleSnapshot, now_us: int, config: EngineConfig) -> list[Event]:
    alloc, unalloc = _ref_segments(snapshot)
    return _ref_greedy(snapshot, now_us, config, sorted(itertools.chain(*alloc, *unalloc), key=_ref_key), "fifo-1")


def _ref_static(snapshot: CycleSnapshot, now_us: int, config: EngineConfig) -> list[Event]:
    cap = sum(n.gpu_count for n in snapshot.cluster.nodes.values() if n.state in ("ready", "draining"))
    quota = {leaf: round(snapshot.tree.abs_share(leaf) * cap) for leaf in snapshot.tree.leaves()}
    used: dict[str, int] = {}
    for run in snapshot.cluster.runs.values():
        used[run.budget] = used.get(run.budget, 0) + run.gpus_per_replica * len(run.open_replicas)

    def admit(job: PendingJob) -> bool:
        return used.get(job.budget, 0) + job.gpus <= quota.get(job.budget, 0)

    def on_place(job: PendingJob) -> None:
        used[job.budget] = used.get(job.budget, 0) + job.gpus

    alloc, unalloc = _ref_segments(snapshot)
    return _ref_greedy(
        snapshot, now_us, config, sorted(itertools.chain(*alloc, *unalloc), key=_ref_key), "static-1", admit, on_place
    )


def _ref_priority(snapshot: CycleSnapshot, now_us: int, config: EngineConfig) -> list[Event]:
    alloc, unalloc = _ref_segments(snapshot)
    jobs = itertools.chain(heapq.merge(*alloc, key=_ref_key), heapq.merge(*unalloc, key=_ref_key))
    return _ref_greedy(snapshot, now_us, config, jobs, "priority-1", preempt=True)


TREE = {"org": 1.0, "org/x": 0.6, "org/x/p": 0.5, "org/x/q": 0.5, "org/y": 0.4}
LEAVES = ["org/x/p", "org/x/q", "org/y"]

trace = st.lists(
    st.tuples(
        st.integers(0, 7_200),  # submit offset, s
        st.sampled_from(LEAVES),
        st.sampled_from([1, 1, 2, 3, 4, 8]),  # g
        st.sampled_from([1, 1, 1, 2, 3]),  # k
        st.booleans(),  # allocated
        st.integers(60, 7_200),  # duration, s
        st.sampled_from([None, None, None, "A100", "V100"]),
    ),
    min_size=1,
    max_size=40,
)
clusters = st.lists(
    st.tuples(st.sampled_from([2, 4, 8]), st.sampled_from([None, "A100", "V100"])), min_size=1, max_size=5
)


def _run(policy: Callable, spec: list, cl: list, seed: int) -> bytes:
    nodes = [SimNode(f"n{i}", g, m) for i, (g, m) in enumerate(cl)]
    jobs = [
        SimJob(f"j{i:02d}", leaf, "u", T0 + s * 1_000_000, g, k, 1800.0 if alloc else 0.0, float(d), m)
        for i, (s, leaf, g, k, alloc, d, m) in enumerate(spec)
    ]
    cfg = SimConfig(
        seed=seed,
        dispatch=DispatchConfig(engine=EngineConfig(), heartbeat_timeout_s=None),
        stop_delay_s=None,
        sample_s=0,
        until_us=T0 + 30 * 3600 * 1_000_000,
    )
    return simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg, scheduler=policy).decision_log()


@settings(max_examples=150, deadline=None)
@given(trace, clusters, st.integers(0, 3))
def test_baselines_decide_as_the_replaced_loop(spec: list, cl: list, seed: int) -> None:
    for new, ref in ((bl.fifo, _ref_fifo), (bl.static_partitions, _ref_static), (bl.strict_priority, _ref_priority)):
        assert _run(new, spec, cl, seed) == _run(ref, spec, cl, seed)


def test_strict_priority_preempts_once_per_cycle_for_a_blocked_shape() -> None:
    """Two 8-GPU allocated jobs behind one 4-GPU unallocated run on one 8-GPU node: the first
    preempts it (rank 0); the second cannot be placed in that cycle nor later while the first runs."""
    spec = [
        (0, "org/y", 4, 1, False, 7200, None),
        (10, "org/x/p", 8, 1, True, 600, None),
        (10, "org/x/q", 8, 1, True, 600, None),
    ]
    log = _run(bl.strict_priority, spec, [(8, None)], 0)
    assert log == _run(_ref_priority, spec, [(8, None)], 0)
    assert log.count(b'"type":"JobPreempted"') == 1
    assert log.count(b'"type":"JobPlaced"') == 4  # j00, j01, j02 once j01 ends, j00 again at the end
    assert b'"by_job_id":"j01"' in log


def test_strict_priority_a_failed_plan_blocks_only_what_it_covers() -> None:
    """Four 8-GPU nodes, three held by unallocated 8-GPU runs, one by an allocated run. In one cycle
    q's first 8x1 job preempts an unallocated run, p's 8x3 job then has no plan (two preemptible
    nodes left), and q's next two 8x1 jobs, which the fit failure of 8x1 alone does not stop, each
    preempt one of the other two (the last is looked at after the failed plan dropped nothing)."""
    spec = [
        (0, "org/y", 8, 1, False, 7200, None),
        (0, "org/y", 8, 1, False, 7200, None),
        (0, "org/y", 8, 1, False, 7200, None),
        (0, "org/y", 8, 1, True, 7200, None),
        (100, "org/x/q", 8, 1, True, 600, None),
        (100, "org/x/p", 8, 3, True, 600, None),
        (100, "org/x/q", 8, 1, True, 600, None),
        (100, "org/x/q", 8, 1, True, 600, None),
    ]
    cl = [(8, None)] * 4
    log = _run(bl.strict_priority, spec, cl, 0)
    assert log == _run(_ref_priority, spec, cl, 0)
    head = log[: log.index(b'"ts":"2024-01-01T00:02')]  # the cycle at 00:01:40 (and before)
    assert [head.count(b'"by_job_id":"j0%d"' % i) for i in (4, 5, 6, 7)] == [1, 0, 1, 1]
