"""A two-leaf lab for re-running the dispatcher's decisions (the audit's ``rerun_decisions``): budgets ``lab/a``
and ``lab/b`` at half each, 4-GPU nodes and the test user's key registered at ``T0`` (``lab``), and 4-GPU
submissions (``submission``) at ``at(s)``, ``T0`` plus ``s`` seconds."""

from __future__ import annotations

from datetime import timedelta

from apportion import events
from apportion.events import BudgetSet, JobSubmitted, NodeRegistered
from tests.kit.dispatcher import T0, USER, submit
from tests.kit.signing import registered


def at(s: float):  # a datetime
    return T0 + timedelta(seconds=s)


def submission(job: str, budget: str, min_runtime_s: float, ts_s: float) -> JobSubmitted:
    return submit(job, budget, 4, min_runtime_s, at(ts_s))


def lab(*nodes: str) -> list[events.Event]:
    """Budgets lab/a and lab/b (half each), 4-GPU nodes registered at T0, the test user's key."""
    return [
        *[
            BudgetSet(event_id=events.det_id("b", p), path=p, share=s, ts=T0)
            for p, s in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5))
        ],
        *[NodeRegistered(event_id=events.det_id("n", n), node_id=n, gpu_count=4, ts=T0) for n in nodes],
        registered(USER, T0),
    ]
