"""Given/when/then for the pure dispatcher (:mod:`apportion.domain.dispatch`): a two-leaf tree, a state folded
from a history, node registrations, the emitted events as compact ``type:id`` strings, and heartbeats (``hb``).

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5
"""

from __future__ import annotations

from dataclasses import replace

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.timeutil import from_us
from tests.kit.builders import T0, submitted

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


# Heartbeat reconciliation: ``reconcile_misses = 2`` (the dispatcher service's default); j1 placed at T0 on
# nodes n0, n1 with 4 GPUs each.
REC = replace(CFG, reconcile_misses=2)


def _running(gpus: int = 2, replicas: int = 1, started: bool = True):
    state = given(reg("n0"), reg("n1"))
    step(state, submitted("j1", budget="lab/a", user="alice", gpus=gpus, replicas=replicas), T0, REC)
    out = step(state, Tick(T0), T0, REC)
    placed = next(e for e in out if isinstance(e, ev.JobPlaced))
    for r, p in enumerate(placed.placements if started else ()):
        step(state, _started(r, p.node_id, p.gpus), T0, REC)
    return state, placed


def _started(replica: int, node: str, gpus: tuple[int, ...]) -> ev.JobStarted:
    return ev.JobStarted(
        job_id="j1", attempt=1, replica=replica, node_id=node, gpus=gpus, ts=from_us(T0), producer="node-agent",
        event_id=ev.det_id("test-started", replica),
    )  # fmt: skip


def hb(node: str, at: int, *running: tuple[str, int, int]) -> ev.NodeHeartbeat:
    return ev.NodeHeartbeat(
        node_id=node,
        running=tuple(ev.RunningWorkload(job_id=j, attempt=a, replica=r, gpus=(0,)) for j, a, r in running),
        ts=from_us(at),
        producer="node-agent",
        event_id=ev.det_id("test-hb", node, at),
    )


def endings(out: list[ev.Event]) -> list[tuple[str, int | None, str | None, float | None, str]]:
    """``(type, attempt, node, grace_s, reason)`` of each ``StopWorkload`` and ``JobCancelled`` in ``out`` (node
    and grace ``None`` for a ``JobCancelled``); any other event fails the test."""
    rows: list[tuple[str, int | None, str | None, float | None, str]] = []
    for e in out:
        if isinstance(e, ev.StopWorkload):
            rows.append((e.type, e.attempt, e.node_id, e.grace_s, e.reason))
        else:
            assert isinstance(e, ev.JobCancelled), e
            rows.append((e.type, e.attempt, None, None, e.reason))
    return rows
