"""Cluster state folded from node and job events (design D1 and D3).

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
* ``NodeHeartbeat`` -> last heartbeat time. ``NodeCordoned``,
  ``NodeDrainRequested``, ``NodeDrained``, ``NodeUncordoned``, ``NodeLost``
  -> the state :func:`apportion.domain.nodes.node_transition` gives (the
  one node state machine: cordoned, draining, drained, ready, lost; a lost
  node ignores them). Only ``ready`` nodes take new work.
* ``JobPlaced`` -> a run holding the GPUs in its placements (they leave the
  node's free set; GPUs of a *stopping* victim are taken over).
* ``JobStarted`` -> ``started_at`` (the latest replica start; protection
  runs from there, for :func:`protection_s` recorded by the decision).
* ``JobCheckpointed`` -> the replica's latest checkpoint (time, progress,
  the progress bounded by the work time the job has had: :func:`progress_bound_s`,
  rule D3.checkpoints); a gang's checkpoint is the smallest over its replicas' latest ones
  (:attr:`Run.checkpoint_us`, :attr:`Run.checkpoint_progress_s`), and the
  job's resume point (:attr:`ClusterState.progress`) follows it across
  attempts. Work lost is :func:`work_lost_gpu_s`.
* ``JobPreempted`` -> the job's preemption count
  (:attr:`ClusterState.preemptions`) grows by one and the run is *stopping*: it no longer counts as running
  work (it is not a candidate for anything), but its GPUs that the
  preemptor did not take stay held until the job is requeued, so nothing
  else lands on a GPU whose process is still shutting down (SIGTERM grace).
* ``JobRequeued`` (attempt a) -> run (job, a-1) is gone; its remaining GPUs
  are free.
* ``JobCompleted``/``JobFailed`` with ``replica`` -> that replica's GPUs are
  free (the run ends when all replicas have); without ``replica`` -> the
  whole run. A report for a stopping run is ignored (the requeue frees it).
* ``JobCancelled`` (with attempt) -> the whole run is gone, its GPUs free.
* ``JobLost`` -> the replicas on the lost node are gone (their GPUs free);
  a gang's replicas on other nodes are being stopped with the normal grace
  period, so the run is *stopping* and they keep their GPUs until the job
  is requeued (as for a preemption). A job that ended (completed, cancelled, or failed as a
  whole run) leaves the per-job tables.

Events for unknown nodes or runs are ignored, so duplicates are harmless.
Times are int microseconds since the epoch, UTC.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import datetime
from typing import Any

from apportion.domain.nodes import NODE_EVENT_TYPES, SCHEDULABLE, NodeState, node_transition
from apportion.events import (
    Event,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    JobStarted,
    NodeHeartbeat,
    NodeRegistered,
    Placement,
    is_allocated,
)
from apportion.timeutil import Micros, s_to_us, to_us

__all__ = [
    "Node",
    "Run",
    "RunKey",
    "ClusterState",
    "ClusterSnapshot",
    "PROTECTION_CAP_W",
    "PROTECTION_DOUBLINGS",
    "PROTECTION_CHURN_BOUND",
    "PROTECTION_GROW_OVER_SHARE",
    "PROTECTION_UNTIL_DONE_S",
    "protection_s",
    "work_ref_us",
    "work_lost_gpu_s",
    "placed_protection_us",
    "placed_run",
]

#: ``protected_until_us`` of an allocated run not every replica of which has started:
#: protected until it has (far beyond any real event time).
UNTIL_STARTED: Micros = 2**62

RunKey = tuple[str, int]
"""A run is one attempt of a job: ``(job_id, attempt)``."""


#: Most doublings :func:`protection_s` applies (2**60 x any minimum runtime is past every cap).
_MAX_DOUBLINGS = 60

PROTECTION_CAP_W = 0.25
"""Default cap of the protection growth, as a fraction of the window W (``EngineConfig.protection_cap_w``):
``W / 4``, the example of rule D3.bounded-churn, since policy ``fairtree-6``. Policies ``fairtree-4`` and ``fairtree-5``
capped at the whole window W, because without a churn bound a job longer than the sum of its protections was
preempted every 42 h once the W / 4 cap was reached (six times for a 187 h job of Philly week 44); with :data:`PROTECTION_CHURN_BOUND` that job is protected until done after its fifth preemption,
and the shorter cap holds long jobs' GPUs for less time between preemptions: weeks 39-45 mean share deficit
0.51 pp against 0.69 pp with the cap W (``CHANGELOG.md``, "Engine policy versions")."""


PROTECTION_DOUBLINGS = 3
"""Default ``EngineConfig.protection_doublings`` (policy ``fairtree-5``): the protection doubles for a job's first
3 preemptions (``min_runtime`` x 1, 2, 4, 8) and is the cap from its 4th on. With doubling to the cap (up to
``fairtree-4``) a 2 h minimum runtime needs 7 preemptions to reach a 7-day window, so the longest Philly jobs
(560-730 h) were preempted up to 8 times on weeks 39-45 (``CHANGELOG.md``, "Engine policy versions")."""


PROTECTION_CHURN_BOUND: int | None = 5
"""Default ``EngineConfig.churn_bound``: preemptions after which a job is protected until it completes
(:data:`PROTECTION_UNTIL_DONE_S`), so no allocated job is preempted more than 5 times;
5 since policy ``fairtree-6``, ``None`` (off) up to ``fairtree-5``."""

PROTECTION_GROW_OVER_SHARE = False
"""Default ``EngineConfig.grow_over_share`` (policy ``fairtree-10``): a job's protection grows with its preemptions
only where its budget is at or under its share (r <= 1) when placed; a borrower (r > 1) is protected for its minimum
runtime whatever its preemptions, the churn bound still applying. True (every job grows) up to ``fairtree-9``."""

PROTECTION_UNTIL_DONE_S = 100 * 365.0 * 86400
"""Protection "until the job completes", seconds: 100 years, past any run, and finite so that it is a
``JobPlaced`` number (JSON) and a :attr:`Run.protection_us` integer like any other protection."""


def protection_s(
    min_runtime_s: float,
    preemptions: int,
    max_min_runtime_s: float | None = None,
    window_s: float | None = None,
    window_fraction: float = PROTECTION_CAP_W,
    doublings: int | None = PROTECTION_DOUBLINGS,
    churn_bound: int | None = PROTECTION_CHURN_BOUND,
    progress_after: int | None = None,
    progress_s: float = 0.0,
    at_share_bound: int | None = None,
    ratio: float | None = None,
    grow_over_share: bool = True,
) -> float:
    """Length of a run's preemption protection, seconds: the one home of rule D3.bounded-churn.

    ``min_runtime * 2**preemptions`` for the first ``doublings`` preemptions and the cap from then on
    (``None``: doubling all the way, as up to policy ``fairtree-4``), capped by the budget's ``max_min_runtime``
    and by ``W x window_fraction`` (default :data:`PROTECTION_CAP_W`, ``W / 4``, the example of rule D3.bounded-churn,
    as up to policy
    ``fairtree-3`` and since ``fairtree-6``; the whole window in ``fairtree-4`` and ``-5``), and never below ``min_runtime`` (the caps bound the
    growth, not the promise of the contract: "protected for min_runtime
    after each start"). ``preemptions`` counts how many times the job was
    preempted before this attempt (its ``JobPreempted`` events in the log),
    so a job that keeps being preempted is protected for longer each time
    and finishes. Unallocated jobs (``min_runtime_s <= 0``) get 0.

    The engine calls it when it places a job and records the value in
    ``Decision.protection_s``; :class:`ClusterState` folds that value into
    :attr:`Run.protection_us`; the audit
    (:func:`apportion.audit.replay.preemption_report`) recomputes it from
    the log with this same function.

    Args:
        min_runtime_s: the job's minimum runtime, seconds.
        preemptions: times the job was preempted before (>= 0).
        max_min_runtime_s: the budget's (inherited) ``max_min_runtime``,
            seconds, or ``None`` (no cap).
        window_s: occupancy window W, seconds, or ``None`` (no cap).
        window_fraction: the growth cap as a fraction of W (``EngineConfig.protection_cap_w``).
        doublings: preemptions after which the protection is the cap (``EngineConfig.protection_doublings``,
            default :data:`PROTECTION_DOUBLINGS`); ``None`` doubles without a jump.
        churn_bound: preemptions after which the job is protected until it completes
            (:data:`PROTECTION_UNTIL_DONE_S`, past the W cap; ``EngineConfig.churn_bound``), so no allocated
            job is preempted more than ``churn_bound`` times (default :data:`PROTECTION_CHURN_BOUND`, 5);
            ``None``: no such bound. A budget's
            ``max_min_runtime`` still caps it (an admin who sets one chooses turnover over the bound).
        progress_after: preemptions from which the protection is at least ``progress_s`` (the work the job has
            saved so far), under the same caps (``EngineConfig.progress_after``; ``None``, the default: off), so a
            long job that has done much work is protected for longer than a short one preempted as often.
        progress_s: the job's checkpointed progress, seconds (where this attempt resumes).
        at_share_bound: the churn bound of a job whose budget is at or under its share (``ratio <= 1``) when
            placed, in place of ``churn_bound`` when lower (``EngineConfig.at_share_bound``; ``None``, the default:
            off), so a job over its share keeps the longer bound and gives borrowed GPUs back sooner.
        ratio: the r of the job's budget when placed (its ``Decision.ratio``), or ``None`` (unknown: over).
        grow_over_share: False: only a job whose budget is at or under its share (``ratio <= 1``) when placed has
            its protection grown with its preemptions; a job over its share (or of unknown ``ratio``) is protected
            for its ``min_runtime`` whatever its preemption count, the churn bound still applying
            (``EngineConfig.grow_over_share``, default :data:`PROTECTION_GROW_OVER_SHARE`, False since policy
            ``fairtree-10``). True, this function's default (a caller that knows no ratio): every job grows, as up
            to ``fairtree-9``.

    The jump cannot be gamed into more than the contract allows: the cap is the budget's ``max_min_runtime``
    (or W), which is what the job could have declared as its minimum runtime at admission, and no job can
    preempt another of its own leaf budget, so a user cannot collect preemptions of their own job. The same holds
    for the churn bound: without a ``max_min_runtime`` a job may declare any minimum runtime at admission (there is
    no limit), so "until it completes" gives it nothing it could not have asked for; with one, the bound stops at it.

    Returns:
        Protection in seconds (``min_runtime_s <= result``).

    >>> protection_s(60.0, 0), protection_s(60.0, 3), protection_s(60.0, 3, max_min_runtime_s=300.0)
    (60.0, 480.0, 300.0)
    >>> protection_s(3600.0, 4, window_s=4 * 7200.0), protection_s(3600.0, 1, max_min_runtime_s=60.0)
    (7200.0, 3600.0)
    >>> protection_s(3600.0, 10, window_s=7200.0, window_fraction=1.0, churn_bound=None)
    7200.0
    >>> protection_s(7200.0, 3, window_s=604800.0), protection_s(7200.0, 4, window_s=604800.0)
    (57600.0, 151200.0)
    >>> protection_s(7200.0, 4, window_s=604800.0, window_fraction=1.0, churn_bound=None)
    604800.0
    >>> protection_s(7200.0, 4, window_s=604800.0, doublings=None), protection_s(60.0, 4, doublings=3)
    (115200.0, inf)
    >>> protection_s(7200.0, 5, window_s=604800.0), protection_s(7200.0, 5, churn_bound=None)
    (3153600000.0, inf)
    >>> protection_s(7200.0, 1, window_s=604800.0, progress_after=1, progress_s=90000.0)
    90000.0
    >>> protection_s(7200.0, 3, window_s=604800.0, at_share_bound=3, ratio=0.9)
    3153600000.0
    >>> [protection_s(7200.0, 2, window_s=604800.0, ratio=r, grow_over_share=False) for r in (1.0, 1.01, None)]
    [28800.0, 7200.0, 7200.0]
    >>> protection_s(7200.0, 5, window_s=604800.0, ratio=1.5, grow_over_share=False)
    3153600000.0
    """
    if not is_allocated(min_runtime_s):
        return 0.0
    if preemptions <= 0:
        return min_runtime_s  # the common case: every cap is >= min_runtime's promise
    if at_share_bound is not None and ratio is not None and ratio <= 1.0:
        churn_bound = at_share_bound if churn_bound is None or at_share_bound < churn_bound else churn_bound
    if churn_bound is not None and preemptions >= churn_bound:
        # the most the job could have declared at admission: max_min_runtime, else any length (no limit)
        if max_min_runtime_s is None:
            return PROTECTION_UNTIL_DONE_S
        return max_min_runtime_s if max_min_runtime_s > min_runtime_s else min_runtime_s
    if not grow_over_share and (ratio is None or ratio > 1.0):
        return min_runtime_s  # over its share: the contract's promise, not grown
    if doublings is not None and preemptions > doublings:
        grown = math.inf  # past the doublings: the caps alone
    else:
        grown = min_runtime_s * 2.0 ** (preemptions if preemptions < _MAX_DOUBLINGS else _MAX_DOUBLINGS)
    if progress_after is not None and preemptions >= progress_after and progress_s > grown:
        grown = progress_s  # the work done so far, under the same caps
    cap = math.inf if max_min_runtime_s is None else max_min_runtime_s
    if window_s is not None and window_s * window_fraction < cap:
        cap = window_s * window_fraction
    if grown > cap:
        grown = cap
    return grown if grown > min_runtime_s else min_runtime_s


def placed_protection_us(ev: JobPlaced) -> Micros:
    """Protection length of the run ``ev`` placed, µs (0 for unallocated).

    ``Decision.protection_s`` (what :func:`protection_s` gave the engine)
    when recorded; a record without it was decided before protection grew
    with preemptions, when it was ``min_runtime``.
    """
    if not ev.allocated:
        return 0
    p = ev.decision.protection_s
    return s_to_us(ev.min_runtime_s if p is None else p)


@dataclass(frozen=True, slots=True)
class Node:
    """One machine.

    Attributes:
        node_id: its id (the tie-break of best fit).
        gpu_count: GPUs it has (indices ``0..gpu_count-1``).
        gpu_model: GPU model name, or ``None`` when unknown.
        state: one of :data:`~apportion.domain.nodes.NODE_STATES` (:func:`~apportion.domain.nodes.node_transition`).
        free: GPU indices held by no run (stopping runs still hold theirs).
        last_heartbeat_us: last heartbeat (or registration), µs UTC.
        block, rack: its place in the network as registered (rule ``D1.topology``), or ``None``.
    """

    node_id: str
    gpu_count: int
    gpu_model: str | None
    state: NodeState
    free: frozenset[int]
    last_heartbeat_us: Micros | None = None
    block: str | None = None
    rack: str | None = None

    @property
    def schedulable(self) -> bool:
        """True when new work may land here (state ``ready``)."""
        return self.state == SCHEDULABLE


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
        protection_us: protection length, µs (:func:`protection_s`, recorded
            in the placement's decision); ``None``: ``min_runtime_us``.
        preemptions: times the job had been preempted before this attempt.
        resumed_from_s: job progress (seconds of work) this attempt resumed from.
        checkpoints: per replica, its latest checkpoint ``(replica, at µs UTC,
            progress s)``, sorted by replica.
        checkpoint_interval_us: its checkpoint interval in force, µs
            (``JobPlaced.checkpoint_interval_s``), or ``None`` (none expected).
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
    protection_us: Micros | None = None
    preemptions: int = 0
    resumed_from_s: float = 0.0
    checkpoints: tuple[tuple[int, Micros, float], ...] = ()
    checkpoint_interval_us: Micros | None = None

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

        Protection runs for :attr:`protection_us` (:func:`protection_s`: the
        minimum runtime, grown with the job's preemptions) from the latest
        replica start (rule D1.allocated-job: "protected from preemption for
        min_runtime after each start"). Until every replica has reported ``JobStarted`` the run
        is protected outright (:data:`UNTIL_STARTED`): a start that the
        dispatcher has not yet read must not shorten the promise. (Counting
        from the placement instead let the live stack preempt a job whose
        ``JobStarted`` was still in flight, which the audit rightly flags.)
        """
        if not self.allocated:
            return None
        if len(self.started_replicas) < self.replicas:
            return UNTIL_STARTED
        length = self.min_runtime_us if self.protection_us is None else self.protection_us
        return (self.started_at_us or self.placed_at_us) + length

    @property
    def checkpoint_us(self) -> Micros | None:
        """Time of the run's last checkpoint, µs UTC, or ``None``.

        A gang has a checkpoint only when every replica reported one; it is
        then the earliest of the replicas' latest (rule D1.work-lost: work
        after it is not saved by every replica).
        """
        cps = self.checkpoints
        if not cps or len(cps) < self.replicas:
            return None
        return min(c[1] for c in cps)

    @property
    def checkpoint_progress_s(self) -> float | None:
        """Job progress saved by the run's last checkpoint (gang: the smallest over replicas), seconds."""
        cps = self.checkpoints
        if not cps or len(cps) < self.replicas:
            return None
        return min(c[2] for c in cps)

    def protected(self, now_us: Micros) -> bool:
        """True when the run may not be preempted at ``now_us`` (allocated and inside its window)."""
        until = self.protected_until_us
        return until is not None and now_us < until


def work_ref_us(run: Run) -> Micros:
    """Since when a run's work is unsaved, µs UTC: the later of its start and its last checkpoint.

    Start is the latest replica's ``JobStarted`` (the placement time while
    none is recorded). Independent of the time of asking, so the victim
    order built on it (:func:`apportion.domain.engine.order_key`) can be
    indexed across cycles.
    """
    start = run.started_at_us if run.started_at_us is not None else run.placed_at_us
    cp = run.checkpoint_us
    return start if cp is None or cp < start else cp


def next_checkpoint_us(run: Run) -> Micros | None:
    """When ``run`` is expected to save its next checkpoint, µs UTC, or ``None`` (no interval known).

    :func:`work_ref_us` (its start or last checkpoint) plus its checkpoint
    interval in force (``JobPlaced.checkpoint_interval_s``: declared, else the
    minimum runtime, rule D1.checkpoint). A prediction, not a promise: a run
    that misses it is simply overdue (the time is then in the past), which
    :func:`~apportion.domain.preemption.checkpoint_rule` reads as "nothing to
    wait for".
    """
    every = run.checkpoint_interval_us
    return None if every is None else work_ref_us(run) + every


def progress_bound_s(worked_us: Micros, run: Run, at_us: Micros) -> float:
    """The most progress a replica of ``run`` can report at event time ``at_us``, seconds (rule D3.checkpoints):
    the work time the job has had, ``worked_us`` (its earlier attempts' run time) plus the time since ``run`` was
    placed; a report above it counts as this much."""
    return (worked_us + max(0, at_us - run.placed_at_us)) / 1e6


def work_lost_gpu_s(run: Run, at_us: Micros) -> float:
    """Work lost if ``run`` stops at event time ``at_us`` (rule D1.work-lost), GPU-seconds.

    ``g * k * (at - ref) / 1e6`` with ``ref`` = :func:`work_ref_us` (the
    later of its start and last checkpoint); 0 when ``at_us <= ref``. The
    one home of the quantity: ``JobPreempted.lost_gpu_s``,
    ``Victim.lost_gpu_s``, ``JobLost.lost_gpu_s`` (with ``at`` = the last
    heartbeat) and the victim cost order all come from it.
    """
    d = at_us - work_ref_us(run)
    return run.gpus_per_replica * run.replicas * d / 1e6 if d > 0 else 0.0


def placed_run(ev: JobPlaced, preemptions: int = 0, resumed_from_s: float = 0.0) -> Run:
    """The run ``ev`` places, as folded: every replica open, none started yet; ``preemptions``: times the job
    had been preempted before, ``resumed_from_s``: the progress it resumes from."""
    return Run(
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
        protection_us=placed_protection_us(ev) if ev.allocated else None,
        preemptions=preemptions,
        resumed_from_s=resumed_from_s,
        checkpoint_interval_us=s_to_us(ev.checkpoint_interval_s) if ev.checkpoint_interval_s else None,
    )


_RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Run))


