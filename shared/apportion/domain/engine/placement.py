"""Free capacity and best fit (rule D3.placement).

Free GPUs of the ``ready`` nodes are indexed by (GPU model, free GPU count)
-> sorted node ids, so a fit is a walk over at most 9 buckets, not all
nodes. :class:`FreeIndex` is the index kept across cycles by the caller
(``DispatchState``); :class:`CycleFree` is one cycle's copy, which the cycle
changes (GPUs taken, nodes reserved). Best fit: nodes with the fewest free
GPUs that fit, ties by node id; within a node the lowest free GPU indices.
A job without a model constraint tries nodes of models no waiting job asks
for first (:func:`spare_models`).

Topology (rule ``D1.topology``): when nodes carry ``block``/``rack``
labels, a gang of k > 1 replicas is spread over the fewest blocks, and
within them the fewest racks (:func:`topology_pick`); best fit orders the
nodes inside each rack and picks the tightest group that holds the rest. A
cluster without labels places exactly as before.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping, Sequence
from operator import attrgetter

from apportion.domain.cluster import ClusterSnapshot, ClusterState, Node
from apportion.domain.engine.inputs import PendingJob

__all__ = ["CycleFree", "FreeIndex", "spare_models", "topology_pick"]

_MODEL = attrgetter("gpu_model")


def spare_models(models: Sequence[str | None], pending: Mapping[str, Sequence[PendingJob]]) -> list[str | None] | None:
    """Models a job without a model constraint should try first (rule D3.scheduling-cycle), or ``None``.

    "Jobs without a model constraint prefer nodes of models that no waiting
    job asks for, so scarce models stay free for the jobs that need them":
    the models of ``models`` that no job of ``pending`` names, sorted (an
    unknown model, ``None``, is never asked for). ``None`` (no preference)
    when no job names a model of ``models`` or every model is asked for.
    """
    present = {m for m in models if m is not None}
    if not present:
        return None
    asked: set[str] = set()
    for jobs in pending.values():
        asked.update(m for m in map(_MODEL, jobs) if m is not None)
        if present <= asked:
            return None
    if not (present & asked):
        return None
    return sorted((m for m in models if m not in asked), key=lambda m: (m is not None, m or ""))


Place = tuple[str, str]
"""A labelled node's ``(block, rack)`` group keys (:func:`_place_of`)."""


def _place_of(n: Node) -> Place | None:
    """Group keys of a node's labels, or ``None`` for a node with neither label.

    A node without a block is a block of its own, one without a rack a rack
    of its own (keys that no label can equal: labels are never empty).
    """
    if n.block is None and n.rack is None:
        return None
    block = n.block if n.block is not None else "\x00" + n.node_id
    return block, (block + "\x00" + n.rack if n.rack is not None else "\x00" + n.node_id)


def _cover(groups: Mapping[str, list[str]], k: int) -> list[tuple[str, int]] | None:
    """Fewest groups holding ``k`` nodes: ``[(group, nodes taken)]``, or ``None`` when all hold fewer.

    One group holds them all: the smallest that does (best fit: larger
    groups stay whole for larger gangs), ties by key. Else the largest groups
    whole (ties by key) while none holds the rest, then the smallest that does.
    """
    left = sorted(groups, key=lambda g: (-len(groups[g]), g))
    out: list[tuple[str, int]] = []
    need = k
    while need > 0:
        if not left:
            return None
        fits = [g for g in left if len(groups[g]) >= need]
        if fits:
            g = min(fits, key=lambda x: (len(groups[x]), x))
            out.append((g, need))
            return out
        g = left.pop(0)
        out.append((g, len(groups[g])))
        need -= len(groups[g])
    return out


def topology_pick(
    cands: Sequence[str], k: int, place: Mapping[str, Place], bound: str | None = None
) -> list[str] | None:
    """k of ``cands`` (eligible nodes in best-fit order) on the fewest blocks, then racks (rule ``D1.topology``).

    Blocks are chosen by :func:`_cover`, then racks within each chosen block
    the same way, then nodes within each rack in ``cands``' order. ``bound``:
    ``"block"`` (``"rack"``) keeps the gang inside one block (rack), the
    tightest that holds it; ``None`` when none does. A node without labels
    is a block and a rack of its own.
    """
    if len(cands) < k:
        return None
    blocks: dict[str, list[str]] = {}
    racks: dict[str, list[str]] = {}
    for n in cands:
        b, r = place.get(n) or ("\x00" + n, "\x00" + n)
        blocks.setdefault(b, []).append(n)
        racks.setdefault(r, []).append(n)
    if bound == "rack":
        fits = [r for r, ns in racks.items() if len(ns) >= k]
        if not fits:
            return None
        return racks[min(fits, key=lambda r: (len(racks[r]), r))][:k]
    if bound == "block":
        fits = [b for b, ns in blocks.items() if len(ns) >= k]
        if not fits:
            return None
        b = min(fits, key=lambda x: (len(blocks[x]), x))
        chosen: list[tuple[str, int]] | None = [(b, k)]
    else:
        chosen = _cover(blocks, k)
    if chosen is None:
        return None
    out: list[str] = []
    for b, take in chosen:
        mine: dict[str, list[str]] = {}
        for n in blocks[b]:
            r = (place.get(n) or ("", "\x00" + n))[1]
            mine.setdefault(r, []).append(n)
        for r, m in _cover(mine, take) or ():
            out.extend(mine[r][:m])
    return out


