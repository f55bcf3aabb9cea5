"""Job shapes as one-byte codes, and the bulk skips they make cheap (speed only: no decision depends on them).

A shape is ``(g, k, model)``: GPUs per replica, replicas, GPU model. The cycle
passes over runs of jobs whose shape is already known to be blocked
(:func:`blocked_run`) and skips a leaf whose every remaining job is at least
as large as a known failure (:func:`segment_floor`, a lower bound of the
shapes of a slice of a pending list). ``CycleSnapshot.memo`` (a
:class:`CycleMemo`) keeps a pending list's codes and floors across cycles, and
owns the :class:`ShapeTable` its codes are written in: the module keeps no
state of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from itertools import islice
from operator import attrgetter
from typing import Any, TypeVar, cast

from apportion.domain.engine.inputs import PendingJob, allocated_count

T = TypeVar("T")

__all__ = [
    "CycleMemo",
    "KeptCarry",
    "Shape",
    "ShapeTable",
    "blocked_run",
    "memo_allocated",
    "memo_codes",
    "carry_kept",
    "memo_kept",
    "memo_tail",
    "segment_floor",
    "shape_floor",
]

_SHAPE = attrgetter("gpus_per_replica", "replicas", "gpu_model")
Shape = tuple[int, int, "str | None"]

#: Most byte patterns a :class:`ShapeTable` keeps (it starts again when full: they are rebuilt on demand).
_PATTERNS_KEPT = 4096


class ShapeTable:
    """Job shapes ``(g, k, model)`` interned to one-byte codes, owned by the :class:`CycleMemo` whose codes use them.

    Codes are given in order of first sight, up to 256; they only encode (no
    decision depends on their values), and each table has its own, so two
    dispatchers or simulations in one process share nothing.
    """

    __slots__ = ("_code", "_shape_of", "_patterns")

    def __init__(self) -> None:
        self._code: dict[Shape, int] = {}
        self._shape_of: list[Shape] = []
        self._patterns: dict[frozenset[int], re.Pattern[bytes]] = {}

    def code(self, g: int, k: int, model: str | None) -> int | None:
        """The one-byte code of shape ``(g, k, model)``, ``None`` once 256 shapes are interned."""
        shape = (g, k, model)
        c = self._code.get(shape)
        if c is None:
            if len(self._shape_of) >= 256:
                return None
            c = self._code[shape] = len(self._shape_of)
            self._shape_of.append(shape)
        return c

    def codes(self, jobs: Sequence[PendingJob]) -> bytes | None:
        """``bytes`` with the :meth:`code` of each job in order, ``None`` past 256 shapes.

        Lets :func:`blocked_run` find the next job of another shape with a
        regular-expression search in C instead of a Python loop over the jobs.
        """
        shapes = list(map(_SHAPE, jobs))
        codes = list(map(self._code.get, shapes))
        if None in codes:
            for i, c in enumerate(codes):
                if c is None:
                    c = self.code(*shapes[i])
                    if c is None:
                        return None
                    codes[i] = c
        return bytes(cast(list[int], codes))  # (every None was replaced above)

    def shape(self, c: int) -> Shape:
        """The shape of code ``c``."""
        return self._shape_of[c]

    def other_than(self, codes: frozenset[int]) -> re.Pattern[bytes]:
        """A pattern matching one byte that is none of ``codes`` (kept)."""
        pat = self._patterns.get(codes)
        if pat is None:
            if len(self._patterns) >= _PATTERNS_KEPT:
                self._patterns.clear()
            pat = self._patterns[codes] = re.compile(b"[^" + b"".join(b"\\x%02x" % c for c in sorted(codes)) + b"]")
        return pat

    def floor(self, codes: bytes, lo: int, hi: int) -> tuple[int, int]:
        """:func:`shape_floor` of the jobs whose :meth:`codes` are ``codes``: from the distinct shapes in the slice."""
        if lo >= hi:
            return (_BIG, _BIG)
        shapes = [self._shape_of[c] for c in set(codes[lo:hi])]
        return (min(s[0] for s in shapes), min(s[1] for s in shapes))


class CycleMemo(dict[int, list[Any]]):
    """What a caller keeps across cycles (``CycleSnapshot.memo``) for its pending lists.

    ``id(list) -> [list, {(lo, hi): (min g, min k) of list[lo:hi]}, shape codes or None, allocated count or -1,
    blocked tails, other values]`` (the allocated count: :func:`~apportion.domain.engine.inputs.allocated_count`
    of the list; the blocked tails: :func:`memo_tail`, and the other values: :func:`memo_kept`, made on first
    use, carried to another list only by their own carry),
    for callers whose pending lists are never changed in place (``DispatchState``:
    copy-on-write, and it carries entries over to the list that replaces one), and
    :attr:`shapes`, the :class:`ShapeTable` the codes are written in.
    """

    __slots__ = ("shapes",)

    def __init__(self, shapes: ShapeTable | None = None) -> None:
        super().__init__()
        self.shapes = shapes if shapes is not None else ShapeTable()

    def keeping(self, ids: set[int]) -> CycleMemo:
        """A memo with the same table and only the entries of the lists ``ids``."""
        kept = CycleMemo(self.shapes)
        kept.update((k, v) for k, v in self.items() if k in ids)
        return kept


def blocked_run(
    jobs: Sequence[PendingJob],
    lo: int,
    hi: int,
    blocked: Callable[[int, int, str | None], bool],
    memo: CycleMemo | None = None,
) -> int:
    """How many of ``jobs[lo:hi]``, from ``lo`` on, have a shape ``(g, k, model)`` for which ``blocked`` holds.

    ``blocked`` is asked once per distinct shape met (a handful per leaf).
    With a ``memo`` (the list's shape codes, :func:`memo_codes`) the next job
    of a shape not yet known blocked is found by a byte search (O(run) in C);
    without, by a scan that costs one tuple lookup per job.
    """
    codes = memo_codes(memo, jobs)
    if codes is not None and memo is not None:
        table = memo.shapes
        known: set[int] = set()
        pos = lo
        while pos < hi:
            c = codes[pos]
            if not blocked(*table.shape(c)):
                return pos - lo
            known.add(c)
            m = table.other_than(frozenset(known)).search(codes, pos + 1, hi)
            if m is None:
                return hi - lo
            pos = m.start()
        return hi - lo
    seen: dict[tuple[int, int, str | None], bool] = {}
    n = 0
    for shape in map(_SHAPE, islice(jobs, lo, hi)):
        b = seen.get(shape)
        if b is None:
            b = seen[shape] = blocked(*shape)
        if not b:
            return n
        n += 1
    return n


_G = attrgetter("gpus_per_replica")


_K = attrgetter("replicas")
_BIG = 1 << 30


def shape_floor(jobs: Sequence[PendingJob], lo: int, hi: int) -> tuple[int, int]:
    """``(min g, min k)`` over ``jobs[lo:hi]`` (``(2**30, 2**30)`` when empty).

    Scans a short prefix first and stops at a 1 x 1 job (g, k >= 1: the
    event schema validates it), else takes the minima over the whole slice.
    """
    if lo >= hi:
        return (_BIG, _BIG)
    mg = mk = _BIG
    for i in range(lo, min(hi, lo + 32)):
        j = jobs[i]
        g, k = j.gpus_per_replica, j.replicas
        if g < mg:
            mg = g
        if k < mk:
            mk = k
        if mg == 1 and mk == 1:
            return (1, 1)
    if hi > lo + 32:
        seg = jobs[lo:hi]
        return (min(map(_G, seg)), min(map(_K, seg)))
    return (mg, mk)


def _memo_entry(memo: CycleMemo, jobs: Sequence[PendingJob]) -> list[Any]:
    """The memo entry ``[jobs, {(lo, hi): floor}, codes or None, allocated count or -1]`` of a pending list
    (created empty)."""
    ent = memo.get(id(jobs))
    if ent is None or ent[0] is not jobs:
        ent = memo[id(jobs)] = [jobs, {}, None, -1]
    return ent


def memo_allocated(memo: CycleMemo | None, jobs: Sequence[PendingJob]) -> int:
    """:func:`~apportion.domain.engine.inputs.allocated_count` of ``jobs``, kept in ``memo`` when there is one."""
    if memo is None:
        return allocated_count(jobs)
    ent = _memo_entry(memo, jobs)
    if len(ent) < 4:
        ent.append(-1)
    b: int = ent[3]
    if b < 0:
        b = ent[3] = allocated_count(jobs)
    return b


def memo_tail(memo: CycleMemo, jobs: Sequence[PendingJob]) -> dict[int, tuple[int, int, int, int]]:
    """The blocked tails of pending list ``jobs`` kept in ``memo``: the first index ``i`` of its allocated jobs
    taken once nothing can be placed any more in the cycle's first pass -> what taking ``jobs[i:]`` then added
    to the cycle's counters (considered, rank, searches, passed over). Those depend on the list alone: every
    job is blocked, and the cycle passes over its jobs by their shapes (speed only: no decision depends on it)."""
    ent = _memo_entry(memo, jobs)
    while len(ent) < 5:
        ent.append(-1 if len(ent) == 3 else {})
    tails: dict[int, tuple[int, int, int, int]] = ent[4]
    return tails


KeptCarry = Callable[[Hashable, Any, PendingJob, bool, int, int], "tuple[Hashable, Any] | None"]
"""How a :func:`memo_kept` value moves to the list that replaces its own: ``(key, value, job, added, i,
allocated count of the new list)`` -> ``(key, value)`` of the new list, or ``None`` to drop it (the arguments of
:meth:`~apportion.domain.engine.caches.EngineCaches.carry`, and the lists' allocated counts). It builds a new
value: the old list's stays as it was."""


def memo_kept(
    memo: CycleMemo | None,
    jobs: Sequence[PendingJob],
    key: Hashable,
    make: Callable[[], T],
    carry: KeptCarry | None = None,
) -> T:
    """``make()``, a value that depends on pending list ``jobs`` alone (and on ``key``), kept with the list in
    ``memo`` under ``key``: made on first use, carried by ``carry`` to the list that replaces this one
    (:func:`carry_kept`; never without it); made each time without a memo."""
    if memo is None:
        return make()
    ent = _memo_entry(memo, jobs)
    while len(ent) < 6:
        ent.append(-1 if len(ent) == 3 else {})
    kept: dict[Hashable, tuple[Any, KeptCarry | None]] = ent[5]
    got = kept.get(key)
    if got is None:
        got = kept[key] = (make(), carry)
    value: T = got[0]
    return value


def carry_kept(
    ent: list[Any], job: PendingJob, added: bool, i: int, b_new: int
) -> dict[Hashable, tuple[Any, KeptCarry | None]]:
    """The :func:`memo_kept` values of memo entry ``ent`` carried to the list that replaces its own (``job``
    added at or removed from index ``i``; ``b_new`` allocated jobs in the new list): those made with a
    ``carry`` that keeps them."""
    out: dict[Hashable, tuple[Any, KeptCarry | None]] = {}
    if len(ent) < 6:
        return out
    for key, (value, carry) in ent[5].items():
        if carry is not None:
            got = carry(key, value, job, added, i, b_new)
            if got is not None:
                out[got[0]] = (got[1], carry)
    return out


def memo_codes(memo: CycleMemo | None, jobs: Sequence[PendingJob]) -> bytes | None:
    """:meth:`ShapeTable.codes` of ``jobs`` in ``memo``'s table, kept in ``memo`` (see :class:`CycleMemo`).

    ``None`` without a memo (callers then scan the jobs) or past 256 shapes
    (kept as ``b""`` so that it is not rebuilt for the same list).
    """
    if memo is None:
        return None
    ent = _memo_entry(memo, jobs)
    c = ent[2]
    if c is None:
        c = ent[2] = memo.shapes.codes(jobs) or b""
    return c or None


def segment_floor(memo: CycleMemo | None, jobs: Sequence[PendingJob], lo: int, hi: int) -> tuple[int, int]:
    """``(min g, min k)`` over ``jobs[lo:hi]`` (a lower bound of every job's shape there).

    Kept in ``memo`` when there is one (``CycleSnapshot.memo``: the dispatcher
    carries it over to the list that replaces one), from the distinct shapes
    of the list's shape codes; computed by a scan otherwise. ``(2**30,
    2**30)`` for an empty slice.
    """
    if memo is None:
        return shape_floor(jobs, lo, hi)
    ent = _memo_entry(memo, jobs)
    f: tuple[int, int] | None = ent[1].get((lo, hi))
    if f is None:
        codes = memo_codes(memo, jobs)
        f = ent[1][(lo, hi)] = shape_floor(jobs, lo, hi) if codes is None else memo.shapes.floor(codes, lo, hi)
    return f
