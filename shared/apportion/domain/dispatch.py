"""The dispatcher's core: ``evolve`` folds events into :class:`DispatchState`,
``decide`` turns one input (an event or a :class:`Tick`) into new events.

The dispatcher service and the simulator both call :func:`step`, which is
``evolve(input)``, then ``decide``, then ``evolve`` of every output, so the
two run identical logic. All time comes from events and ticks (int µs UTC),
all ids from :func:`det_id`; the same inputs give the same outputs, byte
for byte.

What ``decide`` does per input (design D2 and D3):

* ``JobSubmitted`` -> admission (``admit``): ``JobQueued`` (attempt 1) or
  ``JobRejected`` with a machine-readable reason; a job id seen before is
  rejected as ``duplicate_job``.
* ``JobSubmitted`` with ``hold`` -> ``JobQueued`` then ``JobHeld``.
* ``JobSubmitted`` of a job array (``array``) -> one ``JobQueued`` per element
  (:func:`array_events`), or one ``JobRejected`` of the array id; a cycle sees
  at most the array's throttle minus its running elements of its pending ones,
  lowest indices first (:meth:`DispatchState.pending_now`); a
  ``JobCancelRequested`` of the array id cancels every element still active.
* ``JobHoldRequested`` of a pending job -> ``JobHeld``: the job stays in its
  queue (its ``submitted_at`` and place in the order kept) and no cycle
  places it (:meth:`DispatchState.pending_now`); ``JobReleaseRequested`` of a
  held job -> ``JobReleased``, and cycles see it again in fair-share order.
  A hold of a job that is not pending (running, already held) or a release of
  one that is not held -> ``JobRejected`` of the request (reason ``invalid``);
  of an ended job too; of a job never seen -> nothing.
* ``JobCancelRequested`` -> ``JobCancelled``; a running job also gets
  ``StopWorkload`` per replica (its GPUs are free at once). A cancel of a job
  that already ended (within the window) -> ``JobRejected`` of the request
  (``request="JobCancelRequested"``, reason ``invalid``); of a job never seen -> nothing.
* ``JobFailed`` of one replica of a gang still running -> ``StopWorkload``
  to the other replicas and ``JobFailed`` of the whole run.
* A report (``JobCompleted``/``JobFailed``) for a preempted run whose
  replicas have now all stopped -> the stop is finished (below).
* ``NodeDrainRequested`` -> unallocated runs on the node are preempted at
  once; ``NodeDrained`` if it is already empty.
* ``NodeLost`` (from outside) -> ``JobLost`` (charged to the last
  heartbeat), ``StopWorkload`` to the gang's other replicas, ``JobRequeued``.
* A lost run whose every replica reports a ``JobCompleted`` stamped at or
  before the ``JobLost`` had finished (rule D3.completed-before-loss): read
  while a gang's surviving replicas stop or while the requeued attempt
  waits, the job is finished, not run again (``evolve``, no output); read
  once the next attempt is placed, that attempt gets ``StopWorkload`` per
  replica (grace 0) and ``JobCancelled`` (reason ``completed_before_loss``).
* :class:`Tick` -> maintenance, then the scheduling cycle
  (:func:`apportion.domain.engine.run_cycle`) on the state with the
  maintenance folded in:

  - heartbeat timeout (``heartbeat_timeout_s``, default 30 s; ``None``
    disables) -> ``NodeLost`` and the node-lost handling above;
  - a preempted run whose grace period has passed -> the stop is finished;
  - draining nodes: allocated runs whose protection has expired are
    preempted; a draining node without runs -> ``NodeDrained``.

Finishing a stop: the victim gets ``JobRequeued`` (attempt + 1, original
``submitted_at``) unless it was cancelled or every replica reported a
``JobCompleted`` stamped no later than the preemption (its work was done when
the dispatcher decided: the job is finished, as a replay in event-time order,
which folds the report first, says), and
every preemptor that was waiting only for it gets its ``StartWorkload`` per
replica.

``evolve`` mutates the state in place and returns it (the dispatcher folds
every event; copying per event would cost O(state)). A cycle never sees
live state: it runs on :meth:`DispatchState.cycle_snapshot`, made of
frozen values (copy-on-write lists and dict copies).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from uuid import UUID

from apportion.arrays import element_id, split_element_id
from apportion.domain.admission import NodeShape, Rejection, admit, refused_request_event, time_limit_in_force
from apportion.domain.budgets import BudgetTree, fold_budget_event
from apportion.domain.cluster import (
    PROTECTION_UNTIL_DONE_S,
    ClusterState,
    RunKey,
    placed_protection_us,
    work_lost_gpu_s,
)
from apportion.domain.engine import (
    CycleSnapshot,
    EngineCaches,
    EngineConfig,
    PendingJob,
    pending_order,
    preempt_events,
    run_cycle,
    start_events,
    stop_event,
)
from apportion.domain.engine.reasons import ArrayLimit, Held, RefusedBackoff
from apportion.domain.idle import IdleReports, observe_idle
from apportion.domain.occupancy import OccupancyLedger
from apportion.domain.reconcile import Absences, findings, observe
from apportion.domain.seen import forget_older, older_than_window, sweep_due
from apportion.events import (
    DEFAULT_GRACE_S,
    BudgetBatch,
    BudgetRemoved,
    BudgetSet,
    DispatcherConfigured,
    Event,
    JobCancelled,
    JobCancelRequested,
    JobCompleted,
    JobFailed,
    JobHeld,
    JobHoldRequested,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobReleased,
    JobReleaseRequested,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    NodeCordoned,
    NodeDrained,
    NodeDrainRequested,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    NodeRequestRefused,
    NodeUncordoned,
    RejectReason,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
    det_id,
    is_allocated,
)
from apportion.timeutil import WEEK_S, Micros, from_us, s_to_us, to_us, us_to_s

#: ``WorkloadRefused`` reasons (the code before ": ") after which the start will never happen, so the
#: placement is undone and the job requeued (:func:`undo_refused_start`). Not ``duplicate_start``
#: (the replica runs), ``unknown_run`` (a stop for a run the node does not have) nor
#: ``stale_fencing_token`` (a deposed leader's copy of a command the current leader also sent).
UNDO_ON_REFUSAL = frozenset(
    {
        "missing_fencing_token",
        "fencing_token_out_of_range",
        "before_registration",
        "run_lost",
        "expired_command",
        "unknown_node",
        "unknown_gpus",
        "no_workload",
        "gpus_busy",
        "no_account",
        "cannot_isolate",
    }
)

#: ``WorkloadRefused`` codes that say the node cannot run what it was given (its GPUs are held by something else, or
#: it does not have them): only these count toward cordoning it (``DispatchConfig.cordon_after_refusals``). The
#: other codes of :data:`UNDO_ON_REFUSAL` are not the node's doing: a command from before its latest registration
#: (the agent restarted), an expired one, a run it already lost, a token problem, a node it does not host, a job
#: without workload.
NODE_FAULT_REFUSALS = frozenset({"gpus_busy", "unknown_gpus", "cannot_isolate"})

#: The ``WorkloadRefused`` code of a job whose user has no account the node may run it as (none on the node, uid or
#: gid 0, the agent's own): the same on any other try, so with ``DispatchConfig.fail_on_no_account`` the
#: dispatcher fails the job (``JobFailed``, the refusal as its reason) instead of requeueing it.
NO_ACCOUNT = "no_account"

#: The reason of a ``JobHeld`` or ``JobReleased`` whose request gave none (``queue`` shows a held job's reason).
NO_REASON = "no reason given"

#: How the reason of a ``JobRequeued`` that undid a refused start begins; the refusal's code follows (with
#: ``DispatchConfig.refusal_detail`` the agent's whole reason: ``gpus_busy: GPUs [0] are held by ...``).
REFUSED_START = "start refused: "

#: Kinds of the dispatcher's own events of one instant in the order :func:`decide` makes them: a tick's
#: maintenance (nodes lost, then their runs lost, then requeues and the other job verdicts), then its
#: cycle (preemptions and their stops, a drain's end, placements and their starts). Within a kind the
#: order of emission is kept. The engine emits a placement's victims next to it and maintenance emits
#: each lost node with its runs; folding a tick's output grouped by kind gives the same state (a tick
#: never preempts what it places, nor loses a run twice): ``tests/unit/test_dispatch.py``. The one
#: definition of that order for readers that fold a tick's events from several topics, where the log
#: keeps no order between them (``audit verify``, the chaos campaign's checks): :func:`emit_rank`.
EMIT_ORDER: tuple[tuple[str, ...], ...] = (
    ("NodeLost",),
    ("JobLost",),
    ("JobRequeued", "JobQueued", "JobHeld", "JobReleased", "JobRejected", "JobCancelled", "JobFailed"),
    ("JobPreempted",),
    ("StopWorkload",),
    ("NodeDrained",),
    ("JobPlaced",),
    ("StartWorkload",),
)
_EMIT_RANK = {kind: i for i, kinds in enumerate(EMIT_ORDER) for kind in kinds}


def emit_rank(kind: str) -> int:
    """Position of an event type (``Event.type``) in :data:`EMIT_ORDER`; other kinds after all of them."""
    return _EMIT_RANK.get(kind, len(EMIT_ORDER))


__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DispatchConfig",
    "DispatchState",
    "JobRecord",
    "Tick",
    "evolve",
    "decide",
    "step",
    "maintenance",
    "EMIT_ORDER",
    "emit_rank",
    "heartbeat_deadline_us",
    "wakeups",
    "admit_submission",
    "submission_decided",
    "array_events",
    "cancel_array",
    "ArrayRecord",
    "hold_events",
    "held_event",
    "hold_answered",
    "with_job_settings",
    "Backoff",
    "refusal_backoff_s",
    "undo_refused_start",
    "refused_failure_id",
    "DEFAULT_REFUSAL_BACKOFF_S",
    "DEFAULT_REFUSAL_BACKOFF_CAP_S",
    "DEFAULT_CORDON_AFTER_REFUSALS",
    "NODE_FAULT_REFUSALS",
    "COMPLETED_BEFORE_LOSS",
    "LostRun",
    "lost_run_report",
]


DEFAULT_HEARTBEAT_TIMEOUT_S: float = 30.0
"""Default ``heartbeat_timeout``, seconds of event time without a heartbeat before a node is lost
(rule D3.node-lost). Its one home: the dispatcher's settings and the local stack read it."""


DEFAULT_REFUSAL_BACKOFF_S: float = 30.0
"""Default ``DispatchConfig.refusal_backoff_s``: the wait after a job's first refused start, event seconds."""

DEFAULT_REFUSAL_BACKOFF_CAP_S: float = 900.0
"""Default ``DispatchConfig.refusal_backoff_cap_s``: the longest wait after refused starts (15 minutes)."""

DEFAULT_CORDON_AFTER_REFUSALS: int = 3
"""Default ``DispatchConfig.cordon_after_refusals``: refused starts in a row after which a node is cordoned."""


