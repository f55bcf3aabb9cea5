"""Hierarchical fair share: usage ratios and the Fair-Tree-style order.

Formulas (design D2):

* entitlement ``E_b = abs(b) * K`` where ``K`` is the capacity integral over
  the window (GPU-seconds): :func:`entitlement`;
* usage ratio ``r_b = O_b / E_b``, with the named edge cases
  ``r = 0`` when ``O_b = E_b = 0`` (:data:`ZERO_USAGE`) and ``r = +inf``
  when ``E_b = 0 < O_b`` (:data:`OVER_NOTHING`);
* cold start (rule D2.cold-start): the capacity integral is floored at
  :data:`MIN_CAPACITY_GPU_S` (1 GPU-second), ``E_b = abs(b) * max(K, 1)``
  (:func:`effective_capacity`). Every budget shares the factor K, so the
  order by r is the order by ``O_b / abs(b)`` (occupancy per unit of
  share) at any K; the floor changes no ratio once one GPU has been up for
  one second, and below that it keeps an empty window's order exact: no
  ``+inf`` after the first provisional charge, no 0/0, so equal demand is
  split by share from the first cycle instead of by path.
* lower r is more under-used and is served first. This is Slurm Fair Tree's
  level fair share ``S / U`` turned upside down (``U / S``), so that equal
  usage against share compares equal across levels.
* order: at each tree node, children by ``(r, path)`` ascending; depth-first
  gives the order of leaf budgets. Because every ``E_b`` shares the same K,
  ``r_b = O_b / (abs(b) * K)``.
* provisional charge: after a job is placed within a cycle, its budget and
  every ancestor get ``g * k * min(min_runtime, W)`` added to O before the
  rest are ranked (:meth:`FairShareQueue.charge`), so one cycle does not
  hand everything to one budget.

Everything here is pure: inputs are the tree and occupancy numbers, outputs
are ratios and orders. Ties are broken by path, so the order is a
deterministic function of its inputs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from apportion.domain.budgets import ROOT, BudgetTree, ancestors_of, parent_of

INF = math.inf
ZERO_USAGE = 0.0
"""r when a budget has neither occupancy nor entitlement: it is owed nothing and owes nothing."""
OVER_NOTHING = INF
"""r when a budget has occupancy but no entitlement (zero share or zero capacity)."""

MIN_CAPACITY_GPU_S = 1.0
"""Floor of the capacity integral K in every ratio, GPU-seconds (cold start, rule D2.cold-start)."""

T = TypeVar("T")  # pragma: no mutate (its name string is read by nobody)


def effective_capacity(capacity_gpu_s: float) -> float:
    """The K every entitlement is computed from: ``max(K, MIN_CAPACITY_GPU_S)`` GPU-seconds.

    Cold start (rule D2.cold-start). With an empty or short window K is 0 or
    tiny; ``r = O / (abs * K)`` would then be ``+inf`` for every budget that
    has occupancy (or a provisional charge) and 0/0 for the others, and the
    order would fall back to the path tie-break. All budgets share K, so
    ranking by ``r`` is ranking by ``O_b / abs(b)`` at any K > 0; flooring K
    at 1 GPU-second keeps that exact order when K is below it, and changes
    no ratio once it is above. Two budgets at 0.5 asking for 8 single-GPU
    jobs on 8 free GPUs then alternate: 4 and 4.

    >>> effective_capacity(0.0), effective_capacity(0.25), effective_capacity(480.0)
    (1.0, 1.0, 480.0)
    """
    # `>=` would be the same function (at K = MIN both branches give MIN): an equivalent mutant
    return capacity_gpu_s if capacity_gpu_s > MIN_CAPACITY_GPU_S else MIN_CAPACITY_GPU_S  # pragma: no mutate


def entitlement(tree: BudgetTree, path: str, capacity_gpu_s: float) -> float:
    """Entitlement ``E_b = abs(b) * K`` of budget ``path`` in GPU-seconds (rule D2.entitlement).

    ``capacity_gpu_s`` is the capacity integral K over the window, GPU-seconds: the ratios pass it floored
    (:func:`effective_capacity`), the occupancy snapshot's rows report it as measured
    (:func:`apportion.domain.usage.usage_snapshot`). A path not in ``tree`` has abs share 0, so entitlement 0.

    >>> entitlement(BudgetTree.from_mapping({"a": {"share": 0.5}, "a/x": {"share": 0.5}}), "a/x", 4000.0)
    1000.0
    """
    return tree.abs_share(path) * capacity_gpu_s


def free_order_key(unallocated_gpus: int, abs_share: float) -> float:
    """Rank of a leaf for the free GPUs (rule D3.free-order): its unallocated GPUs in use per unit of share.

    With ``EngineConfig.free_order``, pass 2 of the cycle gives the next free GPUs to the leaf with unallocated
    work whose key is lowest, one job at a time (max-min fairness of the unallocated capacity), ties by the
    fair-share order. A leaf of share 0 ranks last (``+inf``), even with nothing in use.

    >>> free_order_key(4, 0.5), free_order_key(1, 0.1), free_order_key(0, 0.0)
    (8.0, 10.0, inf)
    """
    return unallocated_gpus / abs_share if abs_share > 0 else INF


def owner_headroom(abs_share: float, capacity_gpus: int, in_use_gpus: int) -> float:
    """GPUs a leaf at or under its share may still fill with its own unallocated work (rule D3.owner-free).

    Its share of the ready GPUs, ``abs_share * C(t)``, less the GPUs its runs hold (allocated and unallocated,
    not stopping, not preempted in this cycle) and those placed for it in this cycle. Its own unallocated runs
    count, so the headroom is not granted again each cycle. At most 0 means none; a leaf of share 0 has none.

    >>> owner_headroom(0.25, 256, 40), owner_headroom(0.25, 256, 64), owner_headroom(0.0, 256, 0)
    (24.0, 0.0, 0.0)
    """
    return abs_share * capacity_gpus - in_use_gpus


def usage_ratio(occupancy_gpu_s: float, entitlement_gpu_s: float) -> float:
    """Usage ratio ``r = O / E`` with the named edge cases.

    Args:
        occupancy_gpu_s: allocated occupancy O in the window, GPU-seconds (>= 0).
        entitlement_gpu_s: entitlement E in the window, GPU-seconds (>= 0).

    Returns:
        ``O / E`` when ``E > 0``; :data:`ZERO_USAGE` (0.0) when ``O <= 0`` and
        ``E <= 0``; :data:`OVER_NOTHING` (+inf) when ``E <= 0 < O``.
    """
    if entitlement_gpu_s > 0.0:
        return occupancy_gpu_s / entitlement_gpu_s
    return ZERO_USAGE if occupancy_gpu_s <= 0.0 else OVER_NOTHING


def ratios(tree: BudgetTree, occupancy: Mapping[str, float], capacity_gpu_s: float) -> dict[str, float]:
    """Usage ratio of every budget node.

    Args:
        tree: the budget tree.
        occupancy: allocated occupancy per budget path in GPU-seconds,
            already including descendants (missing paths count as 0).
        capacity_gpu_s: capacity integral K over the window, GPU-seconds
            (floored by :func:`effective_capacity`).

    Returns:
        ``{path: r}`` for every path in ``tree``.
    """
    k = effective_capacity(capacity_gpu_s)
    return {p: usage_ratio(occupancy.get(p, 0.0), entitlement(tree, p, k)) for p in tree.paths()}


def budget_order(tree: BudgetTree, occupancy: Mapping[str, float], capacity_gpu_s: float) -> tuple[str, ...]:
    """Leaf budgets in fair-share order (Fair Tree: DFS, children by ``(r, path)``).

    Args: as :func:`ratios`.

    Returns:
        Every leaf path of ``tree``, most under-used first.
    """
    return order_by_ratios(tree, ratios(tree, occupancy, capacity_gpu_s))


def order_by_ratios(tree: BudgetTree, r: Mapping[str, float]) -> tuple[str, ...]:
    """:func:`budget_order` from ratios already computed (``{path: r}`` for every path of ``tree``)."""
    # Depth-first with an explicit stack (children pushed in reverse order), so that a call
    # leaves no reference cycle behind (a recursive closure would: the cyclic GC's work).
    # Ties by path: children come sorted by path and the sort is stable, so sorting by r alone and
    # reversing pushes them by (r, path) descending, and they pop by (r, path) ascending.
    out: list[str] = []
    key = r.__getitem__
    stack = sorted(tree.children(ROOT), key=key)
    stack.reverse()
    children = tree.children
    while stack:
        node = stack.pop()
        kids = children(node)
        if kids:
            got = sorted(kids, key=key)
            got.reverse()
            stack.extend(got)
        else:
            out.append(node)
    return tuple(out)


def lowest_common_ancestor(a: str, b: str) -> str:
    """Deepest budget path that is an ancestor of (or equal to) both; ``""`` is the root."""
    pa, pb = a.split("/"), b.split("/")
    n = 0
    for x, y in zip(pa, pb):
        if x != y:
            break
        n += 1
    return "/".join(pa[:n])


def branches_at_lca(a: str, b: str) -> tuple[str, str, str]:
    """The LCA of two distinct budgets and the child of it on each one's path.

    ``branches_at_lca("lab/x/p", "lab/y") == ("lab", "lab/x", "lab/y")``.
    Used by the preemption rule: compare r of the two branches at the LCA.

    Raises:
        ValueError: one path is an ancestor of the other (or they are equal):
            there are no two branches to compare.
    """
    lca = lowest_common_ancestor(a, b)
    depth = 0 if lca == ROOT else lca.count("/") + 1
    pa, pb = a.split("/"), b.split("/")
    if len(pa) <= depth or len(pb) <= depth:
        raise ValueError(f"{a!r} and {b!r} are on one line of the tree: no branches to compare")
    return lca, "/".join(pa[: depth + 1]), "/".join(pb[: depth + 1])


class FairShareQueue(Generic[T]):
    """Incremental fair-share cursor for one scheduling cycle.

    Yields pending items (jobs) in the order (budget order, then each
    leaf's own item order), where the budget order is recomputed after each
    :meth:`charge` (the provisional charge of rule D2.provisional-charge). Items a
    caller takes and cannot place are simply not revisited (backfill walks
    on).

    Cost: each tree node keeps a heap of its active children keyed by
    ``(r, path)`` with lazy invalidation, so :meth:`charge` is O(depth * log
    fanout) and taking the next item is O(1) while the order is unchanged,
    else O(depth * log fanout). A cycle over 20,000 jobs in 200 leaves is a
    few tens of thousands of cheap steps.

    Args:
        tree: the budget tree.
        occupancy: allocated occupancy per path incl. descendants, GPU-seconds.
        capacity_gpu_s: capacity integral K, GPU-seconds.
        items_by_leaf: pending items per leaf path, each sequence already in
            the leaf's order (``submitted_at``, ``job_id``). Keys that are not
            leaves of ``tree`` are an error. The sequences are read in place,
            not copied: they must not change while the queue is in use.

    Raises:
        KeyError: an ``items_by_leaf`` key is not a leaf of ``tree``.
    """

    __slots__ = (
        "_tree",
        "_occ",
        "_cap",
        "_ent",
        "_ratio",
        "_queues",
        "_heaps",
        "_ver",
        "_active",
        "_current",
        "initial_order",
    )

    def __init__(
        self,
        tree: BudgetTree,
        occupancy: Mapping[str, float],
        capacity_gpu_s: float,
        items_by_leaf: Mapping[str, Sequence[T]],
    ) -> None:
        self._tree = tree
        self._cap = capacity_gpu_s = effective_capacity(capacity_gpu_s)
        paths = tree.paths()
        self._occ: dict[str, float] = {p: float(occupancy.get(p, 0.0)) for p in paths}
        # E of every path, once per cycle (a charge recomputes r from it)
        self._ent: dict[str, float] = {p: entitlement(tree, p, capacity_gpu_s) for p in paths}
        ent = self._ent
        self._ratio: dict[str, float] = {p: usage_ratio(o, ent[p]) for p, o in self._occ.items()}
        # leaf -> [items, next position]: a cursor, so that a cycle does not copy its queues
        self._queues: dict[str, list[Any]] = {}
        for leaf, items in items_by_leaf.items():
            if not tree.is_leaf(leaf):
                raise KeyError(f"{leaf!r} is not a leaf budget")
            if items:
                self._queues[leaf] = [items, 0]
        # activate nodes with pending work: each in its parent's heap at version 0 (the keys are unique,
        # so a heap made in one go pops in the same order as one pushed to node by node)
        self._active: set[str] = set()
        for leaf in self._queues:
            self._active.update(ancestors_of(leaf))
        self._ver: dict[str, int] = dict.fromkeys(self._active, 0)
        self._heaps: dict[str, list[tuple[float, str, int]]] = {}
        ratio = self._ratio
        for node in self._active:
            par = parent_of(node)
            heap = self._heaps.get(par)
            if heap is None:
                self._heaps[par] = [(ratio[node], node, 0)]
            else:
                heap.append((ratio[node], node, 0))
        for heap in self._heaps.values():
            heapq.heapify(heap)
        self._current: str | None  # pragma: no mutate (an annotation only: `str & None` is never evaluated)
        self._current = None
        # the same ratios budget_order(tree, self._occ, capacity_gpu_s) would compute
        self.initial_order: tuple[str, ...] = order_by_ratios(tree, self._ratio)
        """Leaf order at the start of the cycle (for ``Decision.budget_rank``)."""

    # ------------------------------------------------------------------ queries

    def ratio(self, path: str) -> float:
        """Current r of ``path`` including provisional charges (0.0 for the root)."""
        return self._ratio.get(path, ZERO_USAGE)

    def ratio_after(self, path: str, gpu_s: float) -> float:
        """r of ``path`` with ``gpu_s`` more GPU-seconds of occupancy than now (charges included).

        What a provisional charge of ``gpu_s`` to a leaf at or below ``path``
        would make it: the preemption rule's after-move test (rule D3.consistent-view).
        """
        if path not in self._occ:
            return ZERO_USAGE
        return usage_ratio(self._occ[path] + gpu_s, self._ent[path])

    def order(self) -> tuple[str, ...]:
        """Leaf order by the current ratios (with provisional charges): ``budget_order`` of
        the current occupancy (every ratio is recomputed whenever its occupancy changes)."""
        return order_by_ratios(self._tree, self._ratio)

    def occupancy(self, path: str) -> float:
        """Current O of ``path`` including provisional charges, GPU-seconds."""
        return self._occ.get(path, 0.0)

    def __bool__(self) -> bool:
        return bool(self._queues)

    # ------------------------------------------------------------------ iteration

    def _top(self, node: str) -> str | None:
        heap = self._heaps.get(node)
        while heap:
            _, path, ver = heap[0]
            if path in self._active and self._ver[path] == ver:
                return path
            heapq.heappop(heap)
        return None

    def _descend(self) -> str | None:
        node = ROOT
        while True:
            nxt = self._top(node)
            if nxt is None:
                return None if node == ROOT else node
            if nxt in self._queues:
                return nxt
            node = nxt

    def peek_leaf(self) -> str | None:
        """The leaf whose next item comes next, or ``None`` when all are taken.

        Cached in ``_current`` until the order may change: :meth:`charge` and a
        leaf running out (:meth:`_deactivate`) reset it to ``None``.
        """
        if self._current is None:
            self._current = self._descend()
        return self._current

    def pop(self) -> tuple[str, T] | None:
        """Take the next item: ``(leaf, item)``, or ``None`` when exhausted."""
        leaf = self.peek_leaf()
        if leaf is None:
            return None
        q = self._queues[leaf]
        items, pos = q
        item = items[pos]
        pos += 1
        if pos == len(items):
            self._deactivate(leaf)
        else:
            q[1] = pos
        return leaf, item

    def skip(self, leaf: str, n: int) -> None:
        """Pass over the next ``n`` items of ``leaf`` (fewer when it has fewer left).

        Equivalent to ``n`` calls of :meth:`pop` that all return ``leaf``
        (the caller knows they would: no :meth:`charge` in between, and
        ``leaf`` is the one :meth:`peek_leaf` returns), without visiting the
        items. O(1) (O(depth) when ``leaf`` runs out).

        Raises:
            KeyError: ``leaf`` has no items left.
        """
        if n <= 0:  # pragma: no mutate (`n < 0` is the same function: skipping 0 items moves nothing)
            return
        q = self._queues[leaf]
        pos = q[1] + n
        if pos >= len(q[0]):
            self._deactivate(leaf)
        else:
            q[1] = pos

    def __iter__(self) -> Iterator[tuple[str, T]]:
        while (nxt := self.pop()) is not None:
            yield nxt

    def heads(self) -> list[tuple[str, T]]:
        """Each leaf with items left and its next item, in no particular order."""
        return [(leaf, q[0][q[1]]) for leaf, q in self._queues.items()]

    def clear(self) -> None:
        """Stop yielding anything: every leaf's remaining items are passed over (O(leaves), no heap work)."""
        self._queues.clear()
        self._active.clear()
        self._current = None

    def drop_leaf(self, leaf: str) -> list[T]:
        """Stop yielding ``leaf``'s remaining items; returns them (in order)."""
        q = self._queues.get(leaf)
        if q is None:
            return []
        rest = list(q[0][q[1] :])
        self._deactivate(leaf)
        return rest

    def _deactivate(self, leaf: str) -> None:
        del self._queues[leaf]
        self._current = None
        node = leaf
        while node != ROOT:
            self._active.discard(node)
            par = parent_of(node)
            if par == ROOT or self._top(par) is not None:
                break
            node = par

    # ------------------------------------------------------------------ provisional charge

    def charge(self, leaf: str, gpu_s: float) -> None:
        """Add ``gpu_s`` GPU-seconds of provisional occupancy to ``leaf`` and its ancestors.

        The caller computes ``gpu_s = g * k * min(min_runtime, W)`` for an
        allocated job just placed (rule D2.provisional-charge); unallocated jobs are
        never charged. The order of the remaining items changes accordingly.
        """
        if gpu_s == 0.0:
            return
        occ, ent, ratio, active, ver = self._occ, self._ent, self._ratio, self._active, self._ver
        for node in ancestors_of(leaf):
            if node not in occ:
                # `break` is the same: the tree holds every prefix of its paths, so the ancestors missing
                # from it are a suffix of ancestors_of(leaf)
                continue  # pragma: no mutate
            o = occ[node] = occ[node] + gpu_s
            r = ratio[node] = usage_ratio(o, ent[node])
            if node in active:
                # any other step (`- 1`, `+ 2`) is the same: a version only has to differ from the older ones
                v = ver[node] + 1  # pragma: no mutate
                ver[node] = v
                heapq.heappush(self._heaps[parent_of(node)], (r, node, v))
        self._current = None
