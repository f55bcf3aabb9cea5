"""Reconciliation of the dispatcher's runs with what node agents report in their heartbeats.

A node agent's ``NodeHeartbeat`` lists the replicas it runs (``running``). Two disagreements with the
dispatcher's view (:class:`~apportion.domain.cluster.ClusterState`) are repaired:

* **missing**: a replica placed on the node and started there (open, its ``JobStarted`` folded, its run
  not stopping) that the heartbeat does not list. The agent lost it (restarted without its journal,
  the process vanished without a report, ...). When ``misses`` consecutive
  heartbeats of its node do not list it, the run is lost: ``JobLost`` charged to that heartbeat, the
  gang's other replicas stopped, the job requeued (:func:`apportion.domain.dispatch.reconcile_events`).
* **unknown**: a replica listed by ``misses`` consecutive heartbeats of its node for which the
  dispatcher has no open replica of that ``(job, attempt)`` on the node (an old attempt, a finished or
  never placed job, a replica of a lost node still running): it gets ``StopWorkload`` (grace 0: its GPUs
  are not its own any more).

Counting heartbeats rather than seconds keeps the grace right whatever the clock scale (agents send a
heartbeat every ``heartbeat_interval_s`` event seconds, or every ``heartbeat_min_wall_s`` wall seconds on
a fast clock). With ``misses = 2`` the grace is about two heartbeat intervals: a heartbeat folded before
the ``JobCompleted`` of a replica that ended just before it (another topic) is one miss, not a loss.

Only started replicas are counted: a replica whose ``StartWorkload`` the agent has not read yet is
absent from its heartbeats for as long as the command takes to arrive, which has no bound (seen in the
chaos campaign: heartbeats buffered in the agent's producer during a broker outage, all without the
replica the dispatcher had placed just before it; counted, they made the dispatcher requeue a run that
then started, and stop it as unknown). A start that never happens is the agent's to report
(``WorkloadRefused``, undone by :func:`apportion.domain.dispatch.undo_refused_start`).

:class:`Absences` is part of the dispatcher's state, folded by :func:`observe` on every heartbeat
(:func:`apportion.domain.dispatch.evolve`), so a dispatcher rebuilt from the log or a snapshot counts
the same. A heartbeat whose time is not after the last one counted for its node (a duplicate, or one
arriving out of order) changes nothing; heartbeats of nodes never registered are ignored. Pure: no
clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from apportion.domain.cluster import ClusterState, Run, RunKey
from apportion.events import NodeHeartbeat
from apportion.timeutil import Micros, to_us

#: ``(job_id, attempt, replica)``.
ReplicaKey = tuple[str, int, int]

__all__ = ["Absences", "ReplicaKey", "observe", "findings", "known_here"]


@dataclass(slots=True)
class Absences:
    """Per node, consecutive heartbeats that disagreed with the dispatcher (a fold of heartbeats).

    Attributes:
        missing: node id -> replica started there -> consecutive heartbeats without it (>= 1).
        unknown: node id -> run ``(job_id, attempt)`` listed there but not known there -> consecutive
            heartbeats listing it (>= 1).
        last_us: node id -> time of the last heartbeat counted, µs UTC.

    Only the node's latest heartbeat's counters are kept (each heartbeat replaces its node's maps), so
    the size is bounded by the replicas the nodes host or report.
    """

    missing: dict[str, dict[ReplicaKey, int]] = field(default_factory=dict)
    unknown: dict[str, dict[RunKey, int]] = field(default_factory=dict)
    last_us: dict[str, Micros] = field(default_factory=dict)


def known_here(cluster: ClusterState, node_id: str, key: RunKey) -> bool:
    """True when run ``key`` has an open replica placed on ``node_id``."""
    run = cluster.runs.get(key)
    return run is not None and any(run.placements[r].node_id == node_id for r in run.open_replicas)


def _expected(run: Run, node_id: str, awaiting: Mapping[RunKey, object], t_us: Micros) -> list[int]:
    """Replicas of ``run`` the node must be running at ``t_us`` (see the module docstring)."""
    if run.stopping or run.key in awaiting or run.placed_at_us >= t_us:
        return []
    return [r for r in sorted(run.open_replicas & run.started_replicas) if run.placements[r].node_id == node_id]


def observe(ab: Absences, cluster: ClusterState, awaiting: Mapping[RunKey, object], hb: NodeHeartbeat) -> None:
    """Fold one heartbeat into ``ab`` (in place), given the cluster state *before* the heartbeat.

    Args:
        ab: the counters.
        cluster: the dispatcher's nodes and runs.
        awaiting: preemptor runs still waiting for their victims (no ``StartWorkload`` sent yet).
        hb: the heartbeat.
    """
    nid = hb.node_id
    if nid not in cluster.nodes:
        return
    t = to_us(hb.ts)
    last = ab.last_us.get(nid)
    if last is not None and t <= last:
        return
    ab.last_us[nid] = t
    listed = {(w.job_id, w.attempt, w.replica) for w in hb.running}
    old_missing = ab.missing.get(nid, {})
    missing: dict[ReplicaKey, int] = {}
    for key in sorted(cluster.node_runs.get(nid, ())):
        run = cluster.runs.get(key)
        if run is None:
            continue
        for r in _expected(run, nid, awaiting, t):
            rk = (key[0], key[1], r)
            if rk not in listed:
                missing[rk] = old_missing.get(rk, 0) + 1
    old_unknown = ab.unknown.get(nid, {})
    unknown: dict[RunKey, int] = {}
    for key in sorted({(j, a) for j, a, _ in listed}):
        if not known_here(cluster, nid, key):
            unknown[key] = old_unknown.get(key, 0) + 1
    _put(ab.missing, nid, missing)
    _put(ab.unknown, nid, unknown)


def _put(d: dict[str, Any], nid: str, value: dict[Any, int]) -> None:
    if value:
        d[nid] = value
    else:
        d.pop(nid, None)


def findings(ab: Absences, cluster: ClusterState, node_id: str, misses: int) -> tuple[list[RunKey], list[RunKey]]:
    """What the node's latest heartbeat calls for: ``(lost runs, runs to stop)``, each sorted.

    Args:
        ab: the counters, with the heartbeat folded (:func:`observe`).
        cluster: the dispatcher's nodes and runs (the heartbeat folded too).
        node_id: the heartbeat's node.
        misses: consecutive heartbeats that make a disagreement real (>= 1).

    Returns:
        ``lost``: runs with a replica on the node missing from at least ``misses`` heartbeats in a row
        (still open, not stopping); ``stop``: runs listed by at least ``misses`` heartbeats in a row
        with no open replica on the node.
    """
    lost = sorted(
        {
            (j, a)
            for (j, a, r), n in ab.missing.get(node_id, {}).items()
            if n >= misses and _still_open(cluster, (j, a), r, node_id)
        }
    )
    stop = sorted(
        k for k, n in ab.unknown.get(node_id, {}).items() if n >= misses and not known_here(cluster, node_id, k)
    )
    return lost, stop


def _still_open(cluster: ClusterState, key: RunKey, replica: int, node_id: str) -> bool:
    run = cluster.runs.get(key)
    return (
        run is not None
        and not run.stopping
        and replica in run.open_replicas
        and run.placements[replica].node_id == node_id
    )
