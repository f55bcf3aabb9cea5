"""``audit verify`` re-runs decisions made after an out-of-order arrival to the same ranks and ratios (issue 17).

Second test: a node agent cut off from the broker; the dispatcher loses its node at 41 s (heartbeat timeout,
in the same tick as a placement) and requeues its run; the agent comes back and reports that the run had
completed at 35 s. Read while the requeued attempt waits, the report finishes the job (rule
D3.completed-before-loss): it is not placed again. Read after the requeued attempt was placed, it stops and
cancels that attempt. A gang whose other replica's node survives: the same, both replicas' reports needed. The audit must fold its own decisions of a tick before anything it read after
that tick, whatever the event time, and the report after the requeue (or the placement) it could not have
preceded; and it must re-run the loss's tick on the state *before* the loss, as the dispatcher's cycle did on
its fork (folding the tick's own ``NodeLost``/``JobLost`` first, the placement of that tick re-ran to another
ratio).

First test (already held before this change, kept as a regression test of the occupancy ledger's order
independence):

The dispatcher (:class:`services.dispatcher.service.DispatcherService`, driven as ``_lead`` drives it on
an in-memory log, ``tests.service.test_dispatcher.ListLog``) folds its own decisions as it makes them and
other producers' records as they arrive. Here a node agent's ``JobCompleted`` stamped 95 s reaches it
after it preempted that run at 100 s: it folds the preemption first, and its occupancy ledger charges the
run until 100 s (a run's end never takes effect before its previous event). The log orders the two the
other way by event time; an audit that merged its input by event time alone charged the run until 95 s,
4 GPUs x 5 s less, and the next decision of that budget re-ran to another ratio.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from apportion import events
from apportion.audit.verify import rerun_decisions
from apportion.clock import ManualClock
from apportion.events import (
    JobCompleted,
    JobPlaced,
    JobPreempted,
    JobStarted,
    JobSubmitted,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
)
from apportion.timeutil import to_us
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import DispatcherService
from tests.kit.audit_replay import at, lab, submission
from tests.kit.dispatcher import INPUTS, T0, USER, ListLog, log_records


def agent(kind: type, job: str, ts_s: float, **kw: object) -> events.Event:  # one report of each kind per job
    return kind(event_id=events.det_id("agent", kind.__name__, job), job_id=job, attempt=1, ts=at(ts_s), **kw)


def run() -> tuple[DispatcherService, ListLog]:
    log = ListLog()
    clock = ManualClock(T0)
    settings = DispatcherSettings(
        heartbeat_timeout_s=0,
        patience_s=0,  # lab/b is at its share: without patience its job preempts unallocated work at once
        checkpoint_wait_s=0,
        kafka_bootstrap="unused:1",
        redis_url="redis://unused",
    )
    svc = DispatcherService(settings, clock, log.publish, consumed=INPUTS)
    svc.token = 7

    def poll() -> None:  # one poll: fold what arrived, tick, publish (what ``Term.handle`` does)
        out, _ = svc.ingest(log.read())
        svc._emit(out + svc.tick())

    log.put(*lab("n1", "n2"))
    log.put(submission("a1", "lab/a", 50.0, 0))  # protected for 50 s
    poll()
    log.put(agent(JobStarted, "a1", 0, node_id="n1", gpus=(0, 1, 2, 3)))
    clock.advance(1)  # two ticks at one instant would read as one tick to the audit
    log.put(submission("x1", "lab/a", 3600.0, 1))  # takes n2: lab/a holds all 8 GPUs, twice its share
    poll()
    log.put(agent(JobStarted, "x1", 1, node_id="n2", gpus=(0, 1, 2, 3)))
    clock.advance(99)
    log.put(submission("b1", "lab/b", 60.0, 100))  # the cluster full: a1, past its protection, is preempted at 100 s
    poll()
    # a1 had finished at 95 s; its agent's report arrives only now, after the preemption
    log.put(agent(JobCompleted, "a1", 95, node_id="n1"))
    clock.advance(1)
    poll()
    log.put(agent(JobStarted, "b1", 101, node_id="n1", gpus=(0, 1, 2, 3)))
    clock.advance(99)
    log.put(NodeRegistered(event_id=events.det_id("n", "n3"), node_id="n3", gpu_count=4, ts=at(150)))
    log.put(submission("a2", "lab/a", 60.0, 200))  # lab/a's next decision, at 200 s, reads a1's charge
    poll()
    return svc, log


def test_a_report_that_arrives_after_the_preemption_it_predates_re_runs_to_the_same_ratio() -> None:
    svc, log = run()
    recs = log_records(log)
    placed = {r.event.job_id: r.event for r in recs if isinstance(r.event, JobPlaced)}
    assert any(isinstance(r.event, JobPreempted) and r.event.job_id == "a1" for r in recs)
    assert set(placed) == {"a1", "x1", "b1", "a2"}
    checks = rerun_decisions(recs, svc.cfg)
    assert [c.at_us for c in checks] == sorted(c.at_us for c in checks) and len(checks) == 4
    assert all(c.match for c in checks), [d for c in checks for d in c.diffs]


def heartbeat(node: str, ts_s: float) -> NodeHeartbeat:
    return NodeHeartbeat(event_id=events.det_id("hb", node, ts_s), node_id=node, ts=at(ts_s))


def leader(**settings: Any) -> tuple[DispatcherService, ListLog, Callable[[float], None]]:
    """A leading dispatcher on an in-memory log with ``settings``, and ``poll_at(s)``: set the clock to ``at(s)``,
    fold what arrived, tick, publish (what ``Term.handle`` does)."""
    log = ListLog()
    clock = ManualClock(T0)
    cfg = DispatcherSettings(kafka_bootstrap="unused:1", redis_url="redis://unused", **settings)
    svc = DispatcherService(cfg, clock, log.publish, consumed=INPUTS)
    svc.token = 7

    def poll_at(s: float) -> None:
        clock.set(at(s))
        out, _ = svc.ingest(log.read())
        svc._emit(out + svc.tick())

    return svc, log, poll_at


def run_partition(*, report_after_placement: bool = False) -> tuple[DispatcherService, ListLog]:
    svc, log, poll_at = leader(heartbeat_timeout_s=30.0, reconcile_misses=0)  # the heartbeats here list no runs
    log.put(*lab("n1"), submission("x1", "lab/a", 60.0, 0))
    poll_at(0)  # x1 on n1, the only node
    log.put(agent(JobStarted, "x1", 0, node_id="n1", gpus=(0, 1, 2, 3)))
    log.put(NodeRegistered(event_id=events.det_id("n", "n2"), node_id="n2", gpu_count=4, ts=at(1)))
    log.put(submission("z1", "lab/b", 60.0, 1))  # lab/b's usage, so that its r depends on the capacity
    poll_at(1)
    log.put(agent(JobStarted, "z1", 1, node_id="n2", gpus=(0, 1, 2, 3)))
    log.put(heartbeat("n1", 10))  # n1's last heartbeat before its agent is cut off
    for t in (10, 20, 30, 40):
        log.put(heartbeat("n2", t))
        if t == 30:
            log.put(agent(JobCompleted, "z1", 30, node_id="n2"))
        poll_at(t)
    log.put(submission("y1", "lab/b", 60.0, 41))
    poll_at(41)  # n1 lost (31 s silent), x1 lost and requeued; y1 placed on n2 in the same tick
    # n1's agent is back: x1 had completed at 35 s, while it was cut off; the node registers again
    report = agent(JobCompleted, "x1", 35, node_id="n1")
    if not report_after_placement:
        log.put(report)
    log.put(NodeRegistered(event_id=events.det_id("n", "n1", 2), node_id="n1", gpu_count=4, ts=at(45)))
    poll_at(45)  # x1 finished by the report; without it, attempt 2 placed on n1
    if report_after_placement:
        log.put(report)
        poll_at(46)
    return svc, log


def check_partition(svc: DispatcherService, log: ListLog, placed_x1: list[tuple[str, int, str]]) -> None:
    """The decisions of :func:`run_partition`, the loss, and the audit's re-runs and read-model check."""
    from apportion.audit.verify import check_read_models
    from services.dispatcher.logic import read_model

    recs = log_records(log)
    placed = [
        (r.event.job_id, r.event.attempt, r.event.placements[0].node_id) for r in recs if isinstance(r.event, JobPlaced)
    ]
    assert placed == [("x1", 1, "n1"), ("z1", 1, "n2"), ("y1", 1, "n2"), *placed_x1]
    assert [r.event.node_id for r in recs if isinstance(r.event, NodeLost)] == ["n1"]
    assert [(r.event.job_id, r.event.attempt) for r in recs if isinstance(r.event, events.JobRequeued)] == [("x1", 2)]
    checks = rerun_decisions(recs, svc.cfg)
    assert len(checks) == 3 + len(placed_x1)
    y1 = next(r.event for r in recs if isinstance(r.event, JobPlaced) and r.event.job_id == "y1")
    assert 0 < y1.decision.ratio < 1  # lab/b has used its GPUs: r reads the window's capacity
    assert all(c.match for c in checks), [d for c in checks for d in c.diffs]
    jobs, nodes = read_model(svc.state, svc.state.clock_us or 0, svc.cfg)
    assert check_read_models(recs, {"jobs": jobs, "nodes": nodes}, svc.cfg) == []


