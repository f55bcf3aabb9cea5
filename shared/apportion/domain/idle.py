"""Idle runs: what node agents report of each running replica's GPU use, folded for the dispatcher.

Each ``NodeHeartbeat`` lists the replicas its node runs, with ``idle_s`` (event seconds every GPU of the
replica has been idle, ``0.0`` when one is busy now, ``None`` when unknown) and ``idle`` (``idle_s``
reached the node's ``idle_after_s``). :class:`IdleReports` keeps, per node, the entries of its latest
heartbeat (each heartbeat replaces its node's map, so the size is bounded by the replicas the nodes
report); :func:`run_idle` reads a run's idleness from them:

* a run is idle for the shortest ``idle_s`` of its open replicas (a gang is idle only while every
  replica is), as of each replica's node's latest heartbeat, never extrapolated past it;
* unknown (``None``) when a replica's entry is missing or carries no ``idle_s``;
* ``idle`` (Beaker's IDLE) only when every open replica's entry says so.

Part of the dispatcher's state (:func:`apportion.domain.dispatch.evolve` folds every heartbeat), so a
dispatcher rebuilt from the log or a snapshot reads the same. A heartbeat whose time is not after the last
one folded for its node changes nothing. Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from apportion.domain.cluster import Run
from apportion.events import NodeHeartbeat
from apportion.timeutil import Micros, to_us

__all__ = ["IdleReports", "RunIdle", "observe_idle", "run_idle"]

#: ``(job_id, attempt, replica)``.
ReplicaKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class RunIdle:
    """A run's idleness as its agents report it.

    Attributes:
        idle_s: event seconds all of its GPUs have been idle (the shortest over its replicas).
        idle: every replica reached its node's ``idle_after_s`` setting.
    """

    idle_s: float
    idle: bool


@dataclass(slots=True)
class IdleReports:
    """Per node, the idle entries of its latest heartbeat.

    Attributes:
        by_node: node id -> replica -> ``(idle_s, idle)`` (``idle_s`` ``None`` when the agent knows none).
        last_us: node id -> time of the latest heartbeat folded, µs UTC.
        reports: heartbeats folded that carried an idle time (``idle_s``) for a replica: a reader that shows
            idle times (the dispatcher's read model) knows from it that they moved on.
    """

    by_node: dict[str, dict[ReplicaKey, tuple[float | None, bool]]] = field(default_factory=dict)
    last_us: dict[str, Micros] = field(default_factory=dict)
    reports: int = 0


def observe_idle(reports: IdleReports, hb: NodeHeartbeat) -> None:
    """Fold one heartbeat into ``reports`` (in place): its node's entries become the heartbeat's."""
    nid = hb.node_id
    t = to_us(hb.ts)
    last = reports.last_us.get(nid)
    if last is not None and t <= last:
        return
    reports.last_us[nid] = t
    entries = {(w.job_id, w.attempt, w.replica): (w.idle_s, w.idle) for w in hb.running}
    reports.reports += any(w.idle_s is not None for w in hb.running)
    if entries:
        reports.by_node[nid] = entries
    else:
        reports.by_node.pop(nid, None)


def run_idle(reports: IdleReports, run: Run) -> RunIdle | None:
    """``run``'s idleness from its open replicas' latest entries; ``None`` when any is unknown.

    ``None`` too for a run without open replicas.
    """
    seen: list[float] = []
    every = True
    for r in sorted(run.open_replicas):
        idle_s, flagged = reports.by_node.get(run.placements[r].node_id, {}).get(
            (run.job_id, run.attempt, r), (None, False)
        )
        if idle_s is None:
            return None
        seen.append(idle_s)
        every = every and flagged
    return RunIdle(min(seen), every) if seen else None