@dataclass(frozen=True, slots=True)
class Tick:
    """A clock input: "it is now ``now_us``" (µs UTC). Runs maintenance and a cycle."""

    now_us: Micros


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """Dispatcher knobs.

    Attributes:
        engine: scheduling policy (delta, reservation_after, grace, window).
        heartbeat_timeout_s: seconds without a heartbeat before ``NodeLost``;
            ``None`` disables the check (simulations without heartbeats).
        producer: ``producer`` of emitted events.
        reconcile_misses: compare each heartbeat's running list with the
            runs (:mod:`apportion.domain.reconcile`): a replica missing from
            this many consecutive heartbeats of its node is lost, a replica
            listed by as many but unknown there is stopped; ``None`` disables
            it (simulations whose heartbeats list nothing). The dispatcher
            service runs with 2.
        refusal_backoff_s: a job whose start a node refused waits this long before a cycle
            may place it again, doubled for each further refusal of the job
            (:func:`refusal_backoff_s`); 0 turns the backoff off.
        refusal_backoff_cap_s: the longest such wait.
        cordon_after_refusals: a node that refuses this many starts in a row (no
            ``JobStarted`` of it in between) is cordoned by the dispatcher with
            the refusal as its reason; ``None`` never cordons.
        fail_on_no_account: a start refused ``no_account`` fails the job (``JobFailed``, the agent's reason)
            instead of requeueing it; False (records written before it existed) requeues it.
        refusal_detail: the requeue of a refused start carries the agent's whole reason (``start refused:
            gpus_busy: GPUs [0] are held by ...``), so the pending reason names it; False: the code only.
        scheduler: the cycle function ``(snapshot, now_us, engine_config) ->
            events``; ``None`` is the engine's :func:`engine.run_cycle` (the simulator's
            baselines swap it). A function with the attribute
            ``reads_snapshot_only = True`` promises what the engine does: it
            reads the snapshot during the call only, never writes it and keeps
            nothing; it then gets the live view with the state's kept
            :class:`VictimIndex` and :class:`FreeIndex`, as the engine does
            (:meth:`DispatchState.cycle_snapshot` with ``copy=False``), instead
            of copies without them.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    heartbeat_timeout_s: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S
    producer: str = "dispatcher"
    reconcile_misses: int | None = None
    refusal_backoff_s: float = DEFAULT_REFUSAL_BACKOFF_S
    refusal_backoff_cap_s: float = DEFAULT_REFUSAL_BACKOFF_CAP_S
    cordon_after_refusals: int | None = DEFAULT_CORDON_AFTER_REFUSALS
    fail_on_no_account: bool = True
    refusal_detail: bool = True
    scheduler: Callable[[CycleSnapshot, Micros, EngineConfig], list[Event]] | None = None


#: Reason of the ``StopWorkload`` and ``JobCancelled`` that end a job's next attempt once a report shows the lost
#: one had finished (rule D3.completed-before-loss).
COMPLETED_BEFORE_LOSS = "completed_before_loss"


@dataclass(frozen=True, slots=True)
class LostRun:
    """A lost run (``JobLost``) whose completion may still be on its way (rule D3.completed-before-loss).

    Kept on the job's record while its survivors stop, while the next attempt waits and while that attempt runs;
    dropped when a report shows the run had not finished, or when the next attempt ends in another way.

    Attributes:
        attempt: the lost attempt.
        at_us: the loss's event time (the ``JobLost``'s ``ts``; a run preempted before it was lost: the
            preemption's), µs.
        replicas_left: replicas whose ``JobCompleted`` stamped at or before ``at_us`` has not been folded (a
            replica that completed while the run still ran is not among them); empty: the run had finished.
    """

    attempt: int
    at_us: Micros
    replicas_left: frozenset[int]


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A job the dispatcher knows (active: pending, running or stopping).

    Attributes:
        spec: its latest ``JobQueued`` (budget, user, shape, workload).
        attempt: current attempt (1-based).
        status: ``pending``, ``running``, ``stopping`` (preempted, waiting for
            the stop), ``cancelling`` (cancelled while stopping) or ``lost``
            (its run lost, the requeue to come).
        submitted_at_us: original submission time, µs.
        queued_at_us: when the current attempt was queued, µs.
        lost: the lost run while its survivors stop, the next attempt waits or that attempt runs
            (:class:`LostRun`, rule D3.completed-before-loss); ``None`` otherwise.
        completed: replicas of this attempt that reported a ``JobCompleted`` while the rest of its gang ran.
    """

    spec: JobQueued
    attempt: int
    status: str
    submitted_at_us: Micros
    queued_at_us: Micros
    lost: LostRun | None = None
    completed: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class _Stopping:
    """A preempted run waiting for its processes to stop.

    ``plus_grace``: the deadline is ``deadline_us`` plus the configured grace
    period (a lost gang's surviving replicas: ``JobLost`` carries no grace,
    so the deadline is derived from the config, which the dispatcher records,
    and replays identically from the jobs topic).
    ``completed_by``: the preemption's time while every replica reported so
    far ended with a ``JobCompleted`` stamped at or before it (the run had
    finished its work when the dispatcher decided to stop it, and the report
    was in flight); when the last replica has, the job is finished, not
    requeued. ``None`` otherwise (a stop report, a completion after the
    preemption, a lost run): the stop ends as usual.
    """

    deadline_us: Micros
    replicas_left: frozenset[int]
    requeue: bool
    plus_grace: bool = False
    completed_by: Micros | None = None


@dataclass(slots=True)
class ArrayRecord:
    """A job array while any of its elements is active (the fold of its elements' ``JobQueued``).

    Attributes:
        throttle: the most elements running at once (``JobQueued.array_throttle``), or ``None``.
        members: element job id -> index, of the elements still active (an ended one is dropped).
    """

    throttle: int | None
    members: dict[str, int]

    def release_order(self, job_ids: Iterable[str]) -> list[str]:
        """Elements ``job_ids`` in the order its limit lets them start: lowest index first."""
        return sorted(job_ids, key=lambda j: (self.members[j], j))


@dataclass(frozen=True, slots=True)
class Backoff:
    """A job's refused starts (rule D3.refused-starts), from its latest refused ``JobRequeued``.

    Attributes:
        refusals: starts of the job refused so far.
        not_before_us: no cycle places the job before this time, µs (``None``: no backoff).
        node_id: the node that refused the latest start.
        reason: the requeue's reason, :data:`REFUSED_START` and the refusal (its code, or the agent's
            whole reason: ``DispatchConfig.refusal_detail``).
        budget: the job's leaf (its pending list).
    """

    refusals: int
    not_before_us: Micros | None
    node_id: str
    reason: str
    budget: str


