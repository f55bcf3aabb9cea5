"""A capped age weight on the fair-share walk (``EngineConfig.age_weight``; a measured lever, off by default).

As Slurm's multifactor priority adds ``PriorityWeightAge x min(age / PriorityMaxAge, 1)`` to a job's fair-share
factor, pass 1 of the cycle ranks a leaf by its usage ratio lowered by an age term of its oldest allocated job
still to be taken::

    key(leaf) = r(leaf) - w * min(floor(wait / 1 h) / max_age_h, 1)

where ``wait`` is ``now - queued_at`` (the attempt's wait, as the reservation's) of the job of least
``queued_at`` among the leaf's allocated jobs not yet taken, counted in whole hours. An inner node of the tree is
ranked among its siblings by its own r less the largest term of its leaves with jobs left. Old work is pulled
forward gradually, up to ``w`` (in units of r) after ``max_age`` of waiting, instead of at a step. Within a leaf
the order is unchanged ((submitted_at, job_id)); every r, every preemption test and the unallocated pass's order
stay the plain ones: only the order in which pass 1 takes allocated jobs moves. With a floor f
(``EngineConfig.age_floor_r``) a node whose r is above f is lifted no lower than f, and one at or under f keeps
its r. Measured and not adopted: ``docs/simulation.md``, "Levers measured".

The term falls as a leaf's old jobs are taken, so the leaf may lose its place in the middle of its jobs: the
queue (:class:`AgedQueue`) re-keys it after each of its jobs, and :meth:`AgedQueue.steady_end` says how far a
leaf's jobs keep the term of the one just taken (so far they come one after the other, nothing charged between:
what the cycle's passing over of blocked jobs needs).
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Mapping, Sequence

from apportion.domain.budgets import ROOT, BudgetTree, ancestors_of, parent_of
from apportion.domain.engine.inputs import PendingJob
from apportion.domain.fairshare import FairShareQueue
from apportion.timeutil import Micros

__all__ = ["AGE_STEP_S", "AgedQueue", "age_terms"]

AGE_STEP_S = 3600
"""The age term counts the wait in whole steps of this many seconds (Slurm's priority is an integer too): a leaf's
jobs whose oldest-left waits fall in the same whole step share a term, so the blocked ones among them are passed
over at once."""


def age_terms(jobs: Sequence[PendingJob], end: int, now_us: Micros, weight: float, max_age_s: float) -> list[float]:
    """The age term of a leaf at each cursor position ``0..end-1`` over its allocated jobs ``jobs[:end]``:
    ``weight * min(steps / max_steps, 1)`` for the oldest (least ``queued_at``) of ``jobs[pos:end]``, whose
    wait is ``steps`` whole :data:`AGE_STEP_S`. Non-increasing in the position.

    >>> from apportion.domain.engine.inputs import PendingJob
    >>> H = 3_600_000_000
    >>> js = [PendingJob("j%d" % i, 0, "a", "u", 1, 1, 60.0, q, q) for i, q in enumerate([0, 3 * H, H // 2])]
    >>> age_terms(js, 3, 4 * H, 1.0, 8 * 3600.0)
    [0.5, 0.375, 0.375]
    """
    step_us = AGE_STEP_S * 1_000_000
    max_steps = max_age_s / AGE_STEP_S
    out = [0.0] * end
    oldest: Micros | None = None
    for pos in range(end - 1, -1, -1):
        q = jobs[pos].queued_at_us
        if oldest is None or q < oldest:
            oldest = q
        steps = max(now_us - oldest, 0) // step_us
        out[pos] = weight * (1.0 if steps >= max_steps else steps / max_steps)
    return out


def _neg(x: float) -> float:
    return -x


class AgedQueue(FairShareQueue[int]):
    """:class:`~apportion.domain.fairshare.FairShareQueue` over allocated job indices, each node keyed by
    ``r - term`` (the module's formula) instead of ``r``; ``terms[leaf][pos]`` is :func:`age_terms` of the leaf.
    :meth:`ratio`, :meth:`order` and :attr:`initial_order` are the plain fair-share ones."""

    __slots__ = ("_terms", "_term", "_floor")

    def __init__(
        self,
        tree: BudgetTree,
        occupancy: Mapping[str, float],
        capacity_gpu_s: float,
        items_by_leaf: Mapping[str, Sequence[int]],
        terms: Mapping[str, list[float]],
        floor: float | None = None,
    ) -> None:
        super().__init__(tree, occupancy, capacity_gpu_s, items_by_leaf)
        self._terms = terms
        self._floor = floor
        term: dict[str, float] = {}
        for leaf in self._queues:
            t = terms[leaf][0]
            for node in ancestors_of(leaf):
                if term.get(node, -1.0) < t:
                    term[node] = t
        self._term = term
        ratio = self._ratio
        for heap in self._heaps.values():  # (every entry at version 0, r as its key)
            heap[:] = [(self._key(ratio[node], term[node]), node, 0) for _, node, _ in heap]
            heapq.heapify(heap)

    def steady_end(self, leaf: str, pos: int, end: int) -> int:
        """The first position after ``pos`` (at most ``end``) where ``leaf``'s age term differs from that at
        ``pos``: its jobs ``pos..`` before it keep the leaf's key, so they come one after another while nothing
        is charged."""
        return bisect_right(self._terms[leaf], -self._terms[leaf][pos], pos, end, key=_neg)

    def pop(self) -> tuple[str, int] | None:
        got = super().pop()
        if got is not None and got[0] in self._queues:
            self._settle(got[0])
        return got

    def skip(self, leaf: str, n: int) -> None:
        super().skip(leaf, n)
        if leaf in self._queues:
            self._settle(leaf)

    def charge(self, leaf: str, gpu_s: float) -> None:
        super().charge(leaf, gpu_s)  # (its entries keyed by r are superseded by those pushed here)
        if gpu_s != 0.0:
            for node in ancestors_of(leaf):
                if node in self._active:
                    self._push(node)

    def _deactivate(self, leaf: str) -> None:
        super()._deactivate(leaf)
        self._settle_up(parent_of(leaf))

    def _settle(self, leaf: str) -> None:
        """Re-key ``leaf`` (and its ancestors) when its term at its cursor changed."""
        q = self._queues[leaf]
        t = self._terms[leaf][q[1]]
        if t != self._term[leaf]:
            self._term[leaf] = t
            self._push(leaf)
            self._settle_up(parent_of(leaf))

    def _settle_up(self, node: str) -> None:
        """Re-key the active inner nodes from ``node`` up whose largest term of an active child changed."""
        active, term = self._active, self._term
        while node != ROOT:
            if node in active:  # (an inner node whose last leaf ran out is inactive: its parent may not be)
                t = max((term[c] for c in self._tree.children(node) if c in active), default=0.0)
                if t == term[node]:
                    return
                term[node] = t
                self._push(node)
            node = parent_of(node)

    def _push(self, node: str) -> None:
        v = self._ver[node] + 1
        self._ver[node] = v
        heapq.heappush(self._heaps[parent_of(node)], (self._key(self._ratio[node], self._term[node]), node, v))
        self._current = None

    def _key(self, r: float, term: float) -> float:
        """A node's key: ``r - term``; with a ``floor`` f, a node above it is lifted no lower than f
        (``max(r - term, f)``) and one at or under it keeps its r. At f = 1 the term orders the borrowers among
        themselves and never puts one before a node at or under its share."""
        floor = self._floor
        if floor is None:
            return r - term
        return r if r <= floor else max(r - term, floor)
