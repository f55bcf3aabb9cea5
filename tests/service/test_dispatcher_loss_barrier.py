"""Rule D3.loss-barrier: a dispatcher whose reading lags declares no node lost on what it has not read.

The fault: a dispatcher reading late loses a node by heartbeat timeout and requeues its run before it has
read the run's ``JobCompleted``, already in the log before its own ``JobLost``; the job is placed again.

The term (:class:`services.dispatcher.service.Term`) on an in-memory log whose reader can hold a topic back
(a consumer lagging on it), a manual event clock and one wall second per poll. Heartbeat timeout 30 s; times
are event seconds after T0. Given: x1 (4 GPUs) runs on n1 from 0 s; n2 (4 GPUs, free) heartbeats every 10 s
throughout; n1's last heartbeat is at 20 s; x1 completes at 25 s. When: at 51 s (n1 silent 31 s as far as the
dispatcher has read) the reader has not read the jobs topic since 20 s.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from apportion import events
from apportion.audit.config import configured_event
from apportion.audit.verify import rerun_decisions, verify
from apportion.clock import ManualClock
from apportion.events import BudgetSet, JobCompleted, JobPlaced, JobStarted, NodeHeartbeat, NodeRegistered
from apportion.logrecord import LogRecord
from apportion.settings import topic_name
from apportion.timeutil import to_us
from apportion.topics import JOBS, NODES
from services.dispatcher.logic import read_model
from tests.kit.dispatcher import (
    INPUTS,
    T0,
    USER,
    FixedLease,
    ListLog,
    log_records,
    quiet_term,
    submit,
    timed_out_leader,
)
from tests.kit.signing import registered


def at(s: float):  # a datetime
    return T0 + timedelta(seconds=s)


class LaggingLog(ListLog):
    """A :class:`ListLog` whose reader holds back the topics in ``held`` (it has not fetched them yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: set[str] = set()
        self.upto: dict[str, int] = {}  # a held topic's records below this offset are fetched all the same
        self.pos: dict[str, int] = {}

    def read(self) -> list[Any]:
        batch = [
            r
            for r in self.records
            if r.topic in INPUTS
            and (r.topic not in self.held or r.offset < self.upto.get(r.topic, 0))
            and r.offset >= self.pos.get(r.topic, 0)
        ]
        for r in batch:
            self.pos[r.topic] = r.offset + 1
        return batch

    def ends(self) -> dict[str, int]:  # what the broker answers: each input partition's end offset
        return {f"{t}:0": self.next_offset.get(t, 0) for t in INPUTS}

    def positions(self) -> dict[str, int]:
        return {f"{t}:0": self.pos.get(t, 0) for t in INPUTS}


class Harness:
    """One leading term; ``barrier=False`` wires it without the end offsets (the term as it was)."""

    def __init__(self, *, barrier: bool = True) -> None:
        self.log = LaggingLog()
        self.clock = ManualClock(T0)
        self.svc = timed_out_leader(self.log.publish, self.clock)
        settings = self.svc.settings
        self.wall = 0.0
        self.term = quiet_term(
            self.svc,
            settings,
            lambda: self.wall,
            ends=self.log.ends if barrier else None,
            positions=self.log.positions if barrier else None,
        )

    def start(self) -> None:
        self.log.put(
            *[
                BudgetSet(event_id=events.det_id("b", p), path=p, share=s, ts=T0)
                for p, s in (("lab", 1.0), ("lab/a", 1.0))
            ],
            *[NodeRegistered(event_id=events.det_id("n", n), node_id=n, gpu_count=4, ts=T0) for n in ("n1", "n2")],
            registered(USER, T0),
        )
        cfg = configured_event(self.svc.cfg, instance="d-1", fencing_token=7, ts=T0, producer="dispatcher")
        asyncio.run(self.term.start(self.log.read(), [], cfg, FixedLease()))

    def poll_at(self, s: float) -> None:
        self.clock.set(at(s))
        self.wall += 1.0
        asyncio.run(self.term.handle(self.log.read()))

    def heartbeat(self, node: str, s: float) -> None:
        self.log.put(NodeHeartbeat(event_id=events.det_id("hb", node, s), node_id=node, ts=at(s)))

    def agent(self, kind: type, s: float, **kw: Any) -> None:
        self.log.put(kind(event_id=events.det_id("agent", kind.__name__), job_id="x1", attempt=1, ts=at(s), **kw))

    def published(self, kind: type | tuple[type, ...]) -> list[Any]:
        return [e for _, v in self.log.published if isinstance(e := events.decode(v), kind)]

    def records(self) -> list[LogRecord]:
        return log_records(self.log)


def lagging(h: Harness, *, n1_beats_on: bool) -> None:
    """The story up to 51 s: x1 on n1 at 0 s; the reader holds back the jobs topic from 20 s (and the nodes
    topic too when ``n1_beats_on``: n1 then heartbeats on, unread)."""
    h.start()
    h.log.put(submit("x1", "lab/a", 4, min_runtime_s=0))
    h.poll_at(0)
    [placed] = h.published(JobPlaced)
    assert placed.placements[0].node_id == "n1"
    h.agent(JobStarted, 0, node_id="n1", gpus=(0, 1, 2, 3))
    for t in (10, 20):
        h.heartbeat("n1", t)
        h.heartbeat("n2", t)
        h.poll_at(t)
    h.log.held = {topic_name(JOBS), topic_name(NODES)} if n1_beats_on else {topic_name(JOBS)}
    h.agent(JobCompleted, 25, node_id="n1")
    for t in (30, 40, 50):
        if n1_beats_on:
            h.heartbeat("n1", t)
        h.heartbeat("n2", t)
        h.poll_at(t)
    h.poll_at(51)  # n1's deadline (20 s + 30 s) has passed on what the dispatcher has read


def audited(h: Harness) -> None:
    """``audit verify`` (every check, the dispatcher's read models included) is clean on the term's log."""
    recs = h.records()
    jobs, nodes = read_model(h.svc.state, h.svc.state.clock_us or 0, h.svc.cfg)
    report = verify(recs, read_models={"jobs": jobs, "nodes": nodes}, config=h.svc.cfg)
    assert report.ok, report.to_dict()["mismatches"]
    assert rerun_decisions(recs, h.svc.cfg)  # decision ticks were re-run, not none


def test_a_node_that_heartbeats_on_is_not_lost_while_the_reader_lags() -> None:
    h = Harness()
    lagging(h, n1_beats_on=True)
    assert h.term.barrier == {**h.log.ends()}  # the end offsets taken at 51 s: the tick waits for them
    assert h.published(events.NodeLost) == [] and h.published(events.JobLost) == []
    h.log.held = set()  # the reader catches up
    h.poll_at(52)
    assert h.term.barrier is None
    assert h.published(events.NodeLost) == [] and h.published(events.JobRequeued) == []
    assert "x1" not in h.svc.state.jobs and h.svc.state.finished["x1"] == to_us(at(25))
    assert h.svc.state.cluster.nodes["n1"].state == "ready"
    audited(h)


def test_a_silent_node_is_lost_only_after_the_reader_has_caught_up_and_its_completed_run_is_not_requeued() -> None:
    h = Harness()
    lagging(h, n1_beats_on=False)
    assert h.published(events.NodeLost) == []  # behind on the jobs topic: no loss yet
    h.poll_at(51.5)
    assert h.published(events.NodeLost) == []  # still behind
    h.log.held = set()
    h.poll_at(52)
    assert [(e.node_id, e.last_heartbeat) for e in h.published(events.NodeLost)] == [("n1", at(20))]
    assert h.published(events.JobLost) == [] and h.published(events.JobRequeued) == []
    assert [(e.job_id, e.attempt) for e in h.published(JobPlaced)] == [("x1", 1)]  # never placed again
    assert "x1" not in h.svc.state.jobs and h.svc.state.finished["x1"] == to_us(at(25))
    audited(h)


def test_without_the_barrier_the_lagging_term_loses_the_node_and_places_the_completed_job_again() -> None:
    """The fault as it was: the same story on a term without end offsets. The completion, read once the next
    attempt is placed, stops that attempt at once (rule D3.completed-before-loss)."""
    h = Harness(barrier=False)
    lagging(h, n1_beats_on=False)
    assert [e.node_id for e in h.published(events.NodeLost)] == ["n1"]
    assert [(e.job_id, e.attempt) for e in h.published(events.JobLost)] == [("x1", 1)]
    assert [(e.job_id, e.attempt, e.placements[0].node_id) for e in h.published(JobPlaced)] == [
        ("x1", 1, "n1"),
        ("x1", 2, "n2"),  # the completed job placed again, in the loss's own tick
    ]
    h.log.held = set()
    h.poll_at(52)  # the completion, read after the next attempt was placed, stops and cancels that attempt
    assert "x1" not in h.svc.state.jobs and ("x1", 2) not in h.svc.state.cluster.runs
    ended = [(e.type, e.attempt, e.reason) for e in h.published((events.StopWorkload, events.JobCancelled))]
    assert ended == [("StopWorkload", 2, "completed_before_loss"), ("JobCancelled", 2, "completed_before_loss")]
    audited(h)  # the audit agrees with what the dispatcher did


def test_a_node_that_comes_due_while_the_term_waits_is_judged_on_end_offsets_taken_after_it_did() -> None:
    """n2's heartbeats after 30 s are late: none is in the log when the term takes its end offsets for n1 at
    51 s; its heartbeat stamped 55 s is appended after them. Reading up to those offsets (62 s), the term
    finds n2 due too (30 s + 30 s < 62 s): it takes the end offsets again and waits for n2's heartbeat."""
    h = Harness()
    h.start()
    h.log.put(submit("x1", "lab/a", 4, min_runtime_s=0))
    h.poll_at(0)
    h.agent(JobStarted, 0, node_id="n1", gpus=(0, 1, 2, 3))
    for t in (10, 20, 30):
        if t < 30:
            h.heartbeat("n1", t)
        h.heartbeat("n2", t)
        h.poll_at(t)
    h.log.held = {topic_name(JOBS), topic_name(NODES)}
    h.agent(JobCompleted, 25, node_id="n1")
    for t in (40, 50, 51):  # the term polls on (a poll 15 s apart would read as an outage: a grace)
        h.poll_at(t)
    first = h.term.barrier
    assert first is not None and h.term.barrier_for == {"n1"}
    h.heartbeat("n2", 55)  # appended after the end offsets were taken
    h.log.upto = {t.split(":")[0]: off for t, off in first.items()}  # the reader gets as far as those
    h.poll_at(62)
    assert h.log.positions() == first  # read up to them: ticking now would lose n1 and n2
    assert h.term.barrier_for == {"n1", "n2"} and h.term.barrier == h.log.ends() != first
    assert h.published(events.NodeLost) == []
    h.log.held = set()
    h.poll_at(63)
    assert [(e.node_id, e.last_heartbeat, e.ts) for e in h.published(events.NodeLost)] == [("n1", at(20), at(63))]
    assert h.published(events.JobLost) == [] and "x1" in h.svc.state.finished
    audited(h)
