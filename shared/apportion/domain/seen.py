"""De-duplication bounded by the window W (rule D4.log): the one home of the rule.

A reader that de-duplicates by event id keeps ``id -> event time (µs)`` of what it folded. Two rules, used
together so that de-duplication does not depend on when ids are forgotten:

* an event older than the window (its time before the newest folded minus W, :func:`older_than_window`) is
  not folded: its id may have been forgotten, so it could not be told from a duplicate;
* ids older than the window are forgotten (:func:`forget_older`), whenever the map has doubled since the
  last sweep (:func:`sweep_due`, amortised O(1) per event), so it holds about twice what one window holds.

Used by the dispatcher (:meth:`apportion.domain.dispatch.DispatchState.is_stale`, ``forget_old``) and the
policy service (``services/policy/logic.evolve``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

#: Ids are not swept below this many (a sweep of a small map costs more than it frees).
FORGET_MIN = 4096


def older_than_window(t_us: int, clock_us: int | None, window_us: int) -> bool:
    """True when time ``t_us`` is before ``clock_us - window_us`` (never before anything was folded)."""
    return clock_us is not None and t_us < clock_us - window_us


def forget_older(ids: Mapping[K, int], clock_us: int | None, window_us: int) -> dict[K, int]:
    """``ids`` without those whose time is older than the window (:func:`older_than_window`)."""
    if clock_us is None:
        return dict(ids)
    horizon = clock_us - window_us
    return {k: t for k, t in ids.items() if t >= horizon}


def sweep_due(size: int, kept: int, minimum: int = FORGET_MIN) -> bool:
    """True when a map of ``size`` ids has doubled since the last sweep left ``kept`` (and passed ``minimum``)."""
    return size > 2 * max(kept, minimum)
