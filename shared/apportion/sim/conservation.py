"""Work conservation: GPUs left idle while a job that fits them waits (DESIGN sections 3 and 7).

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
(DESIGN section 3: "no GPU idles while a placeable job waits"); a static
partition, which keeps a budget's slice empty while another budget's jobs
wait, does not.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence

from apportion.domain.cluster import Node
from apportion.domain.engine.inputs import PendingJob
from apportion.events import (
    Event,
    JobCheckpointed,
    JobPlaced,
    JobPreempted,
    JobStarted,
    StartWorkload,
    StopWorkload,
)

__all__ = ["Shape", "IdleWhileWaiting", "idle_fitting_gpus", "shapes_of"]

#: Events that change neither a node's free GPUs or state nor the queue: a run's GPUs are taken at its
#: ``JobPlaced`` and come back at its end (completion, stop, loss, requeue, cancel), all of which count.
_QUIET = frozenset({JobStarted, JobCheckpointed, StartWorkload, StopWorkload, JobPreempted})

Shape = tuple[int, int, str | None]
"""``(g, k, model)`` of a pending job."""


def shapes_of(jobs: Iterable[PendingJob]) -> tuple[dict[Shape, int], dict[Shape, int]]:
    """Per shape, the GPUs (``g * k``, summed) of the allocated and of the unallocated jobs in ``jobs``."""
    alloc: dict[Shape, int] = {}
    unalloc: dict[Shape, int] = {}
    for j in jobs:
        shape = (j.gpus_per_replica, j.replicas, j.gpu_model)
        into = alloc if j.min_runtime_s > 0 else unalloc
        into[shape] = into.get(shape, 0) + j.gpus_per_replica * j.replicas
    return alloc, unalloc


def idle_fitting_gpus(free: Mapping[str, tuple[str | None, int]], demand: Mapping[Shape, int]) -> int:
    """``I_c`` of the module docstring for one class of waiting jobs.

    Args:
        free: node -> (model, free GPUs) of the ``ready`` nodes with at least one free GPU.
        demand: shape -> GPUs asked for by the class's pending jobs of that shape (:func:`shapes_of`).
    """
    if not free or not demand:
        return 0
    return _FreeView(free).idle(demand)


class _FreeView:
    """Free GPUs per model as sorted counts with suffix sums: nodes with at least g free, and their free
    GPUs, in O(log n) (a job's eligible nodes of one model are nested by g, so the union of the fitting
    jobs' eligible nodes is, per model, the nodes at or above the smallest fitting g)."""

    __slots__ = ("counts", "tails")

    def __init__(self, free: Mapping[str, tuple[str | None, int]]) -> None:
        per: dict[str | None, list[int]] = {}
        for m, f in free.values():
            per.setdefault(m, []).append(f)
        self.counts: dict[str | None, list[int]] = {}
        self.tails: dict[str | None, list[int]] = {}  # tails[m][i] = sum(counts[m][i:])
        for m, fs in per.items():
            fs.sort()
            tail = [0] * (len(fs) + 1)
            for i in range(len(fs) - 1, -1, -1):
                tail[i] = tail[i + 1] + fs[i]
            self.counts[m], self.tails[m] = fs, tail

    def nodes_at_least(self, g: int, model: str | None) -> int:
        """Nodes of ``model`` (any when ``None``) with at least ``g`` free GPUs."""
        models = self.counts if model is None else ((model,) if model in self.counts else ())
        return sum(len(self.counts[m]) - bisect_left(self.counts[m], g) for m in models)

    def idle(self, demand: Mapping[Shape, int]) -> int:
        lowest: dict[str | None, int] = {}  # model (None: any) -> smallest g of a fitting shape
        asked = 0
        for (g, k, model), gpus in demand.items():
            if self.nodes_at_least(g, model) >= k:
                asked += gpus
                if g < lowest.get(model, g + 1):
                    lowest[model] = g
        if not asked:
            return 0
        anyg = lowest.get(None)
        offered = 0
        for m, fs in self.counts.items():
            least = lowest.get(m) if m is not None else None
            if anyg is not None and (least is None or anyg < least):
                least = anyg
            if least is not None:
                offered += self.tails[m][bisect_left(fs, least)]
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

    __slots__ = ("free", "gpu_s", "_rate", "_since", "_touched", "_shapes", "_runs", "_merged", "_merged_ids", "_dirty")

    def __init__(self) -> None:
        self.free: dict[str, tuple[str | None, int]] = {}
        #: GPU-seconds idle while a fitting (allocated, unallocated) job waited, so far.
        self.gpu_s = [0.0, 0.0]
        self._rate = (0, 0)
        self._since: int | None = None
        self._touched: set[str] = set()
        self._runs: dict[str, tuple[str, ...]] = {}  # job id -> nodes of its latest placement
        self._merged: tuple[tuple[Sequence[PendingJob], ...], dict[Shape, int], dict[Shape, int]] = ((), {}, {})
        self._merged_ids: tuple[int, ...] = ()
        self._dirty = False
        self._shapes: dict[str, tuple[Sequence[PendingJob], dict[Shape, int], dict[Shape, int]]] = {}

    def saw(self, ev: Event) -> None:
        """An event of this instant: the nodes it names, and those of the run of the job it names, may have
        changed their free GPUs or state (a gang lost on one node frees its GPUs on the others too), and the
        waiting jobs may have changed. Events that change neither (:data:`_QUIET`) are passed over."""
        tp = type(ev)
        if tp in _QUIET:
            return
        self._dirty = True
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

    def advance(self, t_us: int, nodes: Mapping[str, Node], pending: Mapping[str, Sequence[PendingJob]]) -> None:
        """Integrate up to ``t_us``, then take ``I`` from ``nodes`` and ``pending`` as they are now."""
        if self._since is not None and t_us > self._since:
            dt = (t_us - self._since) / 1e6
            a, u = self._rate
            if a:
                self.gpu_s[0] += a * dt
            if u:
                self.gpu_s[1] += u * dt
        self._since = t_us
        if not self._dirty:
            return  # no event of the instant changed free GPUs or the queue: I is what it was
        self._dirty = False
        free = self.free
        changed = False
        if self._touched:
            for nid in self._touched:
                n = nodes.get(nid)
                was = free.get(nid)
                if n is not None and n.free and n.schedulable:
                    now = (n.gpu_model, len(n.free))
                    if now != was:
                        free[nid] = now
                        changed = True
                elif was is not None:
                    del free[nid]
                    changed = True
            self._touched.clear()
        if not free or not pending:
            self._rate = (0, 0)
            self._merged_ids = ()  # (the next measure starts afresh)
            return
        lists = tuple(pending.values())
        ids = tuple(map(id, lists))
        if ids == self._merged_ids and not changed:
            return  # neither the free GPUs nor the waiting jobs changed: I is what it was
        if ids != self._merged_ids:
            alloc: dict[Shape, int] = {}
            unalloc: dict[Shape, int] = {}
            cache = self._shapes
            for leaf, jobs in pending.items():
                hit = cache.get(leaf)
                if hit is None or hit[0] is not jobs:
                    hit = cache[leaf] = (jobs, *shapes_of(jobs))
                for into, part in ((alloc, hit[1]), (unalloc, hit[2])):
                    for shape, gpus in part.items():
                        into[shape] = into.get(shape, 0) + gpus
            self._merged = (lists, alloc, unalloc)  # (the lists kept alive: their ids stay theirs)
            self._merged_ids = ids
        _, alloc, unalloc = self._merged
        view = _FreeView(free)
        self._rate = (view.idle(alloc) if alloc else 0, view.idle(unalloc) if unalloc else 0)