class DispatchState:
    """Queue, budgets, nodes and runs as the dispatcher sees them (a fold of events).

    Attributes:
        tree: the budget tree (``BudgetSet``/``BudgetRemoved``; invalid ones skipped).
        ledger: occupancy windows (:class:`OccupancyLedger`).
        cluster: nodes and runs (:class:`ClusterState`).
        jobs: active jobs by id.
        finished: job id -> event time (µs) it ended (completed, failed,
            cancelled, rejected); forgotten once older than the window.
        pending: leaf budget -> pending jobs, allocated first, each class in
            (submitted_at, job_id) order (copy-on-write lists).
        stopping: preempted runs waiting for their stop.
        awaiting: preemptor run -> victims it still waits for before starting.
        draining: ids of draining nodes.
        seen: event id -> event time (µs) of the events folded (de-duplication),
            heartbeats left out; ids older than the window are forgotten
            (:meth:`forget_old`).
        clock_us: the latest event time folded, µs (``None`` before any).
        stale: events not folded because they are older than the window
            (:meth:`is_stale`).
        absences: heartbeats that disagreed with the runs (:class:`~apportion.domain.reconcile.Absences`).
        idle: what the latest heartbeat of each node says of its replicas' GPU use
            (:class:`~apportion.domain.idle.IdleReports`).
        heartbeats_from_us: heartbeat timeouts count from this event time at the earliest, µs
            (``DispatcherConfigured.heartbeats_from``, the latest folded; ``None``: no grace). See
            :func:`heartbeat_deadline_us`.
        backoff: job id -> its refused starts and backoff (:class:`Backoff`), while the job is active.
        held: job id -> its ``JobHeld``, for pending jobs on hold (until ``JobReleased`` or the job ends):
            they stay in ``pending`` and no cycle sees them (:meth:`pending_now`).
        node_refusals: node id -> starts it refused in a row for a fault of its own
            (:data:`NODE_FAULT_REFUSALS`, undone by a refused ``JobRequeued``; a ``JobStarted`` of the
            node or its ``NodeUncordoned`` resets it).
        arrays: array id -> its elements still active (:class:`ArrayRecord`), while any is.
    """

    __slots__ = (
        "tree",
        "ledger",
        "cluster",
        "jobs",
        "finished",
        "pending",
        "stopping",
        "awaiting",
        "draining",
        "seen",
        "absences",
        "idle",
        "clock_us",
        "stale",
        "heartbeats_from_us",
        "backoff",
        "held",
        "node_refusals",
        "arrays",
        "window_us",
        "_kept",
        "_ledger_on",
        "_shapes",
        "_engine",
    )

    def __init__(self, tree: BudgetTree | None = None, window_s: float = float(WEEK_S)) -> None:
        self.tree = tree if tree is not None else BudgetTree.empty()
        self.ledger = OccupancyLedger(window_s)
        self.cluster = ClusterState()
        self.jobs: dict[str, JobRecord] = {}
        self.finished: dict[str, Micros] = {}
        self.pending: dict[str, list[PendingJob]] = {}
        self.stopping: dict[RunKey, _Stopping] = {}
        self.awaiting: dict[RunKey, frozenset[RunKey]] = {}
        self.draining: set[str] = set()
        self.seen: dict[Any, Micros] = {}
        self.absences = Absences()
        self.idle = IdleReports()
        self.clock_us: Micros | None = None
        self.stale = 0
        self.heartbeats_from_us: Micros | None = None
        self.backoff: dict[str, Backoff] = {}
        self.held: dict[str, JobHeld] = {}
        self.node_refusals: dict[str, int] = {}
        self.arrays: dict[str, ArrayRecord] = {}
        self.window_us = s_to_us(window_s)
        self._kept = 0  # size of ``seen`` after the last forget_old
        self._ledger_on = True
        self._shapes: list[NodeShape] | None = None
        # what the engine keeps across cycles (its memo of the copy-on-write pending lists, its live indices)
        self._engine = EngineCaches()

    #: Slots that are caches (rebuilt on demand): left out of a pickle (:mod:`services.dispatcher.snapshot`).
    _CACHES = ("_shapes", "_engine")

    def __getstate__(self) -> dict[str, Any]:
        """The state without its caches (the memo is keyed by list identity, which a copy does not keep)."""
        return {k: getattr(self, k) for k in self.__slots__ if k not in self._CACHES}

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.heartbeats_from_us = None
        self.backoff, self.node_refusals, self.held = {}, {}, {}
        self.arrays = {}
        self.idle = IdleReports()
        for k, v in st.items():
            setattr(self, k, v)
        self._shapes, self._engine = None, EngineCaches()

    def fork(self) -> DispatchState:
        """A scratch copy for planning (shares the ledger read-only; never fold into both)."""
        other = DispatchState.__new__(DispatchState)
        other.tree = self.tree
        other.ledger = self.ledger
        other._ledger_on = False
        c = ClusterState()
        c.nodes, c.runs, c.node_runs = dict(self.cluster.nodes), dict(self.cluster.runs), dict(self.cluster.node_runs)
        c._owner = dict(self.cluster._owner)
        c.preemptions, c.progress = dict(self.cluster.preemptions), dict(self.cluster.progress)
        c.worked_us = dict(self.cluster.worked_us)
        c._order = None
        other.cluster = c
        other.jobs = dict(self.jobs)
        other.finished = dict(self.finished)
        other.pending = dict(self.pending)
        other.stopping = dict(self.stopping)
        other.awaiting = dict(self.awaiting)
        other.draining = set(self.draining)
        other.seen = {}
        other.absences = Absences()  # a scratch cycle folds no heartbeats
        other.idle = self.idle  # read only: a scratch cycle folds no heartbeats
        other.clock_us, other.stale, other.window_us, other._kept = self.clock_us, 0, self.window_us, 0
        other.heartbeats_from_us = self.heartbeats_from_us
        other.backoff, other.node_refusals = dict(self.backoff), dict(self.node_refusals)
        other.held = dict(self.held)
        other.arrays = {a: ArrayRecord(r.throttle, dict(r.members)) for a, r in self.arrays.items()}
        other._shapes = None
        other._engine = self._engine.fork()
        return other

    def cycle_snapshot(self, now_us: Micros, *, copy: bool = True) -> CycleSnapshot:
        """Frozen input of a scheduling cycle at ``now_us`` (occupancy from the ledger).

        ``copy=False`` shares the live cluster dicts (:meth:`ClusterState.view`):
        only for a cycle that runs before the next event is folded and keeps
        nothing (the engine's own :func:`engine.run_cycle` in :func:`_cycle`). It also
        passes the state's :class:`VictimIndex` and :class:`FreeIndex`, brought
        up to date with the runs and nodes that changed since the previous
        cycle (built on first use).
        """
        t = max(now_us, self.ledger.clock or now_us)
        pending = self.pending_now(now_us)
        memo = self._engine.memo_for(pending)
        victims, free = self._engine.live(self.cluster) if not copy else (None, None)
        return CycleSnapshot(
            cluster=self.cluster.snapshot() if copy else self.cluster.view(),
            pending=pending,
            tree=self.tree,
            occupancy=self.ledger.occupancy(t),
            capacity_gpu_s=self.ledger.capacity_gpu_s(t),
            memo=memo,
            victims=victims,
            free=free,
            # (a copy of the outer maps is a snapshot: each heartbeat replaces its node's map)
            idle=self.idle if not copy else IdleReports(dict(self.idle.by_node), dict(self.idle.last_us)),
        )

    def pending_now(self, now_us: Micros, arrays: bool = True) -> dict[str, list[PendingJob]]:
        """The pending lists a cycle at ``now_us`` may place from: jobs on hold (:attr:`held`) and jobs
        backing off after a refused start (:attr:`backoff`, ``not_before_us > now_us``) are left out, until
        released or their backoff ends; with ``arrays``, so are the elements beyond their array's limit
        (the read model keeps those: they keep their place in the order)."""
        pending = dict(self.pending)
        waiting: dict[str, set[str]] = {}
        for job_id in self.held:
            rec = self.jobs.get(job_id)
            if rec is not None:
                waiting.setdefault(rec.spec.budget, set()).add(job_id)
        for job_id, b in self.backoff.items():
            if b.not_before_us is not None and b.not_before_us > now_us:
                rec = self.jobs.get(job_id)
                if rec is not None and rec.status == "pending":
                    waiting.setdefault(b.budget, set()).add(job_id)
        for rec_a in self.arrays.values() if arrays else ():
            if rec_a.throttle is not None:
                self._throttle(rec_a, waiting)
        for budget, ids in waiting.items():
            lst = [j for j in pending.get(budget, ()) if j.job_id not in ids]
            if lst:
                pending[budget] = lst
            else:
                pending.pop(budget, None)
        return pending

    def _throttle(self, arr: ArrayRecord, waiting: dict[str, set[str]]) -> None:
        """Add to ``waiting`` the pending elements of ``arr`` beyond its throttle: of those not already
        waiting, a cycle sees the lowest indices, as many as the throttle minus the elements running
        (or stopping). The filter is here, not in the engine: the engine places what it is given."""
        assert arr.throttle is not None
        running = 0
        ready: dict[str, str] = {}  # job id -> budget
        for job_id in arr.members:
            rec = self.jobs.get(job_id)
            if rec is None:
                continue
            if rec.status != "pending":
                running += 1
            elif job_id not in waiting.get(rec.spec.budget, ()):
                ready[job_id] = rec.spec.budget
        room = max(arr.throttle - running, 0)
        if len(ready) <= room:
            return
        for job_id in arr.release_order(ready)[room:]:
            waiting.setdefault(ready[job_id], set()).add(job_id)

    def array_of(self, job_id: str) -> str | None:
        """The id of the active array whose element ``job_id`` is, or ``None``."""
        parts = split_element_id(job_id)
        if parts is None:
            return None
        arr = self.arrays.get(parts[0])
        return parts[0] if arr is not None and job_id in arr.members else None

    def requests_view(self) -> Mapping[str, JobRecord]:
        """The jobs a request may name, by id (what the identity gate reads a request's owner from): the
        active jobs, and each active array by its id, as the record of its lowest active element (all
        elements share the user and budget)."""
        return _RequestTargets(self)

    def backoff_until(self, job_id: str, now_us: Micros) -> Backoff | None:
        """The backoff that keeps pending job ``job_id`` out of a cycle at ``now_us``, or ``None``."""
        b = self.backoff.get(job_id)
        rec = self.jobs.get(job_id)
        if b is None or b.not_before_us is None or b.not_before_us <= now_us or rec is None:
            return None
        return b if rec.status == "pending" else None

    def waiting_reason(self, job_id: str, now_us: Micros) -> Held | RefusedBackoff | ArrayLimit | None:
        """Why pending job ``job_id`` is kept out of every cycle at ``now_us`` (:meth:`pending_now`), or ``None``.

        A hold comes before a backoff, a backoff before its array's limit: a held job waits for its release
        whatever else holds it back. The dispatcher's read model and the forecast both say it in place of a
        cycle's reason.
        """
        hold = self.held.get(job_id)
        if hold is not None:
            return Held(hold.by, hold.reason, to_us(hold.ts))
        b = self.backoff_until(job_id, now_us)
        if b is not None and b.not_before_us is not None:
            return RefusedBackoff(b.node_id, b.reason, b.refusals, b.not_before_us)
        array_id = self.array_of(job_id)
        arr = self.arrays.get(array_id) if array_id is not None else None
        if array_id is None or arr is None or arr.throttle is None:
            return None
        rec = self.jobs.get(job_id)
        if rec is None or rec.status != "pending":
            return None
        waiting: dict[str, set[str]] = {}
        for member in arr.members:
            if member in self.held or self.backoff_until(member, now_us) is not None:
                waiting.setdefault(rec.spec.budget, set()).add(member)
        self._throttle(arr, waiting)
        if job_id not in waiting.get(rec.spec.budget, ()):
            return None
        running = sum(1 for m in arr.members if (r := self.jobs.get(m)) is not None and r.status != "pending")
        return ArrayLimit(array_id, arr.throttle, running)

    def is_stale(self, ev: Event) -> bool:
        """True when ``ev`` is older than the window: its time is before the latest folded minus W.

        Such an event is not folded (:func:`evolve`): ids that old are forgotten, so it could not
        be told from a duplicate. A reader meets one only when a producer's clock or a record is
        a window late; the dispatcher dead-letters it.
        """
        return older_than_window(to_us(ev.ts), self.clock_us, self.window_us)

    def forget_old(self) -> None:
        """Drop ids (``seen``) and ended jobs (``finished``) older than the window.

        Called by :func:`evolve` whenever ``seen`` has doubled since the last call (amortised O(1)
        per event), so both stay within about twice what one window holds. What is dropped is
        exactly what :meth:`is_stale` refuses from now on, so de-duplication does not depend on
        when this runs: an event is either still in ``seen`` or older than the window.
        """
        if self.clock_us is None:
            return
        self.seen = forget_older(self.seen, self.clock_us, self.window_us)
        self.finished = forget_older(self.finished, self.clock_us, self.window_us)
        self._kept = len(self.seen)

    def node_shapes(self) -> list[NodeShape]:
        """Declared inventory for admission: (GPUs, model, count, block, rack) of nodes not lost (cached)."""
        if self._shapes is None:
            counts: dict[tuple[int, str | None, str | None, str | None], int] = {}
            for n in self.cluster.nodes.values():
                if n.state != "lost":
                    key = (n.gpu_count, n.gpu_model, n.block, n.rack)
                    counts[key] = counts.get(key, 0) + 1
            self._shapes = [
                NodeShape(c, m, cnt, b, r)
                for (c, m, b, r), cnt in sorted(counts.items(), key=lambda x: (x[0][0], *(v or "" for v in x[0][1:])))
            ]
        return self._shapes

    def pending_count(self) -> int:
        """Jobs waiting in the queue."""
        return sum(len(v) for v in self.pending.values())

    # -------------------------------------------------------------- queue helpers

    def _enqueue(self, job: PendingJob) -> None:
        old = self.pending.get(job.budget)
        lst = list(old or ())
        i = bisect_right(lst, _order(job), key=_order)
        lst.insert(i, job)  # = insort(lst, job, key=_order)
        self.pending[job.budget] = lst
        if old:
            self._engine.carry(old, lst, job, True, i)

    def _dequeue(self, job_id: str) -> None:
        rec = self.jobs.get(job_id)
        if rec is None:
            return
        lst = self.pending.get(rec.spec.budget)
        if not lst:
            return
        if lst[0].job_id == job_id:
            i = 0  # the head (what bisect finds for it: the order's keys are unique), the usual case of a placement
        else:
            k = (not is_allocated(rec.spec.min_runtime_s), rec.submitted_at_us, job_id)
            i = bisect_left(lst, k, key=_order)
        if i < len(lst) and lst[i].job_id == job_id:
            old, lst = lst, lst[:i] + lst[i + 1 :]
            if lst:
                self.pending[rec.spec.budget] = lst
                self._engine.carry(old, lst, old[i], False, i)
            else:
                del self.pending[rec.spec.budget]


_order = pending_order


class _RequestTargets(Mapping[str, JobRecord]):
    """:meth:`DispatchState.requests_view`."""

    __slots__ = ("_state",)

    def __init__(self, state: DispatchState) -> None:
        self._state = state

    def __getitem__(self, job_id: str) -> JobRecord:
        st = self._state
        rec = st.jobs.get(job_id)
        if rec is not None:
            return rec
        arr = st.arrays.get(job_id)
        if arr is None:
            raise KeyError(job_id)
        return st.jobs[min(arr.members, key=arr.members.__getitem__)]

    def __iter__(self) -> Iterator[str]:
        yield from self._state.jobs
        yield from self._state.arrays

    def __len__(self) -> int:
        return len(self._state.jobs) + len(self._state.arrays)


def _pending_job(
    spec: JobQueued,
    attempt: int,
    submitted_at_us: Micros,
    queued_at_us: Micros,
    preemptions: int = 0,
    progress_s: float = 0.0,
    worked_us: Micros = 0,
) -> PendingJob:
    return PendingJob(
        job_id=spec.job_id,
        attempt=attempt,
        budget=spec.budget,
        user=spec.user,
        gpus_per_replica=spec.gpus_per_replica,
        replicas=spec.replicas,
        min_runtime_s=spec.min_runtime_s,
        submitted_at_us=submitted_at_us,
        queued_at_us=queued_at_us,
        gpu_model=spec.gpu_model,
        duration_s=spec.duration_s,
        command=spec.command,
        preemptions=preemptions,
        progress_s=progress_s,
        checkpoint_interval_s=spec.checkpoint_interval_s,
        topology_bound=spec.topology_bound,
        attained_gpu_s=worked_us * spec.gpus_per_replica * spec.replicas / 1e6,
    )


