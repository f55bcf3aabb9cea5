"""Work conservation: GPUs left idle while a job that fits them waits (rules D3.scheduling-cycle and D7.simulator).

The figure every simulator report carries, per policy, for allocated and
unallocated waiting jobs separately. At an instant t, with ``f_n`` the free
GPUs of node ``n`` (0 unless the node is ``ready``) and ``m_n`` its model:

* a pending job ``j`` of ``k_j`` replicas of ``g_j`` GPUs (model ``m_j`` or
  any) **fits** when at least ``k_j`` distinct nodes are eligible for it,
  ``E_j = {n : f_n >= g_j and (m_j is None or m_n == m_j)}``: it could start
  now on free GPUs alone, a gang on ``k_j`` distinct nodes;
* for a class ``c`` of waiting jobs (allocated, or unallocated), with
  ``J_c`` its pending jobs that fit,

      I_c(t) = min( sum of f_n over n in the union of E_j for j in J_c,  sum of g_j * k_j over j in J_c )

  the free GPUs some fitting job of the class could use, but no more than
  those jobs ask for (a 1-GPU job waiting next to 8 free GPUs idles 1 of
  them by this count, not 8);
* **idle while waiting** of class ``c`` = the integral of ``I_c`` over the
  run, reported in GPU-hours. ``I`` is piecewise constant: it changes only
  at instants where an event happened, and the simulator takes it after
  each instant's cycle.

A scheduler that never idles a GPU a waiting job could use now scores 0
(rule D3.invariants: "no GPU idles while a placeable job waits"); a static
partition, which keeps a budget's slice empty while another budget's jobs
wait, does not.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import islice
from operator import attrgetter

from apportion.domain.cluster import Node
from apportion.domain.engine.inputs import PendingJob, allocated_count
from apportion.events import (
    Event,
    JobCheckpointed,
    JobPlaced,
    JobPreempted,
    JobStarted,
    StartWorkload,
    StopWorkload,
)

__all__ = ["QUIET_EVENTS", "Shape", "IdleWhileWaiting", "idle_fitting_gpus", "shapes_of"]

#: Events that change neither a node's free GPUs or state nor the queue: a run's GPUs are taken at its
#: ``JobPlaced`` and come back at its end (completion, stop, loss, requeue, cancel), all of which count.
QUIET_EVENTS = frozenset({JobStarted, JobCheckpointed, StartWorkload, StopWorkload, JobPreempted})

Shape = tuple[int, int, str | None]
"""``(g, k, model)`` of a pending job."""
_SHAPE = attrgetter("gpus_per_replica", "replicas", "gpu_model")


def shapes_of(jobs: Sequence[PendingJob]) -> tuple[dict[Shape, int], dict[Shape, int]]:
    """Per shape, the GPUs (``g * k``, summed) of the allocated and of the unallocated jobs in ``jobs``, a
    leaf's pending list (allocated jobs first: :func:`~apportion.domain.engine.inputs.pending_order`)."""
    b = allocated_count(jobs)
    out: tuple[dict[Shape, int], dict[Shape, int]] = ({}, {})
    for into, part in zip(out, (islice(jobs, 0, b), islice(jobs, b, None)), strict=True):
        for (g, k, model), n in Counter(map(_SHAPE, part)).items():
            into[(g, k, model)] = g * k * n
    return out


def idle_fitting_gpus(free: Mapping[str, tuple[str | None, int]], demand: Mapping[Shape, int]) -> int:
    """``I_c`` of the module docstring for one class of waiting jobs.

    Args:
        free: node -> (model, free GPUs) of the ``ready`` nodes with at least one free GPU.
        demand: shape -> GPUs asked for by the class's pending jobs of that shape (:func:`shapes_of`).
    """
    counts: dict[str | None, list[int]] = {}
    for m, f in free.values():
        insort(counts.setdefault(m, []), f)
    return _idle(counts, demand)


