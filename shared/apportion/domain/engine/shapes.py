"""Job shapes as one-byte codes, and the bulk skips they make cheap (speed only: no decision depends on them).

A shape is ``(g, k, model)``: GPUs per replica, replicas, GPU model. The cycle
passes over runs of jobs whose shape is already known to be blocked
(:func:`blocked_run`) and skips a leaf whose every remaining job is at least
as large as a known failure (:func:`segment_floor`, a lower bound of the
shapes of a slice of a pending list). ``CycleSnapshot.memo`` keeps a pending
list's codes and floors across cycles.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import islice
from operator import attrgetter
from typing import Any, cast

from apportion.domain.engine.inputs import PendingJob

__all__ = [
    "Shape",
    "blocked_run",
    "floor_of_codes",
    "memo_codes",
    "segment_floor",
    "shape_code",
    "shape_codes",
    "shape_floor",
]

_SHAPE = attrgetter("gpus_per_replica", "replicas", "gpu_model")
Shape = tuple[int, int, "str | None"]

#: Process-wide interning of job shapes (g, k, model) to one-byte codes for
#: :func:`shape_codes`. Codes only encode; no decision depends on their values.
_CODE: dict[Shape, int] = {}
_SHAPE_OF: list[Shape] = []


def shape_code(g: int, k: int, model: str | None) -> int | None:
    """The one-byte code of shape ``(g, k, model)``, ``None`` once 256 shapes are interned."""
    shape = (g, k, model)
    c = _CODE.get(shape)
    if c is None:
        if len(_SHAPE_OF) >= 256:
            return None
        c = _CODE[shape] = len(_SHAPE_OF)
        _SHAPE_OF.append(shape)
    return c


def shape_codes(jobs: Sequence[PendingJob]) -> bytes | None:
    """``bytes`` with the :func:`shape_code` of each job in order, ``None`` past 256 shapes.

    Lets :func:`blocked_run` find the next job of another shape with a
    regular-expression search in C instead of a Python loop over the jobs.
    """
    shapes = list(map(_SHAPE, jobs))
    codes = list(map(_CODE.get, shapes))
    if None in codes:
        for i, c in enumerate(codes):
            if c is None:
                c = shape_code(*shapes[i])
                if c is None:
                    return None
                codes[i] = c
    return bytes(cast(list[int], codes))  # (every None was replaced above)


@lru_cache(maxsize=4096)
def _other_than(codes: frozenset[int]) -> re.Pattern[bytes]:
    """A pattern matching one byte that is none of ``codes``."""
    return re.compile(b"[^" + b"".join(b"\\x%02x" % c for c in sorted(codes)) + b"]")


def blocked_run(
    jobs: Sequence[PendingJob],
    lo: int,
    hi: int,
    blocked: Callable[[int, int, str | None], bool],
    codes: bytes | None = None,
) -> int:
    """How many of ``jobs[lo:hi]``, from ``lo`` on, have a shape ``(g, k, model)`` for which ``blocked`` holds.

    ``blocked`` is asked once per distinct shape met (a handful per leaf).
    With ``codes`` (:func:`shape_codes` of ``jobs``) the next job of a shape
    not yet known blocked is found by a byte search (O(run) in C); without,
    by a scan that costs one tuple lookup per job.
    """
    if codes is not None:
        known: set[int] = set()
        pos = lo
        while pos < hi:
            c = codes[pos]
            if not blocked(*_SHAPE_OF[c]):
                return pos - lo
            known.add(c)
            m = _other_than(frozenset(known)).search(codes, pos + 1, hi)
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


def _memo_entry(memo: dict[Any, Any], jobs: Sequence[PendingJob]) -> list[Any]:
    """The memo entry ``[jobs, {(lo, hi): floor}, codes or None]`` of a pending list (created empty)."""
    ent = memo.get(id(jobs))
    if ent is None or ent[0] is not jobs:
        ent = memo[id(jobs)] = [jobs, {}, None]
    return ent


def memo_codes(memo: dict[Any, Any] | None, jobs: Sequence[PendingJob]) -> bytes | None:
    """:func:`shape_codes` of ``jobs``, kept in ``memo`` (see ``CycleSnapshot.memo``).

    ``None`` without a memo (callers then scan the jobs) or past 256 shapes
    (kept as ``b""`` so that it is not rebuilt for the same list).
    """
    if memo is None:
        return None
    ent = _memo_entry(memo, jobs)
    c = ent[2]
    if c is None:
        c = ent[2] = shape_codes(jobs) or b""
    return c or None


def segment_floor(memo: dict[Any, Any] | None, jobs: Sequence[PendingJob], lo: int, hi: int) -> tuple[int, int]:
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
        f = ent[1][(lo, hi)] = shape_floor(jobs, lo, hi) if codes is None else floor_of_codes(codes, lo, hi)
    return f


def floor_of_codes(codes: bytes, lo: int, hi: int) -> tuple[int, int]:
    """:func:`shape_floor` of the jobs whose :func:`shape_codes` are ``codes``: from the distinct shapes in the slice."""
    if lo >= hi:
        return (_BIG, _BIG)
    shapes = [_SHAPE_OF[c] for c in set(codes[lo:hi])]
    return (min(s[0] for s in shapes), min(s[1] for s in shapes))
