"""The engine's inputs: the policy knobs (:class:`EngineConfig`) and one pending job (:class:`PendingJob`).

Also the order of a leaf's pending list (:func:`pending_order`: allocated jobs
first, each class by (submitted_at, job_id)) and where its unallocated jobs
begin (:func:`allocated_count`), which the cycle, the baselines and
``DispatchState`` share.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from apportion.domain.cluster import (
    PROTECTION_CAP_W,
    PROTECTION_CHURN_BOUND,
    PROTECTION_DOUBLINGS,
    PROTECTION_GROW_OVER_SHARE,
)
from apportion.events import DEFAULT_GRACE_S, is_allocated
from apportion.timeutil import WEEK_S, Micros

__all__ = [
    "CHECKPOINT_WAIT_S",
    "PATIENCE_S",
    "POLICY_VERSION",
    "EngineConfig",
    "PendingJob",
    "allocated_count",
    "pending_order",
]

POLICY_VERSION = "fairtree-10"
"""fairtree-10: fairtree-9 with protection grown with preemptions only for a job whose budget is at or under its share
(r <= 1) when placed (``EngineConfig.grow_over_share`` False, rule D3.bounded-churn): ``docs/simulation.md``, "Current
results". Recorded in ``DispatcherConfigured.grow_over_share`` (absent: True, so fairtree-9 logs are re-run exactly).
fairtree-9: fairtree-8 with free work by least attained service (``EngineConfig.free_las``, rule D3.free-las) and
a reservation holder's fit counting the allocated runs placed earlier in the same cycle
(:func:`~apportion.domain.engine.reservation.earliest_fit_us`): ``docs/simulation.md``, "Current results". Recorded
in ``DispatcherConfigured.free_las`` (absent: False); the fit's change has no knob, so fairtree-8 logs are not
re-run by this engine.
fairtree-8: fairtree-7 with a reservation holder's fit counting only the runs it may take back (a holder with no
known fit keeps no GPU free) and :func:`~apportion.domain.preemption.gang_rule` bounded by the protection cap (a gang
past it is a victim like any other run): rule D3.gangs, ``docs/simulation.md``, "Current results". Its decisions
differ from fairtree-7's with no knob to turn the two back, so fairtree-7 logs are not re-run by this engine.
fairtree-7: fairtree-6 and :func:`~apportion.domain.preemption.gang_rule` (``EngineConfig.gang_rule``: an
allocated gang is never preempted for a job smaller than it); ``docs/simulation.md``, "Fair share's preemption rules".
fairtree-6: fairtree-5 with a churn bound of 5 (``EngineConfig.churn_bound``: a job preempted 5 times is
protected until it completes) and protection growth capped at W / 4 again (``EngineConfig.protection_cap_w``,
the example of rule D3.bounded-churn); weeks 39-45 of Philly: at most 5 preemptions of any allocated job (6 before) and
mean share deficit 0.51 pp (0.53), ``CHANGELOG.md``, "Engine policy versions".
fairtree-5: fairtree-4 and protection that doubles for a job's first 3 preemptions, then is the cap
(``EngineConfig.protection_doublings``).
fairtree-4: fairtree-3 and :func:`~apportion.domain.preemption.checkpoint_rule` (``EngineConfig.checkpoint_wait_s``),
protection growth capped by W instead of W / 4 (``EngineConfig.protection_cap_w``).
fairtree-3: fairtree-2 and :func:`~apportion.domain.preemption.patience_rule` (``EngineConfig.patience_s``).
fairtree-2: after-move test, no same-cycle reversal, protection grown per preemption,
cold-start capacity floor, reservation backfill, spare models first."""

PATIENCE_S = 7200.0
"""Default ``EngineConfig.patience_s`` (seconds), chosen on Philly (``docs/simulation.md``)."""

CHECKPOINT_WAIT_S = 7200.0
"""Default ``EngineConfig.checkpoint_wait_s`` (seconds): the longest a preemption waits for its victims'
next checkpoint (:func:`~apportion.domain.preemption.checkpoint_rule`); Philly's longest minimum runtime."""


