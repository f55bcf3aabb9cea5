"""The events a cycle emits: ``JobPlaced`` (with its :class:`~apportion.events.Decision`), ``StartWorkload``
per replica, ``JobPreempted`` + ``StopWorkload`` per victim.

Event ids come from :func:`~apportion.events.det_id` and times from the
cycle's event time, so the same snapshot and time always give the same
events, byte for byte. The dispatcher's own stops (drain, node lost,
cancel) use the same constructors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import Run, protection_s, work_lost_gpu_s
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.events import (
    Decision,
    Event,
    JobPlaced,
    JobPreempted,
    Placement,
    StartWorkload,
    StopWorkload,
    Victim,
    det_id,
)
from apportion.timeutil import Micros, from_us, s_to_us, to_us

__all__ = [
    "emit_placed",
    "pending_start_events",
    "preempt_events",
    "protection_cap_us",
    "start_events",
    "stop_event",
]


def start_events(
    job_id: str,
    attempt: int,
    placements: Sequence[Placement],
    ts: Any,
    duration_s: float | None,
    command: tuple[str, ...] | None,
    producer: str,
    *,
    progress_s: float = 0.0,
    checkpoint_interval_s: float | None = None,
) -> list[Event]:
    """``StartWorkload`` for every replica of a run (ids by :func:`det_id`).

    ``progress_s``: seconds of the job's work its last checkpoint saved, where this attempt resumes
    (:attr:`~apportion.domain.engine.inputs.PendingJob.progress_s`); ``checkpoint_interval_s``: the job's
    interval in force, seconds (``JobQueued.checkpoint_interval_s``, i.e.
    :func:`~apportion.events.checkpoint_interval_of`), ``None`` when it does not checkpoint. A simulated
    workload runs ``duration_s - progress_s`` and checkpoints at each multiple of the interval
    (``docs/checkpoints.md``). The dispatcher adds the job's settings for the node agent (its user, ``env``,
    time limit) with :func:`apportion.domain.dispatch.with_job_settings`.
    """
    return [
        StartWorkload(
            event_id=det_id("StartWorkload", job_id, attempt, i),
            ts=ts,
            producer=producer,
            node_id=p.node_id,
            job_id=job_id,
            attempt=attempt,
            replica=i,
            gpus=p.gpus,
            command=command,
            duration_s=duration_s,
            progress_s=progress_s,
            checkpoint_interval_s=checkpoint_interval_s,
        )
        for i, p in enumerate(placements)
    ]


def pending_start_events(job: PendingJob, placements: Sequence[Placement], ts: Any, producer: str) -> list[Event]:
    """:func:`start_events` of a pending job placed on ``placements`` (a
    :class:`~apportion.domain.engine.inputs.PendingJob`: its attempt, duration, command, saved progress and
    checkpoint interval), the one place every scheduler's placement builds its ``StartWorkload``s."""
    return start_events(
        job.job_id,
        job.attempt,
        placements,
        ts,
        job.duration_s,
        job.command,
        producer,
        progress_s=job.progress_s,
        checkpoint_interval_s=job.checkpoint_interval_s,
    )


def preempt_events(
    run: Run,
    ts: Any,
    grace_s: float,
    producer: str,
    *,
    victim: Victim | None = None,
    by_job_id: str | None = None,
    by_budget: str | None = None,
    reason: str = "preempted",
) -> list[Event]:
    """``JobPreempted`` for ``run`` then ``StopWorkload`` to each open replica's node.

    ``JobPreempted.lost_gpu_s`` is :func:`~apportion.domain.cluster.work_lost_gpu_s`
    of the run at ``ts`` (rule D1.work-lost).
    """
    out: list[Event] = [
        JobPreempted(
            event_id=det_id("JobPreempted", run.job_id, run.attempt),
            ts=ts,
            producer=producer,
            job_id=run.job_id,
            attempt=run.attempt,
            budget=run.budget,
            allocated=run.allocated,
            by_job_id=by_job_id,
            by_budget=by_budget,
            victim=victim,
            grace_s=grace_s,
            reason=reason,
            lost_gpu_s=work_lost_gpu_s(run, to_us(ts)),
        )
    ]
    out.extend(stop_event(run, r, ts, grace_s, producer, reason) for r in sorted(run.open_replicas))
    return out


