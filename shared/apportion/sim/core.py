"""Deterministic discrete-event simulator around the real dispatcher core (rule D7.simulator).

The simulator owns a clock and a heap of future happenings ordered by
``(time_us, seq)``; ``seq`` is a counter, so two happenings at the same
time run in the order they were scheduled. Everything the dispatcher sees
goes through :func:`apportion.domain.dispatch.step` - the same function the
dispatcher service calls - so admission, the engine, occupancy windows,
preemption follow-through, drain and node loss are the production code.

What the simulator plays itself:

* users: ``JobSubmitted`` at each trace job's submit time (and
  ``JobCancelRequested`` from ``cancels``);
* node agents: ``NodeRegistered`` at the start; on ``StartWorkload``,
  ``JobStarted`` at once and ``JobCompleted`` when the job's work is done;
  on ``StopWorkload``, ``JobFailed`` (exit -15, "stopped") after a stop
  delay drawn from the seeded RNG in ``[0, grace]``; optional heartbeats;
* workloads that checkpoint (rules D1.checkpoint and D3.checkpoints): a run makes one
  second of progress per second; it saves a checkpoint, ``JobCheckpointed``
  (``progress_s`` = seconds of the job's work, counted across attempts,
  ``replica=None``: the whole gang), each time its progress reaches a
  multiple of the job's interval,
  :func:`apportion.events.checkpoint_interval_of` (declared, else the
  minimum runtime; an unallocated job that declares none never
  checkpoints), except at the very end (the job completes instead). An
  attempt starts from the job's last saved progress, so it runs
  ``duration - progress`` more seconds. A run whose gang lost a node makes
  no more progress. ``SimConfig.checkpoint_on_stop`` says which stopped
  runs also save their progress at the stop (SIGTERM), reported when they
  exit within the grace period; never when the grace is 0 (SIGKILL at once):
  ``"unallocated"`` (the default: a job that declares minimum runtime 0
  accepts preemption at any moment, so its workload is taken to save on
  SIGTERM, the grace period of rule D3.grace; see ``docs/design-notes.md``),
  ``"all"`` (every workload), ``"none"``.
  ``SimConfig.checkpoints=False`` is the old model: every attempt restarts
  from scratch and no ``JobCheckpointed`` is emitted;
* operators and failures: ``NodeDrainRequested`` from ``drains``, silent
  node death from ``node_failures`` (its agent stops reporting).

Cycles: after every instant at which something that can change a decision
happened (a submission, a requeue, GPUs freed, a node change) the
simulator sends a :class:`~apportion.domain.dispatch.Tick`; it also ticks at
the wake-up times :func:`~apportion.domain.dispatch.wakeups` names
(protection expiry, grace end, reservation age, heartbeat deadline).

Determinism: no wall clock, no unseeded randomness, event ids by
:func:`det_id`; the same inputs and seed give a byte-identical log
(:meth:`SimResult.decision_log`).
"""

from __future__ import annotations

import gc
import heapq
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import UNTIL_STARTED
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step, wakeups
from apportion.domain.occupancy import OccupancyLedger
from apportion.events import (
    Event,
    JobCancelRequested,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRequeued,
    JobStarted,
    JobSubmitted,
    NodeDrainRequested,
    NodeHeartbeat,
    NodeRegistered,
    StartWorkload,
    StopWorkload,
    checkpoint_interval_of,
    det_id,
    encode,
    is_allocated,
)
from apportion.report import JobLedger
from apportion.sim.conservation import QUIET_EVENTS, IdleWhileWaiting
from apportion.timeutil import Micros, from_us, s_to_us, us_to_s

__all__ = [
    "SimJob",
    "SimNode",
    "SimConfig",
    "SimResult",
    "Simulator",
    "simulate",
    "default_horizon_us",
    "Debounce",
    "usable_fraction",
]

_DIRTY = (
    JobSubmitted,
    JobCompleted,
    JobFailed,
    JobCancelRequested,
    NodeRegistered,
    NodeDrainRequested,
    JobQueued,
    JobRequeued,
    JobLost,
)


