"""What the engine keeps across cycles for one caller: :class:`EngineCaches` (speed only, never a decision).

A caller that runs cycle after cycle on a state it folds (the dispatcher's
state) holds one :class:`EngineCaches` and never looks inside it:

* the :class:`CycleMemo` of its pending lists (floors, shape codes, blocked tails and kept values, keyed
  by list identity, for lists that are never changed in place: copy-on-write);
  :meth:`EngineCaches.carry` moves an entry to the list that replaces one (less its tails);
* the :class:`VictimIndex` and :class:`FreeIndex` of its live cluster, brought
  up to date with the runs and nodes that changed since the previous cycle.

A cycle given none of these builds them itself; the decisions are the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from apportion.domain.cluster import ClusterState
from apportion.domain.engine.inputs import PendingJob, allocated_count
from apportion.domain.engine.placement import FreeIndex
from apportion.domain.engine.shapes import CycleMemo, carry_kept
from apportion.domain.engine.victims import VictimIndex

__all__ = ["EngineCaches"]


class EngineCaches:
    """The engine's memo and live indices for one caller's state (see the module docstring)."""

    __slots__ = ("memo", "_victims", "_free")

    def __init__(self, memo: CycleMemo | None = None) -> None:
        self.memo = memo if memo is not None else CycleMemo()
        self._victims: VictimIndex | None = None
        self._free: FreeIndex | None = None

    def fork(self) -> EngineCaches:
        """Caches for a scratch copy of the state: the same memo (its entries are keyed by list
        identity, so sharing it is safe), no live indices (a scratch cycle indexes its own runs and nodes)."""
        return EngineCaches(self.memo)

    def memo_for(self, pending: Mapping[str, Sequence[PendingJob]]) -> CycleMemo:
        """The memo for a cycle on ``pending``, pruned to the entries of its lists when it has grown."""
        if len(self.memo) > 2 * len(pending) + 16:
            self.memo = self.memo.keeping({id(lst) for lst in pending.values()})
        return self.memo

    def live(self, cluster: ClusterState) -> tuple[VictimIndex, FreeIndex]:
        """The victim and free indices of ``cluster``, synced with what changed since the last call."""
        if self._victims is None or self._free is None:
            self._victims, self._free = VictimIndex(), FreeIndex()
        return self._victims.sync(cluster), self._free.sync(cluster)

    def carry(self, old: list[PendingJob], new: list[PendingJob], job: PendingJob, added: bool, i: int) -> None:
        """Carry the memo of pending list ``old`` over to ``new``: ``job`` added at (``added``) or
        removed from index ``i``.

        The memo entry is ``[list, floors, codes, allocated count, tails, kept values]``; the count moves by one when ``job`` is
        allocated. Floors: segments are the
        allocated jobs ``[0, b)`` and the unallocated ones ``[b, n)``; a floor
        is ``(min g, min k)``. Adding a job lowers its segment's floor to the
        job's shape at most; removing one keeps the floor when the job attains
        neither minimum, else the entry is dropped (the engine recomputes it).
        Codes (:meth:`ShapeTable.codes` in the memo's table, or ``b""`` when
        unavailable): one byte is inserted or deleted at ``i``. The blocked tails
        (:func:`~apportion.domain.engine.shapes.memo_tail`) are not carried: they depend on the whole list; the
        values kept with a carry (:func:`~apportion.domain.engine.shapes.memo_kept`) are, by it.
        """
        memo = self.memo
        ent = memo.get(id(old))
        if ent is None or ent[0] is not old:
            return
        codes = ent[2]
        if codes:
            if added:
                c = memo.shapes.code(job.gpus_per_replica, job.replicas, job.gpu_model)
                codes = None if c is None else codes[:i] + bytes((c,)) + codes[i:]
            else:
                codes = codes[:i] + codes[i + 1 :]
        else:
            codes = None
        sign = 1 if added else -1
        b_old = ent[3] if len(ent) > 3 and ent[3] >= 0 else allocated_count(old)
        alloc = job.allocated
        b_new = b_old + sign if alloc else b_old
        kept = carry_kept(ent, job, added, i, b_new)
        if not ent[1]:
            memo[id(new)] = [new, {}, codes, b_new, {}, kept]
            return
        g, k = job.gpus_per_replica, job.replicas
        n_new = len(old) + sign
        segs: dict[tuple[int, int], tuple[int, int]] = {}
        for (lo, hi), f in ent[1].items():
            if (lo, hi) == (0, b_old):
                nk, mine = (0, b_new), alloc
            elif (lo, hi) == (b_old, len(old)):
                nk, mine = (b_new, n_new), not alloc
            else:
                continue
            if not mine:
                segs[nk] = f
            elif added:
                segs[nk] = (min(f[0], g), min(f[1], k))
            elif g > f[0] and k > f[1]:
                segs[nk] = f
        memo[id(new)] = [new, segs, codes, b_new, {}, kept]
