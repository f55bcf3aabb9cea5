"""A signed user request and what follows it on the log: ``submission`` (a one-GPU job of ``lab/a`` at ``T0``),
signed by ``ALICE`` (:func:`tests.kit.signing.identity`), and ``queued``, the dispatcher's ``JobQueued`` a second
after it (rule D10.proven-user)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from apportion import events
from apportion.events import JobSubmitted
from tests.kit.signing import identity

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
ALICE = identity("alice")


def submission(user: str = "alice", job_id: str = "j1", ts: datetime = T0) -> JobSubmitted:
    return JobSubmitted(
        event_id=events.det_id("sub", job_id, user),
        job_id=job_id,
        budget="lab/a",
        user=user,
        gpus_per_replica=1,
        min_runtime_s=60.0,
        duration_s=30.0,
        submitted_at=ts,
        ts=ts,
        producer="test",
    )


def queued(sub: JobSubmitted) -> events.JobQueued:
    return events.JobQueued(
        event_id=events.det_id("JobQueued", sub.job_id, 1),
        job_id=sub.job_id,
        budget=sub.budget,
        user=sub.user,
        allocated=True,
        gpus_per_replica=1,
        replicas=1,
        min_runtime_s=60.0,
        duration_s=30.0,
        submitted_at=sub.submitted_at,
        ts=sub.ts + timedelta(seconds=1),
        producer="dispatcher",
    )