def _idle(counts: Mapping[str | None, list[int]], demand: Mapping[Shape, int]) -> int:
    """:func:`idle_fitting_gpus` on the free counts per model, each list sorted ascending.

    A job's eligible nodes of one model are nested by g, so the union of the fitting jobs' eligible nodes is,
    per model, the nodes at or above the smallest fitting g; a count of nodes with at least g free GPUs is a
    bisection.
    """
    if not counts or not demand:
        return 0
    lowest: dict[str | None, int] = {}  # model (None: any) -> smallest g of a fitting shape
    asked = 0
    for (g, k, model), gpus in demand.items():
        if model is None:
            n = 0
            for fs in counts.values():
                n += len(fs) - bisect_left(fs, g)
        else:
            one = counts.get(model)
            n = len(one) - bisect_left(one, g) if one else 0
        if n >= k:
            asked += gpus
            if g < lowest.get(model, g + 1):
                lowest[model] = g
    if not asked:
        return 0
    anyg = lowest.get(None)
    offered = 0
    for m, fs in counts.items():
        least = lowest.get(m) if m is not None else None
        if anyg is not None and (least is None or anyg < least):
            least = anyg
        if least is not None:
            offered += sum(fs[bisect_left(fs, least) :])
    return offered if offered < asked else asked


class IdleWhileWaiting:
    """The simulator's integral of ``I`` (allocated, unallocated), kept as the run goes.

    :meth:`saw` notes the nodes whose free GPUs may have changed (those of the
    instant's events); :meth:`advance` integrates the current ``I`` up to a
    time and re-measures it from the dispatcher's nodes and pending jobs.
    Each leaf's shapes are cached on its pending list (the dispatcher replaces
    a list when it changes), so an instant costs the touched nodes plus the
    distinct shapes waiting, not every job.
    """

    __slots__ = (
        "free",
        "gpu_s",
        "_rate",
        "_since",
        "_touched",
        "_shapes",
        "_runs",
        "_alloc",
        "_unalloc",
        "_stale",
        "dirty",
        "_counts",
    )

    def __init__(self) -> None:
        self.free: dict[str, tuple[str | None, int]] = {}
        #: GPU-seconds idle while a fitting (allocated, unallocated) job waited, so far.
        self.gpu_s = [0.0, 0.0]
        self._rate = (0, 0)
        self._since: int | None = None
        self._touched: set[str] = set()
        self._runs: dict[str, tuple[str, ...]] = {}  # job id -> nodes of its latest placement
        self._alloc: dict[Shape, int] = {}  # GPUs per shape of every waiting allocated job (the cached leaves)
        self._unalloc: dict[Shape, int] = {}  # ... and unallocated job
        self._stale = True
        self.dirty = False  # an event since the last measure may have changed I (:meth:`saw`)
        self._counts: dict[str | None, list[int]] = {}  # model -> free counts of the nodes in ``free``, sorted
        self._shapes: dict[str, tuple[Sequence[PendingJob], dict[Shape, int], dict[Shape, int]]] = {}

    def saw(self, ev: Event) -> None:
        """An event of this instant: the nodes it names, and those of the run of the job it names, may have
        changed their free GPUs or state (a gang lost on one node frees its GPUs on the others too), and the
        waiting jobs may have changed. Events that change neither (:data:`QUIET_EVENTS`) are passed over."""
        tp = type(ev)
        if tp in QUIET_EVENTS:
            return
        self.dirty = True
        touched = self._touched
        if tp is JobPlaced:
            placed = self._runs[ev.job_id] = tuple(p.node_id for p in ev.placements)  # type: ignore[attr-defined]
            touched.update(placed)
            return
        nid = getattr(ev, "node_id", None)
        if nid is not None:
            touched.add(nid)
        job_id = getattr(ev, "job_id", None)
        if job_id is not None:
            nodes = self._runs.get(job_id)
            if nodes is not None:
                touched.update(nodes)

    def until(self, t_us: int) -> None:
        """Integrate the current ``I`` up to ``t_us`` (it is constant since the last measure)."""
        if self._since is not None and t_us > self._since:
            dt = (t_us - self._since) / 1e6
            a, u = self._rate
            if a:
                self.gpu_s[0] += a * dt
            if u:
                self.gpu_s[1] += u * dt
        self._since = t_us

    def advance(self, t_us: int, nodes: Mapping[str, Node], pending: Mapping[str, Sequence[PendingJob]]) -> None:
        """Integrate up to ``t_us``, then take ``I`` from ``nodes`` and ``pending`` as they are now. A caller
        may skip instants with no :attr:`dirty` event: ``I`` did not change there."""
        self.until(t_us)
        if not self.dirty:
            return  # no event of the instant changed free GPUs or the queue: I is what it was
        self.dirty = False
        free = self.free
        counts = self._counts
        changed = False
        if self._touched:
            for nid in self._touched:
                n = nodes.get(nid)
                was = free.get(nid)
                now = (n.gpu_model, len(n.free)) if n is not None and n.free and n.schedulable else None
                if now == was:
                    continue
                changed = True
                if was is not None:
                    fs = counts[was[0]]
                    del fs[bisect_left(fs, was[1])]
                    if not fs:
                        del counts[was[0]]
                if now is None:
                    del free[nid]
                else:
                    free[nid] = now
                    insort(counts.setdefault(now[0], []), now[1])
            self._touched.clear()
        if not free or not pending:
            self._rate = (0, 0)
            self._stale = True  # (the next measure looks again, whatever changed)
            return
        alloc, unalloc = self._alloc, self._unalloc
        cache = self._shapes
        queue_changed = False
        for leaf, jobs in pending.items():
            hit = cache.get(leaf)
            if hit is not None and hit[0] is jobs:
                continue
            queue_changed = True
            one = _one_apart(hit[0], jobs) if hit is not None else None
            if one is not None and hit is not None:  # one job joined or left: move its GPUs only
                job, sign = one
                shape = (job.gpus_per_replica, job.replicas, job.gpu_model)
                delta = {shape: job.gpus_per_replica * job.replicas}
                if job.min_runtime_s > 0:
                    _merge(alloc, delta, sign)
                    _merge(hit[1], delta, sign)
                else:
                    _merge(unalloc, delta, sign)
                    _merge(hit[2], delta, sign)
                cache[leaf] = (jobs, hit[1], hit[2])
                continue
            if hit is not None:
                _merge(alloc, hit[1], -1)
                _merge(unalloc, hit[2], -1)
            hit = cache[leaf] = (jobs, *shapes_of(jobs))
            _merge(alloc, hit[1], 1)
            _merge(unalloc, hit[2], 1)
        if len(cache) != len(pending):  # leaves with nothing waiting any more
            for leaf in [x for x in cache if x not in pending]:
                _, gone_a, gone_u = cache.pop(leaf)
                _merge(alloc, gone_a, -1)
                _merge(unalloc, gone_u, -1)
            queue_changed = True
        if not (queue_changed or changed or self._stale):
            return  # neither the free GPUs nor the waiting jobs changed: I is what it was
        self._stale = False
        self._rate = (_idle(counts, alloc) if alloc else 0, _idle(counts, unalloc) if unalloc else 0)


