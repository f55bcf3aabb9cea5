"""Rule D3.free-las's two queues of free work placed without walking every requeued job.

The cycle keeps each leaf's requeued free jobs per shape, sorted, with its pending list in the memo, and
looks only at the jobs of shapes not yet known not to fit, counting each one's place in the whole order by
bisection; the walk of the first queue (jobs not yet run) steps from one such job to the next. Both are carried
to the list that replaces one (a job added or removed between cycles). The walks they
replace looked at every requeued job in every cycle, and that queue grows with a busy run (the 100,000-job
simulator's run time grew faster than its jobs). The decisions, the ranks they carry and the counters are
those of those walks, kept below as the oracle.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_right
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.budgets import BudgetTree, ancestors_of
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import (
    CycleMemo,
    CycleSnapshot,
    EngineCaches,
    EngineConfig,
    PendingJob,
    pending_order,
    run_cycle,
)
from apportion.domain.engine import cycle as cycle_mod
from apportion.timeutil import from_us
from tests.kit.builders import T0, h

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/x": 0.5, "lab/x/p": 0.5, "lab/x/q": 0.5, "lab/y": 0.5})
NOW = h(10)
CFG = EngineConfig(reservation_after_s=1e9, patience_s=0.0, checkpoint_wait_s=0.0, free_las=True)


def free_job(job_id: str, spec: tuple[str, int, int, str | None, float], at: int) -> PendingJob:
    """A pending unallocated job ``(leaf, g, k, model, attained GPU-s)`` submitted ``at`` µs after hour 1."""
    leaf, g, k, model, held = spec
    return PendingJob(
        job_id=job_id,
        attempt=2 if held else 1,
        budget=leaf,
        user="u",
        gpus_per_replica=g,
        replicas=k,
        min_runtime_s=0.0,
        gpu_model=model,
        submitted_at_us=h(1) + at,
        queued_at_us=h(9),
        duration_s=60.0,
        attained_gpu_s=held,
    )


def world(nodes: list[tuple[int, str | None]], jobs: list[tuple[str, int, int, str | None, float]]) -> CycleSnapshot:
    """Idle nodes ``(GPUs, model)`` and pending unallocated jobs ``(leaf, g, k, model, attained GPU-s)``
    (job ``j<i>`` submitted i µs after hour 1); lab/y holds 100,000 GPU-s of its window: the budget order is
    lab/x/p, lab/x/q, lab/y."""
    cs = ClusterState()
    for i, (gpus, model) in enumerate(nodes):
        cs.apply(ev.NodeRegistered(node_id=f"n{i}", gpu_count=gpus, gpu_model=model, ts=from_us(T0)))
    pending: dict[str, list[PendingJob]] = {}
    for j, (leaf, g, k, model, held) in enumerate(jobs):
        pending.setdefault(leaf, []).append(free_job(f"j{j}", (leaf, g, k, model, held), j))
    for lst in pending.values():
        lst.sort(key=pending_order)
    occ: dict[str, float] = {}
    for leaf, v in {"lab/x/p": 0.0, "lab/x/q": 0.0, "lab/y": 100_000.0}.items():
        for a in ancestors_of(leaf):
            occ[a] = occ.get(a, 0.0) + v
    return CycleSnapshot(cs.snapshot(), pending, TREE, occ, 400_000.0)


def decided(snap: CycleSnapshot, cfg: EngineConfig = CFG) -> tuple[Any, ...]:
    res = run_cycle(snap, NOW, cfg)
    return [e.model_dump_json() for e in res.events], res.considered, res.searches, res.passed_over


def placed_ranks(snap: CycleSnapshot) -> tuple[list[tuple[str, int]], int]:
    res = run_cycle(snap, NOW, CFG)
    return [(e.job_id, e.decision.rank) for e in res.events if isinstance(e, ev.JobPlaced)], res.considered


def walk_every_job(cx: Any, todo: list[str]) -> None:
    """The oracle: every requeued free job of ``todo``'s leaves sorted by (attained, budget order, index), then
    each in turn on free GPUs (``_place_in_turn``), as the cycle did before it kept the queue per shape."""
    later = []
    for pos, leaf in enumerate(todo):
        jobs = cx.pending[leaf]
        for i in range(cx.allocated_end.get(leaf, 0), len(jobs)):
            held = jobs[i].attained_gpu_s
            if held > 0 and not cycle_mod.first_las_queue(held, cx.cfg.free_las_queue_gpu_s):
                later.append((held, pos, i, leaf))
    later.sort()
    cycle_mod._place_in_turn(cx, ((leaf, cx.pending[leaf][i]) for _, _, i, leaf in later))


def walked_decisions(snap: CycleSnapshot, cfg: EngineConfig) -> tuple[Any, ...]:
    """The decisions of the walks that take every job (the oracle), without a memo."""

    def every_index(jobs: Any, queue_gpu_s: float | None) -> list[int]:
        return list(range(len(jobs)))  # the first queue's walk takes every job

    fast, firsts = cycle_mod._place_second_queue, cycle_mod._first_queue
    cycle_mod._place_second_queue = walk_every_job
    cycle_mod._first_queue = every_index
    try:
        return decided(dataclasses.replace(snap, memo=None), cfg)
    finally:
        cycle_mod._place_second_queue, cycle_mod._first_queue = fast, firsts


def test_the_second_queue_places_by_attained_service_and_counts_every_job_it_passes() -> None:
    # one node of 3 GPUs; no job has run before this pass, so the ranks count from 0 and the k-th job of the
    # queue has rank k - 1. Order (attained, budget order, index): j4 (50, y), j0 (100, x/p), j3 (100, y),
    # j1 (300, x/p), j2 (300, x/p), j5 (300, y), j6 (400, x/p), j7 (500, y).
    #   rank 0 j4 (4 GPUs) does not fit; rank 1 j0 (8) neither (a larger shape); rank 2 j3 placed (2 left);
    #   rank 3 j1 placed (1 left); rank 4 j2 (2 GPUs) does not fit; rank 5 j5 placed (0 left);
    #   rank 6 j6 (1 GPU) does not fit: not one GPU is left, the pass ends: 7 jobs considered, j7 not counted.
    jobs: list[tuple[str, int, int, str | None, float]] = [
        ("lab/x/p", 8, 1, None, 100.0),
        ("lab/x/p", 1, 1, None, 300.0),
        ("lab/x/p", 2, 1, None, 300.0),
        ("lab/y", 1, 1, None, 100.0),
        ("lab/y", 4, 1, None, 50.0),
        ("lab/y", 1, 1, None, 300.0),
        ("lab/x/p", 1, 1, None, 400.0),
        ("lab/y", 8, 1, None, 500.0),
    ]
    assert placed_ranks(world([(3, None)], jobs)) == ([("j3", 2), ("j1", 3), ("j5", 5)], 7)
    # one node of 4 GPUs: j4 takes them all, j0 does not fit, nor does j3 (1 GPU): the pass ends at rank 2
    assert placed_ranks(world([(4, None)], jobs)) == ([("j4", 0)], 3)
    # 3 + 8 GPUs: j4 (4), then every 1- and 2-GPU job (10 GPUs taken); j0 and j7 (8) do not fit, and the
    # pass reaches the end of the queue: all 8 jobs counted
    got = placed_ranks(world([(3, None), (8, None)], jobs))
    assert got == ([("j4", 0), ("j3", 2), ("j1", 3), ("j2", 4), ("j5", 5), ("j6", 6)], 8)


def test_a_cycle_on_the_same_lists_reads_the_kept_second_queue_and_decides_the_same(monkeypatch: Any) -> None:
    jobs: list[tuple[str, int, int, str | None, float]] = [
        ("lab/y" if i % 3 else "lab/x/p", 1 + (i % 2) * 7, 1, None, 100.0 * (i % 5 + 1)) for i in range(40)
    ]
    snap = dataclasses.replace(world([(8, None), (3, None)], jobs), memo=CycleMemo())
    made: list[int] = []
    make = cycle_mod._second_queue

    def counted(jobs: Any, start: int, queue_gpu_s: float | None) -> Any:
        made.append(len(jobs))
        return make(jobs, start, queue_gpu_s)

    monkeypatch.setattr(cycle_mod, "_second_queue", counted)
    first = decided(snap)
    assert sorted(made) == [14, 26]  # each leaf's list read once
    assert decided(snap) == first
    assert sorted(made) == [14, 26]  # kept with the lists: not read again
    assert decided(dataclasses.replace(snap, memo=None)) == first


job_st = st.tuples(
    st.sampled_from(["lab/x/p", "lab/x/q", "lab/y"]),
    st.sampled_from([1, 1, 2, 4, 8]),  # GPUs per replica
    st.sampled_from([1, 1, 2]),  # replicas
    st.sampled_from([None, None, "a"]),  # model
    st.sampled_from([0.0, 600.0, 600.0, 1800.0, 3600.0]),  # attained GPU-s (0: never run; ties are common)
)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, "a"])), min_size=1, max_size=4),
    st.lists(job_st, min_size=1, max_size=30),
    st.sampled_from([None, 1000.0]),
)
def test_the_kept_second_queue_decides_and_counts_what_walking_every_job_does(nodes, jobs, queue_gpu_s) -> None:
    snap = world(nodes, jobs)
    cfg = dataclasses.replace(CFG, free_las_queue_gpu_s=queue_gpu_s)
    assert decided(snap, cfg) == walked_decisions(snap, cfg)


edit_st = st.one_of(
    # add a job: (leaf, g, k, model, attained GPU-s, allocated?), submitted at a time that falls among the others
    st.tuples(job_st, st.booleans(), st.integers(0, 40)),
    # remove the job at this place (modulo the list's length) of this leaf
    st.tuples(st.sampled_from(["lab/x/p", "lab/x/q", "lab/y"]), st.integers(0, 40)),
    # replace the job at this place of this leaf by itself having held this many more GPU-s (a requeue: it leaves
    # and comes back to the same place, in the other queue or another place of the second one)
    st.tuples(st.sampled_from(["lab/x/p", "lab/x/q", "lab/y"]), st.integers(0, 40), st.sampled_from([300.0, 900.0])),
)


def edited(pending: dict[str, list[PendingJob]], caches: EngineCaches, n: int, edit: Any) -> None:
    """Apply one edit to ``pending`` as the dispatcher does (copy-on-write, ``EngineCaches.carry``)."""

    def add(leaf: str, job: PendingJob) -> None:
        old = pending[leaf]
        lst = list(old)
        i = bisect_right(lst, pending_order(job), key=pending_order)
        lst.insert(i, job)
        pending[leaf] = lst
        caches.carry(old, lst, job, True, i)

    def remove(leaf: str, at: int) -> PendingJob:
        old = pending[leaf]
        i = at % len(old)
        pending[leaf] = old[:i] + old[i + 1 :]
        caches.carry(old, pending[leaf], old[i], False, i)
        return old[i]

    if len(edit) == 2 or isinstance(edit[1], int):
        leaf, at = edit[:2]
        if len(pending.get(leaf, ())) < 2:
            return  # (the dispatcher carries nothing to a leaf's first list, nor from its last)
        gone = remove(leaf, at)
        if len(edit) == 3:
            add(leaf, dataclasses.replace(gone, attained_gpu_s=gone.attained_gpu_s + edit[2]))
        return
    (leaf, g, k, model, held), allocated, at = edit
    if not pending.get(leaf):
        return
    job = free_job(f"e{n}", (leaf, g, k, model, held), at)
    add(leaf, dataclasses.replace(job, min_runtime_s=600.0) if allocated else job)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([None, "a"])), min_size=1, max_size=4),
    st.lists(job_st, min_size=1, max_size=30),
    st.lists(st.lists(edit_st, min_size=1, max_size=8), min_size=1, max_size=3),
    st.sampled_from([None, 1000.0]),
)
def test_the_queues_carried_to_a_replacing_list_are_those_made_from_it(nodes, jobs, rounds, queue_gpu_s) -> None:
    # a cycle keeps both queues with each list; then jobs are added, removed and replaced as the dispatcher does
    # (copy-on-write, EngineCaches.carry), and the next cycle reads the carried queues: each must equal the
    # queue made from the new list, and the cycle must decide what walking every job does; then again
    cfg = dataclasses.replace(CFG, free_las_queue_gpu_s=queue_gpu_s)
    caches = EngineCaches()
    snap = dataclasses.replace(world(nodes, jobs), memo=caches.memo)
    run_cycle(snap, NOW, cfg)
    pending: dict[str, list[PendingJob]] = {leaf: cast(list[PendingJob], lst) for leaf, lst in snap.pending.items()}
    for lst in pending.values():  # both queues kept with every list, whether the cycle read them or not
        b = sum(1 for j in lst if j.allocated)
        cycle_mod._kept_second_queue(caches.memo, lst, b, queue_gpu_s)
        cycle_mod._kept_first_queue(caches.memo, lst, queue_gpu_s)
    n = 0
    for edits in rounds:
        for edit in edits:
            edited(pending, caches, n, edit)
            n += 1
        after = dataclasses.replace(snap, pending=dict(pending), memo=caches.memo)
        carried = 0
        for leaf, lst in pending.items():
            ent = caches.memo.get(id(lst))
            if ent is None or ent[0] is not lst or len(ent) < 6:
                continue
            b = sum(1 for j in lst if j.allocated)
            for key, (value, _) in ent[5].items():
                carried += 1
                if key[0] == "las":
                    assert key == ("las", b, queue_gpu_s)
                    assert value == cycle_mod._second_queue(lst, b, queue_gpu_s), leaf
                    # each entry holds the very job of the list, at its place
                    assert all(
                        lst[bisect_right(lst, pending_order(e[3]), key=pending_order) - 1] is e[3]
                        for q in value.values()
                        for e in q
                    )
                else:
                    assert key == ("first", queue_gpu_s)
                    assert value == cycle_mod._first_queue(lst, queue_gpu_s), leaf
        assert carried == 2 * len(pending)  # (every list kept both, and every edit carried them)
        assert decided(after, cfg) == walked_decisions(after, cfg)


def indexed(queue: dict[Any, list[Any]], jobs: list[PendingJob]) -> dict[Any, list[tuple[float, int]]]:
    """A second queue's entries as (attained GPU-s, index of the entry's job in ``jobs``)."""
    at = {id(j): i for i, j in enumerate(jobs)}
    return {shape: [(e[0], at[id(e[3])]) for e in q] for shape, q in queue.items()}


def test_a_queue_carried_over_an_added_and_a_removed_job_is_the_one_made_from_the_new_list() -> None:
    # lab/x/p: j0 (0 GPU-s, first queue), j1 (300), j2 (100), j3 (0); queue_gpu_s None
    jobs: list[tuple[str, int, int, str | None, float]] = [
        ("lab/x/p", 1, 1, None, 0.0),
        ("lab/x/p", 1, 1, None, 300.0),
        ("lab/x/p", 2, 1, None, 100.0),
        ("lab/x/p", 1, 1, None, 0.0),
    ]
    caches = EngineCaches()
    snap = dataclasses.replace(world([(1, None)], jobs), memo=caches.memo)
    old = cast(list[PendingJob], snap.pending["lab/x/p"])
    assert indexed(cycle_mod._kept_second_queue(caches.memo, old, 0, None), old) == {
        (1, 1, None, None): [(300.0, 1)],
        (2, 1, None, None): [(100.0, 2)],
    }
    # an allocated job goes first (index 0): every index moves up by one, the key's start becomes 1
    new_job = dataclasses.replace(old[0], job_id="a", min_runtime_s=600.0, attained_gpu_s=0.0)
    new = [new_job, *old]
    caches.carry(old, new, new_job, True, 0)
    ent = caches.memo[id(new)]
    assert {k: indexed(v, new) for k, (v, _) in ent[5].items()} == {
        ("las", 1, None): {(1, 1, None, None): [(300.0, 2)], (2, 1, None, None): [(100.0, 3)]}
    }
    # j1 (index 2) leaves: its shape's list empties and goes, j2 moves down to 2
    newer = new[:2] + new[3:]
    caches.carry(new, newer, new[2], False, 2)
    assert {k: indexed(v, newer) for k, (v, _) in caches.memo[id(newer)][5].items()} == {
        ("las", 1, None): {(2, 1, None, None): [(100.0, 2)]}
    }


def test_a_queue_that_does_not_hold_the_job_removed_is_not_carried() -> None:
    # lab/x/p: j0 (300 GPU-s) and j1 (100), both in the second queue; a job of the same shape, attained and
    # submission as j1 but another object (not of this list) cannot be taken out of it: the queue is dropped
    jobs: list[tuple[str, int, int, str | None, float]] = [
        ("lab/x/p", 1, 1, None, 300.0),
        ("lab/x/p", 1, 1, None, 100.0),
    ]
    snap = world([(1, None)], jobs)
    lst = cast(list[PendingJob], snap.pending["lab/x/p"])
    queue = cycle_mod._second_queue(lst, 0, None)
    key = ("las", 0, None)
    stranger = dataclasses.replace(lst[0], job_id="j1", submitted_at_us=lst[1].submitted_at_us, attained_gpu_s=100.0)
    assert cycle_mod._carry_second_queue(key, queue, stranger, False, 1, 0) is None
    # the list's own j1 leaves: j0 stays, and the old queue is as it was
    assert cycle_mod._carry_second_queue(key, queue, lst[1], False, 1, 0) == (
        key,
        {(1, 1, None, None): [(300.0, lst[0].submitted_at_us, "j0", lst[0])]},
    )
    assert indexed(queue, lst) == {(1, 1, None, None): [(100.0, 1), (300.0, 0)]}
