"""Baseline policies for side-by-side comparison (DESIGN section 7).

Each is a cycle function with the signature of
:func:`apportion.domain.engine.schedule` (``(snapshot, now_us, config) ->
events``), plugged into the same dispatcher core through
``DispatchConfig.scheduler``; only the choice of what to place differs.
All use the engine's gang best fit on free GPUs and backfill.

* ``fifo``: every pending job in (submitted_at, job_id) order, no budgets,
  no preemption; a job that does not fit is skipped (backfill), so FIFO
  here is "first come first served with backfill".
* ``static``: each leaf budget owns a fixed slice of the GPUs,
  ``round(abs_share * C)`` of the capacity of ``ready`` nodes; a job runs only
  if its budget's running GPUs plus its own fit in the slice (no borrowing,
  idle slices stay idle); FIFO within that. No preemption.
* ``priority``: two priority classes, no budgets: allocated jobs (minimum
  runtime > 0) before unallocated ones, FIFO within a class; an allocated
  job that does not fit preempts unallocated runs (least-cost set, as the
  engine) - the classic "production vs best-effort" setup.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator

from apportion.domain.engine import (
    CycleSnapshot,
    EngineConfig,
    PendingJob,
    _Free,
    _plan,
    _Victims,
    _emit_placed,
    preempt_events,
    schedule,
    start_events,
)
from apportion.events import Event
from apportion.timeutil import Micros, from_us

__all__ = ["fifo", "static_partitions", "strict_priority", "POLICIES"]


def _fifo_key(j: PendingJob) -> tuple[int, str]:
    return (j.submitted_at_us, j.job_id)


def _segments(snapshot: CycleSnapshot) -> tuple[list[list[PendingJob]], list[list[PendingJob]]]:
    """Each leaf's pending list split into its allocated and unallocated parts, each in FIFO order.

    A leaf's list is kept sorted by :func:`apportion.domain.engine.pending_order`
    (allocated first, each class by (submitted_at, job_id)), so both parts are
    already sorted by :func:`_fifo_key`.
    """
    alloc, unalloc = [], []
    for lst in snapshot.pending.values():
        b = bisect_left(lst, True, key=lambda j: j.min_runtime_s <= 0)
        if b:
            alloc.append(lst[:b])
        if b < len(lst):
            unalloc.append(lst[b:])
    return alloc, unalloc


def _ordered(snapshot: CycleSnapshot) -> Iterator[PendingJob]:
    """Every pending job in (submitted_at, job_id) order, lazily.

    A k-way merge of the leaves' already sorted parts: a cycle that stops
    early (nothing free) pays for the jobs it looked at, not for sorting the
    whole queue (which took ~70% of a FIFO run over Philly weeks 39-45, where
    the queue holds tens of thousands of jobs). Same order as sorting: job ids
    are unique among pending jobs, so the key is a total order.
    """
    alloc, unalloc = _segments(snapshot)
    return heapq.merge(*alloc, *unalloc, key=_fifo_key)


def _largest_free(free: _Free) -> int:
    """The most free GPUs any node has in this cycle (over all models), 0 when none is free."""
    best = 0
    for b in free.buckets.values():
        for c in range(len(b) - 1, best, -1):
            if b[c]:
                best = c
                break
    return best


def _greedy(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig, jobs: Iterable[PendingJob],
            policy: str, admit: Callable[[PendingJob], bool] | None = None,
            on_place: Callable[[PendingJob], None] | None = None, preempt: bool = False) -> list[Event]:
    free = _Free(snapshot.cluster)
    out: list[Event] = []
    ts = from_us(now_us)
    cfg = EngineConfig(delta=config.delta, reservation_after_s=config.reservation_after_s,
                       window_s=config.window_s, grace_s=config.grace_s, preemption=preempt,
                       policy_version=policy, producer=config.producer)
    victims: _Victims | None = None
    failed: set[tuple[int, int, str | None]] = set()
    # Free GPUs only shrink within a cycle (preemption hands the victims' GPUs to the preemptor, not to
    # the free index), so a job wanting more per replica than any node has free now cannot fit later in
    # this cycle either: skipped without the search, or, once nothing is free and nothing can preempt,
    # the rest of the queue is. Same decisions as trying each job; on a queue of tens of thousands of
    # jobs (Philly weeks 39-45) it is the difference between a cycle per job and a cycle per fit.
    largest = _largest_free(free)
    for rank, job in enumerate(jobs):
        if job.gpus_per_replica > largest and not (preempt and job.min_runtime_s > 0):
            if largest == 0:  # valid because jobs that may preempt all come first (see strict_priority)
                break
            continue
        if admit is not None and not admit(job):
            continue
        shape = (job.gpus_per_replica, job.replicas, job.gpu_model)
        nodes = None if shape in failed else free.fit(*shape)
        if nodes is not None:
            from apportion.events import Placement
            pl = tuple(Placement(node_id=n, gpus=free.take(n, job.gpus_per_replica)) for n in nodes)
            _emit_placed(out, job, pl, (), job.budget, rank, {}, 0.0, False, ts, cfg)
            out.extend(start_events(job.job_id, job.attempt, pl, ts, job.duration_s, job.command,
                                    cfg.producer))
            largest = _largest_free(free)
        elif preempt and job.min_runtime_s > 0:
            failed.add(shape)
            if victims is None:
                victims = _Victims(snapshot.cluster, now_us)
                victims.expired = {}  # priority classes: only the low class is preemptible
            plan = _plan(job, job.budget, free, victims, now_us, lambda p: 0.0, 0.0)
            if plan is None:
                continue
            pl, chosen = plan
            for run, vic in chosen:
                victims.taken.add(run.key)
                out.extend(preempt_events(run, ts, cfg.grace_s, cfg.producer, victim=vic,
                                          by_job_id=job.job_id, by_budget=job.budget))
            _emit_placed(out, job, pl, tuple(v for _, v in chosen), job.budget, rank, {}, 0.0,
                         False, ts, cfg)
        else:
            failed.add(shape)
            continue
        if on_place is not None:
            on_place(job)
    return out


def fifo(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """First come first served with backfill, no budgets, no preemption."""
    return _greedy(snapshot, now_us, config, _ordered(snapshot), "fifo-1")


def static_partitions(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """Fixed GPU slice per leaf budget (``round(abs_share * C)``), no borrowing, FIFO within."""
    cap = sum(n.gpu_count for n in snapshot.cluster.nodes.values() if n.state in ("ready", "draining"))
    quota = {leaf: round(snapshot.tree.abs_share(leaf) * cap) for leaf in snapshot.tree.leaves()}
    used: dict[str, int] = {}
    for run in snapshot.cluster.runs.values():
        used[run.budget] = used.get(run.budget, 0) + run.gpus_per_replica * len(run.open_replicas)

    def admit(job: PendingJob) -> bool:
        return used.get(job.budget, 0) + job.gpus <= quota.get(job.budget, 0)

    def on_place(job: PendingJob) -> None:
        used[job.budget] = used.get(job.budget, 0) + job.gpus

    return _greedy(snapshot, now_us, config, _ordered(snapshot), "static-1", admit, on_place)


def strict_priority(snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
    """Allocated jobs before unallocated ones (FIFO within), preempting unallocated runs."""
    alloc, unalloc = _segments(snapshot)
    jobs = itertools.chain(heapq.merge(*alloc, key=_fifo_key), heapq.merge(*unalloc, key=_fifo_key))
    return _greedy(snapshot, now_us, config, jobs, "priority-1", preempt=True)


#: Policy name -> cycle function (``fairshare`` is the real engine).
POLICIES: dict[str, Callable[[CycleSnapshot, Micros, EngineConfig], list[Event]]] = {
    "fairshare": schedule,
    "fifo": fifo,
    "static": static_partitions,
    "priority": strict_priority,
}