FreeTuple = tuple[
    dict[str, list[int]],
    dict[str, str | None],
    dict[str, int],
    dict[str | None, list[list[str]]],
    int,
    dict[str, Place],
]
"""``(free, model, count, buckets, maxc, place)``: a free-capacity index's contents (:func:`_build_free`)."""


def _build_free(nodes: Mapping[str, Node], ids: Sequence[str]) -> FreeTuple:
    """``(free, model, count, buckets, maxc, place)`` of the ``ready`` nodes among ``ids`` (sorted);
    ``place``: the labelled ones' group keys (:func:`_place_of`)."""
    fr: dict[str, list[int]] = {}
    mo: dict[str, str | None] = {}
    co: dict[str, int] = {}
    bk: dict[str | None, list[list[str]]] = {}
    pl: dict[str, Place] = {}
    maxc = 0
    for nid in ids:
        n = nodes[nid]
        if n.state != "ready":
            continue
        p = _place_of(n)
        if p is not None:
            pl[nid] = p
        mo[nid] = n.gpu_model
        c = co[nid] = n.gpu_count
        if c > maxc:
            maxc = c
        b = bk.get(n.gpu_model)
        if b is None:
            b = bk[n.gpu_model] = []
        while len(b) <= c:
            b.append([])
        if n.free:
            f = fr[nid] = sorted(n.free)
            b[len(f)].append(nid)  # nid ascending: lists stay sorted
        else:
            fr[nid] = []
    for b in bk.values():
        while len(b) <= maxc:
            b.append([])
    return fr, mo, co, bk, maxc, pl


class FreeIndex:
    """Free capacity of the ``ready`` nodes, kept across cycles (the base a cycle copies).

    ``free[node]`` (sorted free GPU indices), ``model``, ``count`` (GPUs) and
    ``buckets[model][c]`` (sorted ids of nodes with exactly c free GPUs, c >= 1),
    ``maxc`` (most GPUs of a node), ``place`` (labelled nodes' topology keys):
    exactly what :func:`_build_free` gives for the cluster's nodes. :meth:`sync`
    re-reads only the nodes in ``ClusterState.changed_nodes``; a change of a
    node's state, model, GPU count or labels rebuilds from scratch (rare), a
    change of its free set moves it between buckets.
    """

    __slots__ = ("free", "model", "count", "buckets", "maxc", "place", "_cluster")

    def __init__(self) -> None:
        self.free: dict[str, list[int]] = {}
        self.model: dict[str, str | None] = {}
        self.count: dict[str, int] = {}
        self.buckets: dict[str | None, list[list[str]]] = {}
        self.maxc = 0
        self.place: dict[str, Place] = {}
        self._cluster: ClusterState | None = None

    def _rebuild(self, cluster: ClusterState) -> None:
        self.free, self.model, self.count, self.buckets, self.maxc, self.place = _build_free(
            cluster.nodes, sorted(cluster.nodes)
        )
        self._cluster = cluster
        cluster.changed_nodes = set()

    def sync(self, cluster: ClusterState) -> FreeIndex:
        """Update from ``cluster`` (a :class:`ClusterState`) and return self."""
        changed = cluster.changed_nodes
        if cluster is not self._cluster or changed is None:
            self._rebuild(cluster)
            return self
        if changed:
            nodes = cluster.nodes
            for nid in sorted(changed):
                n = nodes.get(nid)
                was = nid in self.model
                if (n is not None and n.state == "ready") != was:
                    self._rebuild(cluster)
                    return self
                if n is None or not was:
                    continue
                if (
                    self.model[nid] != n.gpu_model
                    or self.count[nid] != n.gpu_count
                    or self.place.get(nid) != _place_of(n)
                ):
                    self._rebuild(cluster)
                    return self
                old = self.free[nid]
                new = sorted(n.free)
                if old != new:
                    b = self.buckets[n.gpu_model]
                    if old:
                        lst = b[len(old)]
                        del lst[bisect_left(lst, nid)]
                    if new:
                        insort(b[len(new)], nid)
                    self.free[nid] = new
            changed.clear()
        return self

    def as_tuple(self) -> FreeTuple:
        """Contents for comparison with a rebuild (tests)."""
        return (self.free, self.model, self.count, self.buckets, self.maxc, self.place)