# --------------------------------------------------------------------------- evolve


def evolve(state: DispatchState, ev: Event) -> DispatchState:
    """Fold one event into ``state`` (in place) and return it.

    Every event goes to the occupancy ledger and the cluster state; queue
    and job bookkeeping as follows: ``JobQueued`` and ``JobRequeued`` put the
    job in the queue; ``JobPlaced`` takes it out (running);
    ``JobPreempted`` marks the run stopping; reports of a stopping run count
    its stopped replicas; ``JobCompleted``/``JobFailed`` ending the run,
    ``JobCancelled`` and ``JobRejected`` finish the job. Budget events
    update the tree (an invalid change is skipped; the policy service
    rejects it). Duplicate event ids are ignored, and so is an event older
    than the window (:meth:`DispatchState.is_stale`, counted in ``stale``).
    """
    _fold(state, ev)
    return state


def _fold(state: DispatchState, ev: Event) -> bool:
    """:func:`evolve`; False when ``ev`` was not folded (older than the window, or a duplicate)."""
    eid = ev.event_id
    t_ev = to_us(ev.ts)
    clock = state.clock_us
    if older_than_window(t_ev, clock, state.window_us):  # before the seen check: the same whether swept or not
        state.stale += 1
        return False
    if eid in state.seen:
        return False
    cls = type(ev)
    if clock is None or t_ev > clock:
        state.clock_us = t_ev
    if cls is not NodeHeartbeat:  # a heartbeat folded twice changes nothing: not recorded
        state.seen[eid] = t_ev
        if sweep_due(len(state.seen), state._kept):
            state.forget_old()
    if state._ledger_on:
        state.ledger.apply(ev)
    state.cluster.apply(ev)
    if isinstance(ev, NodeHeartbeat):
        observe(state.absences, state.cluster, state.awaiting, ev)
        if ev.node_id in state.cluster.nodes:  # heartbeats of nodes never registered are ignored
            observe_idle(state.idle, ev)
    elif cls in _NODE_CHANGES:
        state._shapes = None  # the declared inventory may have changed
    fold = _FOLDS.get(cls)
    if fold is not None:
        fold(state, ev, t_ev)
    if state.arrays and cls in _ENDS_JOB and ev.job_id not in state.jobs:  # type: ignore[attr-defined]
        _array_forget(state, ev.job_id, t_ev)  # type: ignore[attr-defined]
    return True


#: Node events that may change the declared inventory (:meth:`DispatchState.node_shapes`); heartbeats do not.
_NODE_CHANGES: frozenset[type[Event]] = frozenset(
    {NodeRegistered, NodeCordoned, NodeDrainRequested, NodeDrained, NodeUncordoned, NodeRequestRefused, NodeLost}
)


def _fold_queued(state: DispatchState, ev: JobQueued, t_ev: Micros) -> None:
    """The job joins its budget's queue (an array member joins its array's record)."""
    t = to_us(ev.ts)
    sub = to_us(ev.submitted_at)
    state.jobs[ev.job_id] = JobRecord(ev, ev.attempt, "pending", sub, t)
    state._enqueue(_pending_job(ev, ev.attempt, sub, t))
    if ev.array_id is not None and ev.array_index is not None:
        arr = state.arrays.get(ev.array_id)
        if arr is None:
            arr = state.arrays[ev.array_id] = ArrayRecord(ev.array_throttle, {})
        arr.members[ev.job_id] = ev.array_index


def _fold_placed(state: DispatchState, ev: JobPlaced, t_ev: Micros) -> None:
    """The job leaves the queue and runs; with victims still stopping, it awaits them."""
    jobs = state.jobs
    rec = jobs.get(ev.job_id)
    if rec is not None and rec.status == "pending" and rec.attempt == ev.attempt:
        state._dequeue(rec.spec.job_id)
        state.held.pop(rec.spec.job_id, None)
        jobs[rec.spec.job_id] = JobRecord(
            rec.spec, rec.attempt, "running", rec.submitted_at_us, rec.queued_at_us, rec.lost
        )  # the lost run's report may still end it (rule D3.completed-before-loss)
        victims = ev.decision.victims
        if victims:
            vics = frozenset((v.job_id, v.attempt) for v in victims if (v.job_id, v.attempt) in state.stopping)
            if vics:
                state.awaiting[(rec.spec.job_id, rec.attempt)] = vics


def _fold_preempted(state: DispatchState, ev: JobPreempted, t_ev: Micros) -> None:
    """The run is stopping, until its replicas report or its grace period ends."""
    jobs = state.jobs
    key = (ev.job_id, ev.attempt)
    rec = jobs.get(ev.job_id)
    run = state.cluster.runs.get(key)
    if rec is not None and rec.attempt == ev.attempt and run is not None:
        jobs[ev.job_id] = JobRecord(rec.spec, rec.attempt, "stopping", rec.submitted_at_us, rec.queued_at_us)
        state.stopping[key] = _Stopping(
            to_us(ev.ts) + s_to_us(ev.grace_s), run.open_replicas, True, completed_by=to_us(ev.ts)
        )


def _fold_requeued(state: DispatchState, ev: JobRequeued, t_ev: Micros) -> None:
    """The stop is done; the job is back in the queue (after a refused start: backing off, D3.refused-starts)."""
    jobs = state.jobs
    rec = jobs.get(ev.job_id)
    _stop_done(state, (ev.job_id, ev.attempt - 1))
    if rec is None:
        return
    if ev.refused_by is not None:
        until = None if ev.not_before is None else to_us(ev.not_before)
        state.backoff[ev.job_id] = Backoff(ev.refusals, until, ev.refused_by, ev.reason, rec.spec.budget)
        if ev.reason.removeprefix(REFUSED_START).split(":", 1)[0] in NODE_FAULT_REFUSALS:
            state.node_refusals[ev.refused_by] = state.node_refusals.get(ev.refused_by, 0) + 1
    t = to_us(ev.ts)
    sub = to_us(ev.submitted_at)
    lost = rec.lost if rec.lost is not None and rec.lost.attempt == ev.attempt - 1 else None
    jobs[ev.job_id] = JobRecord(rec.spec, ev.attempt, "pending", sub, t, lost)
    c = state.cluster  # its fold of this event already ran: counts and progress are current
    state._enqueue(
        _pending_job(
            rec.spec,
            ev.attempt,
            sub,
            t,
            c.preemptions.get(ev.job_id, 0),
            c.progress.get(ev.job_id, 0.0),
            c.worked_us.get(ev.job_id, 0),
        )
    )


def _fold_report(state: DispatchState, ev: JobCompleted | JobFailed, t_ev: Micros) -> None:
    """A replica's end: of a stopping run, one replica fewer to wait for; of a running run that ended, the job
    is finished; of a lost run, rule D3.completed-before-loss (:func:`_fold_lost_report`)."""
    jobs = state.jobs
    key = (ev.job_id, ev.attempt)
    rec = jobs.get(ev.job_id)
    lost = rec.lost if rec is not None and rec.lost is not None and rec.lost.attempt == ev.attempt else None
    st = state.stopping.get(key)
    if st is not None:
        left = frozenset() if ev.replica is None else st.replicas_left - {ev.replica}
        by = st.completed_by
        done = by is not None and isinstance(ev, JobCompleted) and t_ev <= by
        state.stopping[key] = _Stopping(st.deadline_us, left, st.requeue, st.plus_grace, by if done else None)
        if done and not left and rec is not None and rec.attempt == ev.attempt:
            # the run had finished its work when the dispatcher preempted it (the agent's report, stamped
            # earlier, was in flight): the job is done, as a replay in event-time order, which folds the report
            # first, says. The stop entry stays until _finish_stop has started the preemptors waiting for it.
            _finish_job(state, ev.job_id, t_ev, key)
            return
    if rec is not None and lost is not None:
        _fold_lost_report(state, rec, lost, ev, t_ev)
        return
    if st is not None:
        return
    if rec is not None and rec.attempt == ev.attempt and rec.status == "running":
        if key not in state.cluster.runs:
            del jobs[ev.job_id]
            state.finished[ev.job_id] = t_ev
            state.awaiting.pop(key, None)
            state.backoff.pop(ev.job_id, None)
        elif isinstance(ev, JobCompleted) and ev.replica is not None:  # one replica of a gang that runs on
            jobs[ev.job_id] = replace(rec, completed=rec.completed | {ev.replica})


def _finish_job(state: DispatchState, job_id: str, t_ev: Micros, stopping: RunKey | None = None) -> None:
    """The job is done at ``t_ev``: out of the queue and the job table; ``stopping``: its run whose stop was under
    way, freed (its stop entry stays until :func:`_finish_stop` has started the preemptors waiting for it)."""
    if stopping is not None:
        state.cluster.finish(stopping)
    state._dequeue(job_id)
    state.held.pop(job_id, None)
    del state.jobs[job_id]
    state.finished[job_id] = t_ev
    state.backoff.pop(job_id, None)
    state.cluster.preemptions.pop(job_id, None)  # what the report's fold does to a run that ends the job
    state.cluster.progress.pop(job_id, None)
    state.cluster.worked_us.pop(job_id, None)


def _fold_lost_report(
    state: DispatchState, rec: JobRecord, lost: LostRun, ev: JobCompleted | JobFailed, t_ev: Micros
) -> None:
    """Rule D3.completed-before-loss: a report of a lost run read after its loss.

    A ``JobCompleted`` stamped at or before the loss ends the replica it names (``replica=None``: all); once every
    replica has, the run had finished its work before it was declared lost. Read while a gang's survivors stop
    or the requeued attempt waits, the job is finished (out of the queue), not run again; read while the next
    attempt runs, the record keeps the finished :class:`LostRun` and :func:`decide` ends that attempt
    (:func:`completed_before_loss_events`). A ``JobFailed``, or a completion stamped after the loss, drops the
    lost run: the requeue (or the next attempt) stands.
    """
    job_id = rec.spec.job_id
    after = lost_run_report(lost, ev, t_ev)
    if after is None:
        state.jobs[job_id] = replace(rec, lost=None)
        return
    left = after.replicas_left
    if left or rec.status == "running":
        state.jobs[job_id] = replace(rec, lost=replace(lost, replicas_left=left))
        return
    _finish_job(state, job_id, t_ev, (job_id, lost.attempt) if rec.status == "stopping" else None)


def lost_run_report(lost: LostRun, ev: JobCompleted | JobFailed, t_ev: Micros) -> LostRun | None:
    """Rule D3.completed-before-loss: what a report of the lost run (``ev``, stamped ``t_ev``) leaves of it.

    Returns:
        ``lost`` less the replica a ``JobCompleted`` stamped at or before ``lost.at_us`` names (``replica=None``:
        all; ``replicas_left`` empty: the run had finished its work); ``None`` for a ``JobFailed`` or a
        completion stamped after the loss (the run had not finished: the requeue stands).
    """
    if isinstance(ev, JobFailed) or t_ev > lost.at_us:
        return None
    return replace(lost, replicas_left=frozenset() if ev.replica is None else lost.replicas_left - {ev.replica})


def _fold_held(state: DispatchState, ev: JobHeld, t_ev: Micros) -> None:
    rec = state.jobs.get(ev.job_id)
    if rec is not None and rec.status == "pending":
        state.held[ev.job_id] = ev