def _merge(into: dict[Shape, int], part: Mapping[Shape, int], sign: int) -> None:
    """Add (``sign`` 1) or take away (-1) one leaf's GPUs per shape; shapes left at 0 are dropped."""
    for shape, gpus in part.items():
        left = into.get(shape, 0) + sign * gpus
        if left:
            into[shape] = left
        else:
            del into[shape]


def _one_apart(old: Sequence[PendingJob], new: Sequence[PendingJob]) -> tuple[PendingJob, int] | None:
    """``(job, 1)`` when ``new`` is ``old`` with one job inserted, ``(job, -1)`` with one taken out, else ``None``.

    The dispatcher replaces a leaf's list on every change, and most changes are one job queued or placed:
    the first index where the two differ is found by bisection (identity holds on a prefix, then fails), and
    both sides of it are compared to confirm.
    """
    n, m = len(old), len(new)
    if m == n + 1:
        longer, shorter, sign = new, old, 1
    elif m == n - 1:
        longer, shorter, sign = old, new, -1
    else:
        return None
    lo, hi = 0, len(shorter)
    while lo < hi:
        mid = (lo + hi) // 2
        if longer[mid] is shorter[mid]:
            lo = mid + 1
        else:
            hi = mid
    # both sides checked in full (a prefix that is not identical can still pass the bisection); identical
    # elements compare equal without a look at their fields, so this is one pass in C
    if longer[:lo] != shorter[:lo] or longer[lo + 1 :] != shorter[lo:]:
        return None
    return longer[lo], sign
