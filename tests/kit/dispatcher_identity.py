"""Signed requests to the dispatcher (rule D10.proven-user): the users ``ALICE``, ``CAROL``, ``EVE`` and ops'
``OPS`` (:func:`tests.kit.signing.identity`), ``setup`` (budgets ``lab`` and ``lab/a``, node n1 of 8 GPUs and
their four keys registered at ``T0``), ``sub`` (a 2-GPU submission to ``lab/a``) and ``cancel``, each at ``T0``
plus some minutes, unsigned until a user signs them."""

from __future__ import annotations

from datetime import timedelta

from apportion import events
from apportion.events import BudgetSet, JobCancelRequested, JobSubmitted, NodeRegistered
from tests.kit.dispatcher import T0
from tests.kit.signing import identity, registered

ALICE, CAROL, EVE, OPS = identity("alice"), identity("carol"), identity("eve"), identity("root", "ops")


def setup() -> list[events.Event]:
    return [
        BudgetSet(event_id=events.det_id("t", "lab"), path="lab", share=1.0, ts=T0, producer="test"),
        BudgetSet(event_id=events.det_id("t", "lab/a"), path="lab/a", share=1.0, ts=T0, producer="test"),
        NodeRegistered(event_id=events.det_id("t", "n1"), node_id="n1", gpu_count=8, ts=T0, producer="test"),
        *(registered(i, T0) for i in (ALICE, CAROL, EVE, OPS)),
    ]


def sub(job_id: str, user: str = "carol", minutes: int = 1) -> JobSubmitted:
    ts = T0 + timedelta(minutes=minutes)
    return JobSubmitted(
        event_id=events.det_id("sub", job_id, user, minutes),
        job_id=job_id,
        budget="lab/a",
        user=user,
        gpus_per_replica=2,
        min_runtime_s=600.0,
        duration_s=3600.0,
        submitted_at=ts,
        ts=ts,
        producer="test",
    )


def cancel(job_id: str, user: str, minutes: int = 2) -> JobCancelRequested:
    return JobCancelRequested(
        event_id=events.det_id("cancel", job_id, user, minutes),
        job_id=job_id,
        user=user,
        ts=T0 + timedelta(minutes=minutes),
        producer="test",
    )