def _fold_released(state: DispatchState, ev: JobReleased, t_ev: Micros) -> None:
    state.held.pop(ev.job_id, None)


def _fold_cancelled(state: DispatchState, ev: JobCancelled, t_ev: Micros) -> None:
    """The job is finished, out of the queue or its stop done."""
    jobs = state.jobs
    rec = jobs.get(ev.job_id)
    if rec is None:
        return
    state.held.pop(ev.job_id, None)
    if rec.status == "pending":
        state._dequeue(ev.job_id)
    _stop_done(state, (ev.job_id, rec.attempt))
    state.awaiting.pop((ev.job_id, rec.attempt), None)
    del jobs[ev.job_id]
    state.finished[ev.job_id] = t_ev
    state.backoff.pop(ev.job_id, None)


def _fold_rejected(state: DispatchState, ev: JobRejected, t_ev: Micros) -> None:
    if ev.request == "JobSubmitted":
        state.finished[ev.job_id] = t_ev  # a refused cancel leaves the job as it was


def _fold_lost(state: DispatchState, ev: JobLost, t_ev: Micros) -> None:
    """D3.node-lost: the run ends; a gang's replicas on other nodes are stopping, with the grace period. The run's
    completion may still be on its way (:class:`LostRun`, rule D3.completed-before-loss)."""
    jobs = state.jobs
    rec = jobs.get(ev.job_id)
    if rec is None or rec.attempt != ev.attempt:
        return
    key = (ev.job_id, ev.attempt)
    prior = state.stopping.get(key)
    lost: LostRun | None
    if rec.lost is not None and rec.lost.attempt == ev.attempt:  # a second report of the same loss
        lost = rec.lost
    elif prior is None:
        lost = LostRun(ev.attempt, t_ev, frozenset(range(rec.spec.replicas)) - rec.completed)
    elif prior.completed_by is not None:  # preempted first: only a completion before the preemption counts
        lost = LostRun(ev.attempt, min(t_ev, prior.completed_by), prior.replicas_left)
    else:  # its stop already had a report that was no completion before it
        lost = None
    state.awaiting.pop(key, None)
    _stop_done(state, key)
    run = state.cluster.runs.get(key)
    if run is not None:
        jobs[ev.job_id] = replace(rec, status="stopping", lost=lost)
        state.stopping[key] = _Stopping(to_us(ev.ts), run.open_replicas, True, plus_grace=True)
    else:
        jobs[ev.job_id] = replace(rec, status="lost", lost=lost)


def _fold_started(state: DispatchState, ev: JobStarted, t_ev: Micros) -> None:
    state.node_refusals.pop(ev.node_id, None)  # a start there: its refusals are no longer in a row


def _fold_drain_requested(state: DispatchState, ev: NodeDrainRequested, t_ev: Micros) -> None:
    state.draining.add(ev.node_id)


def _fold_drain_ended(state: DispatchState, ev: NodeDrained | NodeLost | NodeUncordoned, t_ev: Micros) -> None:
    state.draining.discard(ev.node_id)
    if isinstance(ev, NodeUncordoned):
        state.node_refusals.pop(ev.node_id, None)


def _fold_budget(state: DispatchState, ev: BudgetSet | BudgetRemoved | BudgetBatch, t_ev: Micros) -> None:
    state.tree = fold_budget_event(state.tree, ev)


def _fold_configured(state: DispatchState, ev: DispatcherConfigured, t_ev: Micros) -> None:
    if ev.heartbeats_from is not None:
        t = to_us(ev.heartbeats_from)
        if state.heartbeats_from_us is None or t > state.heartbeats_from_us:
            state.heartbeats_from_us = t


#: Event class -> how :func:`evolve` folds it into the queue and job bookkeeping (after the ledger and the
#: cluster state, which fold every event).
_FOLDS: dict[type[Event], Callable[[DispatchState, Any, Micros], None]] = {
    JobQueued: _fold_queued,
    JobPlaced: _fold_placed,
    JobPreempted: _fold_preempted,
    JobRequeued: _fold_requeued,
    JobCompleted: _fold_report,
    JobFailed: _fold_report,
    JobHeld: _fold_held,
    JobReleased: _fold_released,
    JobCancelled: _fold_cancelled,
    JobRejected: _fold_rejected,
    JobLost: _fold_lost,
    JobStarted: _fold_started,
    NodeDrainRequested: _fold_drain_requested,
    NodeDrained: _fold_drain_ended,
    NodeLost: _fold_drain_ended,
    NodeUncordoned: _fold_drain_ended,
    BudgetSet: _fold_budget,
    BudgetRemoved: _fold_budget,
    BudgetBatch: _fold_budget,
    DispatcherConfigured: _fold_configured,
}


#: Events after which a job may have ended (left ``DispatchState.jobs``).
_ENDS_JOB = frozenset({JobCompleted, JobFailed, JobCancelled})


def _array_forget(state: DispatchState, job_id: str, t_us: Micros) -> None:
    """An element that ended leaves its array; an array without active elements has ended (its id is in
    ``finished``, as an ended job's is: a cancel of it is answered, a new submission of it is a duplicate)."""
    aid = state.array_of(job_id)
    if aid is None:
        return
    arr = state.arrays[aid]
    del arr.members[job_id]
    if not arr.members:
        del state.arrays[aid]
        state.finished[aid] = t_us


def _stop_done(state: DispatchState, victim: RunKey) -> None:
    """A stopping run is gone: nobody waits for it any more."""
    if state.stopping.pop(victim, None) is None:
        return
    for p, vs in [(p, vs) for p, vs in state.awaiting.items() if victim in vs]:
        rest = vs - {victim}
        if rest:
            state.awaiting[p] = rest
        else:
            del state.awaiting[p]


# --------------------------------------------------------------------------- decide


def admit_submission(state: DispatchState, job: JobSubmitted) -> tuple[RejectReason, str] | None:
    """Admission of a submission (rule D2.rejection): ``None`` to queue it, else ``(reason, message)``.

    :func:`apportion.domain.admission.admit` against the shapes of the
    registered (not lost) nodes, plus the dispatcher's own check: a job id
    seen before is a ``duplicate_job``.
    """
    if job.job_id in state.jobs or job.job_id in state.finished or job.job_id in state.arrays:
        return (RejectReason.DUPLICATE_JOB, f"job {job.job_id!r} was already submitted")
    if job.array is not None:
        taken = next((j for j in job.job_ids if j in state.jobs or j in state.finished), None)
        if taken is not None:
            return (RejectReason.DUPLICATE_JOB, f"job {taken!r} of array {job.job_id!r} was already submitted")
    shapes = state.node_shapes()
    rejection = admit(state.tree, job, shapes, us_to_s(state.window_us))
    if rejection is not None:
        return (rejection.reason, rejection.message)
    return None


def submission_decided(state: DispatchState, job: JobSubmitted) -> bool:
    """Whether ``state`` has folded the verdict on ``job``: its ``JobQueued`` (of the first element, for an
    array) or its ``JobRejected``. A rebuild decides only the others."""
    first = job.job_ids[0]
    return any(j in state.jobs or j in state.finished for j in (job.job_id, first)) or job.job_id in state.arrays


def array_events(job: JobSubmitted, queued: JobQueued, ts: Any, prod: str) -> list[Event]:
    """The admission of an admitted job array: ``queued`` (the array's ``JobQueued`` as one job) once per
    element, with the element's id and index and the array's throttle, each followed by its ``JobHeld``
    when the array was submitted held. Ids are deterministic in the element."""
    spec = job.array_spec
    assert spec is not None
    out: list[Event] = []
    for i in spec.indices:
        eid = element_id(job.job_id, i)
        update = {
            "event_id": det_id("JobQueued", eid, 1),
            "job_id": eid,
            "array_id": job.job_id,
            "array_index": i,
            "array_throttle": spec.throttle,
        }
        out.append(queued.model_copy(update=update))
        if job.hold:
            out.append(held_event(eid, job.user, "submitted held", job.event_id, ts, prod))
    return out


def decide(
    state: DispatchState, inp: Event | Tick, now_us: Micros, config: DispatchConfig | None = None
) -> list[Event]:
    """Events that follow from ``inp`` given ``state`` (see the module docstring).

    ``state`` must already have ``inp`` folded in (:func:`step` does this);
    ``decide`` does not change ``state``.

    Args:
        state: the folded state.
        inp: the event just folded, or a :class:`Tick`.
        now_us: event time of the decision, µs UTC (for a Tick, ``tick.now_us``).
        config: dispatcher knobs (defaults when ``None``).

    Returns:
        New events in emission order, ``ts`` = ``now_us``.
    """
    cfg = config or DispatchConfig()
    handler = _DECISIONS.get(type(inp))
    return handler(state, inp, now_us, cfg) if handler is not None else []