def test_a_completion_stamped_before_the_loss_of_its_run_finishes_the_job_it_requeued() -> None:
    """Rule D3.completed-before-loss: read while attempt 2 waits, the report (35 s, before the loss at 41 s)
    finishes x1; it is never placed again."""
    svc, log = run_partition()
    assert "x1" not in svc.state.jobs and svc.state.finished["x1"] == to_us(at(35))
    assert svc.state.pending_count() == 0
    check_partition(svc, log, [])


def test_a_completion_read_after_the_next_attempt_was_placed_stops_that_attempt() -> None:
    """The report read at 46 s, after attempt 2 was placed on n1 at 45 s: x1 is done, so attempt 2 is stopped at
    once and cancelled (``completed_before_loss``); the audit folds the report after the placement, as the
    dispatcher did (by event time it would finish x1 before attempt 2 was placed), and agrees with both the
    placement and the rows."""
    svc, log = run_partition(report_after_placement=True)
    assert "x1" not in svc.state.jobs and svc.state.finished["x1"] == to_us(at(46))
    recs = log_records(log)
    ended = [
        (r.event.type, r.event.attempt, r.event.reason)
        for r in recs
        if isinstance(r.event, (events.StopWorkload, events.JobCancelled)) and r.event.job_id == "x1"
    ]
    assert ended == [("StopWorkload", 2, "completed_before_loss"), ("JobCancelled", 2, "completed_before_loss")]
    check_partition(svc, log, [("x1", 2, "n1")])


