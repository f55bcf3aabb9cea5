"""The dispatcher reconciles with what node agents report: a run an agent lost is requeued, a start it
refused is undone (rule D3.node-lost). Given / when / then, exact events.

Tree: lab (1.0) -> a 0.5 (members: alice), b 0.5; nodes n0, n1 with 4 GPUs each.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.dispatch import UNDO_ON_REFUSAL, Tick, step
from apportion.timeutil import from_us
from tests.kit.builders import T0, m, submitted
from tests.kit.domain_dispatch import CFG, TREE, given, reg, types
from tests.kit.narrowing import narrow, narrow_each


def _running(gpus: int = 2, replicas: int = 1):
    state = given(reg("n0"), reg("n1"))
    step(state, submitted("j1", budget="lab/a", user="alice", gpus=gpus, replicas=replicas), T0, CFG)
    out = step(state, Tick(T0), T0, CFG)
    placed = next(e for e in out if isinstance(e, ev.JobPlaced))
    return state, placed


def _lost(node: str, attempt: int = 1, producer: str = "node-agent") -> ev.JobLost:
    return ev.JobLost(
        job_id="j1",
        attempt=attempt,
        node_id=node,
        charged_until=from_us(m(1)),
        ts=from_us(m(1)),
        producer=producer,
        event_id=ev.det_id("test-lost", node, attempt, producer),
    )


def _refused(node: str, reason: str, attempt: int = 1) -> ev.WorkloadRefused:
    return ev.WorkloadRefused(
        node_id=node,
        job_id="j1",
        attempt=attempt,
        reason=reason,
        ts=from_us(m(1)),
        producer="node-agent",
        event_id=ev.det_id("test-refused", node, reason, attempt),
    )


def test_a_run_its_agent_lost_is_requeued_keeping_submitted_at():
    state, placed = _running()
    out = step(state, _lost(placed.placements[0].node_id), m(1), CFG)
    assert types(out) == ["JobRequeued:j1"]
    requeued = narrow(ev.JobRequeued, out[0])
    assert (requeued.attempt, requeued.submitted_at, requeued.reason) == (2, placed.submitted_at, "lost on its node")
    assert [j.job_id for j in state.pending["lab/a"]] == ["j1"]


def test_a_gang_lost_on_one_node_stops_its_other_replicas_with_the_grace_period():
    state, placed = _running(gpus=4, replicas=2)
    other = placed.placements[1].node_id
    out = step(state, _lost(placed.placements[0].node_id), m(1), CFG)
    assert [(e.type, e.node_id, e.grace_s) for e in narrow_each(ev.StopWorkload, out)] == [
        ("StopWorkload", other, CFG.engine.grace_s)
    ]


def test_a_loss_of_an_old_attempt_or_by_the_dispatcher_itself_changes_nothing():
    state, placed = _running()
    node = placed.placements[0].node_id
    assert step(state, _lost(node, attempt=7), m(1), CFG) == []
    assert step(state, _lost(node, producer=CFG.producer), m(1), CFG) == []


def test_a_refused_start_is_undone_and_requeued():
    state, placed = _running()
    node = placed.placements[0].node_id
    out = step(state, _refused(node, "before_registration: sent 1, node registered 2"), m(1), CFG)
    assert types(out) == ["JobRequeued:j1"]
    requeued = narrow(ev.JobRequeued, out[0])
    assert (requeued.attempt, requeued.reason) == (2, "start refused: before_registration: sent 1, node registered 2")
    free = {n.node_id: len(n.free) for n in state.cluster.nodes.values()}
    assert free == {"n0": 4, "n1": 4}  # the refused run's GPUs are free again


def test_a_refused_gang_start_stops_the_other_replicas_at_once():
    state, placed = _running(gpus=4, replicas=2)
    out = step(state, _refused(placed.placements[0].node_id, "gpus_busy"), m(1), CFG)
    assert types(out) == ["StopWorkload:j1", "JobRequeued:j1"]
    stop = narrow(ev.StopWorkload, out[0])
    assert (stop.node_id, stop.grace_s) == (placed.placements[1].node_id, 0.0)


def test_refusals_that_do_not_undo():
    state, placed = _running()
    node = placed.placements[0].node_id
    for reason in ("duplicate_start: j1#1/0", "unknown_run", "stale_fencing_token: token 6 < 7"):
        assert reason.split(":")[0] not in UNDO_ON_REFUSAL
        assert step(state, _refused(node, reason), m(1), CFG) == []
    assert step(state, _refused(node, "gpus_busy", attempt=3), m(1), CFG) == []  # not the current attempt


def test_undo_codes_are_the_node_agents_refusal_codes():
    from services.node_agent import logic as agent

    codes = {v for k, v in vars(agent).items() if k.isupper() and isinstance(v, str) and "_" in v}
    assert UNDO_ON_REFUSAL <= codes


def test_a_refusal_read_during_a_rebuild_is_undone_by_the_new_leader():
    # the agent refused the start while no leader ran: the successor's recovery undoes it
    from apportion.domain.dispatch import DispatchState
    from services.dispatcher.logic import recover

    log: list = [reg("n0"), reg("n1"), submitted("j1", budget="lab/a", user="alice", gpus=2)]
    state = DispatchState(TREE)
    for e in log[:2]:
        step(state, e, T0, CFG)
    log += step(state, log[2], T0, CFG)  # JobQueued
    log += step(state, Tick(T0), T0, CFG)  # JobPlaced, StartWorkload
    placed = next(e for e in log if isinstance(e, ev.JobPlaced))
    log.append(_refused(placed.placements[0].node_id, "before_registration: sent 1, node registered 2"))
    fresh = DispatchState(TREE)
    out = recover(fresh, log, m(2), CFG)
    assert types(out) == ["JobRequeued:j1"]
    assert (fresh.jobs["j1"].status, fresh.jobs["j1"].attempt) == ("pending", 2)
    # a second recovery of the same log plus that decision decides nothing more
    again = DispatchState(TREE)
    assert recover(again, [*log, *out], m(3), CFG) == []