def _decide_tick(state: DispatchState, tick: Tick, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """Maintenance, then the scheduling cycle on the state with the maintenance folded in."""
    out = maintenance(state, now_us, cfg)
    if not out:
        return _cycle(state, now_us, cfg)
    scratch = state.fork()
    for e in out:
        evolve(scratch, e)
    out.extend(_cycle(scratch, now_us, cfg))
    return out


def _decide_submitted(state: DispatchState, job: JobSubmitted, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """Admission (D2.rejection): ``JobRejected``, or ``JobQueued`` (an array's members; ``JobHeld`` after a
    held submission)."""
    ts, prod = from_us(now_us), cfg.producer
    verdict = admit_submission(state, job)
    if verdict is not None:
        reason, msg = verdict
        return [
            JobRejected(
                event_id=det_id("JobRejected", job.job_id, job.event_id),
                ts=ts,
                producer=prod,
                job_id=job.job_id,
                budget=job.budget,
                user=job.user,
                reason=reason,
                message=msg,
            )
        ]
    queued: list[Event] = [
        JobQueued(
            event_id=det_id("JobQueued", job.job_id, 1),
            ts=ts,
            producer=prod,
            job_id=job.job_id,
            budget=job.budget,
            user=job.user,
            allocated=job.allocated,
            gpus_per_replica=job.gpus_per_replica,
            replicas=job.replicas,
            min_runtime_s=job.min_runtime_s,
            gpu_model=job.gpu_model,
            duration_s=job.duration_s,
            command=job.command,
            submitted_at=job.submitted_at,
            attempt=1,
            checkpoint_interval_s=job.checkpoint_every_s,
            env=job.env,
            time_limit_s=time_limit_in_force(state.tree, job),
            topology_bound=job.topology_bound,
        )
    ]
    if job.array is not None:
        return array_events(job, queued[0], ts, prod)  # type: ignore[arg-type]
    if job.hold:
        queued.append(held_event(job.job_id, job.user, "submitted held", job.event_id, ts, prod))
    return queued


def _decide_hold(
    state: DispatchState, req: JobHoldRequested | JobReleaseRequested, now_us: Micros, cfg: DispatchConfig
) -> list[Event]:
    return hold_events(state, req, from_us(now_us), cfg.producer)


def _decide_cancel(state: DispatchState, req: JobCancelRequested, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """``JobCancelled``; a running job's replicas also get ``StopWorkload``; an ended job: a refusal."""
    ts, prod = from_us(now_us), cfg.producer
    rec = state.jobs.get(req.job_id)
    if rec is None and req.job_id in state.arrays:
        return cancel_array(state, req, now_us, cfg)
    if rec is None:
        if req.job_id in state.finished:  # a prompt answer rather than none (the requester would wait it out)
            why = Rejection(RejectReason.INVALID, f"job {req.job_id!r} already finished: nothing to cancel")
            return [refused_request_event(req, why, budget="", ts=ts, producer=prod)]
        return []
    cid = det_id("JobCancelled", rec.spec.job_id)
    reason = req.reason or "cancelled"
    if rec.status == "pending":
        return [JobCancelled(event_id=cid, ts=ts, producer=prod, job_id=rec.spec.job_id, attempt=None, reason=reason)]
    out: list[Event] = []
    run = state.cluster.runs.get((rec.spec.job_id, rec.attempt))
    if run is not None and rec.status == "running":
        out = preempt_events(run, ts, cfg.engine.grace_s, prod, reason="cancelled")[1:]  # stops only
    elif rec.status == "stopping":
        out = _start_waiting(state, (rec.spec.job_id, rec.attempt), ts, prod)
    return out + [
        JobCancelled(event_id=cid, ts=ts, producer=prod, job_id=rec.spec.job_id, attempt=rec.attempt, reason=reason)
    ]


def _decide_report(
    state: DispatchState, rep: JobCompleted | JobFailed, now_us: Micros, cfg: DispatchConfig
) -> list[Event]:
    """The last replica of a stopping run: the stop is finished; a failed replica of a running gang: the
    other replicas are stopped and the whole run fails."""
    ts, prod = from_us(now_us), cfg.producer
    key = (rep.job_id, rep.attempt)
    st = state.stopping.get(key)
    if st is not None:
        return _finish_stop(state, key, ts, prod) if not st.replicas_left else []
    rec = state.jobs.get(rep.job_id)
    if rec is not None and rec.lost is not None and rec.lost.attempt == rep.attempt:
        return completed_before_loss_events(state, rep.job_id, ts, prod)
    run = state.cluster.runs.get(key)
    if not isinstance(rep, JobFailed) or run is None or run.stopping or rep.replica is None:
        return []
    stops = preempt_events(run, ts, cfg.engine.grace_s, prod, reason="gang replica failed")[1:]
    return stops + [
        JobFailed(
            event_id=det_id("JobFailed", run.job_id, run.attempt, "gang"),
            ts=ts,
            producer=prod,
            job_id=run.job_id,
            attempt=run.attempt,
            replica=None,
            reason="gang replica failed",
        )
    ]


def completed_before_loss_events(state: DispatchState, job_id: str, ts: Any, prod: str) -> list[Event]:
    """Rule D3.completed-before-loss: the job's lost run had finished, and its next attempt already runs.

    That attempt ends at once: ``StopWorkload`` (grace 0, reason :data:`COMPLETED_BEFORE_LOSS`) to each open
    replica that was sent its start (a run still waiting for its victims has none), then ``JobCancelled`` of
    the attempt with the same reason, which frees its GPUs and ends its charge at ``ts``. Nothing for a job
    whose lost run has not finished (every replica's completion stamped at or before the loss folded) or
    whose next attempt is not running.
    """
    rec = state.jobs.get(job_id)
    if rec is None or rec.lost is None or rec.lost.replicas_left or rec.status != "running":
        return []
    key = (job_id, rec.attempt)
    run = state.cluster.runs.get(key)
    out: list[Event] = []
    if run is not None and key not in state.awaiting:
        out = [stop_event(run, r, ts, 0.0, prod, COMPLETED_BEFORE_LOSS) for r in sorted(run.open_replicas)]
    return out + [
        JobCancelled(
            event_id=det_id("JobCancelled", job_id),
            ts=ts,
            producer=prod,
            job_id=job_id,
            attempt=rec.attempt,
            reason=COMPLETED_BEFORE_LOSS,
        )
    ]


def _decide_drain(state: DispatchState, req: NodeDrainRequested, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    return _drain(state, req.node_id, now_us, from_us(now_us), cfg)


def _decide_job_lost(state: DispatchState, ev: JobLost, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """A run lost by another producer's word (the dispatcher's own JobLost is handled where it is made)."""
    if ev.producer == cfg.producer:
        return []
    return requeue_lost_run(state, ev, from_us(now_us), cfg.producer, cfg.engine.grace_s)


def _decide_refused(state: DispatchState, ev: WorkloadRefused, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    return undo_refused_start(state, ev, from_us(now_us), cfg.producer, cfg)


def _decide_node_lost(state: DispatchState, ev: NodeLost, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    ts = from_us(now_us)
    last = to_us(ev.last_heartbeat)
    return _node_lost(state, ev.node_id, last, ts, cfg.producer, emit_lost=None, grace_s=cfg.engine.grace_s)


def _decide_heartbeat(state: DispatchState, hb: NodeHeartbeat, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    if cfg.reconcile_misses is None:
        return []
    return reconcile_events(state, hb, from_us(now_us), cfg.producer, cfg.reconcile_misses, cfg.engine.grace_s)


#: Input class -> what :func:`decide` makes of it (other inputs: nothing).
_DECISIONS: dict[type[Event] | type[Tick], Callable[[DispatchState, Any, Micros, DispatchConfig], list[Event]]] = {
    Tick: _decide_tick,
    JobSubmitted: _decide_submitted,
    JobHoldRequested: _decide_hold,
    JobReleaseRequested: _decide_hold,
    JobCancelRequested: _decide_cancel,
    JobCompleted: _decide_report,
    JobFailed: _decide_report,
    NodeDrainRequested: _decide_drain,
    JobLost: _decide_job_lost,
    WorkloadRefused: _decide_refused,
    NodeLost: _decide_node_lost,
    NodeHeartbeat: _decide_heartbeat,
}


def cancel_array(state: DispatchState, req: JobCancelRequested, now_us: Micros, cfg: DispatchConfig) -> list[Event]:
    """The cancel of a job array (``req.job_id`` an active array's id): each active element's cancel, in
    index order, as a cancel of that element alone would be (its stops first when it runs), then a
    ``JobCancelled`` of the array id itself (``attempt`` ``None``), the verdict a requester waits for
    under the request's key, with the count of elements cancelled (``array_elements``)."""
    arr = state.arrays[req.job_id]
    out: list[Event] = []
    for job_id, _ in sorted(arr.members.items(), key=lambda m: m[1]):
        out += decide(state, replace_request(req, job_id), now_us, cfg)
    done = JobCancelled(
        event_id=det_id("JobCancelled", req.job_id), ts=from_us(now_us), producer=cfg.producer, job_id=req.job_id,
        attempt=None, reason=req.reason or "cancelled", array_elements=len(arr.members),
    )  # fmt: skip
    return [*out, done]


def replace_request(req: JobCancelRequested, job_id: str) -> JobCancelRequested:
    """``req`` naming ``job_id`` instead (an element of the array it names); same id and signature fields."""
    return req.model_copy(update={"job_id": job_id})


def held_event(
    job_id: str, by: str, reason: str, request_id: Any, ts: Any, prod: str, elements: int | None = None
) -> JobHeld:
    """``JobHeld`` of ``job_id`` answering the request ``request_id`` (id deterministic in the request);
    ``elements``: the count of a job array's elements held, on the answer of the array's id."""
    fields = {"ts": ts, "producer": prod, "job_id": job_id, "by": by, "reason": reason, "request_id": request_id}
    return JobHeld(event_id=det_id("JobHeld", job_id, request_id), array_elements=elements, **fields)


def released_event(
    job_id: str, by: str, reason: str, request_id: Any, ts: Any, prod: str, elements: int | None = None
) -> JobReleased:
    """``JobReleased`` of ``job_id`` answering the request ``request_id`` (as :func:`held_event`)."""
    fields = {"ts": ts, "producer": prod, "job_id": job_id, "by": by, "reason": reason, "request_id": request_id}
    return JobReleased(event_id=det_id("JobReleased", job_id, request_id), array_elements=elements, **fields)


def hold_events(state: DispatchState, req: JobHoldRequested | JobReleaseRequested, ts: Any, prod: str) -> list[Event]:
    """The answer to a hold or release request (module docstring): ``JobHeld``, ``JobReleased`` or the
    request's ``JobRejected`` (reason ``invalid``, the job's state named); nothing for a job never seen."""
    rec = state.jobs.get(req.job_id)
    hold = isinstance(req, JobHoldRequested)
    verb = "hold" if hold else "release"
    why: str | None = None
    if rec is None and req.job_id in state.arrays:
        return _array_hold_events(state, req, ts, prod)
    if rec is None:
        if req.job_id not in state.finished:
            return []
        why = f"job {req.job_id!r} already finished: nothing to {verb}"
    elif hold and req.job_id in state.held:
        why = f"job {req.job_id!r} is already held"
    elif hold and rec.status != "pending":
        why = f"job {req.job_id!r} is {rec.status}: only a pending job can be held (cancel stops a running one)"
    elif not hold and req.job_id not in state.held:
        why = f"job {req.job_id!r} is not held: nothing to release"
    if why is not None:
        budget = rec.spec.budget if rec is not None else ""
        return [refused_request_event(req, Rejection(RejectReason.INVALID, why), budget=budget, ts=ts, producer=prod)]
    reason = req.reason or NO_REASON
    answer = held_event if hold else released_event
    return [answer(req.job_id, req.user, reason, req.event_id, ts, prod)]


def _array_hold_events(
    state: DispatchState, req: JobHoldRequested | JobReleaseRequested, ts: Any, prod: str
) -> list[Event]:
    """A hold or release of a job array (``req.job_id`` an active array's id), as :func:`cancel_array` does a
    cancel: each element it applies to (a hold: every pending element not held; a release: every held one), in
    index order, as a request on that element alone would be answered, then the same answer of the array id
    itself with the count of those elements (``array_elements``: the verdict the requester waits for under the
    request's key; no job of that id, so the fold keeps nothing of it). None applies: the request's ``JobRejected`` (``invalid``)."""
    hold = isinstance(req, JobHoldRequested)
    arr = state.arrays[req.job_id]
    elements = [j for j, _ in sorted(arr.members.items(), key=lambda m: m[1])]
    if hold:
        todo = [j for j in elements if j not in state.held and (r := state.jobs.get(j)) and r.status == "pending"]
    else:
        todo = [j for j in elements if j in state.held]
    if not todo:
        what = "pending element to hold" if hold else "held element to release"
        why = Rejection(RejectReason.INVALID, f"array {req.job_id!r} has no {what}")
        first = state.jobs.get(elements[0]) if elements else None
        budget = first.spec.budget if first is not None else ""
        return [refused_request_event(req, why, budget=budget, ts=ts, producer=prod)]
    answer = held_event if hold else released_event
    reason = req.reason or NO_REASON
    out: list[Event] = [answer(job_id, req.user, reason, req.event_id, ts, prod) for job_id in todo]
    return [*out, answer(req.job_id, req.user, reason, req.event_id, ts, prod, elements=len(todo))]


def hold_answered(state: DispatchState, req: JobHoldRequested | JobReleaseRequested) -> bool:
    """Whether ``state`` has folded the answer to a hold or release request (its ``JobHeld``, ``JobReleased``
    or ``JobRejected``, ids deterministic in the request): a rebuild decides only the others."""
    kind = "JobHeld" if isinstance(req, JobHoldRequested) else "JobReleased"
    ids = (det_id(kind, req.job_id, req.event_id), det_id("JobRejected", req.job_id, req.event_id))
    return any(i in state.seen for i in ids)


def step(state: DispatchState, inp: Event | Tick, now_us: Micros, config: DispatchConfig | None = None) -> list[Event]:
    """``evolve(inp)``, ``decide``, then ``evolve`` every output; returns the outputs.

    A duplicate input (its ``event_id`` already folded) or one older than the
    window (:meth:`DispatchState.is_stale`) gives no output.
    This is the one entry point of the dispatcher service and the simulator.
    """
    if not isinstance(inp, Tick) and not _fold(state, inp):
        return []  # (older than the window: counted in ``stale``; or a duplicate)
    out = decide(state, inp, now_us, config)
    for e in out:
        evolve(state, e)
    return out


def _cycle(state: DispatchState, now_us: Micros, config: DispatchConfig | None = None) -> list[Event]:
    """The scheduling cycle on ``state`` at ``now_us``: :func:`engine.run_cycle` (or ``config.scheduler``)
    on a snapshot."""
    cfg = config or DispatchConfig()
    if not state.pending:
        return []
    fn = cfg.scheduler
    if fn is None:
        # the engine reads the snapshot during the call only and never writes: no copies needed
        return with_job_settings(state, run_cycle(state.cycle_snapshot(now_us, copy=False), now_us, cfg.engine).events)
    view = getattr(fn, "reads_snapshot_only", False) is True
    return with_job_settings(state, fn(state.cycle_snapshot(now_us, copy=not view), now_us, cfg.engine))


def with_job_settings(state: DispatchState, out: list[Event]) -> list[Event]:
    """``out`` with each ``StartWorkload`` carrying its job's settings for the node agent: the submission's
    ``env``, the time limit in force (``JobQueued.env``, ``JobQueued.time_limit_s``) and, for a command, the
    job's proven user, whose Unix account the agent runs it as (``docs/security.md``, "Node boundary"; a
    simulated workload names none). Events of jobs without settings pass as they are (no copy)."""
    res = out
    for i, e in enumerate(out):
        if type(e) is StartWorkload:
            rec = state.jobs.get(e.job_id)
            if rec is None:
                continue
            user = rec.spec.user if e.command is not None else None
            spec = rec.spec
            if spec.env or spec.time_limit_s is not None or user is not None or spec.array_id is not None:
                if res is out:
                    res = list(out)
                env = dict(spec.env or {})
                if spec.array_id is not None:
                    env["APPORTION_ARRAY_ID"] = spec.array_id
                    env["APPORTION_ARRAY_INDEX"] = str(spec.array_index)
                update = {"env": env, "time_limit_s": spec.time_limit_s, "user": user}
                res[i] = e.model_copy(update=update)
    return res


def maintenance(state: DispatchState, now_us: Micros, config: DispatchConfig | None = None) -> list[Event]:
    """Time-driven events at ``now_us``: node loss, grace expiry, drain progress (see module doc)."""
    cfg = config or DispatchConfig()
    ts = from_us(now_us)
    prod = cfg.producer
    out: list[Event] = []
    handled: set[RunKey] = set()
    for nid in overdue_nodes(state, now_us, cfg):
        last = state.cluster.nodes[nid].last_heartbeat_us
        assert last is not None
        out.extend(_node_lost(state, nid, last, ts, prod, emit_lost=handled, grace_s=cfg.engine.grace_s))
    finished: set[RunKey] = set()  # stops finished in this pass (their JobRequeued is not folded yet)
    for key in sorted(state.stopping):
        st = state.stopping[key]
        deadline = st.deadline_us + (s_to_us(cfg.engine.grace_s) if st.plus_grace else 0)
        if now_us >= deadline and key not in handled:
            out.extend(_finish_stop(state, key, ts, prod, finished))
            finished.add(key)
    for nid in sorted(state.draining):
        out.extend(_drain(state, nid, now_us, ts, cfg, skip=handled))
    return out


def overdue_nodes(state: DispatchState, now_us: Micros, config: DispatchConfig | None = None) -> list[str]:
    """The nodes a tick at ``now_us`` declares lost by heartbeat timeout (rule D3.node-lost), sorted.

    Nodes neither lost nor drained whose deadline (:func:`heartbeat_deadline_us`) is past; none when the
    timeout is off. The dispatcher asks before it ticks: such a tick waits for its read barrier
    (rule D3.loss-barrier).
    """
    cfg = config or DispatchConfig()
    if cfg.heartbeat_timeout_s is None:
        return []
    # now_us > heartbeat_deadline_us(last, since, limit) is max(last, since) < cutoff: asked before every tick,
    # so one comparison a node, and none while the grace since heartbeats_from_us has not run out
    cutoff = now_us - s_to_us(cfg.heartbeat_timeout_s)
    since = state.heartbeats_from_us
    if since is not None and since >= cutoff:
        return []
    return sorted(
        nid
        for nid, n in state.cluster.nodes.items()
        if n.last_heartbeat_us is not None and n.last_heartbeat_us < cutoff and n.state not in ("lost", "drained")
    )


def heartbeat_deadline_us(last_heartbeat_us: Micros, heartbeats_from_us: Micros | None, limit_us: Micros) -> Micros:
    """The event time (µs) after which a node whose last heartbeat is ``last_heartbeat_us`` is lost.

    ``limit_us`` after the later of its last heartbeat and ``heartbeats_from_us``
    (:attr:`DispatchState.heartbeats_from_us`): a dispatcher that could not read the log (a broker
    outage it led through, a start after a gap in the log's heartbeats) records when it could again
    (``DispatcherConfigured.heartbeats_from``), and a node is judged on heartbeats it could have read,
    never on its own blindness. ``None``: no grace, the plain timeout. A node that really went away
    is lost at most one timeout later than without the grace.
    """
    start = last_heartbeat_us if heartbeats_from_us is None else max(last_heartbeat_us, heartbeats_from_us)
    return start + limit_us


def _finish_stop(
    state: DispatchState, key: RunKey, ts: Any, prod: str, finished: set[RunKey] | None = None
) -> list[Event]:
    """The victim ``key`` has stopped: requeue it and start preemptors waiting only for it.

    ``finished``: other victims whose stop was finished earlier in the same
    :func:`decide` call (see :func:`_start_waiting`).
    """
    st = state.stopping.get(key)
    if st is None:
        return []
    job_id, attempt = key
    out: list[Event] = []
    rec = state.jobs.get(job_id)
    if rec is None:  # it completed before the stop reached it (evolve finished the job): nothing to requeue,
        out = _start_waiting(state, key, ts, prod, finished)  # and no JobRequeued will end the stop entry
        _stop_done(state, key)
        return out
    if st.requeue:
        out.append(requeue_event(rec, attempt, ts, prod, "preempted"))
    return out + _start_waiting(state, key, ts, prod, finished)


def _start_waiting(
    state: DispatchState, key: RunKey, ts: Any, prod: str, finished: set[RunKey] | None = None
) -> list[Event]:
    """``StartWorkload`` of every preemptor that waits for victim ``key`` and nothing else.

    ``finished`` counts as already gone: victims whose stop this same
    :func:`decide` call finished before ``key``. Their ``JobRequeued`` is only
    folded after :func:`decide` returns, so without it two victims whose grace
    ends in one maintenance pass would each see the other still awaited, and
    the preemptor would never start (seen live: the main job at 1440x, where
    the 30 s grace is 21 ms of wall time, shorter than the victims' exit
    reports took).
    """
    out: list[Event] = []
    gone = {key} | (finished or set())
    # (the preemptors in order; only those waiting for key are sorted)
    for p in sorted(p for p, vs in state.awaiting.items() if key in vs and vs <= gone):
        run = state.cluster.runs.get(p)
        prec = state.jobs.get(p[0])
        if run is not None and prec is not None and not run.stopping:
            out.extend(
                start_events(
                    p[0],
                    p[1],
                    run.placements,
                    ts,
                    prec.spec.duration_s,
                    prec.spec.command,
                    prod,
                    progress_s=run.resumed_from_s,
                    checkpoint_interval_s=prec.spec.checkpoint_interval_s,
                )
            )
    return with_job_settings(state, out)


def _drain(
    state: DispatchState, nid: str, now_us: Micros, ts: Any, cfg: DispatchConfig, skip: set[RunKey] | None = None
) -> list[Event]:
    """Drain step for node ``nid``: preempt what may go now; ``NodeDrained`` when empty."""
    node = state.cluster.nodes.get(nid)
    if node is None or node.state != "draining":
        return []
    out: list[Event] = []
    keys = sorted(state.cluster.node_runs.get(nid, ()))
    busy = False
    for key in keys:
        run = state.cluster.runs[key]
        if run.stopping or (skip is not None and key in skip):
            busy = True
            continue
        if run.protected(now_us):
            busy = True
            continue
        out.extend(preempt_events(run, ts, cfg.engine.grace_s, cfg.producer, reason="drain"))
        if skip is not None:
            skip.add(key)
        busy = True
    if not busy:
        out.append(NodeDrained(event_id=det_id("NodeDrained", nid, now_us), ts=ts, producer=cfg.producer, node_id=nid))
    return out


def _node_lost(
    state: DispatchState,
    nid: str,
    last_hb_us: Micros,
    ts: Any,
    prod: str,
    emit_lost: set[RunKey] | None,
    grace_s: float = DEFAULT_GRACE_S,
) -> list[Event]:
    """Node ``nid`` is gone: its runs are lost (charged to the last heartbeat) and requeued.

    ``JobLost.lost_gpu_s`` is the work lost up to the last heartbeat
    (:func:`~apportion.domain.cluster.work_lost_gpu_s`). A gang's replicas on
    other nodes get ``StopWorkload`` with the normal grace period
    (``grace_s``, rule D3.node-lost: so they can checkpoint); the job is then
    requeued when they have stopped or the grace has passed, as after a
    preemption. A run with no replica elsewhere is requeued at once.

    ``emit_lost`` is not ``None`` when the dispatcher itself detected the loss
    (then ``NodeLost`` is emitted first, and handled runs are added to it).
    """
    out: list[Event] = []
    if emit_lost is not None:
        out.append(
            NodeLost(
                event_id=det_id("NodeLost", nid, last_hb_us),
                ts=ts,
                producer=prod,
                node_id=nid,
                last_heartbeat=from_us(last_hb_us),
            )
        )
    for key in sorted(state.cluster.node_runs.get(nid, ())):
        run = state.cluster.runs.get(key)
        if run is None:
            continue
        if emit_lost is not None:
            if key in emit_lost:
                continue  # a gang on two nodes lost in one pass: handled with the first
            emit_lost.add(key)
        out.extend(_lose_run(state, run, nid, last_hb_us, ts, prod, grace_s))
    return out


def _lose_run(
    state: DispatchState,
    run: Any,
    nid: str,
    charged_us: Micros,
    ts: Any,
    prod: str,
    grace_s: float,
    reason: str = "node lost",
) -> list[Event]:
    """``run`` is lost on node ``nid``: ``JobLost`` (unless stopping), stops elsewhere, requeue if nothing survives.

    ``JobLost`` is charged until ``charged_us`` (:func:`~apportion.domain.cluster.work_lost_gpu_s`);
    the gang's open replicas on other nodes get ``StopWorkload`` with the grace period ``grace_s``
    (grace 0 on a node that is lost too); without such survivors the job is requeued at once.
    """
    out: list[Event] = []
    rec = state.jobs.get(run.job_id)
    survivors = False
    if not run.stopping:
        out.append(
            JobLost(
                event_id=det_id("JobLost", run.job_id, run.attempt),
                ts=ts,
                producer=prod,
                job_id=run.job_id,
                attempt=run.attempt,
                node_id=nid,
                charged_until=from_us(charged_us),
                lost_gpu_s=work_lost_gpu_s(run, charged_us),
            )
        )
        for r in sorted(run.open_replicas):
            p = run.placements[r]
            if p.node_id != nid:
                other = state.cluster.nodes.get(p.node_id)
                lost_too = other is None or other.state == "lost"
                survivors = survivors or not lost_too
                out.append(stop_event(run, r, ts, 0.0 if lost_too else grace_s, prod, "gang replica lost"))
    if rec is not None and rec.attempt == run.attempt and not survivors:
        out.append(requeue_event(rec, run.attempt, ts, prod, reason))
    return out


def reconcile_events(
    state: DispatchState, hb: NodeHeartbeat, ts: Any, prod: str, misses: int, grace_s: float
) -> list[Event]:
    """What a heartbeat's running list calls for (:func:`apportion.domain.reconcile.findings`).

    A run with a replica the node stopped reporting ``misses`` heartbeats ago is lost there
    (:func:`_lose_run`, charged until this heartbeat, requeue reason ``not running on its node``;
    a replica of the gang the node still reports gets ``StopWorkload`` with grace 0, since the
    loss frees the run's GPUs on the node). A run the node reports but the dispatcher does not
    place there gets ``StopWorkload`` (grace 0, reason ``unknown to the dispatcher``, id
    ``det_id("StopWorkload", "unknown", node, job, attempt)``).
    """
    nid = hb.node_id
    lost, stop = findings(state.absences, state.cluster, nid, misses)
    t = to_us(hb.ts)
    out: list[Event] = []
    listed = {(w.job_id, w.attempt) for w in hb.running}
    for key in lost:
        run = state.cluster.runs[key]
        evs = _lose_run(state, run, nid, t, ts, prod, grace_s, reason="not running on its node")
        if key in listed:  # part of the gang still runs here: its GPUs are released with the loss
            here = min(r for r in run.open_replicas if run.placements[r].node_id == nid)
            evs.insert(1, stop_event(run, here, ts, 0.0, prod, "gang replica lost"))
        out.extend(evs)
    for job_id, attempt in stop:
        out.append(
            StopWorkload(
                event_id=det_id("StopWorkload", "unknown", nid, job_id, attempt),
                ts=ts,
                producer=prod,
                node_id=nid,
                job_id=job_id,
                attempt=attempt,
                grace_s=0.0,
                reason="unknown to the dispatcher",
            )
        )
    return out


def requeue_event(rec: JobRecord, attempt: int, ts: Any, prod: str, reason: str) -> JobRequeued:
    """``JobRequeued`` of ``rec``'s job after attempt ``attempt`` ended: attempt + 1, keeping ``submitted_at``."""
    job_id = rec.spec.job_id
    return JobRequeued(
        event_id=det_id("JobRequeued", job_id, attempt + 1),
        ts=ts,
        producer=prod,
        job_id=job_id,
        attempt=attempt + 1,
        submitted_at=from_us(rec.submitted_at_us),
        reason=reason,
    )


def requeue_lost_run(state: DispatchState, ev: JobLost, ts: Any, prod: str, grace_s: float) -> list[Event]:
    """A node agent reports a run of its node lost (its own restart or shutdown): requeue the job.

    The dispatcher's own losses (``NodeLost``) are handled by :func:`_node_lost`; this is the
    same for one run reported by the agent (rule D3.node-lost): replicas of a gang on
    other nodes get ``StopWorkload`` with the normal grace period, and the job is requeued when
    they have stopped (the stopping machinery); a run with no replica elsewhere is requeued at
    once. A report for another attempt than the job's current one changes nothing.
    """
    key = (ev.job_id, ev.attempt)
    rec = state.jobs.get(ev.job_id)
    if rec is None or rec.attempt != ev.attempt:
        return []
    run = state.cluster.runs.get(key)
    if run is None:  # its only node: requeue now
        return [requeue_event(rec, ev.attempt, ts, prod, "lost on its node")]
    return [
        stop_event(run, r, ts, grace_s, prod, "gang replica lost")
        for r in sorted(run.open_replicas)
        if run.placements[r].node_id != ev.node_id
    ]


def refusal_backoff_s(refusals: int, config: DispatchConfig | None = None) -> float:
    """Seconds a job waits after its ``refusals``-th refused start (rule D3.refused-starts).

    ``refusal_backoff_s x 2^(refusals - 1)``, capped at ``refusal_backoff_cap_s``: with the defaults
    30 s, 60 s, 120 s, 240 s, 480 s, then 900 s from the sixth refusal on. 0 when the backoff is off or nothing was refused.
    """
    cfg = config or DispatchConfig()
    if refusals <= 0 or cfg.refusal_backoff_s <= 0:
        return 0.0
    return float(min(cfg.refusal_backoff_s * 2.0 ** min(refusals - 1, 64), cfg.refusal_backoff_cap_s))


def refused_failure_id(ev: WorkloadRefused) -> UUID:
    """The id of the ``JobFailed`` that answers the refusal ``ev`` when it fails the job (:data:`NO_ACCOUNT`).

    That ``JobFailed`` is stamped at the refusal's event time, not when the dispatcher read the refusal
    (:func:`undo_refused_start`); a reader that re-runs the dispatcher's decisions folds it where the
    dispatcher made it, right after the refusal, and finds it by this id.
    """
    return det_id("JobFailed", ev.job_id, ev.attempt, "refused", ev.event_id)


def undo_refused_start(
    state: DispatchState, ev: WorkloadRefused, ts: Any, prod: str, config: DispatchConfig | None = None
) -> list[Event]:
    """A node agent refused to start a replica of a placed run: undo the placement and requeue.

    Only for refusals after which the start will never happen (:data:`UNDO_ON_REFUSAL`), and
    only while the refused attempt is the job's current, running one (a refusal of an old
    attempt, or of a run already stopping, changes nothing). The other replicas are stopped at
    once (grace 0: they never ran as a gang) and ``JobRequeued`` (keeping ``submitted_at``)
    frees the run's GPUs. Rule D3.refused-starts:

    * the requeue records the refusal (``refused_by``, ``refused_at``): the run's occupancy ends
      at the refusal's event time in every reader (``D3.refused-starts``,
      :func:`apportion.domain.occupancy.requeued_end_us`);
    * the job backs off: ``not_before`` is :func:`refusal_backoff_s` of its refusals so far after
      the decision, and no cycle places it before then (:meth:`DispatchState.pending_now`);
    * a ready node that has now refused ``cordon_after_refusals`` starts in a row for a fault of
      its own (:data:`NODE_FAULT_REFUSALS`; :attr:`DispatchState.node_refusals`) is cordoned:
      ``NodeCordoned`` by the dispatcher, the refusal as its reason;
    * a refusal no retry can outrun (:data:`NO_ACCOUNT`, with ``fail_on_no_account``) fails the job
      instead: ``JobFailed`` of the run at the refusal's event time (its occupancy ends there, as a
      requeue's would), the agent's reason as its reason.
    """
    cfg = config or DispatchConfig()
    code = ev.reason.split(":", 1)[0].strip()
    rec = state.jobs.get(ev.job_id)
    run = state.cluster.runs.get((ev.job_id, ev.attempt))
    if code not in UNDO_ON_REFUSAL or rec is None or rec.attempt != ev.attempt or rec.status != "running":
        return []
    if run is None or run.stopping:
        return []
    if any(run.placements[r].node_id == ev.node_id for r in run.started_replicas):
        return []  # that node started the replica after all (the refusal was of another copy)
    out: list[Event] = [
        stop_event(run, r, ts, 0.0, prod, f"start refused on {ev.node_id}: {code}")
        for r in sorted(run.open_replicas)
        if run.placements[r].node_id != ev.node_id
    ]
    if code == NO_ACCOUNT and cfg.fail_on_no_account:
        failed = JobFailed(
            event_id=refused_failure_id(ev),
            ts=min(ev.ts, ts),
            producer=prod,
            job_id=ev.job_id,
            attempt=ev.attempt,
            node_id=ev.node_id,
            reason=ev.reason,
        )
        return [*out, failed]
    prior = state.backoff.get(ev.job_id)
    refusals = (prior.refusals if prior is not None else 0) + 1
    wait_s = refusal_backoff_s(refusals, cfg)
    requeue = requeue_event(rec, ev.attempt, ts, prod, REFUSED_START + (ev.reason if cfg.refusal_detail else code))
    out.append(
        requeue.model_copy(
            update={
                "refused_by": ev.node_id,
                "refused_at": min(ev.ts, ts),
                "refusals": refusals,
                "not_before": from_us(to_us(ts) + s_to_us(wait_s)) if wait_s > 0 else None,
            }
        )
    )
    in_a_row = state.node_refusals.get(ev.node_id, 0) + 1
    node = state.cluster.nodes.get(ev.node_id)
    limit = cfg.cordon_after_refusals
    if (
        limit is not None
        and code in NODE_FAULT_REFUSALS
        and in_a_row >= limit
        and node is not None
        and node.state == "ready"
    ):
        out.append(
            NodeCordoned(
                event_id=det_id("NodeCordoned", ev.node_id, "refused", ev.event_id),
                ts=ts,
                producer=prod,
                node_id=ev.node_id,
                reason=f"refused {in_a_row} starts in a row, the last {ev.job_id}#{ev.attempt}: {ev.reason}",
                by=prod,
            )
        )
    return out


def wakeups(ev: Event, config: DispatchConfig | None = None) -> list[Micros]:
    """Future times (µs) at which ``ev`` may make a :class:`Tick` decide something new.

    For drivers that tick on demand (the simulator): protection expiry of a
    placed allocated run (its recorded protection, :func:`placed_protection_us`),
    end of the grace period of a preemption or of a lost gang's survivors,
    ``reservation_after`` of a queued job, the end of a refused job's backoff, heartbeat deadline of a node.
    """
    cfg = config or DispatchConfig()
    t = to_us(ev.ts)
    if isinstance(ev, JobPlaced) and ev.allocated:
        until = placed_protection_us(ev)
        return [] if until >= s_to_us(PROTECTION_UNTIL_DONE_S) else [t + until]  # protected until it ends
    if isinstance(ev, JobPreempted):
        return [t + s_to_us(ev.grace_s)]
    if isinstance(ev, JobLost):  # a gang's surviving replicas stop within the grace period
        return [t + s_to_us(cfg.engine.grace_s)]
    if isinstance(ev, JobRequeued) and ev.not_before is not None:  # the refusal backoff ends: it may be placed
        return [t + s_to_us(cfg.engine.reservation_after_s), to_us(ev.not_before)]
    if isinstance(ev, (JobQueued, JobRequeued)):
        return [t + s_to_us(cfg.engine.reservation_after_s)]
    if isinstance(ev, NodeHeartbeat) and cfg.heartbeat_timeout_s is not None:
        return [t + s_to_us(cfg.heartbeat_timeout_s) + 1]
    return []


def fold(events: Iterable[Event], tree: BudgetTree | None = None, window_s: float = float(WEEK_S)) -> DispatchState:
    """A state folded from a log (recovery: replay the topics from offset 0)."""
    state = DispatchState(tree, window_s)
    for e in events:
        evolve(state, e)
    return state