def gang_report(replica: int, node: str, ts_s: float) -> events.JobCompleted:
    return JobCompleted(
        event_id=events.det_id("agent", "gang", replica), job_id="g1", attempt=1, replica=replica, node_id=node,
        ts=at(ts_s),
    )  # fmt: skip


def run_lost_gang(*, survivor_first: bool) -> tuple[DispatcherService, ListLog]:
    """g1 (lab/a, 2 x 4 GPUs, protected for an hour) on n1 and n2; n1's agent is cut off after 10 s, n2's
    heartbeats on. y1 (lab/b, 4 GPUs) waits from 40 s. At 41 s n1 is lost: ``JobLost`` of g1 and a stop of its
    replica on n2 (grace 30 s). Both replicas had completed at 35 s; their reports are read at 42 s and 43 s,
    the lost replica's first unless ``survivor_first``."""
    svc, log, poll_at = leader(heartbeat_timeout_s=30.0, reconcile_misses=0)
    gang = USER.sign(
        JobSubmitted(
            event_id=events.det_id("test", "g1"), job_id="g1", budget="lab/a", user="u", gpus_per_replica=4,
            replicas=2, min_runtime_s=3600.0, duration_s=600.0, submitted_at=at(0), ts=at(0), producer="test",
        )
    )  # fmt: skip
    log.put(*lab("n1", "n2"), gang)
    poll_at(0)
    for r, n in enumerate(("n1", "n2")):
        log.put(
            JobStarted(
                event_id=events.det_id("agent", "started", r), job_id="g1", attempt=1, replica=r, node_id=n,
                gpus=(0, 1, 2, 3), ts=at(0),
            )
        )  # fmt: skip
    log.put(heartbeat("n1", 10))
    for t in (10, 20, 30):
        log.put(heartbeat("n2", t))
        poll_at(t)
    log.put(heartbeat("n2", 40), submission("y1", "lab/b", 60.0, 40))
    poll_at(40)  # y1 waits: g1 holds both nodes and is protected
    poll_at(41)  # n1 lost
    reports = [gang_report(0, "n1", 35), gang_report(1, "n2", 35)]
    if survivor_first:
        reports.reverse()
    log.put(reports[0])
    poll_at(42)
    log.put(reports[1])
    poll_at(43)
    log.put(NodeRegistered(event_id=events.det_id("n", "n1", 2), node_id="n1", gpu_count=4, ts=at(45)))
    poll_at(45)  # n1 back: a requeued g1 would fit again
    return svc, log