class CycleFree:
    """Free-capacity index of one cycle: (model, free count) -> sorted node ids.

    A copy of a :class:`FreeIndex` (``base``, the caller's, kept across cycles)
    or built from the snapshot's nodes; the cycle changes its copy only.
    """

    __slots__ = ("free", "model", "count", "buckets", "maxc", "place", "reserved", "log", "prefer")

    def __init__(self, cluster: ClusterSnapshot, base: FreeIndex | None = None) -> None:
        self.reserved: set[str] = set()
        #: models a job without a model constraint tries first (:func:`spare_models`), or None
        self.prefer: list[str | None] | None = None
        self.log: list[str] = []  # nodes changed this cycle (free taken, victims taken, reserved), in order
        if base is None:
            ids = cluster.order if cluster.order is not None else sorted(cluster.nodes)
            self.free, self.model, self.count, self.buckets, self.maxc, self.place = _build_free(cluster.nodes, ids)
        else:
            self.free = dict(base.free)  # the lists are replaced, never changed in place
            self.model, self.count, self.maxc, self.place = base.model, base.count, base.maxc, base.place  # read only
            self.buckets = {m: [list(x) for x in b] for m, b in base.buckets.items()}

    def fit(self, g: int, k: int, model: str | None, bound: str | None = None) -> list[str] | None:
        """k distinct nodes with >= g free GPUs, best fit (fewest free, then id).

        Without a model constraint, nodes of :attr:`prefer` (models no waiting
        job asks for) first; only when they cannot hold the job, all models.
        A gang (k > 1) on labelled nodes: the fewest blocks, then racks
        (:func:`topology_pick`); ``bound`` (``"block"``/``"rack"``): within one.
        """
        if model is None and self.prefer is not None:
            got = self._fit(g, k, self.prefer, bound)
            if got is not None:
                return got
        return self._fit(g, k, [model] if model is not None else list(self.buckets), bound)

    def _fit(self, g: int, k: int, models: list[str | None], bound: str | None = None) -> list[str] | None:
        if k > 1 and (self.place or bound is not None):
            return topology_pick([n for nodes in self._walk(g, models) for n in nodes], k, self.place, bound)
        picked: list[str] = []
        for nodes in self._walk(g, models):
            if nodes:
                need = k - len(picked)
                picked.extend(nodes[:need])
                if len(picked) == k:
                    return picked
        return None

    def _walk(self, g: int, models: list[str | None]) -> Iterator[list[str]]:
        """The unreserved nodes of ``models`` with c free GPUs, sorted by id, for c = g, g+1, ... (best-fit order)."""
        for c in range(g, self.maxc + 1):
            if len(models) == 1:
                b = self.buckets.get(models[0])
                if b is None:
                    return
                yield b[c]
            else:
                yield sorted(n for m in models if m in self.buckets for n in self.buckets[m][c])

    def _move(self, nid: str, old: int, new: int) -> None:
        b = self.buckets[self.model[nid]]
        if old and nid not in self.reserved:
            lst = b[old]
            del lst[bisect_left(lst, nid)]
        if new and nid not in self.reserved:
            insort(b[new], nid)

    def take(self, nid: str, n: int) -> tuple[int, ...]:
        """Take the n lowest free GPUs of ``nid``."""
        self.log.append(nid)
        f = self.free[nid]
        got, rest = f[:n], f[n:]
        self._move(nid, len(f), len(rest))
        self.free[nid] = rest
        return tuple(got)

    def reserve(self, nid: str) -> None:
        self.log.append(nid)
        f = self.free[nid]
        if f:
            self._move(nid, len(f), 0)
        self.reserved.add(nid)

    def unreserve_all(self) -> None:
        """Give the reserved nodes' free GPUs back to the buckets (for unallocated work, pass 2)."""
        for nid in sorted(self.reserved):
            self.log.append(nid)
            self.reserved.discard(nid)
            f = self.free[nid]
            if f:
                insort(self.buckets[self.model[nid]][len(f)], nid)

    def reserved_free(self) -> int:
        """Free GPUs on the reserved nodes."""
        return sum(len(self.free[n]) for n in self.reserved)

    def reserved_fits(self, g: int, model: str | None) -> bool:
        """Some reserved node of ``model`` (any when ``None``) has at least ``g`` free GPUs."""
        for n in self.reserved:
            if len(self.free[n]) >= g and (model is None or self.model[n] == model):
                return True
        return False

    def fit_with_reserved(self, g: int, k: int, model: str | None, bound: str | None = None) -> list[str] | None:
        """:meth:`fit` over the unreserved nodes and the reserved ones together (best fit, then id);
        ``bound`` as in :meth:`fit`."""
        if not self.reserved_fits(g, model):
            return self.fit(g, k, model, bound)
        cand: list[tuple[int, str]] = []
        models = [model] if model is not None else list(self.buckets)
        for c in range(g, self.maxc + 1):
            for m in models:
                b = self.buckets.get(m)
                if b is not None:
                    cand.extend((c, n) for n in b[c])
        for n in self.reserved:
            c = len(self.free[n])
            if c >= g and (model is None or self.model[n] == model):
                cand.append((c, n))
        if len(cand) < k:
            return None
        cand.sort()
        if k > 1 and (self.place or bound is not None):
            return topology_pick([n for _, n in cand], k, self.place, bound)
        return [n for _, n in cand[:k]]
