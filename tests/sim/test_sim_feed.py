"""The simulator's feed of submissions: each trace job joins the heap of happenings when the submission before it
leaves, with the place in the order it would hold were every submission on the heap from the start (after the
nodes' registration, before cancels, drains and anything pushed later at the same instant)."""

from __future__ import annotations

from typing import Any

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.sim.core import SimConfig, SimJob, Simulator
from apportion.timeutil import to_us
from tests.kit.simkit import T0, at, job, nodes

AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}


class _Watched(Simulator):
    """Counts the submissions on the heap at each event fed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.most = 0

    def _feed(self, e: ev.Event, t: int) -> bool:
        self.most = max(self.most, sum(1 for h in self._heap if isinstance(h[3], SimJob)))
        return super()._feed(e, t)


def test_submissions_join_the_heap_one_at_a_time_in_their_order_and_before_a_cancel_at_the_same_instant() -> None:
    # c, a, b submitted at T0 (given out of order), d at 00:10; c's cancel at T0: the inputs at T0 are the node's
    # registration, then a, b, c (submit time, then job id), then the cancel; d comes at 00:10
    jobs = [
        job("c", "lab/a", submit=T0),
        job("a", "lab/b", submit=T0),
        job("d", "lab/a", submit=at(0, 10)),
        job("b", "lab/a", submit=T0),
    ]
    cfg = SimConfig(seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), sample_s=0, cancels=(("c", T0),))
    sim = _Watched(BudgetTree.from_mapping(AB), nodes(("n0", 8)), jobs, cfg)
    r = sim.run()
    inputs = [
        (to_us(e.ts) - T0, e.type, getattr(e, "job_id", None) or getattr(e, "node_id", None))
        for e in r.log
        if e.producer in ("sim/user", "sim/agent") and not isinstance(e, (ev.JobStarted, ev.JobCompleted))
    ]
    assert inputs == [
        (0, "NodeRegistered", "n0"),
        (0, "JobSubmitted", "a"),
        (0, "JobSubmitted", "b"),
        (0, "JobSubmitted", "c"),
        (0, "JobCancelRequested", "c"),
        (600_000_000, "JobSubmitted", "d"),
    ]
    assert sim.most == 1
    assert {e.job_id for e in r.log if isinstance(e, ev.JobCompleted)} == {"a", "b", "d"}
