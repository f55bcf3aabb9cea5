"""Baseline policies for side-by-side comparison (rule D7.baselines).

Each is a cycle function ``(snapshot, now_us, config) -> events`` (the
events of :func:`apportion.domain.engine.run_cycle`), plugged into the same
dispatcher core through ``DispatchConfig.scheduler``; only the choice of
what to place differs.
All use the engine's gang best fit on free GPUs and backfill.

* ``fifo``: every pending job in (submitted_at, job_id) order, no budgets,
  no preemption; a job that does not fit is skipped (backfill), so FIFO
  here is "first come first served with backfill".
* ``static``: each leaf budget owns a fixed slice of the GPUs,
  ``round(abs_share * C)`` of the capacity C of the ``ready`` and ``draining``
  nodes (a drain does not shrink the slices until the node is drained); a job runs only
  if its budget's running GPUs plus its own fit in the slice (no borrowing,
  idle slices stay idle); FIFO within that. No preemption.
* ``priority``: two priority classes, no budgets: allocated jobs (minimum
  runtime > 0) before unallocated ones, FIFO within a class; an allocated
  job that does not fit preempts unallocated runs (least-cost set, as the
  engine) - the classic "production vs best-effort" setup.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from apportion.domain.engine.cycle import CycleSnapshot
from apportion.domain.engine.emit import emit_placed, pending_start_events, preempt_events
from apportion.domain.engine.inputs import EngineConfig, PendingJob, allocated_count
from apportion.domain.engine.placement import CycleFree
from apportion.domain.engine.search import PreemptionRequest, plan_preemption
from apportion.domain.engine.shapes import CycleMemo, segment_floor
from apportion.domain.engine.victims import CycleVictims
from apportion.domain.nodes import COUNTED_STATES
from apportion.events import Event, Placement
from apportion.sim.capacity import Shape, add_blocked, is_blocked, largest_free
from apportion.sim.peers.kai import Kai
from apportion.sim.peers.kueue import Kueue
from apportion.sim.peers.slurm import Slurm
from apportion.timeutil import Micros, from_us

__all__ = ["fifo", "static_partitions", "strict_priority", "POLICIES"]


def _fifo_key(j: PendingJob) -> tuple[int, str]:
    return (j.submitted_at_us, j.job_id)


Segment = tuple[str, Sequence[PendingJob], int, int]
"""``(leaf, jobs, lo, hi)``: the part ``jobs[lo:hi]`` of a leaf's pending list, sorted by :func:`_fifo_key`."""


def _segments(snapshot: CycleSnapshot) -> tuple[list[Segment], list[Segment]]:
    """Each leaf's pending list split into its allocated and unallocated parts, each in FIFO order.

    A leaf's list is kept sorted by :func:`apportion.domain.engine.pending_order`
    (allocated first, each class by (submitted_at, job_id)), so both parts
    ``[0, b)`` and ``[b, n)`` are already sorted by :func:`_fifo_key`. Empty
    parts are left out.
    """
    alloc: list[Segment] = []
    unalloc: list[Segment] = []
    for leaf, lst in snapshot.pending.items():
        b = allocated_count(lst)
        if b:
            alloc.append((leaf, lst, 0, b))
        if b < len(lst):
            unalloc.append((leaf, lst, b, len(lst)))
    return alloc, unalloc


def _floor_of(memo: CycleMemo | None, seg: Segment) -> tuple[int, int]:
    """``(min g, min k)`` over the jobs of ``seg`` (a lower bound of each job's shape).

    :func:`~apportion.domain.engine.segment_floor`: kept in the dispatcher's
    memo (carried over to the list that replaces one on enqueue and dequeue,
    see ``DispatchState._memo_carry``), so a long queue is scanned once, not
    per cycle; ``memo=None``: computed.
    """
    _, lst, lo, hi = seg
    return segment_floor(memo, lst, lo, hi)


def _merge(segs: list[Segment], live: list[bool]) -> Iterator[tuple[int, PendingJob]]:
    """``(segment index, job)`` of the jobs of ``segs`` in :func:`_fifo_key` order, lazily.

    A k-way merge (as :func:`heapq.merge`) that stops taking from segment i
    as soon as ``live[i]`` is false, checked before each of its jobs (the
    caller may clear it between two jobs). Keys are unique (job ids are
    unique among pending jobs), so the order is that of sorting the jobs.
    """
    heap = []
    for i, (_, lst, lo, hi) in enumerate(segs):
        if lo < hi and live[i]:
            heap.append((_fifo_key(lst[lo]), i, lo))
    heapq.heapify(heap)
    while heap:
        _, i, pos = heap[0]
        _, lst, _, hi = segs[i]
        yield i, lst[pos]
        pos += 1
        if pos < hi and live[i]:
            heapq.heapreplace(heap, (_fifo_key(lst[pos]), i, pos))
        else:
            heapq.heappop(heap)


