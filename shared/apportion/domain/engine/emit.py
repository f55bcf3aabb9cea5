"""The events a cycle emits: ``JobPlaced`` (with its :class:`~apportion.events.Decision`), ``StartWorkload``
per replica, ``JobPreempted`` + ``StopWorkload`` per victim.

Event ids come from :func:`~apportion.events.det_id` and times from the
cycle's event time, so the same snapshot and time always give the same
events, byte for byte. The dispatcher's own stops (drain, node lost,
cancel) use the same constructors.

An event whose every value is already what validation would return for its field (the exact type, within
the field's bounds: an ``int`` where an ``int`` goes, a ``float`` where a ``float`` goes, aware UTC times,
nested models already built) is made as validation would make it without running validation again
(:func:`built`): the same fields, the same values, the same JSON. Any other value (an ``int`` for a
``float`` field, a bound crossed) goes through validation, which converts it or raises as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import Run, protection_s, work_lost_gpu_s
from apportion.domain.engine.inputs import EngineConfig, PendingJob
from apportion.events import (
    MAX_SECONDS,
    Decision,
    Event,
    JobCompleted,
    JobPlaced,
    JobPreempted,
    JobStarted,
    Placement,
    StartWorkload,
    StopWorkload,
    Victim,
    det_id,
)
from apportion.timeutil import Micros, from_us, s_to_us, to_us

__all__ = [
    "built",
    "emit_placed",
    "pending_start_events",
    "placement",
    "preempt_events",
    "protection_cap_us",
    "real_or_none",
    "start_events",
    "stop_event",
    "utc_time",
]


M = TypeVar(
    "M", Victim, Decision, JobPlaced, JobPreempted, StartWorkload, StopWorkload, Placement, JobStarted, JobCompleted
)

_new = object.__new__
# the model's own slot setters (what ``object.__setattr__`` ends in, without its lookup by name)
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def _fields_of(cls: type[Any]) -> tuple[dict[str, Any], tuple[tuple[str, Any], ...]]:
    """Every field of ``cls`` in its order with its default (``None`` for a default factory), and the factories."""
    fields = cls.model_fields
    return (
        {name: None if f.default_factory is not None else f.default for name, f in fields.items()},
        tuple((name, f.default_factory) for name, f in fields.items() if f.default_factory is not None),
    )


_FIELDS: dict[type[Any], tuple[dict[str, Any], tuple[tuple[str, Any], ...]]] = {
    cls: _fields_of(cls)
    for cls in (
        Victim,
        Decision,
        JobPlaced,
        JobPreempted,
        StartWorkload,
        StopWorkload,
        Placement,
        JobStarted,
        JobCompleted,
    )
}


def built(cls: type[M], values: dict[str, Any], plain: bool) -> M:
    """``cls(**values)``. With ``plain`` (the caller checked that every value is exactly what validation
    returns for its field: :func:`utc_time`, :func:`real_or_none`, ...) the instance validation would build, made
    without validating again: the other fields at their defaults, ``values``' keys as the fields set."""
    if not plain:
        return cls(**values)
    template, factories = _FIELDS[cls]
    fields = {**template, **values}
    for name, factory in factories:
        if name not in values:
            fields[name] = factory()
    obj = _new(cls)
    _set_dict(obj, fields)
    _set_fields_set(obj, set(values))
    _set_extra(obj, None)
    _set_private(obj, None)
    return obj


def placement(node_id: str, gpus: tuple[int, ...]) -> Placement:
    """``Placement(node_id=node_id, gpus=gpus)``, without validating again when the values are already what
    validation returns (a ``str`` and a tuple of ``int``: :func:`built`)."""
    return built(
        Placement,
        {"node_id": node_id, "gpus": gpus},
        type(node_id) is str and type(gpus) is tuple and _all_of(int, gpus),
    )


def _all_of(cls: type[Any], items: Sequence[object]) -> bool:
    """Every item is of exactly type ``cls`` (a loop: no generator per call)."""
    for x in items:
        if type(x) is not cls:
            return False
    return True


def utc_time(v: object) -> bool:
    """An aware UTC ``datetime``: what a time field's validation returns unchanged."""
    return type(v) is datetime and v.tzinfo is UTC


def real_or_none(v: object) -> bool:
    """A ``float | None`` field's value as validation returns it (an ``int`` would become a ``float``)."""
    return v is None or type(v) is float


def _interval(v: object) -> bool:
    """A ``float | None`` field of bounds (0, MAX_SECONDS] as validation returns it."""
    return v is None or (type(v) is float and 0.0 < v <= MAX_SECONDS)


