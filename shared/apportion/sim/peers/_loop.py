"""What the three peer policies (``slurm``, ``kueue``, ``kai``) share: one cycle's scratch state,
an admission loop over the leaf budgets' pending lists, and a victim planner.

Only the order (which job next) and the victim rule (which runs may go) differ
between the peers; everything else is the engine's primitives, as the
baselines in :mod:`apportion.sim.baselines` use them: gang best fit on free
GPUs (:class:`apportion.domain.engine.placement.CycleFree`), ``JobPlaced`` with its
``Decision`` (:func:`~apportion.domain.engine.emit.emit_placed`),
``JobPreempted`` + ``StopWorkload`` with the grace period of ``EngineConfig``
(:func:`~apportion.domain.engine.emit.preempt_events`), the dispatcher's
follow-through (the preemptor starts when its victims have stopped; each
victim is requeued and resumes from its last checkpoint).

Pure: functions of the snapshot and the cycle time; no wall clock, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from apportion.domain.budgets import ancestors_of
from apportion.domain.cluster import UNTIL_STARTED, Run, RunKey, work_lost_gpu_s
from apportion.domain.engine.cycle import CycleSnapshot
from apportion.domain.engine.emit import emit_placed, pending_start_events, preempt_events
from apportion.domain.engine.inputs import EngineConfig, PendingJob, allocated_count
from apportion.domain.engine.placement import CycleFree
from apportion.domain.engine.shapes import blocked_run
from apportion.domain.nodes import COUNTED_STATES
from apportion.domain.preemption import branches_of
from apportion.events import Event, Placement, Victim
from apportion.sim.capacity import Shape, add_blocked, is_blocked, largest_free
from apportion.timeutil import Micros, from_us

__all__ = [
    "Cycle",
    "PeerPolicy",
    "Seg",
    "admission_loop",
    "capacity_gpus",
    "leaf_segments",
    "may_fit",
    "plan_victims",
    "run_gpus",
    "subtree_sums",
    "take_in_turn",
    "victim_order",
]


def capacity_gpus(snapshot: CycleSnapshot) -> int:
    """GPUs of the ``ready`` and ``draining`` nodes (the capacity quotas are cut from, as ``static``)."""
    return sum(n.gpu_count for n in snapshot.cluster.nodes.values() if n.state in COUNTED_STATES)


def run_gpus(run: Run) -> int:
    """GPUs a run holds now: g x its open replicas."""
    return run.gpus_per_replica * len(run.open_replicas)


class Cycle:
    """One cycle's scratch state (the snapshot is never written).

    Attributes:
        snapshot, now: the cycle's inputs (µs UTC).
        cfg: the engine knobs with the peer's ``policy_version``.
        free: this cycle's copy of the free index (placements take from it).
        out: events emitted so far, in order.
        held: leaf -> GPUs of its non-stopping runs, plus this cycle's placements, minus this cycle's victims.
        runs: leaf -> its non-stopping runs (victim candidates), in run-key order.
        taken: runs chosen as victims in this cycle.
        no_fit: shapes known not to fit on free GPUs for the rest of the cycle (free GPUs only shrink).
        considered: jobs looked at so far (a decision's ``rank``).
    """

    def __init__(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig, policy: str) -> None:
        self.snapshot = snapshot
        self.now = now_us
        self.ts = from_us(now_us)
        self.cfg = replace(config, preemption=True, policy_version=policy)
        self.free = CycleFree(snapshot.cluster, snapshot.free)
        self.out: list[Event] = []
        self.held: dict[str, int] = {}
        self.runs: dict[str, list[Run]] = {}
        for key in sorted(snapshot.cluster.runs):
            run = snapshot.cluster.runs[key]
            if run.stopping:
                continue
            self.held[run.budget] = self.held.get(run.budget, 0) + run_gpus(run)
            self.runs.setdefault(run.budget, []).append(run)
        self.taken: set[RunKey] = set()
        self.no_fit: list[Shape] = []
        self.considered = 0
        self.largest = largest_free(self.free)

    def fit(self, job: PendingJob) -> list[str] | None:
        """Nodes for ``job`` on free GPUs (gang best fit), ``None`` when it does not fit (remembered)."""
        g, k, m = job.gpus_per_replica, job.replicas, job.gpu_model
        if g > self.largest or is_blocked(self.no_fit, g, k, m):
            return None
        nodes = self.free.fit(g, k, m)
        if nodes is None:
            add_blocked(self.no_fit, (g, k, m))
        return nodes

    def place_free(self, job: PendingJob, nodes: list[str], ratio: float = 0.0) -> None:
        """Place ``job`` on free GPUs of ``nodes``: ``JobPlaced`` then ``StartWorkload`` per replica."""
        pl = tuple(Placement(node_id=n, gpus=self.free.take(n, job.gpus_per_replica)) for n in nodes)
        emit_placed(self.out, job, pl, (), job.budget, self.considered, {}, ratio, False, self.ts, self.cfg)
        self.out.extend(pending_start_events(job, pl, self.ts, self.cfg.producer))
        self.held[job.budget] = self.held.get(job.budget, 0) + job.gpus
        self.largest = largest_free(self.free)

    def place_over(
        self, job: PendingJob, placements: tuple[Placement, ...], victims: list[Run], ratio: float = 0.0
    ) -> None:
        """Preempt ``victims`` (grace of the config) and place ``job`` on ``placements`` (it starts when they stop).

        A victim's audit record names rule ``unallocated`` or, for an allocated run,
        ``expired_behind`` (the two ids the event schema has); which peer rule allowed it
        is the decision's ``policy_version``.
        """
        recs = []
        for run in victims:
            self.taken.add(run.key)
            rule: Literal["unallocated", "expired_behind"] = "expired_behind" if run.allocated else "unallocated"
            until = run.protected_until_us
            vic = Victim(
                job_id=run.job_id,
                attempt=run.attempt,
                budget=run.budget,
                allocated=run.allocated,
                gpus=run.gpus,
                protected_until=from_us(until) if until is not None and until < UNTIL_STARTED else None,
                rule=rule,
                lost_gpu_s=work_lost_gpu_s(run, self.now),
            )
            recs.append(vic)
            self.out.extend(
                preempt_events(
                    run,
                    self.ts,
                    self.cfg.grace_s,
                    self.cfg.producer,
                    victim=vic,
                    by_job_id=job.job_id,
                    by_budget=job.budget,
                )
            )
            self.held[run.budget] = self.held.get(run.budget, 0) - run_gpus(run)
        emit_placed(
            self.out, job, placements, tuple(recs), job.budget, self.considered, {}, ratio, False, self.ts, self.cfg
        )
        self.held[job.budget] = self.held.get(job.budget, 0) + job.gpus
        self.largest = largest_free(self.free)

    def candidates(self, leaf: str) -> list[Run]:
        """The leaf's runs that may still be chosen as victims in this cycle (not taken, not stopping)."""
        taken = self.taken
        return [r for r in self.runs.get(leaf, ()) if r.key not in taken]


def plan_victims(
    cyc: Cycle, job: PendingJob, accepted: Iterable[Run], nodes: Container[str] | None = None
) -> tuple[tuple[Placement, ...], list[Run]] | None:
    """Victims and placements for ``job`` from runs the peer's rule accepts, in the peer's order; ``None`` if none fit.

    Takes runs from ``accepted`` one at a time (the peer's generator applies its
    own rule to each, with the earlier ones provisionally gone) until the gang
    fits: k distinct eligible nodes (``ready``, not reserved, the model, at least
    g GPUs) each with g GPUs free or held by accepted runs. Then, as Kueue's
    "minimum number of preemptions" step (KEP-1714), only what the placement
    needs stays: the k nodes needing fewest victim GPUs (nodes with g free GPUs
    need none; ties by node id), and on each node the accepted runs in order
    until g GPUs are there, minus any that turn out unnecessary. Every peer
    rule here is monotone in the victims removed (a victim's queue with fewer
    runs gone is only further above its share), so the subset still obeys it.
    The free index is updated (the job's free GPUs taken) only when a plan is
    returned. ``nodes``: only these nodes may hold the job (``None``: any).
    """
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    free = cyc.free
    fmodel, fcount, ffree, reserved = free.model, free.count, free.free, free.reserved

    def eligible(nid: str) -> bool:
        return (
            nid in fmodel
            and nid not in reserved
            and fcount[nid] >= g
            and (model is None or fmodel[nid] == model)
            and (nodes is None or nid in nodes)
        )

    ready = sorted(n for n in fmodel if eligible(n) and len(ffree[n]) >= g)
    n_ok = len(ready)
    avail: dict[str, int] = {}
    on_node: dict[str, list[tuple[Run, tuple[int, ...]]]] = {}
    for run in accepted:
        for r in sorted(run.open_replicas):
            p = run.placements[r]
            nid = p.node_id
            if not eligible(nid):
                continue
            before = avail.get(nid, len(ffree[nid]))
            avail[nid] = before + len(p.gpus)
            on_node.setdefault(nid, []).append((run, p.gpus))
            if before < g <= avail[nid]:
                n_ok += 1
        if n_ok >= k:
            break
    else:
        return None
    options: list[tuple[int, str, list[tuple[Run, tuple[int, ...]]]]] = [(0, n, []) for n in ready[:k]]
    for nid, lst in on_node.items():
        have = len(ffree[nid])
        if have >= g or avail[nid] < g:
            continue
        chosen = []
        got = have
        for x in lst:
            if got >= g:
                break
            chosen.append(x)
            got += len(x[1])
        for x in list(reversed(chosen)):
            if got - len(x[1]) >= g:
                chosen.remove(x)
                got -= len(x[1])
        options.append((sum(len(x[1]) for x in chosen), nid, chosen))
    options.sort(key=lambda o: (o[0], o[1]))
    best = options[:k]
    placements = []
    victims: dict[RunKey, Run] = {}
    for _, nid, chosen in sorted(best, key=lambda o: o[1]):
        gpus = list(free.take(nid, min(g, len(ffree[nid]))))
        extra = sorted(x for _, gs in chosen for x in gs)
        gpus.extend(extra[: g - len(gpus)])
        placements.append(Placement(node_id=nid, gpus=tuple(sorted(gpus))))
        for run, _ in chosen:
            victims.setdefault(run.key, run)
            for p in run.placements:
                free.log.append(p.node_id)
    return tuple(placements), [victims[key] for key in sorted(victims)]


def victim_pools(
    cyc: Cycle,
    job: PendingJob,
    branch_ok: Callable[[str, str], bool],
    run_ok: Callable[[Run], bool] = lambda run: True,
) -> dict[str, list[Run]] | None:
    """Each queue's candidate victims for ``job`` in victim order (:func:`victim_order`), or ``None`` when
    even all of them could not make room (too few GPUs, or no k nodes: :func:`may_fit`).

    The preemptor's own leaf offers its unallocated runs (preemption by priority within the queue); another
    leaf offers the runs ``run_ok`` accepts when ``branch_ok(victim branch, preemptor branch)`` holds for the
    branches below their lowest common ancestor (a peer's test that its rule can ever accept a run there).
    """
    x = job.budget
    pools: dict[str, list[Run]] = {}
    reach = 0
    for leaf in cyc.runs:
        if leaf == x:
            cands = [r for r in cyc.candidates(leaf) if not r.allocated]
        else:
            br = branches_of(leaf, x)
            if br is None or not branch_ok(br[1], br[2]):
                continue
            cands = [r for r in cyc.candidates(leaf) if run_ok(r)]
        if cands:
            pools[leaf] = victim_order(cands)
            reach += sum(run_gpus(r) for r in cands)
    if reach + sum(len(f) for f in cyc.free.free.values()) < job.gpus:
        return None
    if not may_fit(cyc, job, (r for lst in pools.values() for r in lst)):
        return None
    return pools


def may_fit(cyc: Cycle, job: PendingJob, runs: Iterable[Run]) -> bool:
    """Whether ``job``'s gang could fit if every run of ``runs`` went (a bound checked before a victim search).

    k eligible nodes (as :func:`plan_victims`) each with at least g GPUs free or held by those runs.
    """
    g, k, model = job.gpus_per_replica, job.replicas, job.gpu_model
    free = cyc.free
    fmodel, fcount, ffree, reserved = free.model, free.count, free.free, free.reserved
    avail: dict[str, int] = {}
    for run in runs:
        for r in run.open_replicas:
            p = run.placements[r]
            avail[p.node_id] = avail.get(p.node_id, 0) + len(p.gpus)
    ok = 0
    for nid in fmodel:
        if nid in reserved or fcount[nid] < g or (model is not None and fmodel[nid] != model):
            continue
        if len(ffree[nid]) + avail.get(nid, 0) >= g:
            ok += 1
            if ok >= k:
                return True
    return False


@dataclass
class Seg:
    """A leaf's pending jobs ``jobs[lo:hi]`` in the order the peer walks them, with a cursor.

    ``preempt``: allocated jobs of the segment may preempt (the peer's planner is
    asked when one does not fit on free GPUs); unallocated jobs never do.
    """

    leaf: str
    jobs: Sequence[PendingJob]
    lo: int
    hi: int
    preempt: bool = True
    split: int = -1
    """Jobs before ``split`` are allocated, the rest unallocated (``-1``: ``hi`` when ``preempt``, else ``lo``)."""
    pos: int = field(init=False)
    ver: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.pos = self.lo
        if self.split < 0:
            self.split = self.hi if self.preempt else self.lo


def leaf_segments(snapshot: CycleSnapshot, split: bool) -> tuple[list[Seg], list[Seg]]:
    """Each leaf's pending list as segments, leaves in path order.

    ``split``: ``(allocated parts, unallocated parts)``, each a segment of its own;
    else ``(whole lists, [])`` (allocated jobs first within a leaf: the list's order,
    :func:`apportion.domain.engine.inputs.pending_order`). Leaves not in the tree are skipped.
    """
    tree = snapshot.tree
    alloc: list[Seg] = []
    unalloc: list[Seg] = []
    for leaf in sorted(snapshot.pending):
        lst = snapshot.pending[leaf]
        if not lst or leaf not in tree or not tree.is_leaf(leaf):
            continue
        b = allocated_count(lst)
        if not split:
            alloc.append(Seg(leaf, lst, 0, len(lst), split=b))
            continue
        if b:
            alloc.append(Seg(leaf, lst, 0, b))
        if b < len(lst):
            unalloc.append(Seg(leaf, lst, b, len(lst), preempt=False))
    return alloc, unalloc


Planner = Callable[[Cycle, PendingJob], "tuple[tuple[Placement, ...], list[Run]] | None"]


def admission_loop(
    cyc: Cycle,
    segs: list[Seg],
    key: Callable[[Seg, PendingJob], Any],
    planner: Planner | None,
    ratio: Callable[[str], float] = lambda leaf: 0.0,
) -> None:
    """Place jobs of ``segs``, always the head of the segment with the smallest ``key`` next, until none can go.

    The key of a segment is asked for its current head job whenever the segment
    is (re)queued: after one of its jobs is placed or passed over, and, for the
    segments of a leaf whose runs were preempted, after a preemption (their
    key may have improved; stale heap entries are dropped by version).

    A head job is placed on free GPUs if it fits; else, if it is allocated, its
    segment may preempt and ``planner`` is given, the planner is asked for
    victims. A leaf whose planner search failed once in this cycle does not
    search again in this cycle (Kueue and KAI consider one head per queue per
    attempt; this bounds the searches per cycle by the leaves). Jobs whose shape
    cannot be placed any more in this cycle (wider than any node's free GPUs,
    or covering a shape that failed) are passed over in runs, by a byte search
    over the list's shape codes (:func:`apportion.domain.engine.shapes.blocked_run`).
    A job that cannot be placed does not block the ones behind it (backfill).
    """
    memo = cyc.snapshot.memo
    no_search: set[str] = set()
    by_leaf: dict[str, list[int]] = {}
    heap: list[tuple[Any, int, int]] = []
    for i, s in enumerate(segs):
        by_leaf.setdefault(s.leaf, []).append(i)

    def blocked(g: int, k: int, m: str | None) -> bool:
        return g > cyc.largest or is_blocked(cyc.no_fit, g, k, m)

    def skip(s: Seg) -> None:
        if s.pos >= s.hi:
            return
        if s.pos < s.split and s.preempt and planner is not None and s.leaf not in no_search:
            return  # an allocated job that may preempt: looked at one by one
        s.pos += blocked_run(s.jobs, s.pos, s.hi, blocked, memo)

    def push(i: int) -> None:
        s = segs[i]
        skip(s)
        if s.pos < s.hi:
            s.ver += 1
            heapq.heappush(heap, (key(s, s.jobs[s.pos]), i, s.ver))

    for i in range(len(segs)):
        push(i)
    while heap:
        if cyc.largest == 0 and planner is None:
            return
        _, i, ver = heapq.heappop(heap)
        s = segs[i]
        if ver != s.ver or s.pos >= s.hi:
            continue
        job = s.jobs[s.pos]
        s.pos += 1
        cyc.considered += 1
        nodes = cyc.fit(job)
        if nodes is not None:
            cyc.place_free(job, nodes, ratio(s.leaf))
            push(i)
            continue
        if job.allocated and s.preempt and planner is not None and s.leaf not in no_search:
            plan = planner(cyc, job)
            if plan is not None:
                placements, victims = plan
                cyc.place_over(job, placements, victims, ratio(s.leaf))
                for leaf in sorted({v.budget for v in victims} - {s.leaf}):
                    for j in by_leaf.get(leaf, ()):
                        if segs[j].pos < segs[j].hi:
                            push(j)
            else:
                no_search.add(s.leaf)
        push(i)


def victim_order(runs: Iterable[Run]) -> list[Run]:
    """Runs of one queue in the order Kueue and KAI take victims within it: lower priority
    (unallocated) first, then the most recently started (least work lost), then run key."""
    return sorted(runs, key=lambda r: (r.allocated, -(r.started_at_us or r.placed_at_us), r.key))


class PeerPolicy:
    """A peer's cycle function, ``(snapshot, now_us, config) -> events``, with per-simulation memory.

    Slurm keeps decayed usage across cycles; the others keep nothing. The memory
    belongs to one simulation: it is reset when a cycle comes from another
    dispatcher state (its live run table, ``snapshot.cluster.runs``, is another
    object; the dispatcher hands the live view because of
    ``reads_snapshot_only``, so the table is the same object for a whole run).
    Two simulations interleaved on one instance would reset each other: build
    one instance per simulation for that (the registry's instances serve runs
    one after the other, as the CLI and the tests do).
    """

    reads_snapshot_only = True
    name = "peer"

    def __init__(self) -> None:
        self._sim: object | None = None

    def reset(self) -> None:
        """Forget what earlier cycles taught (a new simulation)."""

    def __call__(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        runs = snapshot.cluster.runs
        if runs is not self._sim:
            self._sim = runs
            self.reset()
        return self.cycle(snapshot, now_us, config)

    def cycle(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        """One scheduling cycle (the peer's own)."""
        raise NotImplementedError


def take_in_turn(
    pools: dict[str, list[Run]],
    rank: Callable[[str], Any],
    allowed: Callable[[Run], bool],
    on_take: Callable[[Run], None],
    last: str | None = None,
) -> Iterator[Run]:
    """Victims one at a time, each from the queue that ``rank`` puts highest now (KEP-1714's "biggest offender").

    ``pools``: leaf -> its candidate runs in the queue's own victim order
    (:func:`victim_order`); a run taken is removed from its list, so a second
    call (the next strategy) sees only the rest. At each step the queue with
    the largest ``rank(leaf)`` (ties: the smaller path) among those with runs
    left is asked; its first run in order that ``allowed`` accepts is yielded
    after ``on_take`` (the caller's provisional accounting); a queue none of
    whose runs is accepted is dropped for this call. A run refused once is not
    asked again in the same call (the rules are monotone in the victims taken). ``last``: a queue asked
    only once every other is exhausted or dropped (the preemptor's own queue:
    within-queue preemption by priority comes after reclaiming from others).
    """
    dropped: set[str] = set()
    pos: dict[str, int] = {}  # runs before it in a pool were refused in this call: the peers' rules are
    # monotone in the victims taken (a queue only loses usage), so a refusal holds for the rest of the call
    while True:
        best: str | None = None
        best_rank: Any = None
        for leaf in sorted(pools):
            if leaf == last or leaf in dropped or pos.get(leaf, 0) >= len(pools[leaf]):
                continue
            r = rank(leaf)
            if best is None or r > best_rank:
                best, best_rank = leaf, r
        if best is None:
            if last is None or last in dropped or last not in pools or pos.get(last, 0) >= len(pools[last]):
                return
            best = last
        lst = pools[best]
        i = pos.get(best, 0)
        while i < len(lst) and not allowed(lst[i]):
            i += 1
        pos[best] = i
        if i < len(lst):
            run = lst.pop(i)
            on_take(run)
            yield run
        else:
            dropped.add(best)


def subtree_sums(values: dict[str, float] | dict[str, int]) -> dict[str, float]:
    """Path -> the sum of ``values`` (per leaf) over the leaves at or below it (every ancestor of a leaf gets it)."""
    out: dict[str, float] = {}
    for leaf, v in values.items():
        for a in ancestors_of(leaf):
            out[a] = out.get(a, 0.0) + v
    return out