@dataclass(frozen=True, slots=True)
class SimJob:
    """One trace job.

    Attributes:
        job_id: unique id.
        budget: leaf budget charged.
        user: submitting user.
        submit_us: submit time, µs UTC.
        gpus_per_replica, replicas: gang shape g x k.
        min_runtime_s: 0 = unallocated.
        duration_s: the job's work, seconds of run time (an attempt that resumes
            from a checkpoint runs the rest).
        gpu_model: required model or ``None``.
        checkpoint_interval_s: declared checkpoint interval (``None``: the
            default of :func:`apportion.events.checkpoint_interval_of`).
    """

    job_id: str
    budget: str
    user: str
    submit_us: Micros
    gpus_per_replica: int
    replicas: int
    min_runtime_s: float
    duration_s: float
    gpu_model: str | None = None
    checkpoint_interval_s: float | None = None


def usable_fraction(model_gpus: Mapping[str | None, int], models: Iterable[str | None]) -> float:
    """Fraction of the cluster's GPUs that jobs asking for ``models`` could run on (``None``: any model).

    The bound of a budget's **attainable share**, ``min(share, usable_fraction)`` over its waiting allocated
    jobs' models: a budget whose waiting work all needs a scarce model cannot get more than that model's
    part of the cluster, whatever the scheduler does (docs/simulation.md, "How the figures are defined").
    """
    total = sum(model_gpus.values())
    if not total:
        return 0.0
    asked: set[str | None] = set()
    for m in models:
        if m is None:
            return 1.0
        asked.add(m)
    return sum(model_gpus.get(m, 0) for m in asked) / total


def default_horizon_us(jobs: Sequence[SimJob], nodes: Sequence[SimNode]) -> Micros:
    """The clock's default stop for a trace that might never drain (``apportion simulate`` without ``--tail-h``).

    The last submission plus twice (the trace's GPU-seconds of work / the
    cluster's GPUs + the longest job's duration): the time a scheduler that
    kept every GPU busy and never threw work away would need to run
    everything submitted, plus room for the last long job, doubled. A trace
    that drains ends earlier (the run stops when nothing is left); one that
    cannot (jobs preempting each other for ever, say) stops there, its
    unfinished jobs reported as such. 0 jobs: 0.
    """
    if not jobs:
        return 0
    gpus = sum(n.gpus for n in nodes) or 1
    work = sum(j.gpus_per_replica * j.replicas * j.duration_s for j in jobs)
    longest = max(j.duration_s for j in jobs)
    return max(j.submit_us for j in jobs) + s_to_us(2 * (work / gpus + longest))


@dataclass
class Debounce:
    """When a wanted scheduling cycle runs: a dispatcher batching its input (:attr:`SimConfig.min_gap_s`), and
    the forecast's forward run spacing its cycles by how far ahead it looks (:mod:`apportion.forecast`).

    After a cycle at ``last`` the next one runs no earlier than ``last + gap``, where ``gap = max(min_gap,
    spacing x (last - origin))``: a cycle wanted at ``t`` runs at once when ``t`` is at or past that, else one
    cycle runs at the gap's end, shared by every cycle wanted before it. With ``spacing`` 0 the gap is
    ``min_gap``; with both 0 every cycle runs when wanted.

    Attributes:
        min_gap_us: the least gap, µs.
        spacing: the gap's growth, a fraction of the time since ``origin_us`` (0: none).
        origin_us: where the growing gap counts from (the forecast's time).
        last_us: the last cycle's time (``None``: none yet).
        deferred_us: the time of the cycle waiting for the gap's end (``None``: none).
    """

    min_gap_us: Micros = 0
    spacing: float = 0.0
    origin_us: Micros = 0
    last_us: Micros | None = None
    deferred_us: Micros | None = None

    def gap_us(self, last: Micros) -> Micros:
        """The gap after a cycle at ``last``."""
        return max(self.min_gap_us, int(self.spacing * max(0, last - self.origin_us)))

    def want(self, t: Micros, force: bool = False) -> tuple[bool, Micros | None]:
        """A cycle is wanted at ``t``: ``(True, None)`` when it runs now (recorded as the last), else ``(False,
        at)`` with ``at`` the gap's end where a wake-up must be set, or ``(False, None)`` when one already is.
        ``force``: it runs now whatever the gap."""
        last = self.last_us
        if not force and last is not None and (self.min_gap_us or self.spacing) and t < last + self.gap_us(last):
            if self.deferred_us is not None and self.deferred_us > t:
                return False, None  # its wake-up is set
            # none set, or it came before the gap's end (a cycle run whatever the gap moved the last one on)
            self.deferred_us = last + self.gap_us(last)
            return False, self.deferred_us
        if self.deferred_us is not None and self.deferred_us <= t:
            self.deferred_us = None
        self.last_us = t
        return True, None


