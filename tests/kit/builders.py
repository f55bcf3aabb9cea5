"""Small fluent builders for domain tests (shared by occupancy, admission, engine tests).

Times are domain time, int microseconds since the epoch (UTC), written
relative to a fixed origin ``T0``::

    placed("j1", budget="lab/a", gpus=2, at=h(1))    # JobPlaced at T0 + 1 h
    completed("j1", at=h(3))

Every builder gives a deterministic ``event_id`` (uuid5 of its type, key
fields and time), so building the same event twice yields a duplicate, as a
redelivery would. Pass ``event_id=`` to override. ``at`` accepts int µs or an
aware ``datetime``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from apportion import events as ev
from apportion.timeutil import US_PER_S, from_us, to_us

T0_DT = datetime(2024, 1, 1, tzinfo=UTC)
#: Origin of test time, 2024-01-01T00:00:00Z, in µs.
T0: int = to_us(T0_DT)


def s(x: float) -> int:
    """T0 + x seconds, in µs."""
    return T0 + round(x * US_PER_S)


def m(x: float) -> int:
    """T0 + x minutes, in µs."""
    return s(x * 60)


def h(x: float) -> int:
    """T0 + x hours, in µs."""
    return s(x * 3600)


def d(x: float) -> int:
    """T0 + x days, in µs."""
    return s(x * 86400)


def dt(at: int | datetime) -> datetime:
    """µs (or datetime) -> aware UTC datetime."""
    return at if isinstance(at, datetime) else from_us(at)


def _id(event_id: uuid.UUID | None, *parts: object) -> uuid.UUID:
    return event_id if event_id is not None else ev.det_id("test", *parts)


# --------------------------------------------------------------------------- budgets


def budget_set(
    path: str,
    share: float = 1.0,
    *,
    members: Sequence[str] | None = None,
    max_min_runtime_s: float | None = None,
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.BudgetSet:
    """A ``BudgetSet`` of ``path``."""
    return ev.BudgetSet(
        path=path,
        share=share,
        members=tuple(members) if members is not None else None,
        max_min_runtime_s=max_min_runtime_s,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "BudgetSet", path, share, at),
    )


def tree(spec: Mapping[str, Any]):
    """A ``BudgetTree`` from ``{path: share}`` or ``{path: {share, members, max_min_runtime_s}}``."""
    from apportion.domain.budgets import BudgetTree

    return BudgetTree.from_mapping(spec)


# --------------------------------------------------------------------------- jobs


def submitted(
    job_id: str,
    *,
    budget: str = "lab/a",
    user: str = "alice",
    gpus: int = 1,
    replicas: int = 1,
    min_runtime_s: float = 3600.0,
    gpu_model: str | None = None,
    duration_s: float | None = 3600.0,
    command: Sequence[str] | None = None,
    at: int | datetime = T0,
    submitted_at: int | datetime | None = None,
    event_id: uuid.UUID | None = None,
) -> ev.JobSubmitted:
    """A ``JobSubmitted`` (``gpus`` is per replica; ``min_runtime_s=0`` is unallocated)."""
    return ev.JobSubmitted(
        job_id=job_id,
        budget=budget,
        user=user,
        gpus_per_replica=gpus,
        replicas=replicas,
        min_runtime_s=min_runtime_s,
        gpu_model=gpu_model,
        duration_s=duration_s,
        command=tuple(command) if command is not None else None,
        submitted_at=dt(submitted_at if submitted_at is not None else at),
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobSubmitted", job_id, at),
    )


def placed(
    job_id: str,
    *,
    budget: str = "lab/a",
    gpus: int = 1,
    replicas: int = 1,
    attempt: int = 1,
    allocated: bool = True,
    min_runtime_s: float | None = None,
    nodes: Sequence[str] | None = None,
    user: str = "alice",
    at: int | datetime = T0,
    submitted_at: int | datetime | None = None,
    event_id: uuid.UUID | None = None,
    decision: ev.Decision | None = None,
) -> ev.JobPlaced:
    """A ``JobPlaced``: ``replicas`` replicas of ``gpus`` GPUs on nodes ``n0, n1, ...``.

    ``min_runtime_s`` defaults to 3600 when allocated and 0 when not; ``decision`` to rank 0 at r = 0.
    """
    if min_runtime_s is None:
        min_runtime_s = 3600.0 if allocated else 0.0
    nodes = list(nodes) if nodes is not None else [f"n{i}" for i in range(replicas)]
    placements = tuple(ev.Placement(node_id=n, gpus=tuple(range(gpus))) for n in nodes)
    return ev.JobPlaced(
        job_id=job_id,
        attempt=attempt,
        budget=budget,
        user=user,
        allocated=allocated,
        gpus_per_replica=gpus,
        replicas=replicas,
        min_runtime_s=min_runtime_s,
        placements=placements,
        submitted_at=dt(submitted_at if submitted_at is not None else at),
        decision=decision if decision is not None else ev.Decision(rank=0, budget_rank=0, ratio=0.0),
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobPlaced", job_id, attempt, at),
    )


def started(
    job_id: str,
    *,
    attempt: int = 1,
    replica: int = 0,
    node: str = "n0",
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobStarted:
    """A ``JobStarted`` of one replica."""
    return ev.JobStarted(
        job_id=job_id,
        attempt=attempt,
        replica=replica,
        node_id=node,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobStarted", job_id, attempt, replica, at),
    )


def completed(
    job_id: str,
    *,
    attempt: int = 1,
    replica: int | None = None,
    node: str | None = None,
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobCompleted:
    """A ``JobCompleted`` of the whole run (``replica=None``) or one replica, reported by ``node``."""
    return ev.JobCompleted(
        job_id=job_id,
        attempt=attempt,
        replica=replica,
        node_id=node,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobCompleted", job_id, attempt, replica, at),
    )


def failed(
    job_id: str,
    *,
    attempt: int = 1,
    replica: int | None = None,
    exit_code: int = 1,
    node: str | None = None,
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobFailed:
    """A ``JobFailed`` of the whole run or one replica, reported by ``node``."""
    return ev.JobFailed(
        job_id=job_id,
        attempt=attempt,
        replica=replica,
        node_id=node,
        exit_code=exit_code,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobFailed", job_id, attempt, replica, at),
    )


def preempted(
    job_id: str,
    *,
    attempt: int = 1,
    budget: str = "lab/a",
    allocated: bool = True,
    by_job_id: str | None = None,
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobPreempted:
    """A ``JobPreempted`` of a run."""
    return ev.JobPreempted(
        job_id=job_id,
        attempt=attempt,
        budget=budget,
        allocated=allocated,
        by_job_id=by_job_id,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobPreempted", job_id, attempt, at),
    )


def requeued(
    job_id: str,
    *,
    attempt: int = 2,
    submitted_at: int | datetime = T0,
    reason: str = "preempted",
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobRequeued:
    """A ``JobRequeued``: the job waits again as ``attempt``."""
    return ev.JobRequeued(
        job_id=job_id,
        attempt=attempt,
        submitted_at=dt(submitted_at),
        reason=reason,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobRequeued", job_id, attempt, at),
    )


def cancelled(
    job_id: str, *, attempt: int | None = 1, at: int | datetime = T0, event_id: uuid.UUID | None = None
) -> ev.JobCancelled:
    """A ``JobCancelled`` (``attempt=None``: it was pending)."""
    return ev.JobCancelled(
        job_id=job_id,
        attempt=attempt,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobCancelled", job_id, attempt, at),
    )


def job_lost(
    job_id: str,
    *,
    charged_until: int | datetime,
    attempt: int = 1,
    node: str = "n0",
    at: int | datetime = T0,
    event_id: uuid.UUID | None = None,
) -> ev.JobLost:
    """A ``JobLost`` charged up to ``charged_until``."""
    return ev.JobLost(
        job_id=job_id,
        attempt=attempt,
        node_id=node,
        charged_until=dt(charged_until),
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "JobLost", job_id, attempt, at),
    )


# --------------------------------------------------------------------------- nodes


def node(
    node_id: str, gpus: int = 8, *, model: str | None = None, at: int | datetime = T0, event_id: uuid.UUID | None = None
) -> ev.NodeRegistered:
    """A ``NodeRegistered`` with ``gpus`` GPUs of ``model``."""
    return ev.NodeRegistered(
        node_id=node_id,
        gpu_count=gpus,
        gpu_model=model,
        simulated=True,
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "NodeRegistered", node_id, gpus, at),
    )


def cordoned(node_id: str, *, at: int | datetime = T0, event_id: uuid.UUID | None = None) -> ev.NodeCordoned:
    """A ``NodeCordoned``."""
    return ev.NodeCordoned(
        node_id=node_id, ts=dt(at), producer="test", event_id=_id(event_id, "NodeCordoned", node_id, at)
    )


def drain(node_id: str, *, at: int | datetime = T0, event_id: uuid.UUID | None = None) -> ev.NodeDrainRequested:
    """A ``NodeDrainRequested``."""
    return ev.NodeDrainRequested(
        node_id=node_id, ts=dt(at), producer="test", event_id=_id(event_id, "NodeDrainRequested", node_id, at)
    )


def drained(node_id: str, *, at: int | datetime = T0, event_id: uuid.UUID | None = None) -> ev.NodeDrained:
    """A ``NodeDrained``."""
    return ev.NodeDrained(
        node_id=node_id, ts=dt(at), producer="test", event_id=_id(event_id, "NodeDrained", node_id, at)
    )


def uncordoned(node_id: str, *, at: int | datetime = T0, event_id: uuid.UUID | None = None) -> ev.NodeUncordoned:
    """A ``NodeUncordoned``."""
    return ev.NodeUncordoned(
        node_id=node_id, ts=dt(at), producer="test", event_id=_id(event_id, "NodeUncordoned", node_id, at)
    )


def node_lost(
    node_id: str, *, last_heartbeat: int | datetime, at: int | datetime = T0, event_id: uuid.UUID | None = None
) -> ev.NodeLost:
    """A ``NodeLost`` whose last heartbeat was at ``last_heartbeat``."""
    return ev.NodeLost(
        node_id=node_id,
        last_heartbeat=dt(last_heartbeat),
        ts=dt(at),
        producer="test",
        event_id=_id(event_id, "NodeLost", node_id, at),
    )