def _run_fields(job_id: object, attempt: object, ts: object, producer: object) -> bool:
    """The envelope and the run of an event as validation returns them."""
    return type(job_id) is str and type(attempt) is int and type(producer) is str and utc_time(ts)


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
    plain = (
        _run_fields(job_id, attempt, ts, producer)
        and (command is None or (type(command) is tuple and _all_of(str, command)))
        and real_or_none(duration_s)
        and (progress_s is None or (type(progress_s) is float and 0.0 <= progress_s <= MAX_SECONDS))
        and _interval(checkpoint_interval_s)
    )
    out: list[Event] = []
    for i, p in enumerate(placements):
        out.append(
            built(
                StartWorkload,
                {
                    "event_id": det_id("StartWorkload", job_id, attempt, i),
                    "ts": ts,
                    "producer": producer,
                    "node_id": p.node_id,
                    "job_id": job_id,
                    "attempt": attempt,
                    "replica": i,
                    "gpus": p.gpus,
                    "command": command,
                    "duration_s": duration_s,
                    "progress_s": progress_s,
                    "checkpoint_interval_s": checkpoint_interval_s,
                },
                plain and type(p) is Placement,
            )
        )
    return out


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
    lost = work_lost_gpu_s(run, to_us(ts))
    job_id, attempt = run.job_id, run.attempt
    plain = (
        _run_fields(job_id, attempt, ts, producer)
        and type(grace_s) is float
        and type(reason) is str
        and type(run.budget) is str
        and type(run.allocated) is bool
        and (by_job_id is None or type(by_job_id) is str)
        and (by_budget is None or type(by_budget) is str)
        and (victim is None or type(victim) is Victim)
        and type(lost) is float
        and lost >= 0.0
    )
    out: list[Event] = [
        built(
            JobPreempted,
            {
                "event_id": det_id("JobPreempted", job_id, attempt),
                "ts": ts,
                "producer": producer,
                "job_id": job_id,
                "attempt": attempt,
                "budget": run.budget,
                "allocated": run.allocated,
                "by_job_id": by_job_id,
                "by_budget": by_budget,
                "victim": victim,
                "grace_s": grace_s,
                "reason": reason,
                "lost_gpu_s": lost,
            },
            plain,
        )
    ]
    for r in sorted(run.open_replicas):
        out.append(stop_event(run, r, ts, grace_s, producer, reason))
    return out


def stop_event(run: Run, replica: int, ts: Any, grace_s: float, producer: str, reason: str) -> StopWorkload:
    """``StopWorkload`` of one replica of ``run`` to its node (id by :func:`det_id`: one per replica and attempt).

    Args:
        grace_s: SIGTERM-to-SIGKILL grace, seconds.
    """
    job_id, attempt, node_id = run.job_id, run.attempt, run.placements[replica].node_id
    return built(
        StopWorkload,
        {
            "event_id": det_id("StopWorkload", job_id, attempt, replica),
            "ts": ts,
            "producer": producer,
            "node_id": node_id,
            "job_id": job_id,
            "attempt": attempt,
            "grace_s": grace_s,
            "reason": reason,
        },
        _run_fields(job_id, attempt, ts, producer)
        and type(node_id) is str
        and type(grace_s) is float
        and type(reason) is str,
    )


def job_protection_s(job: PendingJob, tree: BudgetTree, cfg: EngineConfig, ratio: float | None = None) -> float:
    """:func:`protection_s` of ``job`` placed now, seconds: its preemptions so far, its budget's
    ``max_min_runtime``, the cap ``cfg.window_s x cfg.protection_cap_w``, with ``cfg.progress_after`` its
    checkpointed progress and with ``cfg.at_share_bound`` or ``cfg.grow_over_share`` its budget's r ``ratio`` in
    the cycle's view (what its ``JobPlaced`` records)."""
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
        cfg.grow_over_share,
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
    allocated = job.allocated
    protection = None
    if allocated and tree is not None:
        protection = job_protection_s(job, tree, cfg, r)
    preemptions = job.preemptions if protection is not None else None
    b_rank = budget_rank.get(leaf, -1)
    policy = cfg.policy_version
    decision = built(
        Decision,
        {
            "rank": rank,
            "budget_rank": b_rank,
            "ratio": r,
            "victims": victims,
            "reservation": reservation,
            "policy_version": policy,
            "protection_s": protection,
            "preemptions": preemptions,
        },
        type(rank) is int
        and type(b_rank) is int
        and type(r) is float
        and type(victims) is tuple
        and _all_of(Victim, victims)
        and type(reservation) is bool
        and type(policy) is str
        and real_or_none(protection)
        and (preemptions is None or type(preemptions) is int),
    )
    job_id, attempt, producer, mr = job.job_id, job.attempt, cfg.producer, job.min_runtime_s
    g, k, ckpt, submitted_at = (
        job.gpus_per_replica,
        job.replicas,
        job.checkpoint_interval_s,
        from_us(job.submitted_at_us),
    )
    out.append(
        built(
            JobPlaced,
            {
                "event_id": det_id("JobPlaced", job_id, attempt),
                "ts": ts,
                "producer": producer,
                "job_id": job_id,
                "attempt": attempt,
                "budget": job.budget,
                "user": job.user,
                "allocated": allocated,
                "gpus_per_replica": g,
                "replicas": k,
                "min_runtime_s": mr,
                "placements": placements,
                "submitted_at": submitted_at,
                "checkpoint_interval_s": ckpt,
                "decision": decision,
            },
            _run_fields(job_id, attempt, ts, producer)
            and type(job.budget) is str
            and type(job.user) is str
            and type(allocated) is bool
            and type(g) is int
            and type(k) is int
            and type(mr) is float
            and type(placements) is tuple
            and _all_of(Placement, placements)
            and utc_time(submitted_at)
            and _interval(ckpt),
        )
    )
