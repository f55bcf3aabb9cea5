"""Heartbeats reconciled with the dispatcher's runs (issue 18; ``apportion.domain.reconcile``).

Given / when / then with exact event sequences. Tree: lab (1.0) -> a 0.5 (members: alice), b 0.5;
nodes n0, n1 with 4 GPUs each, registered at T0; the run of j1 is placed at T0. Reconciliation with
``reconcile_misses = 2`` (the dispatcher service's default).
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.dispatch import step
from apportion.timeutil import from_us
from tests.kit.builders import T0, m
from tests.kit.domain_dispatch import CFG, REC, _running, _started, hb, types
from tests.kit.narrowing import narrow, narrow_each


def test_a_replica_missing_from_two_heartbeats_in_a_row_is_lost_and_requeued():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, hb(node, m(1)), m(1), REC) == []  # one miss: not yet
    out = step(state, hb(node, m(2)), m(2), REC)
    assert types(out) == ["JobLost:j1", "JobRequeued:j1"]
    lost, requeued = narrow(ev.JobLost, out[0]), narrow(ev.JobRequeued, out[1])
    assert (lost.node_id, lost.attempt, lost.charged_until, lost.producer) == (node, 1, from_us(m(2)), "dispatcher")
    assert lost.event_id == ev.det_id("JobLost", "j1", 1)
    assert (requeued.attempt, requeued.submitted_at, requeued.reason) == (
        2,
        placed.submitted_at,
        "not running on its node",
    )
    assert (state.jobs["j1"].status, state.jobs["j1"].attempt) == ("pending", 2)
    assert {n.node_id: len(n.free) for n in state.cluster.nodes.values()} == {"n0": 4, "n1": 4}
    assert step(state, hb(node, m(3)), m(3), REC) == []  # nothing left to lose


def test_a_replica_listed_between_two_misses_is_not_lost():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, hb(node, m(1)), m(1), REC) == []
    assert step(state, hb(node, m(2), ("j1", 1, 0)), m(2), REC) == []
    assert step(state, hb(node, m(3)), m(3), REC) == []
    assert state.jobs["j1"].status == "running"


def test_a_heartbeat_counted_once_and_only_after_the_placement():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, hb(node, T0), T0, REC) == []  # sent at the placement's instant: not a miss
    assert step(state, hb(node, m(1)), m(1), REC) == []
    # the same heartbeat again (a redelivery under another id), and an older one arriving late
    again = hb(node, m(1)).model_copy(update={"event_id": ev.det_id("redelivered")})
    assert step(state, again, m(1), REC) == []
    late = hb(node, m(1) - 1).model_copy(update={"event_id": ev.det_id("late")})
    assert step(state, late, m(1), REC) == []
    assert state.jobs["j1"].status == "running"
    assert types(step(state, hb(node, m(2)), m(2), REC)) == ["JobLost:j1", "JobRequeued:j1"]


def test_heartbeats_of_the_other_node_do_not_count():
    state, placed = _running()
    node = placed.placements[0].node_id
    other = "n1" if node == "n0" else "n0"
    for i in range(1, 4):
        assert step(state, hb(other, m(i)), m(i), REC) == []
    assert state.jobs["j1"].status == "running"


def test_a_gang_replica_missing_on_one_node_stops_the_other_with_the_grace_then_requeues():
    state, placed = _running(gpus=4, replicas=2)
    a, b = (p.node_id for p in placed.placements)
    step(state, hb(b, m(1), ("j1", 1, 1)), m(1), REC)
    assert step(state, hb(a, m(1)), m(1), REC) == []
    out = step(state, hb(a, m(2)), m(2), REC)
    assert types(out) == ["JobLost:j1", "StopWorkload:j1"]
    lost, stop = narrow(ev.JobLost, out[0]), narrow(ev.StopWorkload, out[1])
    assert (lost.node_id, stop.node_id, stop.grace_s) == (a, b, CFG.engine.grace_s)
    assert state.jobs["j1"].status == "stopping"
    # the surviving replica reports its end: the job is requeued
    done = ev.JobCompleted(
        job_id="j1", attempt=1, replica=1, node_id=b, ts=from_us(m(3)), producer="node-agent",
        event_id=ev.det_id("test-done", "j1"),
    )  # fmt: skip
    out = step(state, done, m(3), REC)
    assert types(out) == ["JobRequeued:j1"] and narrow(ev.JobRequeued, out[0]).attempt == 2


def test_a_replica_the_dispatcher_does_not_know_is_stopped_after_two_heartbeats():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, hb(node, m(1), ("j1", 1, 0), ("ghost", 3, 0)), m(1), REC) == []
    out = step(state, hb(node, m(2), ("j1", 1, 0), ("ghost", 3, 0)), m(2), REC)
    assert types(out) == ["StopWorkload:ghost"]
    stop = narrow(ev.StopWorkload, out[0])
    assert (stop.node_id, stop.attempt, stop.grace_s, stop.reason) == (node, 3, 0.0, "unknown to the dispatcher")
    assert stop.event_id == ev.det_id("StopWorkload", "unknown", node, "ghost", 3)
    assert state.jobs["j1"].status == "running"  # the known replica is untouched


def test_an_unknown_replica_listed_once_is_not_stopped():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, hb(node, m(1), ("j1", 1, 0), ("ghost", 1, 0)), m(1), REC) == []
    assert step(state, hb(node, m(2), ("j1", 1, 0)), m(2), REC) == []
    assert step(state, hb(node, m(3), ("j1", 1, 0), ("ghost", 1, 0)), m(3), REC) == []


def test_the_old_attempt_of_a_requeued_job_is_stopped_where_it_still_runs():
    state, placed = _running()
    node = placed.placements[0].node_id
    step(state, hb(node, m(1)), m(1), REC)
    step(state, hb(node, m(2)), m(2), REC)  # lost and requeued (attempt 2 pending)
    # the agent was only slow: attempt 1 shows up after all
    assert step(state, hb(node, m(3), ("j1", 1, 0)), m(3), REC) == []
    out = step(state, hb(node, m(4), ("j1", 1, 0)), m(4), REC)
    assert [(e.type, e.job_id, e.attempt, e.node_id) for e in narrow_each(ev.StopWorkload, out)] == [
        ("StopWorkload", "j1", 1, node)
    ]


def test_a_replica_not_started_yet_is_not_counted_until_its_start():
    # the StartWorkload may take any time to arrive (a broker outage): only a started replica can go missing
    state, placed = _running(started=False)
    node, gpus = placed.placements[0].node_id, placed.placements[0].gpus
    for i in (1, 2, 3):
        assert step(state, hb(node, m(i)), m(i), REC) == []
    step(state, _started(0, node, gpus).model_copy(update={"ts": from_us(m(4))}), m(4), REC)
    assert step(state, hb(node, m(5)), m(5), REC) == []
    assert types(step(state, hb(node, m(6)), m(6), REC)) == ["JobLost:j1", "JobRequeued:j1"]


def test_a_preemptor_waiting_for_its_victims_and_a_stopping_run_are_not_counted():
    state, placed = _running()
    node = placed.placements[0].node_id
    state.awaiting[("j1", 1)] = frozenset({("victim", 1)})  # as folded from a JobPlaced with victims
    for i in (1, 2, 3):
        assert step(state, hb(node, m(i)), m(i), REC) == []
    del state.awaiting[("j1", 1)]
    pre = ev.JobPreempted(
        job_id="j1", attempt=1, budget="lab/a", allocated=True, grace_s=30.0, ts=from_us(m(4)),
        producer="dispatcher", event_id=ev.det_id("test-preempted", "j1"),
    )  # fmt: skip
    step(state, pre, m(4), REC)
    for i in (5, 6, 7):
        out = step(state, hb(node, m(i)), m(i), REC)
        assert "JobLost:j1" not in types(out)


def test_reconciliation_off_by_default():
    state, placed = _running()
    node = placed.placements[0].node_id
    for i in (1, 2, 3):
        assert step(state, hb(node, m(i)), m(i), CFG) == []
    assert state.jobs["j1"].status == "running"


def test_heartbeats_of_an_unregistered_node_are_ignored():
    state, _ = _running()
    for i in (1, 2, 3):
        assert step(state, hb("nx", m(i), ("ghost", 1, 0)), m(i), REC) == []
    assert not state.absences.missing and not state.absences.unknown
