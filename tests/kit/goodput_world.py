"""The cluster and queue of :mod:`tests.kit.engine_world` for the goodput rules (design D2 and D3), over ``AB``:
``placed_jobs``, ``placements`` and ``preempted`` render a cycle's events; ``cycle`` and ``explained`` run it with
``explain`` and return why each job still waits.

``AB``::

    lab (1.0)
    ├── a  0.5
    └── b  0.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.engine import CycleResult, PendingReason
from tests.kit import engine_world
from tests.kit.engine_world import NOW, placed, preempted

__all__ = ["AB", "NOW", "World", "cycle", "explained", "placed_jobs", "placements", "preempted"]

AB = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})

#: ``job@node[gpus]+node[gpus]`` per JobPlaced, in order
placements = placed


@dataclass
class World(engine_world.World):
    """:class:`tests.kit.engine_world.World` over ``AB``."""

    tree: BudgetTree = AB


def placed_jobs(res: CycleResult) -> list[str]:
    return [e.job_id for e in res.events if isinstance(e, ev.JobPlaced)]


def cycle(w: engine_world.World, *, explain: bool = True, **cfg: Any) -> CycleResult:
    return w.cycle(explain=explain, **cfg)


def explained(w: engine_world.World, **cfg: Any) -> dict[str, PendingReason]:
    res = cycle(w, **cfg)
    plain = cycle(w, explain=False, **cfg)
    assert plain.events == res.events and plain.reasons == {}  # asking changes no decision
    return res.reasons
