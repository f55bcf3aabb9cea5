"""Job arrays: one submission for N jobs that differ only in their index (Slurm's ``--array``).

The index expression is Slurm's: a comma-separated list of items, each an index ``N``, a range ``N-M``
(both ends included) or a stepped range ``N-M:S``, optionally followed by ``%T``, the most elements that
may run at once (the throttle). ``0-99%8`` is indices 0 to 99 with at most 8 running; ``1,3,10-16:3`` is
1, 3, 10, 13 and 16. The indices are kept sorted and unique, as Slurm's bitmap keeps them.

Each element is its own job, with the derived id ``<array id>_<index>`` (:func:`element_id`), as Slurm
names them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "MAX_ARRAY_ELEMENTS",
    "MAX_ARRAY_INDEX",
    "ArraySpec",
    "parse_array",
    "element_id",
    "split_element_id",
]

#: The most elements one array may have (one submission; its admission emits one ``JobQueued`` each).
MAX_ARRAY_ELEMENTS = 100_000

#: The highest index an element may have (Slurm's ``MaxArraySize`` minus one, raised to six digits).
MAX_ARRAY_INDEX = 999_999

_ITEM = re.compile(r"(\d+)(?:-(\d+)(?::(\d+))?)?")


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """A parsed index expression.

    Attributes:
        indices: the element indices, ascending, unique, at least one.
        throttle: the most elements running at once (``%T``), or ``None`` for no limit.
    """

    indices: tuple[int, ...]
    throttle: int | None = None


def parse_array(text: str) -> ArraySpec:
    """The :class:`ArraySpec` of a Slurm index expression (module docstring).

    >>> parse_array("0-6:2%2")
    ArraySpec(indices=(0, 2, 4, 6), throttle=2)

    Raises:
        ValueError: an item that is not ``N``, ``N-M`` or ``N-M:S``, a range whose end is below its start,
            a step or throttle below 1, an index above :data:`MAX_ARRAY_INDEX`, or more than
            :data:`MAX_ARRAY_ELEMENTS` elements; the message quotes the offending part.
    """
    body, pct, throttle_text = text.strip().partition("%")
    throttle: int | None = None
    if pct:
        if not throttle_text.isdigit() or int(throttle_text) < 1:
            raise ValueError(f"array {text!r}: the throttle after % must be a whole number >= 1")
        throttle = int(throttle_text)
    if not body:
        raise ValueError(f"array {text!r}: no indices (e.g. 0-99, 1,3,5, 0-99:2, 0-99%8)")
    found: set[int] = set()
    for item in body.split(","):
        m = _ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"array {text!r}: {item!r} is not an index N, a range N-M or a stepped range N-M:S")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        step = int(m.group(3)) if m.group(3) is not None else 1
        if hi < lo:
            raise ValueError(f"array {text!r}: range {item!r} ends below its start")
        if step < 1:
            raise ValueError(f"array {text!r}: the step of {item!r} must be >= 1")
        if hi > MAX_ARRAY_INDEX:
            raise ValueError(f"array {text!r}: index {hi} is above the highest allowed, {MAX_ARRAY_INDEX}")
        if len(found) + (hi - lo) // step + 1 > MAX_ARRAY_ELEMENTS:
            raise ValueError(f"array {text!r}: more than {MAX_ARRAY_ELEMENTS} elements")
        found.update(range(lo, hi + 1, step))
    return ArraySpec(tuple(sorted(found)), throttle)


def element_id(array_id: str, index: int) -> str:
    """The job id of element ``index`` of array ``array_id``: ``<array id>_<index>`` (Slurm's form)."""
    return f"{array_id}_{index}"


def split_element_id(job_id: str) -> tuple[str, int] | None:
    """``(array id, index)`` when ``job_id`` has an element's form (:func:`element_id`), else ``None``.

    The form alone does not make a job an element (any job may be named ``x_3``): a reader checks the
    array id against the arrays it knows.
    """
    head, sep, tail = job_id.rpartition("_")
    if not sep or not head or not tail.isdigit() or (len(tail) > 1 and tail[0] == "0"):
        return None
    return head, int(tail)