def _rank(segs: list[Segment], job: PendingJob) -> int:
    """How many jobs of ``segs`` come before ``job`` in :func:`_fifo_key` order (its 0-based rank)."""
    k = _fifo_key(job)
    return sum(bisect_left(lst, k, lo, hi, key=_fifo_key) - lo for _, lst, lo, hi in segs)


def _greedy(
    snapshot: CycleSnapshot,
    now_us: Micros,
    config: EngineConfig,
    segs: list[Segment],
    policy: str,
    room: dict[str, int] | None = None,
    preemptors: list[Segment] | None = None,
) -> list[Event]:
    """One cycle of a baseline: try the jobs of ``preemptors`` then of ``segs``, each in FIFO order, greedily.

    Args:
        snapshot: the cycle's frozen inputs (nodes, runs and ``memo``; the
            jobs are those of the segments).
        now_us: cycle time, µs since the epoch UTC.
        config: the engine knobs (``delta``, grace and so on are carried over).
        segs: the jobs placed on free GPUs only (gang best fit), merged in
            :func:`_fifo_key` order.
        policy: ``policy_version`` written in the decisions.
        room: static partitions: leaf budget -> GPUs it may still take (a
            missing leaf: 0); a job of ``segs`` is tried only if
            ``job.gpus <= room[job.budget]``, and placing it lowers that room.
            ``None``: no limit.
        preemptors: allocated jobs tried before ``segs`` (merged in FIFO
            order), without ``room``: each is placed on free GPUs, or else by
            preempting unallocated runs (least-cost set,
            :func:`apportion.domain.engine.plan_preemption`). ``None``: no preemption.

    Returns:
        Events in order, as :func:`apportion.domain.engine.run_cycle`'s. A
        decision's ``rank`` is the job's 0-based position in the whole order
        (all preemptors, then all jobs of ``segs``), counting jobs skipped.

    Within a cycle free GPUs only shrink (a placement takes them; preemption
    hands the victims' GPUs to the preemptor, never to the free index), the
    unallocated runs that may be preempted only go (``victims.taken`` grows)
    and a leaf's room only shrinks. So a shape whose fit on free GPUs failed,
    or whose preemption plan failed, stays failed for the rest of the cycle,
    and so does every shape it covers (:func:`covers`; a plan failure implies
    a fit failure, since the nodes a fit would pick are plan options); a job
    wider per replica than any node's free GPUs, or larger than its leaf's
    room, cannot be placed later in the cycle either. Such jobs are passed
    over without a search, and a whole segment is dropped from the merge once
    its floor (:func:`_floor_of`: smallest g and k of its jobs) shows none of
    its jobs can be placed any more; ranks are then counted by bisection
    (:func:`_rank`). Same decisions as trying each job in turn. On Philly
    week 44, strict priority ran ~3.1M preemption searches in 15k cycles and
    static partitions ~4.9M quota checks without this.
    """
    free = CycleFree(snapshot.cluster, snapshot.free)
    out: list[Event] = []
    ts = from_us(now_us)
    cfg = EngineConfig(
        delta=config.delta,
        reservation_after_s=config.reservation_after_s,
        window_s=config.window_s,
        grace_s=config.grace_s,
        patience_s=0.0,  # (patience_rule is ours, not a baseline's)
        checkpoint_wait_s=0.0,  # (nor checkpoint_rule)
        preemption=preemptors is not None,
        policy_version=policy,
        producer=config.producer,
    )
    memo = snapshot.memo
    no_fit: list[Shape] = []  # shapes known not to fit on free GPUs (for the rest of the cycle)

    def place_free(job: PendingJob, nodes: list[str], rank: int) -> None:
        pl = tuple(Placement(node_id=n, gpus=free.take(n, job.gpus_per_replica)) for n in nodes)
        emit_placed(out, job, pl, (), job.budget, rank, {}, 0.0, False, ts, cfg)
        out.extend(pending_start_events(job, pl, ts, cfg.producer))

    start = 0
    if preemptors is not None:
        start = sum(hi - lo for _, _, lo, hi in preemptors)
        no_plan: list[Shape] = []  # shapes known to have no preemption plan either
        victims: CycleVictims | None = None
        pfloors = [_floor_of(memo, sg) for sg in preemptors]
        plive = [True] * len(preemptors)
        for _, job in _merge(preemptors, plive):
            g, k, m = job.gpus_per_replica, job.replicas, job.gpu_model
            if is_blocked(no_plan, g, k, m):
                continue
            nodes = None if is_blocked(no_fit, g, k, m) else free.fit(g, k, m)
            if nodes is not None:
                place_free(job, nodes, _rank(preemptors, job))
                continue
            add_blocked(no_fit, (g, k, m))
            if victims is None:
                victims = CycleVictims(snapshot.cluster, now_us, snapshot.victims)
                victims.expired = {}  # priority classes: only the low class is preemptible
            plan = plan_preemption(PreemptionRequest(job, job.budget, free, victims, now_us))
            if plan is None:
                add_blocked(no_plan, (g, k, m))
                for i, (fg, fk) in enumerate(pfloors):
                    if plive[i] and is_blocked(no_plan, fg, fk, None):  # covers every job of the segment
                        plive[i] = False
                continue
            pl, chosen = plan
            for run, vic in chosen:
                victims.taken.add(run.key)
                out.extend(
                    preempt_events(
                        run, ts, cfg.grace_s, cfg.producer, victim=vic, by_job_id=job.job_id, by_budget=job.budget
                    )
                )
            emit_placed(
                out, job, pl, tuple(v for _, v in chosen), job.budget, _rank(preemptors, job), {}, 0.0, False, ts, cfg
            )
    largest = largest_free(free)
    if largest == 0:  # every job wants >= 1 GPU per replica: nothing more can be placed
        return out
    floors = [_floor_of(memo, sg) for sg in segs]

    def dead(i: int) -> bool:
        fg, fk = floors[i]
        return (
            fg > largest or (room is not None and fg * fk > room.get(segs[i][0], 0)) or is_blocked(no_fit, fg, fk, None)
        )

    live = [not dead(i) for i in range(len(segs))]
    for _, job in _merge(segs, live):
        g, k, m = job.gpus_per_replica, job.replicas, job.gpu_model
        if g > largest or (room is not None and g * k > room.get(job.budget, 0)):
            continue
        nodes = None if is_blocked(no_fit, g, k, m) else free.fit(g, k, m)
        if nodes is None:
            add_blocked(no_fit, (g, k, m))
        else:
            place_free(job, nodes, start + _rank(segs, job))
            if room is not None:
                room[job.budget] = room.get(job.budget, 0) - g * k
            largest = largest_free(free)
            if largest == 0:
                break
        for i in range(len(segs)):
            if live[i] and dead(i):
                live[i] = False
    return out