@dataclass(frozen=True, slots=True)
class SimNode:
    """A simulated node: ``gpus`` GPUs of ``model``, in ``block`` and ``rack`` (rule ``D1.topology``; ``None``: unknown)."""

    node_id: str
    gpus: int
    model: str | None = None
    block: str | None = None
    rack: str | None = None


StopCheckpoint = Literal["unallocated", "all", "none"]
"""Which stopped workloads save their progress on SIGTERM (``SimConfig.checkpoint_on_stop``)."""
STOP_CHECKPOINTS: tuple[str, ...] = get_args(StopCheckpoint)


@dataclass(frozen=True)
class SimConfig:
    """Simulation knobs.

    Attributes:
        seed: required; drives the stop delays (and is recorded in reports).
        dispatch: dispatcher config (``heartbeat_timeout_s=None`` unless
            ``heartbeat_s`` is set).
        heartbeat_s: node heartbeat period, seconds; ``None`` = no heartbeats.
        stop_delay_s: fixed time a stopped workload takes to exit; ``None``
            draws it uniformly from [0, grace] with the seeded RNG.
        start_us: when nodes register (default: first submit).
        until_us: stop the clock here (default: run until nothing is left).
        drains: ``(node_id, at_us)`` drain requests.
        node_failures: ``(node_id, at_us)`` silent node deaths.
        cancels: ``(job_id, at_us)`` cancel requests.
        cycle_s: while jobs wait, also tick every ``cycle_s`` seconds (the
            dispatcher service's periodic cycle); ``None`` ticks on events only.
        min_gap_s: debounce: a cycle wanted at t runs at ``max(t, last cycle +
            min_gap_s)`` (a dispatcher batching its input); 0 = at once.
        sample_s: period of the share/queue samples, seconds.
        keep_log: keep every event (for scenario tests and the decision log).
        pause_gc: pause Python's cyclic garbage collector during :meth:`Simulator.run`
            (restored after, also on errors). A run creates no reference cycles
            (tested: ``tests/sim/test_properties.py``), so memory is still freed by
            reference counting; the collector's scans of the young objects cost
            about 8% of the 100,000-job benchmark. No decision depends on it.
        checkpoints: workloads checkpoint at their interval and resume from the
            last checkpoint (module docstring); ``False``: restart from scratch.
        checkpoint_on_stop: which stopped workloads also save their progress
            on SIGTERM, reported within the grace period (needs ``checkpoints``):
            ``"unallocated"`` (default), ``"all"`` or ``"none"`` (module docstring).
    """

    seed: int
    dispatch: DispatchConfig = field(default_factory=lambda: DispatchConfig(heartbeat_timeout_s=None))
    heartbeat_s: float | None = None
    stop_delay_s: float | None = None
    start_us: Micros | None = None
    until_us: Micros | None = None
    drains: tuple[tuple[str, Micros], ...] = ()
    node_failures: tuple[tuple[str, Micros], ...] = ()
    cancels: tuple[tuple[str, Micros], ...] = ()
    cycle_s: float | None = 300.0
    min_gap_s: float = 0.0
    sample_s: float = 3600.0
    keep_log: bool = True
    pause_gc: bool = True
    checkpoints: bool = True
    checkpoint_on_stop: StopCheckpoint = "unallocated"

    def __post_init__(self) -> None:
        if self.checkpoint_on_stop not in STOP_CHECKPOINTS:
            raise ValueError(f"checkpoint_on_stop must be one of {STOP_CHECKPOINTS}, not {self.checkpoint_on_stop!r}")