def _run_with(run: Run, **changes: Any) -> Run:
    """``dataclasses.replace(run, **changes)`` without its walk of the field descriptors (a run has no
    ``__post_init__``: the other fields are copied as they are); the folds replace a run at every start,
    preemption and partial release."""
    new = _new(Run)
    for name in _RUN_FIELDS:
        _set(new, name, changes[name] if name in changes else getattr(run, name))
    return new


_new = object.__new__
_set = object.__setattr__


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

    __slots__ = (
        "nodes",
        "runs",
        "node_runs",
        "_owner",
        "_order",
        "changed",
        "changed_nodes",
        "preemptions",
        "progress",
        "worked_us",
        "_folding_ts",
    )

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
        #: job id -> times it was preempted (``JobPreempted`` of a running attempt), kept
        #: across attempts until the job ends: the input of :func:`protection_s`.
        self.preemptions: dict[str, int] = {}
        #: job id -> progress (seconds of work) of its last checkpoint, across attempts
        #: (the gang minimum of the last attempt that checkpointed): where a requeued job resumes.
        self.progress: dict[str, float] = {}
        #: job id -> run time (µs) of its attempts that ended, each from its placement to the event that freed
        #: its last replica, kept until the job ends: with the run in progress, the bound of a reported
        #: progress (:func:`progress_bound_s`).
        self.worked_us: dict[str, Micros] = {}
        self._folding_ts: datetime | None = None  # the time of the event :meth:`apply` folds (it ends a run)

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

    # ------------------------------------------------------------------ folding

    def apply(self, ev: Event) -> None:
        """Fold one event (unknown types are ignored). See the module docstring."""
        self._folding_ts = ev.ts
        if isinstance(ev, JobPlaced):
            self._placed(ev)
        elif isinstance(ev, JobStarted):
            self._started(ev)
        elif isinstance(ev, (JobCompleted, JobFailed)):
            run = self.runs.get((ev.job_id, ev.attempt))
            if run is not None and not run.stopping:
                self._release(run, ev.replica)
                if run.key not in self.runs:  # the whole run ended: the job is done
                    self._job_ended(run.job_id)
        elif isinstance(ev, JobPreempted):
            run = self.runs.get((ev.job_id, ev.attempt))
            if run is not None and not run.stopping:
                self.runs[run.key] = _run_with(run, stopping=True)
                self.preemptions[run.job_id] = self.preemptions.get(run.job_id, 0) + 1
                if self.changed is not None:
                    self.changed.add(run.key)
        elif isinstance(ev, JobCheckpointed):
            self._checkpointed(ev)
        elif isinstance(ev, JobRequeued):
            run = self.runs.get((ev.job_id, ev.attempt - 1))
            if run is not None:
                self._release(run, None)
        elif isinstance(ev, JobCancelled):
            run = self.runs.get((ev.job_id, ev.attempt)) if ev.attempt is not None else None
            if run is not None:
                self._release(run, None)
            self._job_ended(ev.job_id)
        elif isinstance(ev, JobLost):
            run = self.runs.get((ev.job_id, ev.attempt))
            if run is not None:
                self._lost(run, ev.node_id)
        elif isinstance(ev, NodeHeartbeat):
            node = self.nodes.get(ev.node_id)
            if node is not None and node.state != "lost":
                self._set_node(replace(node, last_heartbeat_us=to_us(ev.ts)))
        elif isinstance(ev, NodeRegistered):
            self._registered(ev)
        elif isinstance(ev, NODE_EVENT_TYPES):
            # cordon, drain request, drained, uncordon, loss: the node state machine decides
            node = self.nodes.get(ev.node_id)
            if node is not None:
                new = node_transition(node.state, ev)
                if new != node.state:
                    self._set_node(replace(node, state=new))

    def _set_node(self, node: Node) -> None:
        """Replace a node's value (copy-on-write) and tell the incremental indices."""
        self.nodes[node.node_id] = node
        if self.changed_nodes is not None:
            self.changed_nodes.add(node.node_id)

    def _started(self, ev: JobStarted) -> None:
        """A replica started: the run's latest start (protection runs from it) and its started replicas."""
        run = self.runs.get((ev.job_id, ev.attempt))
        if run is None:
            return
        t = to_us(ev.ts)
        started = run.started_replicas | {ev.replica}
        if run.started_at_us is None or t > run.started_at_us or started != run.started_replicas:
            self.runs[run.key] = _run_with(run, started_at_us=max(t, run.started_at_us or t), started_replicas=started)
            if self.changed is not None:
                self.changed.add(run.key)

    def _lost(self, run: Run, node_id: str) -> None:
        """Node ``node_id`` was lost: free ``run``'s replicas there; the others are stopping."""
        here = [r for r in sorted(run.open_replicas) if run.placements[r].node_id == node_id]
        if len(here) == len(run.open_replicas) or not here:
            self._release(run, None)
            return
        for r in here:
            self._release(run, r)
            run = self.runs[run.key]
        if not run.stopping:
            self.runs[run.key] = _run_with(run, stopping=True)

    def finish(self, key: RunKey) -> None:
        """Run ``key`` completed though it was being stopped (its ``JobCompleted``, stamped before the
        preemption, was in flight): free its GPUs, the job is done (what :meth:`apply` of that report does to
        a run that is not stopping; ``domain.dispatch.evolve`` calls it)."""
        run = self.runs.get(key)
        if run is not None:
            self._release(run, None)
            self._job_ended(run.job_id)

    def _job_ended(self, job_id: str) -> None:
        self.preemptions.pop(job_id, None)
        self.progress.pop(job_id, None)
        self.worked_us.pop(job_id, None)

    def progress_bound_s(self, job_id: str, attempt: int, at_us: Micros) -> float | None:
        """:func:`progress_bound_s` of run ``(job_id, attempt)`` at ``at_us``; ``None`` when the run is not held."""
        run = self.runs.get((job_id, attempt))
        return None if run is None else progress_bound_s(self.worked_us.get(job_id, 0), run, at_us)

    def _checkpointed(self, ev: JobCheckpointed) -> None:
        """A replica (``replica=None``: every replica) saved a checkpoint; stopping runs too (SIGTERM's last one)."""
        run = self.runs.get((ev.job_id, ev.attempt))
        if run is None:
            return
        t = to_us(ev.ts)
        # the workload's word, bounded by the work time the job has had (rule D3.checkpoints)
        progress = min(ev.progress_s, progress_bound_s(self.worked_us.get(run.job_id, 0), run, t))
        which = range(run.replicas) if ev.replica is None else (ev.replica,)
        cps = {c[0]: c for c in run.checkpoints}
        moved = False
        for r in which:
            if not 0 <= r < run.replicas:
                continue
            old = cps.get(r)
            if old is None or t > old[1] or (t == old[1] and progress > old[2]):
                cps[r] = (r, t, progress)
                moved = True
        if not moved:
            return  # a duplicate or an older report
        run = _run_with(run, checkpoints=tuple(cps[r] for r in sorted(cps)))
        self.runs[run.key] = run
        if self.changed is not None:
            self.changed.add(run.key)
        p = run.checkpoint_progress_s
        if p is not None and p > self.progress.get(run.job_id, -1.0):
            self.progress[run.job_id] = p

    def _registered(self, ev: NodeRegistered) -> None:
        held = {g for (n, g) in self._owner if n == ev.node_id} if ev.node_id in self.node_runs else set()
        free = frozenset(i for i in range(ev.gpu_count) if i not in held)
        prev = self.nodes.get(ev.node_id)
        state = node_transition(None if prev is None else prev.state, ev)
        self._set_node(Node(ev.node_id, ev.gpu_count, ev.gpu_model, state, free, to_us(ev.ts), ev.block, ev.rack))
        self.node_runs.setdefault(ev.node_id, frozenset())

    def _placed(self, ev: JobPlaced) -> None:
        key = (ev.job_id, ev.attempt)
        if key in self.runs:
            return
        self.runs[key] = placed_run(ev, self.preemptions.get(ev.job_id, 0), self.progress.get(ev.job_id, 0.0))
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
                    node.block,
                    node.rack,
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
                    node.block,
                    node.rack,
                )
                if self.changed_nodes is not None:
                    self.changed_nodes.add(p.node_id)
            rest = self.node_runs.get(p.node_id, frozenset()) - {key}
            self.node_runs[p.node_id] = rest
        left = run.open_replicas - which
        if self.changed is not None:
            self.changed.add(key)
        if left:
            self.runs[key] = _run_with(run, open_replicas=left)
        else:
            del self.runs[key]
            if self._folding_ts is not None:
                ran = max(0, to_us(self._folding_ts) - run.placed_at_us)
                self.worked_us[run.job_id] = self.worked_us.get(run.job_id, 0) + ran
