"""Free capacity in one cycle, for the baseline and peer policies: the largest free node, and shapes known
not to fit (pure, over the engine's :class:`~apportion.domain.engine.placement.CycleFree`).
"""

from __future__ import annotations

from apportion.domain.engine.placement import CycleFree
from apportion.sim.conservation import Shape

__all__ = ["Shape", "add_blocked", "covers", "is_blocked", "largest_free"]


def largest_free(free: CycleFree) -> int:
    """The most free GPUs any node has in this cycle (over all models), 0 when none is free."""
    best = 0
    for b in free.buckets.values():
        for c in range(len(b) - 1, best, -1):
            if b[c]:
                best = c
                break
    return best


def covers(shape: Shape, g: int, k: int, model: str | None) -> bool:
    """Whether a job of shape ``(g, k, model)`` needs at least what ``shape`` needs.

    True when ``shape`` is ``(fg, fk, fm)`` with ``fg <= g``, ``fk <= k`` and
    ``fm`` either ``None`` (any model) or ``model``: every gang placement of
    the job (k distinct nodes of that model, g GPUs each) contains one of
    ``shape``, so if ``shape`` cannot be placed, neither can the job.
    """
    fg, fk, fm = shape
    return fg <= g and fk <= k and (fm is None or fm == model)


def is_blocked(shapes: list[Shape], g: int, k: int, model: str | None) -> bool:
    """Whether some shape in ``shapes`` covers ``(g, k, model)`` (:func:`covers`)."""
    for fg, fk, fm in shapes:
        if fg <= g and fk <= k and (fm is None or fm == model):
            return True
    return False


def add_blocked(shapes: list[Shape], shape: Shape) -> None:
    """Add ``shape`` to the blocked ``shapes`` unless one already covers it; drop those it covers.

    The list stays an antichain (no entry covers another), so :func:`is_blocked`
    gives the same answer as over every shape ever added, on a shorter list.
    """
    g, k, m = shape
    if is_blocked(shapes, g, k, m):
        return
    shapes[:] = [s for s in shapes if not covers(shape, *s)]
    shapes.append(shape)