HERO_MIN_GPUS = 1024
"""Default ``EngineConfig.hero_min_gpus``: the least GPUs of a job that rule ``D3.hero-cover`` concerns."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler policy knobs.

    Attributes:
        delta: hysteresis for preempting an expired allocated run: its branch
            r must exceed the preemptor's by at least this (default 0.05).
        reservation_after_s: a blocked allocated job waiting at least this
            long (seconds since queued) reserves nodes (default 1 h).
        window_s: occupancy window W in seconds (for the provisional charge).
        grace_s: SIGTERM-to-SIGKILL grace of ``StopWorkload``, seconds.
        patience_s: longest wait of a job at or over its share before it
            preempts whatever the work lost (:func:`~apportion.domain.preemption.patience_rule`;
            default 2 h, 0 turns the rule off).
        checkpoint_wait_s: longest a preemption waits for its victims' next checkpoint when waiting
            costs fewer GPU-seconds than it saves (:func:`~apportion.domain.preemption.checkpoint_rule`;
            default 2 h, 0 turns the rule off).
        protection_cap_w: cap of the protection growth as a fraction of ``window_s``
            (:func:`~apportion.domain.cluster.protection_s`; default 0.25, W / 4).
        protection_doublings: preemptions for which the protection doubles before it jumps to the cap
            (:func:`~apportion.domain.cluster.protection_s`; default 3; ``None`` doubles to the cap).
        churn_bound: preemptions after which a job is protected until it completes, so no allocated job is
            preempted more often (:func:`~apportion.domain.cluster.protection_s`; default 5; ``None``: no bound).
        gang_rule: apply :func:`~apportion.domain.preemption.gang_rule` (an allocated gang is never preempted
            for a job smaller than it; default True, False up to policy fairtree-6).
        gang_min_gpus: the gang rule spares only gangs of at least this many GPUs (rule D3.gangs;
            :func:`~apportion.domain.preemption.gang_rule`); default ``None``: every gang.
        gang_bound_x: the gang rule's bound as a multiple of the gang's own protection, where lower than the
            protection cap (rule D3.gangs; :func:`~apportion.domain.preemption.gang_bound_us`); default ``None``:
            the cap alone.
        gang_last_resort: a gang the gang rule spares (past its protection, under its bound) is a victim when
            no feasible victim set without one exists (rule D3.gangs: "while other victims exist"); default
            False: spared until its bound. Measured and not adopted (docs/hero.md), part of no policy version.
        gang_last_resort_over_share: with ``gang_last_resort``, the last resort takes only the gangs of a budget
            over its share (r > 1 in the cycle's view); a gang of a budget at or under its share stays spared until
            its bound, as the gang rule has it (rule D3.gangs: the gang whose budget falls further behind while it
            gathers again). Default False; measured in docs/hero.md, part of no policy version.
        hero_min_gpus: rule ``D3.hero-cover`` applies to jobs of at least this many GPUs (a job that large and
            larger than its budget's share of the capacity neither reserves nodes nor preempts busy allocated runs;
            :func:`~apportion.domain.engine.reservation.share_covers`); default 1,024, so no job of a cluster of a few
            hundred GPUs is concerned; ``None``: off.
        cover_min_gpus: the least GPUs of a job that rule ``D3.hero-cover``'s reservation and preemption clause
            concerns, where lower than ``hero_min_gpus`` (the victims' clause keeps ``hero_min_gpus``): a job of at
            least this many GPUs that its budget's share does not cover (g x k > abs(b) x C(t)) neither reserves
            nodes nor preempts busy allocated runs. Default ``None``: ``hero_min_gpus`` alone. Measured and not
            adopted (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        free_order: place unallocated jobs by rule D3.free-order (the leaf with the fewest unallocated GPUs
            in use per unit of share first, one job at a time; :func:`~apportion.domain.fairshare.free_order_key`);
            default False: leaf by leaf in the budget order of the allocated pass. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        progress_after: preemptions from which a job's protection is at least the progress its last checkpoint
            saved, capped as every protection (:func:`~apportion.domain.cluster.protection_s`; rule
            D3.bounded-churn's job-dependent variant); default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        at_share_bound: the churn bound of a job whose budget is at or under its share (r <= 1 in the cycle's
            view) when placed, where lower than ``churn_bound``; a job over its share keeps ``churn_bound``
            (:func:`~apportion.domain.cluster.protection_s`); default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        grow_over_share: False (policy fairtree-10, rule D3.bounded-churn): a job's protection grows with its
            preemptions only where its budget is at or under its share (r <= 1 in the cycle's view) when placed; over
            its share it is its minimum runtime, the churn bound still applying
            (:func:`~apportion.domain.cluster.protection_s`). True: every job grows (policies up to fairtree-9, and
            records written before it existed).
        owner_free: rule D3.owner-free: when the allocated pass first reaches a leaf over its share, each leaf at
            or under its share (r <= 1 in the cycle's view) first places its unallocated jobs on free GPUs, up to
            its headroom (:func:`~apportion.domain.fairshare.owner_headroom`); they stay free and preemptible.
            Default False.
        gang_wait_s: rule D3.gang-wait: an allocated job of several replicas (a gang across nodes) whose attempt
            has waited less than this (seconds since queued) starts only on free GPUs (its own or a reservation's
            lent ones): it neither reserves nodes nor preempts; default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        hero_reserve_takable: rule D3.hero-cover's reservation clause: a covered job of at least ``hero_min_gpus`` GPUs
            reserves only nodes whose allocated runs it may take back once their protection ends (a node with a run it
            may not take back gives the reservation no known time to fit, which unreserves it);
            :func:`~apportion.domain.engine.reservation.untakable_nodes`. Default False. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        hero_waits: rule D3.hero-waits: a covered job of at least ``hero_min_gpus`` GPUs never preempts a covered hero
            run within its share (D3.hero-cover's victims' clause then has no fallback for it): it waits, and from its
            first blocked cycle reserves the k nodes that fit it soonest, those holding a run it may never take back
            (such a hero run, a run it may not take back once its protection ends, or one protected until it
            completes) left out (:func:`~apportion.domain.engine.reservation.soonest_nodes`); backfill there must end
            or be preemptible by then (D3.scheduling-cycle). Default False, part of no policy version (docs/hero.md).
        free_las: rule D3.free-las: unallocated jobs by least attained service first (``PendingJob.attained_gpu_s``,
            the GPU-seconds the job's earlier attempts held), ties in the order without it: every job that has not
            run yet leaf by leaf in the budget order of the allocated pass, then the requeued ones, fewest
            GPU-seconds first; with ``free_order`` on, rule D3.free-order orders them instead. Default True
            (policy fairtree-9); False in records written before it existed.
        free_age_s: aged free work first: with ``free_las``, unallocated jobs submitted at least this long ago
            (seconds) are placed before the rest of the free work, across all leaves oldest first, ties by job id;
            the rest keep rule D3.free-las's order. Default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        free_las_queue_gpu_s: discretized least attained service (two queues, as Tiresias's 2D-LAS): with
            ``free_las``, a requeued unallocated job whose earlier attempts held fewer GPU-seconds than this joins
            the jobs not yet run, in its place in its leaf's submission order; the rest keep rule D3.free-las's
            order (:func:`~apportion.domain.engine.cycle.first_las_queue`). Default ``None``: off (every requeued
            job after the jobs not yet run). Not part of any policy version.
        free_starve_x: rule D3.free-starve (Tiresias's starvation promotion, ``STARVELIMIT``): with ``free_las``, a
            requeued unallocated job whose wait since it was requeued (seconds since queued) exceeds this multiple
            of its attained service (``PendingJob.attained_gpu_s``) goes back to the jobs not yet run, in its place
            in its leaf's submission order (:func:`~apportion.domain.engine.cycle.free_starved`). Default ``None``:
            off. Not part of any policy version.
        free_starve_s: rule D3.free-starve with a fixed wait instead: a requeued unallocated job that has waited
            more than this long (seconds since queued) is promoted the same way. Default ``None``: off; with both
            set, either promotes. Not part of any policy version.
        free_las_levels_gpu_s: rule D3.free-starve's levels: with ``free_las``, the requeued unallocated jobs not
            promoted go by the level of their attained service (how many of these ascending thresholds, GPU-seconds,
            it has reached), then by first submission across all leaves, instead of fewest GPU-seconds first.
            Default ``None``: off. Not part of any policy version.
        age_first_s: aged allocated work first (an age term, as Slurm's multifactor priority and Tiresias's
            STARVELIMIT have): before the fair-share walk, the allocated jobs of one node (replicas 1; every job with
            ``age_first_gangs``) whose attempt has waited at least this long (seconds since queued) are taken in the
            fair-share order among themselves, each placed on free GPUs or by a preemption under the usual rules,
            never reserving; a blocked one keeps its place in the walk
            (:func:`~apportion.domain.engine.cycle._take_aged`). Default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        age_first_gangs: with ``age_first_s``, gangs across nodes (replicas > 1) are aged too; default False: a
            gang keeps its place in the walk (taken ahead of it, it would gather its nodes by preempting).
        age_weight: a capped age weight on the fair-share walk (Slurm's ``PriorityWeightAge``, in units of r):
            pass 1 ranks each leaf by its r less ``age_weight * min(floor(wait / 1 h) / (age_max_s / 1 h), 1)``,
            ``wait`` that of its oldest allocated job not yet taken
            (:mod:`~apportion.domain.engine.aging`). Default ``None``: off. Measured and not adopted
            (``docs/simulation.md``, "Levers measured"), so it is not part of any policy version.
        age_max_s: with ``age_weight``, the wait at which the term reaches its cap (Slurm's ``PriorityMaxAge``,
            whose default of 7 days it takes), seconds.
        age_floor_r: with ``age_weight``, a leaf whose r is above this is lifted by its term no lower than it, and
            one at or under it keeps its r (at 1.0 the term orders the borrowers among themselves, after every
            leaf at or under its share). Default ``None``: no floor.
        preemption: False disables preemption (baselines).
        policy_version: recorded in every :class:`Decision`.
        producer: ``producer`` of emitted events.
    """

    delta: float = 0.05
    reservation_after_s: float = 3600.0
    window_s: float = float(WEEK_S)
    grace_s: float = DEFAULT_GRACE_S
    patience_s: float = PATIENCE_S
    checkpoint_wait_s: float = CHECKPOINT_WAIT_S
    protection_cap_w: float = PROTECTION_CAP_W
    protection_doublings: int | None = PROTECTION_DOUBLINGS
    churn_bound: int | None = PROTECTION_CHURN_BOUND
    gang_rule: bool = True
    gang_min_gpus: int | None = None
    gang_bound_x: float | None = None
    gang_last_resort: bool = False
    gang_last_resort_over_share: bool = False
    hero_min_gpus: int | None = HERO_MIN_GPUS
    cover_min_gpus: int | None = None
    free_order: bool = False
    progress_after: int | None = None
    at_share_bound: int | None = None
    grow_over_share: bool = PROTECTION_GROW_OVER_SHARE
    owner_free: bool = False
    gang_wait_s: float | None = None
    hero_reserve_takable: bool = False
    hero_waits: bool = False
    free_las: bool = True
    free_age_s: float | None = None
    free_las_queue_gpu_s: float | None = None
    free_starve_x: float | None = None
    free_starve_s: float | None = None
    free_las_levels_gpu_s: tuple[float, ...] | None = None
    age_first_s: float | None = None
    age_first_gangs: bool = False
    age_weight: float | None = None
    age_max_s: float = float(WEEK_S)
    age_floor_r: float | None = None
    preemption: bool = True
    policy_version: str = POLICY_VERSION
    producer: str = "dispatcher"

    @property
    def least_attained_free(self) -> bool:
        """Does the unallocated pass order free work by least attained service (rule D3.free-las)? The rule
        applies unless D3.free-order (``free_order``) shares the free GPUs instead."""
        return self.free_las and not self.free_order


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job waiting in the queue (one attempt).

    Attributes:
        job_id, attempt: identity of the run it would become.
        budget: leaf budget path charged.
        user: submitting user.
        gpus_per_replica, replicas: gang shape g x k.
        min_runtime_s: protection in seconds; 0 = unallocated.
        gpu_model: required model or ``None``.
        submitted_at_us: original submission (queue order), µs UTC.
        queued_at_us: when this attempt entered the queue (reservation wait), µs UTC.
        duration_s, command: the workload, passed on to ``StartWorkload``.
        preemptions: times the job was preempted before (``ClusterState.preemptions``),
            the input of :func:`~apportion.domain.cluster.protection_s`.
        progress_s: progress its last checkpoint saved, seconds (where this attempt resumes).
        checkpoint_interval_s: the job's checkpoint interval in force (``JobQueued.checkpoint_interval_s``),
            seconds, or ``None`` (no checkpoint expected); recorded in ``JobPlaced``.
        topology_bound: ``"block"``/``"rack"``: all replicas within one (``JobSubmitted.topology_bound``,
            rule ``D1.topology``), or ``None``.
        attained_gpu_s: GPU-seconds the job's earlier attempts held, each from its placement to the release of its
            last replica (``ClusterState.worked_us`` x g x k): its attained service, the key of rule D3.free-las.
    """

    job_id: str
    attempt: int
    budget: str
    user: str
    gpus_per_replica: int
    replicas: int
    min_runtime_s: float
    submitted_at_us: Micros
    queued_at_us: Micros
    gpu_model: str | None = None
    duration_s: float | None = None
    command: tuple[str, ...] | None = None
    preemptions: int = 0
    progress_s: float = 0.0
    checkpoint_interval_s: float | None = None
    topology_bound: str | None = None
    attained_gpu_s: float = 0.0

    @property
    def allocated(self) -> bool:
        """True when charged (:func:`~apportion.events.is_allocated`)."""
        return is_allocated(self.min_runtime_s)

    @property
    def gpus(self) -> int:
        """g * k."""
        return self.gpus_per_replica * self.replicas


def allocated_count(jobs: Sequence[PendingJob]) -> int:
    """Index of the first unallocated job of a leaf's pending list (= how many allocated jobs lead it).

    The list must be in :func:`pending_order` (allocated jobs first).
    """
    return bisect_left(jobs, True, key=_is_unallocated)


def _is_unallocated(j: PendingJob) -> bool:
    return not is_allocated(j.min_runtime_s)


def pending_order(j: PendingJob) -> tuple[bool, int, str]:
    """Sort key of a leaf's pending list: allocated jobs first, each class by (submitted_at, job_id)."""
    return (not is_allocated(j.min_runtime_s), j.submitted_at_us, j.job_id)