def fifo(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """First come first served with backfill, no budgets, no preemption."""
    alloc, unalloc = _segments(snapshot)
    return _greedy(snapshot, now_us, config, alloc + unalloc, "fifo-1")


def static_partitions(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """Fixed GPU slice per leaf budget (``round(abs_share * C)``), no borrowing, FIFO within."""
    cap = sum(n.gpu_count for n in snapshot.cluster.nodes.values() if n.state in COUNTED_STATES)
    room = {leaf: round(snapshot.tree.abs_share(leaf) * cap) for leaf in snapshot.tree.leaves()}
    for run in snapshot.cluster.runs.values():
        room[run.budget] = room.get(run.budget, 0) - run.gpus_per_replica * len(run.open_replicas)
    alloc, unalloc = _segments(snapshot)
    return _greedy(snapshot, now_us, config, alloc + unalloc, "static-1", room=room)


def strict_priority(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """Allocated jobs before unallocated ones (FIFO within), preempting unallocated runs."""
    alloc, unalloc = _segments(snapshot)
    return _greedy(snapshot, now_us, config, unalloc, "priority-1", preemptors=alloc)


# They read the snapshot during the call only and keep nothing (the cycle works on copies of the free
# index and never writes the victim index): the dispatcher may pass its live view and kept indices.
# (A function attribute, which typing cannot declare: set through the function's __dict__.)
for _policy in (fifo, static_partitions, strict_priority):
    _policy.__dict__["reads_snapshot_only"] = True

#: Policy name -> cycle function for ``DispatchConfig.scheduler``; ``fairshare`` is ``None``: the
#: dispatcher's own engine (:func:`apportion.domain.engine.run_cycle`).
POLICIES: dict[str, Callable[[CycleSnapshot, Micros, EngineConfig], list[Event]] | None] = {
    "fairshare": None,
    "fifo": fifo,
    "static": static_partitions,
    "priority": strict_priority,
    # the peers: one instance each, with per-simulation memory (PeerPolicy: reset when a cycle comes from
    # another simulation's dispatcher state)
    "slurm": Slurm(),
    "kueue": Kueue(),
    "kai": Kai(),
}