def stop_event(run: Run, replica: int, ts: Any, grace_s: float, producer: str, reason: str) -> StopWorkload:
    """``StopWorkload`` of one replica of ``run`` to its node (id by :func:`det_id`: one per replica and attempt).

    Args:
        grace_s: SIGTERM-to-SIGKILL grace, seconds.
    """
    return StopWorkload(
        event_id=det_id("StopWorkload", run.job_id, run.attempt, replica),
        ts=ts,
        producer=producer,
        node_id=run.placements[replica].node_id,
        job_id=run.job_id,
        attempt=run.attempt,
        grace_s=grace_s,
        reason=reason,
    )


def job_protection_s(job: PendingJob, tree: BudgetTree, cfg: EngineConfig, ratio: float | None = None) -> float:
    """:func:`protection_s` of ``job`` placed now, seconds: its preemptions so far, its budget's
    ``max_min_runtime``, the cap ``cfg.window_s x cfg.protection_cap_w``, with ``cfg.progress_after`` its
    checkpointed progress and with ``cfg.at_share_bound`` its budget's r ``ratio`` in the cycle's view
    (what its ``JobPlaced`` records)."""
    return protection_s(
        job.min_runtime_s,
        job.preemptions,
        tree.max_min_runtime_s(job.budget),
        cfg.window_s,
        cfg.protection_cap_w,
        cfg.protection_doublings,
        cfg.churn_bound,
        cfg.progress_after,
        job.progress_s,
        cfg.at_share_bound,
        ratio,
    )


def protection_cap_us(budget: str, tree: BudgetTree, cfg: EngineConfig) -> Micros | None:
    """The cap of every protection of a run of ``budget``, µs, or ``None`` (no cap): what :func:`protection_s`
    grows a protection to past its doublings, ``W x cfg.protection_cap_w`` or the budget's ``max_min_runtime``
    when lower (rule D3.gangs). The gang rule's bound (:func:`~apportion.domain.preemption.gang_rule`)."""
    cap = protection_s(1.0, 1, tree.max_min_runtime_s(budget), cfg.window_s, cfg.protection_cap_w, 0, None)
    return None if math.isinf(cap) else s_to_us(cap)


def emit_placed(
    out: list[Event],
    job: PendingJob,
    placements: tuple[Placement, ...],
    victims: tuple[Victim, ...],
    leaf: str,
    rank: int,
    budget_rank: Mapping[str, int],
    r: float,
    reservation: bool,
    ts: Any,
    cfg: EngineConfig,
    tree: BudgetTree | None = None,
) -> None:
    """Append the ``JobPlaced`` of ``job``. With ``tree`` its decision records the
    protection (:func:`protection_s` of the job's preemptions, capped by the budget's
    ``max_min_runtime`` and ``W x protection_cap_w``); without (baseline policies), none: the
    protection is then the minimum runtime."""
    protection = None
    if job.allocated and tree is not None:
        protection = job_protection_s(job, tree, cfg, r)
    out.append(
        JobPlaced(
            event_id=det_id("JobPlaced", job.job_id, job.attempt),
            ts=ts,
            producer=cfg.producer,
            job_id=job.job_id,
            attempt=job.attempt,
            budget=job.budget,
            user=job.user,
            allocated=job.allocated,
            gpus_per_replica=job.gpus_per_replica,
            replicas=job.replicas,
            min_runtime_s=job.min_runtime_s,
            placements=placements,
            submitted_at=from_us(job.submitted_at_us),
            checkpoint_interval_s=job.checkpoint_interval_s,
            decision=Decision(
                rank=rank,
                budget_rank=budget_rank.get(leaf, -1),
                ratio=r,
                victims=victims,
                reservation=reservation,
                policy_version=cfg.policy_version,
                protection_s=protection,
                preemptions=job.preemptions if protection is not None else None,
            ),
        )
    )
