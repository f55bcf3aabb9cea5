"""Cluster state folded from node and job events (DESIGN sections 1 and 3).

:class:`ClusterState` is the dispatcher's live view of the machines: every
node (GPU count, model, state, free GPU indices, last heartbeat) and every
run (a job attempt holding GPUs: budget, placements, placed/started time,
protection expiry). It is a fold: :meth:`ClusterState.apply` takes one event
and changes the state; nothing else writes it.

A scheduling cycle never reads live state: :meth:`ClusterState.snapshot`
returns a :class:`ClusterSnapshot` that shares the frozen :class:`Node` and
:class:`Run` values with the live state (copy-on-write: the live state
replaces a value, it never mutates one), so taking a snapshot is a couple
of C-speed dict copies, not a deep copy.

Fold rules:

* ``NodeRegistered`` -> ``ready`` with ``gpu_count`` GPUs (indices
  ``0..gpu_count-1``); GPUs still held by runs stay held. Counts as a
  heartbeat.
* ``NodeHeartbeat`` -> last heartbeat time. ``NodeCordoned`` ->
  ``cordoned``; ``NodeDrainRequested`` -> ``draining``; ``NodeDrained`` ->
  ``drained``; ``NodeUncordoned`` -> ``ready``; ``NodeLost`` -> ``lost``.
  Only ``ready`` nodes take new work.
* ``JobPlaced`` -> a run holding the GPUs in its placements (they leave the
  node's free set; GPUs of a *stopping* victim are taken over).
* ``JobStarted`` -> ``started_at`` (the latest replica start; protection
  runs from there).
* ``JobPreempted`` -> the run is *stopping*: it no longer counts as running
  work (it is not a candidate for anything), but its GPUs that the
  preemptor did not take stay held until the job is requeued, so nothing
  else lands on a GPU whose process is still shutting down (SIGTERM grace).
* ``JobRequeued`` (attempt a) -> run (job, a-1) is gone; its remaining GPUs
  are free.
* ``JobCompleted``/``JobFailed`` with ``replica`` -> that replica's GPUs are
  free (the run ends when all replicas have); without ``replica`` -> the
  whole run. A report for a stopping run is ignored (the requeue frees it).
* ``JobCancelled`` (with attempt) and ``JobLost`` -> the whole run is gone,
  its GPUs free.

Events for unknown nodes or runs are ignored, so duplicates are harmless.
Times are int microseconds since the epoch, UTC.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from apportion.events import (
    Event,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    NodeCordoned,
    NodeDrained,
    NodeDrainRequested,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
    Placement,
)
from apportion.timeutil import Micros, s_to_us, to_us

__all__ = ["Node", "Run", "RunKey", "ClusterState", "ClusterSnapshot", "NODE_STATES"]

#: Node states (DESIGN section 1). Only ``ready`` nodes take new work.
NODE_STATES = ("ready", "cordoned", "draining", "drained", "lost")

#: ``protected_until_us`` of an allocated run not every replica of which has started:
#: protected until it has (far beyond any real event time).
UNTIL_STARTED: Micros = 2**62

RunKey = tuple[str, int]
"""A run is one attempt of a job: ``(job_id, attempt)``."""

_STATE_OF: dict[type, str] = {
    NodeCordoned: "cordoned",
    NodeDrainRequested: "draining",
    NodeDrained: "drained",
    NodeUncordoned: "ready",
}


@dataclass(frozen=True, slots=True)
class Node:
    """One machine.

    Attributes:
        node_id: its id (the tie-break of best fit).
        gpu_count: GPUs it has (indices ``0..gpu_count-1``).
        gpu_model: GPU model name, or ``None`` when unknown.
        state: one of :data:`NODE_STATES`.
        free: GPU indices held by no run (stopping runs still hold theirs).
        last_heartbeat_us: last heartbeat (or registration), µs UTC.
    """

    node_id: str
    gpu_count: int
    gpu_model: str | None
    state: str
    free: frozenset[int]
    last_heartbeat_us: Micros | None = None

    @property
    def schedulable(self) -> bool:
        """True when new work may land here (state ``ready``)."""
        return self.state == "ready"


@dataclass(frozen=True, slots=True)
class Run:
    """A run: one attempt of a job, holding GPUs on one node per replica.

    Attributes:
        job_id, attempt: identity (``key``).
        budget: budget path charged (when ``allocated``).
        user: submitting user.
        allocated: ``min_runtime_us > 0``.
        gpus_per_replica, replicas: the gang shape g x k.
        min_runtime_us: protection length, µs.
        placements: one per replica, in replica order.
        placed_at_us: when ``JobPlaced`` was logged, µs UTC.
        started_at_us: latest ``JobStarted`` of a replica, or ``None``.
        started_replicas: replicas that reported ``JobStarted``.
        submitted_at_us: original submission time (kept across requeues).
        open_replicas: replicas still holding GPUs.
        stopping: preempted, waiting for its processes to stop.
        duration_s, command: the workload (re-sent on requeue).
        gpu_model: requested model, or ``None``.
    """

    job_id: str
    attempt: int
    budget: str
    user: str
    allocated: bool
    gpus_per_replica: int
    replicas: int
    min_runtime_us: Micros
    placements: tuple[Placement, ...]
    placed_at_us: Micros
    submitted_at_us: Micros
    started_at_us: Micros | None = None
    started_replicas: frozenset[int] = frozenset()
    open_replicas: frozenset[int] = frozenset()
    stopping: bool = False

    @property
    def key(self) -> RunKey:
        """``(job_id, attempt)``."""
        return (self.job_id, self.attempt)

    @property
    def gpus(self) -> int:
        """GPUs of the whole gang, g * k."""
        return self.gpus_per_replica * self.replicas

    @property
    def protected_until_us(self) -> Micros | None:
        """End of minimum-runtime protection, µs UTC; ``None`` when unallocated.

        Protection runs for ``min_runtime`` from the latest replica start
        (DESIGN section 3: "protected from preemption for min_runtime after
        each start"). Until every replica has reported ``JobStarted`` the run
        is protected outright (:data:`UNTIL_STARTED`): a start that the
        dispatcher has not yet read must not shorten the promise. (Counting
        from the placement instead let the live stack preempt a job whose
        ``JobStarted`` was still in flight, which the audit rightly flags.)
        """
        if not self.allocated:
            return None
        if len(self.started_replicas) < self.replicas:
            return UNTIL_STARTED
        return (self.started_at_us or self.placed_at_us) + self.min_runtime_us

    def protected(self, now_us: Micros) -> bool:
        """True when the run may not be preempted at ``now_us`` (allocated and inside its window)."""
        until = self.protected_until_us
        return until is not None and now_us < until


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """Immutable view of the cluster for one scheduling cycle.

    Attributes:
        nodes: node id -> :class:`Node`.
        runs: run key -> :class:`Run` (stopping runs included; check ``stopping``).
        node_runs: node id -> keys of runs with a replica there.
        order: every node id, sorted (cached by the live state).
    """

    nodes: Mapping[str, Node]
    runs: Mapping[RunKey, Run]
    node_runs: Mapping[str, frozenset[RunKey]]
    order: tuple[str, ...] | None = None
    """Node ids sorted (``None``: sort ``nodes`` yourself)."""


class ClusterState:
    """The live cluster, folded from node and job events (see module docstring).

    Mutable on purpose (the dispatcher folds every event); values inside
    are frozen and replaced, so :meth:`snapshot` is cheap and safe.
    """

    __slots__ = ("nodes", "runs", "node_runs", "_owner", "_order", "changed", "changed_nodes")

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self.runs: dict[RunKey, Run] = {}
        self.node_runs: dict[str, frozenset[RunKey]] = {}
        # (node, gpu) -> run holding it; a preemptor takes over a stopping victim's GPUs
        self._owner: dict[tuple[str, int], RunKey] = {}
        self._order: tuple[str, ...] | None = None
        #: Keys of runs added, replaced or removed since the last reader cleared it, or
        #: ``None`` (the default: not tracked). An incremental index over ``runs``
        #: (:class:`apportion.domain.engine.VictimIndex`) switches it on and drains it.
        self.changed: set[RunKey] | None = None
        #: The same for node ids whose :class:`Node` was replaced (read by
        #: :class:`apportion.domain.engine.FreeIndex`).
        self.changed_nodes: set[str] | None = None

    # ------------------------------------------------------------------ queries

    def snapshot(self) -> ClusterSnapshot:
        """Immutable view for a scheduling cycle (shallow copies of frozen values)."""
        if self._order is None or len(self._order) != len(self.nodes):
            self._order = tuple(sorted(self.nodes))
        return ClusterSnapshot(dict(self.nodes), dict(self.runs), dict(self.node_runs), self._order)

    def view(self) -> ClusterSnapshot:
        """:meth:`snapshot` without the copies: the live dicts, valid only until the next ``apply``.

        For a caller that reads it synchronously and keeps nothing (the
        dispatcher's own cycle runs the engine on it; the engine never writes).
        """
        if self._order is None or len(self._order) != len(self.nodes):
            self._order = tuple(sorted(self.nodes))
        return ClusterSnapshot(self.nodes, self.runs, self.node_runs, self._order)

    def runs_on(self, node_id: str) -> list[Run]:
        """Runs with a replica on ``node_id``, sorted by key."""
        return [self.runs[k] for k in sorted(self.node_runs.get(node_id, ()))]

    # ------------------------------------------------------------------ folding

    def apply(self, ev: Event) -> None:
        """Fold one event (unknown types are ignored). See the module docstring."""
        cls = type(ev)
        if cls is JobPlaced:
            self._placed(ev)  # type: ignore[arg-type]
        elif cls is JobStarted:
            run = self.runs.get((ev.job_id, ev.attempt))  # type: ignore[attr-defined]
            if run is not None:
                t = to_us(ev.ts)
                started = run.started_replicas | {ev.replica}  # type: ignore[attr-defined]
                if run.started_at_us is None or t > run.started_at_us or started != run.started_replicas:
                    self.runs[run.key] = replace(
                        run, started_at_us=max(t, run.started_at_us or t), started_replicas=started
                    )
                    if self.changed is not None:
                        self.changed.add(run.key)
        elif cls is JobCompleted or cls is JobFailed:
            run = self.runs.get((ev.job_id, ev.attempt))  # type: ignore[attr-defined]
            if run is not None and not run.stopping:
                self._release(run, ev.replica)  # type: ignore[attr-defined]
        elif cls is JobPreempted:
            run = self.runs.get((ev.job_id, ev.attempt))  # type: ignore[attr-defined]
            if run is not None and not run.stopping:
                self.runs[run.key] = replace(run, stopping=True)
                if self.changed is not None:
                    self.changed.add(run.key)
        elif cls is JobRequeued:
            run = self.runs.get((ev.job_id, ev.attempt - 1))  # type: ignore[attr-defined]
            if run is not None:
                self._release(run, None)
        elif cls is JobCancelled or cls is JobLost:
            attempt = ev.attempt  # type: ignore[attr-defined]
            run = self.runs.get((ev.job_id, attempt)) if attempt is not None else None  # type: ignore[attr-defined]
            if run is not None:
                self._release(run, None)
        elif cls is NodeHeartbeat:
            node = self.nodes.get(ev.node_id)  # type: ignore[attr-defined]
            if node is not None and node.state != "lost":
                self.nodes[node.node_id] = replace(node, last_heartbeat_us=to_us(ev.ts))
                if self.changed_nodes is not None:
                    self.changed_nodes.add(node.node_id)
        elif cls is NodeRegistered:
            self._registered(ev)  # type: ignore[arg-type]
        elif cls in _STATE_OF:
            node = self.nodes.get(ev.node_id)  # type: ignore[attr-defined]
            if node is not None and node.state != "lost":
                self.nodes[node.node_id] = replace(node, state=_STATE_OF[cls])
                if self.changed_nodes is not None:
                    self.changed_nodes.add(node.node_id)
        elif cls is NodeLost:
            node = self.nodes.get(ev.node_id)  # type: ignore[attr-defined]
            if node is not None:
                self.nodes[node.node_id] = replace(node, state="lost")
                if self.changed_nodes is not None:
                    self.changed_nodes.add(node.node_id)

    def _registered(self, ev: NodeRegistered) -> None:
        held = {g for (n, g) in self._owner if n == ev.node_id} if ev.node_id in self.node_runs else set()
        free = frozenset(i for i in range(ev.gpu_count) if i not in held)
        self.nodes[ev.node_id] = Node(ev.node_id, ev.gpu_count, ev.gpu_model, "ready", free, to_us(ev.ts))
        if self.changed_nodes is not None:
            self.changed_nodes.add(ev.node_id)
        self.node_runs.setdefault(ev.node_id, frozenset())

    def _placed(self, ev: JobPlaced) -> None:
        key = (ev.job_id, ev.attempt)
        if key in self.runs:
            return
        self.runs[key] = Run(
            job_id=ev.job_id,
            attempt=ev.attempt,
            budget=ev.budget,
            user=ev.user,
            allocated=ev.allocated,
            gpus_per_replica=ev.gpus_per_replica,
            replicas=ev.replicas,
            min_runtime_us=s_to_us(ev.min_runtime_s),
            placements=ev.placements,
            placed_at_us=to_us(ev.ts),
            submitted_at_us=to_us(ev.submitted_at),
            open_replicas=frozenset(range(len(ev.placements))),
        )
        if self.changed is not None:
            self.changed.add(key)
        owner = self._owner
        for p in ev.placements:
            node = self.nodes.get(p.node_id)
            for g in p.gpus:
                owner[(p.node_id, g)] = key
            if node is not None:
                self.nodes[p.node_id] = Node(
                    node.node_id,
                    node.gpu_count,
                    node.gpu_model,
                    node.state,
                    node.free.difference(p.gpus),
                    node.last_heartbeat_us,
                )
                if self.changed_nodes is not None:
                    self.changed_nodes.add(p.node_id)
            self.node_runs[p.node_id] = self.node_runs.get(p.node_id, frozenset()) | {key}

    def _release(self, run: Run, replica: int | None) -> None:
        """Free the GPUs of one replica (or all open ones) that ``run`` still owns."""
        key = run.key
        which = run.open_replicas if replica is None else ({replica} & run.open_replicas)
        if not which:
            return
        owner = self._owner
        for r in sorted(which):
            p = run.placements[r]
            mine = [g for g in p.gpus if owner.get((p.node_id, g)) == key]
            for g in mine:
                del owner[(p.node_id, g)]
            node = self.nodes.get(p.node_id)
            if node is not None and mine:
                self.nodes[p.node_id] = Node(
                    node.node_id,
                    node.gpu_count,
                    node.gpu_model,
                    node.state,
                    node.free.union(g for g in mine if g < node.gpu_count),
                    node.last_heartbeat_us,
                )
                if self.changed_nodes is not None:
                    self.changed_nodes.add(p.node_id)
            rest = self.node_runs.get(p.node_id, frozenset()) - {key}
            self.node_runs[p.node_id] = rest
        left = run.open_replicas - which
        if self.changed is not None:
            self.changed.add(key)
        if left:
            self.runs[key] = replace(run, open_replicas=left)
        else:
            del self.runs[key]