@dataclass
class SimResult:
    """What a run produced.

    Attributes:
        log: every event in processing order (inputs and dispatcher outputs),
            when ``keep_log``.
        state: the dispatcher state at the end.
        placed_first: job id -> first placement time (µs).
        submitted: job id -> submit time (µs).
        job_budget: job id -> budget.
        preemptions: victim budget -> count.
        violations: preemptions of protected runs (must stay empty): judged by the one
            protection window, :attr:`apportion.domain.cluster.Run.protected_until_us`
            (:func:`~apportion.domain.cluster.protection_s` as the run's ``JobPlaced``
            recorded it, from the latest replica start; a gang not yet started in full
            is protected outright), as the audit's ``preemption_report`` judges a log.
        samples: ``(t_us, {leaf: (O_b/K in the window, running GPUs, pending
            jobs, pending allocated jobs)})``.
        total: a ledger over the whole run (window = the run), for utilisation.
        measured: ``(O_b, U_b, K)`` of ``total`` at the last submission
            (GPU-s): the span with sustained demand, before the drain-out tail.
        start_us, end_us: simulated span.
        cycles: scheduling cycles run; events: events processed.
        capacity_gpus: GPUs in the cluster.
        jobs_ledger: the job events folded as they happened
            (:class:`apportion.report.JobLedger`: completions, work lost,
            preemptions), also when ``keep_log`` is off.
        idle_waiting_gpu_s: GPU-seconds idle while a job that fits them waited, (allocated jobs,
            unallocated jobs): :mod:`apportion.sim.conservation`.
        usable: per sample (aligned with ``samples``; empty on a cluster of one GPU model): leaf with
            allocated work waiting -> :func:`usable_fraction` of that work (the attainable share's bound).
    """

    log: list[Event]
    state: DispatchState
    placed_first: dict[str, Micros]
    submitted: dict[str, Micros]
    job_budget: dict[str, str]
    preemptions: dict[str, int]
    violations: list[str]
    samples: list[tuple[Micros, dict[str, tuple[float, int, int, int]]]]
    total: OccupancyLedger
    start_us: Micros
    end_us: Micros
    cycles: int
    events: int
    capacity_gpus: int
    measured: tuple[dict[str, float], dict[str, float], float] | None = None
    measured_until_us: Micros | None = None
    job_allocated: dict[str, bool] = field(default_factory=dict)
    jobs_ledger: JobLedger = field(default_factory=JobLedger)
    idle_waiting_gpu_s: tuple[float, float] = (0.0, 0.0)
    usable: list[dict[str, float]] = field(default_factory=list)

    def decision_log(self) -> bytes:
        """The dispatcher's outputs as JSON lines (byte-identical for the same inputs and seed)."""
        return b"\n".join(encode(e) for e in self.log if e.producer == "dispatcher")