def test_a_lost_gang_whose_replicas_all_completed_before_the_loss_is_not_run_again() -> None:
    """Rule D3.completed-before-loss with a surviving replica. The lost replica's report first: read while the
    survivor stops, the pair finishes g1 (never requeued), which frees n2 for y1 at 43 s. The survivor's
    first: its stop ends at 42 s (requeue, y1 placed on n2), then the lost replica's report finishes the waiting
    attempt. Either way g1 is not placed again, and the audit re-runs every decision and agrees with the rows."""
    from apportion.audit.verify import check_read_models
    from services.dispatcher.logic import read_model

    for survivor_first, requeued, y1_at in ((False, [], 43), (True, [("g1", 2)], 42)):
        svc, log = run_lost_gang(survivor_first=survivor_first)
        recs = log_records(log)
        assert [r.event.node_id for r in recs if isinstance(r.event, NodeLost)] == ["n1"]
        assert [(r.event.job_id, r.event.attempt) for r in recs if isinstance(r.event, events.JobRequeued)] == requeued
        placed = [(r.event.job_id, r.event.attempt, r.event.ts) for r in recs if isinstance(r.event, JobPlaced)]
        assert placed == [("g1", 1, at(0)), ("y1", 1, at(y1_at))]
        assert "g1" not in svc.state.jobs and svc.state.finished["g1"] == to_us(at(35))
        checks = rerun_decisions(recs, svc.cfg)
        assert len(checks) == 2 and all(c.match for c in checks), [d for c in checks for d in c.diffs]
        jobs, nodes = read_model(svc.state, svc.state.clock_us or 0, svc.cfg)
        assert check_read_models(recs, {"jobs": jobs, "nodes": nodes}, svc.cfg) == []


def run_requeue_before_report() -> tuple[DispatcherService, ListLog]:
    """a1 is preempted at 100 s; its grace (30 s) ends at 130 s with no stop report, so the dispatcher requeues
    it in a tick that decides nothing else (131 s); only then does the agent's report arrive: a1 had completed at
    95 s. The dispatcher folded the requeue first, so the report is of an old attempt and changes nothing; at 140 s
    it places attempt 2 on a new node."""
    svc, log, poll_at = leader(heartbeat_timeout_s=0, patience_s=0, checkpoint_wait_s=0, grace_s=30.0)
    log.put(*lab("n1", "n2"), submission("a1", "lab/a", 50.0, 0))
    poll_at(0)
    log.put(agent(JobStarted, "a1", 0, node_id="n1", gpus=(0, 1, 2, 3)))
    log.put(submission("x1", "lab/a", 3600.0, 1))
    poll_at(1)
    log.put(agent(JobStarted, "x1", 1, node_id="n2", gpus=(0, 1, 2, 3)))
    log.put(submission("b1", "lab/b", 60.0, 100))
    poll_at(100)  # a1, past its protection, preempted for b1
    poll_at(131)  # the grace ended at 130 s with no report: a1 is requeued (attempt 2)
    log.put(agent(JobCompleted, "a1", 95, node_id="n1"))  # in flight until now
    log.put(NodeRegistered(event_id=events.det_id("n", "n3"), node_id="n3", gpu_count=4, ts=at(140)))
    poll_at(140)  # attempt 2 placed on n3
    return svc, log


def test_a_completion_read_after_the_requeue_of_its_attempt_is_folded_after_it() -> None:
    svc, log = run_requeue_before_report()
    recs = log_records(log)
    requeued = [(r.event.job_id, r.event.attempt, r.event.ts) for r in recs if isinstance(r.event, events.JobRequeued)]
    assert requeued == [("a1", 2, at(131))]
    placed = [(r.event.job_id, r.event.attempt) for r in recs if isinstance(r.event, JobPlaced)]
    assert placed == [("a1", 1), ("x1", 1), ("b1", 1), ("a1", 2)]
    checks = rerun_decisions(recs, svc.cfg)
    assert all(c.match for c in checks), [d for c in checks for d in c.diffs]


def test_the_read_model_check_folds_that_completion_after_the_requeue_too() -> None:
    """The dispatcher's rows list a1 (attempt 2 running); a fold by event time finished a1 with the completion
    stamped 95 s, before the preemption at 100 s, and called the row "a job the log says is not active"
    (the main job, fourteenth session). ``check_read_models`` folds in the dispatcher's order."""
    from apportion.audit.verify import check_read_models
    from services.dispatcher.logic import read_model

    svc, log = run_requeue_before_report()
    recs = log_records(log)
    jobs, nodes = read_model(svc.state, svc.state.clock_us or 0, svc.cfg)
    assert (jobs["a1"]["state"], jobs["a1"]["attempt"]) == ("running", 2)
    assert check_read_models(recs, {"jobs": jobs, "nodes": nodes}, svc.cfg) == []
