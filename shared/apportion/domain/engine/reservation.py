"""Reservations (rule D3.scheduling-cycle): where a long-blocked job reserves, and when it could start there.

The highest-ranked blocked allocated job that has waited at least
``reservation_after`` reserves k nodes (:func:`reservation_nodes`); jobs
ranked below it may still use the reserved free GPUs as
:func:`~apportion.domain.preemption.backfill_rule` allows, judged against
the holder's earliest possible start (:func:`earliest_fit_us`): a
reservation never idles GPUs. Reservations are recomputed every cycle from
the snapshot, so they need no events and replay identically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence, Set

from apportion.domain.cluster import PROTECTION_UNTIL_DONE_S, UNTIL_STARTED, ClusterSnapshot, Run, RunKey
from apportion.domain.engine.placement import CycleFree, topology_pick
from apportion.timeutil import Micros, s_to_us

__all__ = [
    "earliest_fit_us",
    "hero_sheltered",
    "node_fit_us",
    "protection_end_us",
    "reservation_nodes",
    "share_covers",
    "soonest_nodes",
    "untakable_nodes",
]

_UNTIL_DONE_US = s_to_us(PROTECTION_UNTIL_DONE_S)  # a run protected until it completes: no known end


def share_covers(gpus: int, share: float, capacity_gpus: int) -> bool:
    """Rule ``D3.hero-cover``: a budget of absolute share ``share`` covers a job of ``gpus`` GPUs on a cluster
    of ``capacity_gpus``: ``g x k <= abs(b) x C(t)``. A job it does not cover neither reserves nodes nor preempts
    busy allocated runs (its reservation and preemption search in :mod:`apportion.domain.engine.cycle`).

    >>> share_covers(4096, 0.30, 16384), share_covers(8192, 0.10, 16384), share_covers(1638, 0.10, 16384)
    (True, False, True)
    """
    return gpus <= share * capacity_gpus


def hero_sheltered(gpus: int, share: float, capacity_gpus: int, ratio: float, hero_min_gpus: int | None) -> bool:
    """Rule ``D3.hero-cover``, the victims' clause: an allocated run of ``gpus`` GPUs (at least ``hero_min_gpus``)
    that its budget's share covers (:func:`share_covers`), of a budget within its share (``ratio`` r <= 1 in the
    cycle's view), is a preemption victim only when no feasible victim set without such a run exists (the
    preemption search, :func:`~apportion.domain.engine.search.plan_preemption`).

    >>> hero_sheltered(4096, 0.25, 16384, 1.0, 1024), hero_sheltered(4096, 0.25, 16384, 1.01, 1024)
    (True, False)
    >>> hero_sheltered(8192, 0.25, 16384, 0.5, 1024), hero_sheltered(512, 0.25, 16384, 0.5, 1024)
    (False, False)
    """
    if hero_min_gpus is None or gpus < hero_min_gpus:
        return False
    return share_covers(gpus, share, capacity_gpus) and ratio <= 1.0


def protection_end_us(run: Run) -> Micros:
    """When an allocated ``run``'s protection ends, µs UTC, as a reservation counts it: from its start
    (:attr:`Run.protected_until_us`), or for a run not yet started from its placement (earlier: a lower
    bound); :data:`~apportion.domain.cluster.UNTIL_STARTED` for a run protected until it completes (no
    known end)."""
    if run.protection_us is not None and run.protection_us >= _UNTIL_DONE_US:
        return UNTIL_STARTED
    until = run.protected_until_us
    if until is None or until >= UNTIL_STARTED:
        length = run.min_runtime_us if run.protection_us is None else run.protection_us
        until = run.placed_at_us + length
    return until


def untakable_nodes(
    cluster: ClusterSnapshot,
    now_us: Micros,
    taken: Set[RunKey],
    may_take: Callable[[Run, Micros], bool],
    placed: Sequence[Run] = (),
) -> set[str]:
    """Rule ``D3.hero-cover``'s reservation clause (``EngineConfig.hero_reserve_takable``): the nodes holding an
    allocated run (open, not stopping, not ``taken`` in this cycle; ``placed``: those placed earlier in the cycle)
    that a covered hero holder may not take back once its protection ends (``may_take(run, protection end)``
    false), or that is protected until it completes. On such a node :func:`earliest_fit_us` knows no time to
    fit, so a reservation holding it would be dropped and lower-ranked work would keep landing on all its nodes;
    the holder reserves among the other nodes instead (:func:`reservation_nodes`' ``exclude``)."""
    out: set[str] = set()
    runs = list(cluster.runs.values())
    runs.extend(placed)
    for run in runs:
        if run.stopping or not run.allocated or run.key in taken or not run.open_replicas:
            continue
        until = protection_end_us(run)
        if until >= UNTIL_STARTED or not may_take(run, max(until, now_us)):
            out.update(run.placements[r].node_id for r in run.open_replicas)
    return out


def earliest_fit_us(
    cluster: ClusterSnapshot,
    nodes: Sequence[str],
    g: int,
    now_us: Micros,
    taken: set[RunKey] | frozenset[RunKey],
    may_take: Callable[[Run, Micros], bool] | None = None,
    placed: Sequence[Run] = (),
) -> Micros:
    """A lower bound of when a reservation's holder can start on its ``nodes``, µs UTC (rule D3.scheduling-cycle).

    Per node (:func:`node_fit_us`): the GPUs not held by running allocated runs are available now
    (free, unallocated work - evicted the moment the holder can start -,
    stopping runs and runs preempted in this cycle (``taken``), all counted
    as now: a lower bound). ``placed``: the runs placed earlier in this
    cycle (not in ``cluster`` yet), counted as the cluster's runs are: an
    allocated one holds its GPUs until its protection ends, as any run not
    yet started. (Counted as available now, they made the holder's fit
    time now although it could not start: no allocated job's protection
    ends by now, so none could use the GPUs the reservation lends, and
    what unallocated work left of them idled while such jobs waited.) An
    allocated run's GPUs become available no earlier than its protection ends
    (:attr:`Run.protected_until_us`; for a run not yet started, its
    placement time plus its protection, which is earlier), and then only
    when the holder may take them back (``may_take(run, protection end)``:
    :func:`~apportion.domain.preemption.victim_rule` at that time; a run of
    its own leaf, or of a budget not behind it by delta, is never taken
    back and frees its GPUs only when it ends, which the engine cannot
    know: never, for this bound). ``may_take=None`` takes every run back.
    The node fits the holder (``g`` GPUs) at the first time enough are
    available; the holder needs all of its nodes, so the answer is the
    latest of them.

    Returns ``now_us`` when every node fits now, and ``2**62``
    (:data:`~apportion.domain.cluster.UNTIL_STARTED`) when a node has no
    known time to fit (fewer than ``g`` GPUs, or runs the holder may not take).
    """
    latest = now_us
    here = _placed_by_node(placed)
    for nid in nodes:
        t = node_fit_us(cluster, nid, g, now_us, taken, may_take, here.get(nid, ()))
        if t >= UNTIL_STARTED:
            return UNTIL_STARTED  # no known time for this node: none for the holder (the other nodes need not be read)
        if t > latest:
            latest = t
    return max(latest, now_us)


def _placed_by_node(placed: Sequence[Run]) -> dict[str, list[Run]]:
    """node -> the runs of ``placed`` with an open replica there (each run once per node)."""
    out: dict[str, list[Run]] = {}
    for run in placed:
        for nid in dict.fromkeys(run.placements[r].node_id for r in run.open_replicas):
            out.setdefault(nid, []).append(run)
    return out


def node_fit_us(
    cluster: ClusterSnapshot,
    nid: str,
    g: int,
    now_us: Micros,
    taken: Set[RunKey],
    may_take: Callable[[Run, Micros], bool] | None,
    placed: Sequence[Run] = (),
) -> Micros:
    """When node ``nid`` first has ``g`` GPUs for a reservation's holder, µs UTC, as :func:`earliest_fit_us`
    counts it (``placed``: the runs placed earlier in the cycle with a replica on this node); at most ``now_us``
    when it fits now, :data:`~apportion.domain.cluster.UNTIL_STARTED` when it has no known time to fit."""
    node = cluster.nodes[nid]
    held: list[tuple[Micros, int]] = []
    busy = 0
    runs = cluster.runs
    here = [runs.get(key) for key in cluster.node_runs.get(nid, ())]
    here.extend(placed)
    for run in here:
        if run is None or run.stopping or not run.allocated or run.key in taken:
            continue
        n = sum(len(run.placements[r].gpus) for r in run.open_replicas if run.placements[r].node_id == nid)
        until = protection_end_us(run)
        if until < UNTIL_STARTED and may_take is not None and not may_take(run, max(until, now_us)):
            until = UNTIL_STARTED  # its GPUs come back when it ends: no known time
        held.append((until, n))
        busy += n
    avail = node.gpu_count - busy
    if avail >= g:
        return now_us
    for until, n in sorted(held):
        avail += n
        if avail >= g:
            return until
    return UNTIL_STARTED


def soonest_nodes(
    cluster: ClusterSnapshot,
    free: CycleFree,
    g: int,
    k: int,
    model: str | None,
    now_us: Micros,
    taken: Set[RunKey],
    may_take: Callable[[Run, Micros], bool],
    placed: Sequence[Run] = (),
    bound: str | None = None,
) -> list[str]:
    """Rule ``D3.hero-waits``: the k eligible nodes (not reserved, of ``model``, with at least g GPUs) that fit a
    waiting covered hero soonest (:func:`node_fit_us`, with ``may_take`` false for the runs it may never take,
    so a node holding one has no known time and is left out), ties by id; on labelled nodes (or with a
    ``bound``) the fewest blocks, then racks (:func:`~apportion.domain.engine.placement.topology_pick`) among
    the nodes that fit by the earliest time at which enough of them do. ``[]`` when fewer than k have a known
    time (or none within ``bound``)."""
    here = _placed_by_node(placed)
    count, reserved = free.count, free.reserved
    fits = []
    for nid, m in free.model.items():
        if nid in reserved or count[nid] < g or (model is not None and m != model):
            continue
        t = node_fit_us(cluster, nid, g, now_us, taken, may_take, here.get(nid, ()))
        if t < UNTIL_STARTED:
            fits.append((max(t, now_us), nid))
    if len(fits) < k:
        return []
    fits.sort()
    if k == 1 or (not free.place and bound is None):
        return [n for _, n in fits[:k]]
    for level in sorted({t for t, _ in fits[k - 1 :]}):
        got = topology_pick([n for t, n in fits if t <= level], k, free.place, bound)
        if got is not None:
            return got
    return []


def reservation_nodes(
    free: CycleFree,
    g: int,
    k: int,
    model: str | None,
    unalloc: Mapping[str, int] | None = None,
    bound: str | None = None,
    exclude: Set[str] = frozenset(),
) -> list[str]:
    """k eligible nodes for a blocked job: most GPUs available to it now first, ties by id.

    On labelled nodes (or for a job with a ``bound``), a gang (k > 1) takes
    the fewest blocks, then racks, among the nodes that free up soonest
    (:func:`_topology_reservation`, rule ``D1.topology``).

    Available: free, plus (``unalloc``: node -> GPUs) those of unallocated
    runs, which the holder evicts as soon as it can start; so a node whose
    free GPUs the reservation lent to unallocated work in the last cycle
    ranks as it did and the reservation stays put. Eligible: not reserved,
    not in ``exclude`` (rule ``D3.hero-cover``'s reservation clause:
    :func:`untakable_nodes`), the model matches, at least g GPUs. Nodes with
    c >= 1 free GPUs that are not reserved are exactly ``buckets[model][c]``,
    so without unallocated runs they are walked from the most free down;
    nodes with no free GPU are looked for only when fewer than k were found.
    """
    if k > 1 and (free.place or bound is not None):
        return _topology_reservation(free, g, k, model, unalloc or {}, bound, exclude)
    out: list[str] = []
    count = free.count
    if unalloc:
        ffree, reserved, fmodel = free.free, free.reserved, free.model
        avail: dict[str, int] = {}
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            for c in range(1, len(b)):
                for n in b[c]:
                    if count[n] >= g and n not in exclude:
                        avail[n] = c
        for n, u in unalloc.items():
            if (
                n in fmodel
                and n not in reserved
                and n not in exclude
                and count[n] >= g
                and (model is None or fmodel[n] == model)
            ):
                avail[n] = len(ffree[n]) + u
        out = [n for _, n in sorted((-a, n) for n, a in avail.items())[:k]]
        if len(out) == k:
            return out
        have = set(out)
        zero = sorted(
            n
            for n, m in fmodel.items()
            if n not in have
            and not ffree[n]
            and n not in reserved
            and n not in exclude
            and (model is None or m == model)
            and count[n] >= g
        )
        out.extend(zero[: k - len(out)])
        return out
    several = model is None and len(free.buckets) > 1
    for c in range(free.maxc, 0, -1):
        cand: list[str] = []
        for m, b in free.buckets.items():
            if model is not None and m != model:
                continue
            cand.extend(n for n in b[c] if count[n] >= g and n not in exclude)
        if cand:
            if several:
                cand.sort()
            out.extend(cand[: k - len(out)])
            if len(out) == k:
                return out
    ffree, reserved = free.free, free.reserved
    zero = sorted(
        n
        for n, m in free.model.items()
        if not ffree[n] and n not in reserved and n not in exclude and (model is None or m == model) and count[n] >= g
    )
    out.extend(zero[: k - len(out)])
    return out


def _topology_reservation(
    free: CycleFree,
    g: int,
    k: int,
    model: str | None,
    unalloc: Mapping[str, int],
    bound: str | None,
    exclude: Set[str] = frozenset(),
) -> list[str]:
    """k eligible nodes on the fewest blocks, then racks, among those with the most GPUs available now
    (rule ``D1.topology``): the candidates are the nodes with at least ``a`` available (free, plus
    ``unalloc``'s), for ``a`` from the most any node has down to 0; the first ``a`` whose candidates hold
    the gang (within ``bound``, if any) gives :func:`~apportion.domain.engine.placement.topology_pick`'s
    choice among them (candidates in order of most available, ties by id), ``exclude``'s nodes left out. ``[]``
    when no set holds it."""
    ffree, reserved, fmodel, count = free.free, free.reserved, free.model, free.count
    avail = sorted(
        (-(len(ffree[n]) + unalloc.get(n, 0)), n)
        for n, m in fmodel.items()
        if n not in reserved and n not in exclude and count[n] >= g and (model is None or m == model)
    )
    if len(avail) < k:
        return [n for _, n in avail] if bound is None else []
    levels = sorted({-a for a, _ in avail[k - 1 :]}, reverse=True)
    for level in levels:
        cands = [n for a, n in avail if -a >= level]
        got = topology_pick(cands, k, free.place, bound)
        if got is not None:
            return got
    return []