class Simulator:
    """One simulation: a cluster, a budget tree, a trace, a policy.

    Args:
        tree: the budget tree.
        nodes: the cluster.
        jobs: the trace (any order; sorted by (submit, job_id)).
        config: knobs incl. the required seed.
        dispatch: dispatcher config override (e.g. a baseline scheduler).
    """

    def __init__(
        self,
        tree: BudgetTree,
        nodes: Sequence[SimNode],
        jobs: Sequence[SimJob],
        config: SimConfig,
        window_s: float | None = None,
    ) -> None:
        self.tree = tree
        self.nodes = list(nodes)
        self.jobs = sorted(jobs, key=lambda j: (j.submit_us, j.job_id))
        self.cfg = config
        dcfg = config.dispatch
        if config.heartbeat_s is None and dcfg.heartbeat_timeout_s is not None:
            from dataclasses import replace

            dcfg = replace(dcfg, heartbeat_timeout_s=None)
        self.dcfg = dcfg
        self.rng = random.Random(config.seed)
        self.state = DispatchState(tree, window_s if window_s is not None else dcfg.engine.window_s)
        self._heap: list[tuple[int, int, int, Any]] = []
        self._next_job = 0  # index in ``jobs`` of the next submission to join the heap
        self._job_seq = 0  # the seq of ``jobs[0]``'s submission
        self._seq = 0
        self._alive: dict[tuple[str, int, int], str] = {}  # (job, attempt, replica) -> node
        self._on_node: dict[tuple[str, str, int], int] = {}  # (node, job, attempt) -> replica
        self._dead: set[str] = set()
        self._specs = {j.job_id: j for j in self.jobs}
        self.log: list[Event] = []
        self.placed_first: dict[str, Micros] = {}
        self.preemptions: dict[str, int] = {}
        self.violations: list[str] = []
        self.samples: list[tuple[Micros, dict[str, tuple[float, int, int, int]]]] = []
        self.cycles = 0
        self.events = 0
        self._periodic_at: Micros | None = None
        self._real = 0
        self._ticks = 0  # of ``_real``: wake-ups (a tick only matters while the dispatcher has something to act on)
        self._debounce = Debounce(s_to_us(config.min_gap_s))
        self.jobs_ledger = JobLedger()
        self.idle = IdleWhileWaiting()
        self.usable: list[dict[str, float]] = []  # per sample: leaf -> usable_fraction of its waiting work
        models = {n.model for n in self.nodes}
        self._model_gpus: dict[str | None, int] = {}
        if len(models) > 1:  # with one model every job can use every GPU: the attainable share is the share
            for n in self.nodes:
                self._model_gpus[n.model] = self._model_gpus.get(n.model, 0) + n.gpus
        self._saved: dict[str, float] = {}  # job -> progress saved by its last checkpoint, s
        # running run -> [start µs, progress at start s, interval s or None, gang broken at µs or None, duration s]
        self._live: dict[tuple[str, int], list[Any]] = {}

    # ------------------------------------------------------------------ heap

    _EV, _TICK, _HB, _DIE, _SAMPLE, _DONE, _PERIODIC, _CKPT = range(8)
    #: Happenings that are work; heartbeats, samples and periodic cycles only
    #: keep going while some of these remain (else the run ends).
    _REAL = frozenset({_EV, _TICK, _DIE, _DONE})

    def _push(self, t: Micros, kind: int, payload: Any = None) -> None:
        self._seq += 1
        if kind in self._REAL:
            self._real += 1
            if kind == self._TICK:
                self._ticks += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def _push_next_job(self) -> None:
        """The next trace job's submission onto the heap, with the seq it was given at the start (counted in
        ``_real`` from the start)."""
        k = self._next_job
        if k < len(self.jobs):
            j = self.jobs[k]
            heapq.heappush(self._heap, (j.submit_us, self._job_seq + k, self._EV, j))
            self._next_job = k + 1

    # ------------------------------------------------------------------ run

    def run(self) -> SimResult:
        """Run to the end (or ``until_us``) and return the result."""
        paused = self.cfg.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        try:
            return self._run()
        finally:
            if paused:
                gc.enable()

    def _run(self) -> SimResult:
        cfg = self.cfg
        start = cfg.start_us if cfg.start_us is not None else (self.jobs[0].submit_us if self.jobs else 0)
        for n in self.nodes:
            self._push(
                start,
                self._EV,
                NodeRegistered(
                    event_id=det_id("sim", "NodeRegistered", n.node_id),
                    ts=from_us(start),
                    producer="sim/agent",
                    node_id=n.node_id,
                    gpu_count=n.gpus,
                    gpu_model=n.model,
                    simulated=True,
                    block=n.block,
                    rack=n.rack,
                ),
            )
            if cfg.heartbeat_s:
                self._push(start + s_to_us(cfg.heartbeat_s), self._HB, n.node_id)
        # the submissions, in (submit, job id) order, take the next seqs; each joins the heap when the one before
        # it leaves (the heap's order is the same as with all of them in it, and it stays small)
        self._job_seq = self._seq + 1
        self._seq += len(self.jobs)
        self._real += len(self.jobs)
        self._push_next_job()
        for job_id, at in cfg.cancels:
            self._push(
                at,
                self._EV,
                JobCancelRequested(
                    event_id=det_id("sim", "JobCancelRequested", job_id),
                    ts=from_us(at),
                    producer="sim/user",
                    job_id=job_id,
                    user="sim",
                ),
            )
        for nid, at in cfg.drains:
            self._push(
                at,
                self._EV,
                NodeDrainRequested(
                    event_id=det_id("sim", "NodeDrainRequested", nid, at),
                    ts=from_us(at),
                    producer="sim/ops",
                    node_id=nid,
                ),
            )
        for nid, at in cfg.node_failures:
            self._push(at, self._DIE, nid)
        if cfg.sample_s:
            self._push(start, self._SAMPLE)
        span_end = cfg.until_us
        total = OccupancyLedger(window_s=10 * 365 * 86400)
        self.total = total
        now = start
        heap = self._heap
        debounce = self._debounce
        measure = self.jobs[-1].submit_us if self.jobs else start
        self.measured: tuple[dict[str, float], dict[str, float], float] | None = None
        live = self._live
        ckpt = self._CKPT
        while heap:
            top = heap[0]
            if top[2] == ckpt and top[3][:2] not in live:  # its run has ended: not a happening
                heapq.heappop(heap)
                continue
            if self._real == self._ticks and self._nothing_to_act_on():
                break  # only wake-ups are left and nothing they could act on: the run ends at the last job's end
            t = top[0]
            if self.measured is None and t > measure:
                self._measure(measure)
            if span_end is not None and t > span_end:
                break
            if t > now:
                now = t
            dirty = False
            sample_now = False
            while heap and heap[0][0] == t:
                _, _, kind, payload = heapq.heappop(heap)
                if kind in self._REAL:
                    self._real -= 1
                if kind == self._EV:
                    if type(payload) is SimJob:
                        self._push_next_job()
                    dirty |= self._feed(self._materialise(payload, t), t)
                elif kind == self._TICK:
                    self._ticks -= 1
                    dirty = True
                elif kind == self._PERIODIC:
                    self._periodic_at = None
                    dirty = True
                elif kind == ckpt:
                    dirty |= self._checkpoint(payload, t)
                elif kind == self._DONE:
                    if self._alive.pop(payload[:3], None) is not None:
                        job_id, attempt, replica = payload[:3]
                        live.pop((job_id, attempt), None)
                        self._push(
                            t,
                            self._EV,
                            JobCompleted(
                                event_id=det_id("sim", "JobCompleted", job_id, attempt, replica),
                                ts=from_us(t),
                                producer="sim/agent",
                                job_id=job_id,
                                attempt=attempt,
                                replica=replica,
                                node_id=payload[3],
                            ),
                        )
                elif kind == self._HB:
                    if payload not in self._dead:
                        self._push(
                            t,
                            self._EV,
                            NodeHeartbeat(
                                event_id=det_id("sim", "NodeHeartbeat", payload, t),
                                ts=from_us(t),
                                producer="sim/agent",
                                node_id=payload,
                            ),
                        )
                        if self._real and cfg.heartbeat_s:  # (always set when heartbeats were pushed)
                            self._push(t + s_to_us(cfg.heartbeat_s), self._HB, payload)
                elif kind == self._DIE:
                    self._dead.add(payload)
                    for key, nid in list(self._alive.items()):
                        if nid == payload:
                            del self._alive[key]
                            run = live.get(key[:2])
                            if run is not None and run[3] is None:
                                run[3] = t  # the gang makes no more progress
                elif kind == self._SAMPLE:
                    sample_now = True  # after this instant's cycle
                    if self._real:
                        self._push(t + s_to_us(cfg.sample_s), self._SAMPLE)
            if dirty and (
                self.state.pending
                or self.state.draining
                or self.state.stopping
                or self.dcfg.heartbeat_timeout_s is not None
            ):
                now_, tick_at = debounce.want(t)
                if tick_at is not None:
                    self._push(tick_at, self._TICK)
                if now_:
                    self.cycles += 1
                    self._outputs(step(self.state, Tick(t), t, self.dcfg), t)
            if sample_now:
                self._sample(t)
            if self.idle.dirty:  # (else I has not changed: it is integrated at the next change or the end)
                self.idle.advance(t, self.state.cluster.nodes, self.state.pending)
            if cfg.cycle_s and self.state.pending and self._periodic_at is None and self._real:
                self._periodic_at = t + s_to_us(cfg.cycle_s)
                self._push(self._periodic_at, self._PERIODIC)
        if self.measured is None:
            self._measure(max(measure, total.clock or measure))
        self.idle.until(now)
        return SimResult(
            measured=self.measured,
            measured_until_us=measure,
            log=self.log,
            state=self.state,
            placed_first=self.placed_first,
            submitted={j.job_id: j.submit_us for j in self.jobs},
            job_budget={j.job_id: j.budget for j in self.jobs},
            job_allocated={j.job_id: is_allocated(j.min_runtime_s) for j in self.jobs},
            jobs_ledger=self.jobs_ledger,
            preemptions=self.preemptions,
            violations=self.violations,
            samples=self.samples,
            total=total,
            start_us=start,
            end_us=now,
            cycles=self.cycles,
            events=self.events,
            capacity_gpus=sum(n.gpus for n in self.nodes),
            idle_waiting_gpu_s=(self.idle.gpu_s[0], self.idle.gpu_s[1]),
            usable=self.usable,
        )

    def _nothing_to_act_on(self) -> bool:
        """Nothing a cycle could act on: no pending job, no run (running or stopping), no draining node.

        With no submission, completion, stop or node death ahead either, a wake-up (a protection
        expiry, say, of a run protected until it completes) can decide nothing more, so the run ends.
        """
        st = self.state
        return not (st.pending or st.cluster.runs or st.stopping or st.awaiting or st.draining)

    def _materialise(self, payload: Any, t: Micros) -> Event:
        if isinstance(payload, SimJob):
            j = payload
            return JobSubmitted(
                event_id=det_id("sim", "JobSubmitted", j.job_id),
                ts=from_us(t),
                producer="sim/user",
                job_id=j.job_id,
                budget=j.budget,
                user=j.user,
                gpus_per_replica=j.gpus_per_replica,
                replicas=j.replicas,
                min_runtime_s=j.min_runtime_s,
                gpu_model=j.gpu_model,
                duration_s=j.duration_s,
                submitted_at=from_us(j.submit_us),
                checkpoint_interval_s=j.checkpoint_interval_s,
            )
        return payload

    def _feed(self, ev: Event, t: Micros) -> bool:
        """Give one input event to the dispatcher; True when a cycle may now decide something new."""
        self.events += 1
        if self.cfg.keep_log:
            self.log.append(ev)
        self.total.apply(ev)
        self.jobs_ledger.apply(ev)
        if type(ev) not in QUIET_EVENTS:
            self.idle.saw(ev)
        if type(ev) is JobCheckpointed:
            saved = self._saved
            if ev.progress_s > saved.get(ev.job_id, 0.0):
                saved[ev.job_id] = ev.progress_s
        out = step(self.state, ev, t, self.dcfg)
        if type(ev) is JobStarted:
            run = self.state.cluster.runs.get((ev.job_id, ev.attempt))
            until = run.protected_until_us if run is not None and run.allocated else None
            if until is not None and until < UNTIL_STARTED:
                self._push(until, self._TICK)
        for w in wakeups(ev, self.dcfg):
            self._push(w, self._TICK)
        self._outputs(out, t)
        return isinstance(ev, _DIRTY) or any(isinstance(e, _DIRTY) for e in out)

    def _outputs(self, out: list[Event], t: Micros) -> None:
        """Record dispatcher outputs and act as the node agents on commands."""
        keep = self.cfg.keep_log
        jobs = self.jobs_ledger
        idle = self.idle
        quiet = QUIET_EVENTS
        for e in out:
            self.events += 1
            if keep:
                self.log.append(e)
            self.total.apply(e)
            jobs.apply(e)
            if type(e) not in quiet:
                idle.saw(e)
            for w in wakeups(e, self.dcfg):
                self._push(w, self._TICK)
            if type(e) is StartWorkload:
                self._start(e, t)
            elif type(e) is StopWorkload:
                self._stop(e, t)
            elif type(e) is JobPlaced:
                self.placed_first.setdefault(e.job_id, t)
            elif type(e) is JobPreempted:
                self._preempted(e, t)

    def _measure(self, t: Micros) -> None:
        """Totals over [start, t] (t = last submission): the span with sustained demand."""
        tot = self.total
        t = max(t, tot.clock or t)
        self.measured = (tot.occupancy(t), tot.unallocated(t), tot.capacity_gpu_s(t))

    def _preempted(self, e: JobPreempted, t: Micros) -> None:
        self.preemptions[e.budget] = self.preemptions.get(e.budget, 0) + 1
        # the dispatcher's fold still holds the run (a preempted run stays, stopping, until its requeue)
        run = self.state.cluster.runs.get((e.job_id, e.attempt))
        if run is not None and run.protected(t):
            self.violations.append(
                f"{e.job_id}#{e.attempt} preempted at {from_us(t).isoformat()} inside its protection"
            )

    def _start(self, e: StartWorkload, t: Micros) -> None:
        rk = (e.job_id, e.attempt)
        duration = e.duration_s or 0.0
        run = self._live.get(rk)
        if run is None:  # the run's first replica: it resumes from the job's last checkpoint
            spec = self._specs.get(e.job_id)
            every = None
            base = 0.0
            if self.cfg.checkpoints and spec is not None:
                every = checkpoint_interval_of(spec.checkpoint_interval_s, spec.min_runtime_s)
                base = min(self._saved.get(e.job_id, 0.0), duration)
            saves = self.cfg.checkpoint_on_stop == "all" or (
                self.cfg.checkpoint_on_stop == "unallocated"
                and spec is not None
                and not is_allocated(spec.min_runtime_s)
            )
            run = self._live[rk] = [t, base, every, None, duration, self.cfg.checkpoints and saves]
            if every:
                self._next_checkpoint(e.job_id, e.attempt, int(base // every) + 1, run)
        if e.node_id in self._dead:
            if run[3] is None:
                run[3] = t  # a replica never started: the gang makes no progress
            return
        key = (e.job_id, e.attempt, e.replica)
        self._alive[key] = e.node_id
        self._on_node[(e.node_id, e.job_id, e.attempt)] = e.replica
        remaining = duration - run[1]
        self._push(
            t,
            self._EV,
            JobStarted(
                event_id=det_id("sim", "JobStarted", e.job_id, e.attempt, e.replica),
                ts=from_us(t),
                producer="sim/agent",
                job_id=e.job_id,
                attempt=e.attempt,
                replica=e.replica,
                node_id=e.node_id,
                gpus=e.gpus,
            ),
        )
        self._push(t + s_to_us(remaining), self._DONE, (e.job_id, e.attempt, e.replica, e.node_id))

    def _next_checkpoint(self, job_id: str, attempt: int, k: int, run: list[Any]) -> None:
        """Schedule the run's ``k``-th checkpoint (progress ``k * every``) unless the job is done by then.

        ``run`` is the simulator's record of a running run: ``[start µs, progress at
        start s, interval s, time its gang stopped progressing (µs) or None, duration s]``.
        """
        start, base, every, _dead, duration, _saves = run
        progress = k * every
        if progress < duration:
            self._push(start + s_to_us(progress - base), self._CKPT, (job_id, attempt, k))

    def _checkpoint(self, payload: tuple[str, int, int], t: Micros) -> bool:
        """A running workload reached its next checkpoint: ``JobCheckpointed``, and schedule the one after."""
        job_id, attempt, k = payload
        run = self._live.get((job_id, attempt))
        if run is None or run[3] is not None:
            return False
        dirty = self._feed(self._checkpointed(job_id, attempt, k * run[2], t, k), t)
        self._next_checkpoint(job_id, attempt, k + 1, run)
        return dirty

    def _checkpointed(self, job_id: str, attempt: int, progress: float, t: Micros, tag: Any) -> JobCheckpointed:
        return JobCheckpointed(
            event_id=det_id("sim", "JobCheckpointed", job_id, attempt, tag),
            ts=from_us(t),
            producer="sim/agent",
            job_id=job_id,
            attempt=attempt,
            progress_s=progress,
        )

    def _stop(self, e: StopWorkload, t: Micros) -> None:
        replica = self._on_node.pop((e.node_id, e.job_id, e.attempt), None)
        if replica is None or e.node_id in self._dead:
            return
        if self._alive.pop((e.job_id, e.attempt, replica), None) is None:
            return
        delay = self.cfg.stop_delay_s
        if delay is None:
            delay = self.rng.uniform(0.0, e.grace_s)
        delay = min(delay, e.grace_s)
        at = t + s_to_us(delay)
        run = self._live.pop((e.job_id, e.attempt), None)
        if run is not None and run[5] and e.grace_s > 0:
            # SIGTERM: the workload saves the progress it had when it stopped working, then exits
            start, base, _every, dead, _duration, _saves = run
            upto = t if dead is None else min(t, dead)
            progress = base + us_to_s(max(0, upto - start))
            self._push(at, self._EV, self._checkpointed(e.job_id, e.attempt, progress, at, "stop"))
        self._push(
            at,
            self._EV,
            JobFailed(
                event_id=det_id("sim", "JobFailed", e.job_id, e.attempt, replica),
                ts=from_us(at),
                producer="sim/agent",
                job_id=e.job_id,
                attempt=e.attempt,
                replica=replica,
                node_id=e.node_id,
                exit_code=-15,
                reason="stopped",
            ),
        )

    def _sample(self, t: Micros) -> None:
        st = self.state
        led = st.ledger
        if led.clock is None or t < led.clock:
            return
        occ = led.occupancy(t)
        cap = led.capacity_gpu_s(t)
        running: dict[str, int] = {}
        for run in st.cluster.runs.values():
            if not run.stopping:
                running[run.budget] = running.get(run.budget, 0) + run.gpus_per_replica * len(run.open_replicas)
        row = {}
        usable: dict[str, float] = {}
        for leaf in self.tree.leaves():
            waiting = st.pending.get(leaf, ())
            row[leaf] = (
                occ.get(leaf, 0.0) / cap if cap > 0 else 0.0,
                running.get(leaf, 0),
                len(waiting),
                sum(1 for j in waiting if j.allocated),
            )
            if self._model_gpus and row[leaf][3]:
                usable[leaf] = usable_fraction(self._model_gpus, (j.gpu_model for j in waiting if j.allocated))
        self.samples.append((t, row))
        self.usable.append(usable)


def simulate(
    tree: BudgetTree,
    nodes: Sequence[SimNode],
    jobs: Sequence[SimJob],
    config: SimConfig,
    scheduler: Callable[..., list[Event]] | None = None,
) -> SimResult:
    """Run one simulation; ``scheduler`` swaps the cycle (baselines), default the fair-share engine."""
    from dataclasses import replace

    cfg = config
    if scheduler is not None:
        cfg = replace(config, dispatch=replace(config.dispatch, scheduler=scheduler))
    return Simulator(tree, nodes, jobs, cfg).run()
