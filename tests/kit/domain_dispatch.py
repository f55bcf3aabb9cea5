"""Given/when/then for the pure dispatcher (:mod:`apportion.domain.dispatch`): a two-leaf tree, a state folded
from a history, node registrations, and the emitted events as compact ``type:id`` strings.

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, step
from apportion.timeutil import from_us
from tests.kit.builders import T0

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 0.5, "members": ["alice"]}, "lab/b": 0.5})
CFG = DispatchConfig(heartbeat_timeout_s=None)


def reg(nid: str, gpus: int = 4) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=gpus, ts=from_us(T0), event_id=ev.det_id("reg", nid))


def given(*events) -> DispatchState:
    state = DispatchState(TREE)
    for e in events:
        step(state, e, e.ts and int(e.ts.timestamp() * 1e6), CFG)
    return state


def types(out) -> list[str]:
    return [f"{e.type}:{getattr(e, 'job_id', getattr(e, 'node_id', ''))}" for e in out]
