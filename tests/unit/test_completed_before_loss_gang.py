"""Rule D3.completed-before-loss for a gang whose other replica's node survives the loss.

Given: g (lab/b, 2 replicas of 4 GPUs) placed at T0, replica 0 on n0 and replica 1 on n1; heartbeat timeout
30 s; n1 heartbeats at T0 + 20 s, n0 never after its registration at T0. The tick at L = T0 + 30 s + 1 µs
loses n0: ``NodeLost``, ``JobLost`` of g#1 at L and ``StopWorkload`` of replica 1 on n1 with the 30 s grace;
no requeue yet (the survivor stops first). n2 and n3 register at L (room for attempt 2); n1 heartbeats at L.
Attempt 2, when placed, goes to n1 and n2. When: the replicas' reports are read after the loss, in the order given, each 1 s after the one before.
Then: as the table says. A completion counts when stamped at or before L; the job is finished only when
every replica's has been folded (a replica that completed while the gang still ran counts too); a
failure or a completion stamped after L (the survivor's own stop) leaves the requeue.

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from apportion import events as ev
from apportion.domain.dispatch import DispatchConfig, DispatchState, LostRun, Tick, fold, step
from apportion.timeutil import Micros, from_us
from tests.kit.builders import T0, submitted
from tests.kit.domain_dispatch import TREE, endings, types
from tests.kit.narrowing import narrow

CFG = DispatchConfig(heartbeat_timeout_s=30)  # grace 30 s (the default)
L: Micros = T0 + 30_000_001
S = 1_000_000
GRACE_END = L + 30 * S


def reg(nid: str, at: Micros = T0) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=4, ts=from_us(at), event_id=ev.det_id("reg", nid, at))


def heartbeat(nid: str, at: Micros) -> ev.NodeHeartbeat:
    return ev.NodeHeartbeat(node_id=nid, ts=from_us(at), event_id=ev.det_id("hb", nid, at))


def completed(replica: int, at: Micros, attempt: int = 1) -> ev.JobCompleted:
    return ev.JobCompleted(
        job_id="g", attempt=attempt, replica=replica, ts=from_us(at), event_id=ev.det_id("done", replica, at, attempt)
    )


def failed(replica: int, at: Micros) -> ev.JobFailed:
    return ev.JobFailed(
        job_id="g", attempt=1, replica=replica, exit_code=143, ts=from_us(at), event_id=ev.det_id("f", replica, at)
    )


def placed(before_loss: tuple[ev.Event, ...] = ()) -> tuple[DispatchState, list[ev.Event]]:
    """g placed at T0 (replica 0 on n0, 1 on n1); ``before_loss`` read at T0 + 10 s; n1 heartbeats at T0 + 20 s."""
    state, log = DispatchState(TREE), []
    given: tuple[ev.Event, ...] = (reg("n0"), reg("n1"), submitted("g", budget="lab/b", gpus=4, replicas=2))
    for e in given:
        log += [e, *step(state, e, T0, CFG)]
    out = step(state, Tick(T0), T0, CFG)
    assert [p.node_id for p in narrow(ev.JobPlaced, out[0]).placements] == ["n0", "n1"]
    log += out
    for e in (*before_loss, heartbeat("n1", T0 + 20 * S)):
        log += [e, *step(state, e, T0 + 10 * S, CFG)]
    return state, log


def lose_n0(state: DispatchState, log: list[ev.Event]) -> list[ev.Event]:
    out = step(state, Tick(L), L, CFG)
    log += out
    for e in (reg("n2", at=L), reg("n3", at=L), heartbeat("n1", L)):
        log += [e, *step(state, e, L, CFG)]
    return out


def test_the_loss_stops_the_survivor_and_keeps_the_run_for_its_reports() -> None:
    state, log = placed()
    out = lose_n0(state, log)
    assert types(out) == ["NodeLost:n0", "JobLost:g", "StopWorkload:g"]
    assert endings(out[2:]) == [("StopWorkload", 1, "n1", 30.0, "gang replica lost")]
    assert (state.jobs["g"].attempt, state.jobs["g"].status) == (1, "stopping")
    assert state.jobs["g"].lost == LostRun(1, L, frozenset({0, 1}))


@dataclass(frozen=True)
class Case:
    before_loss: tuple[ev.Event, ...]  # read at T0 + 10 s, while g runs
    after_loss: tuple[ev.Event, ...]  # read from L + 1 s on, 1 s apart
    then: list[str]  # what each read after the loss decides (types), one entry per report, joined by "|"
    finished_at: Micros | None  # the job's end, or None: it is requeued and attempt 2 is placed


CASES = {
    "both completed before the loss, the lost replica's report first: finished, never requeued": Case(
        (), (completed(0, T0 + 25 * S), completed(1, T0 + 25 * S)), ["", ""], T0 + 25 * S
    ),
    "both completed, the survivor's report first: its stop ends, requeued, then finished while it waits": Case(
        (), (completed(1, T0 + 25 * S), completed(0, T0 + 26 * S)), ["JobRequeued:g", ""], T0 + 26 * S
    ),
    "a whole-run report before the loss: finished": Case(
        (), (ev.JobCompleted(job_id="g", attempt=1, ts=from_us(L), event_id=ev.det_id("whole")),), [""], L
    ),  # fmt: skip
    "the survivor completed while the gang ran (read before the loss), the lost one's report after: finished": Case(
        (completed(1, T0 + 5 * S),), (completed(0, T0 + 25 * S),), [""], T0 + 25 * S
    ),
    "only the survivor completed: requeued when its stop ends": Case(
        (), (completed(1, T0 + 25 * S),), ["JobRequeued:g"], None
    ),
    "the survivor stopped by the loss (a report after it): requeued, the lost one's completion changes nothing": Case(
        (), (failed(1, L + S), completed(0, T0 + 25 * S)), ["JobRequeued:g", ""], None
    ),
    "the survivor's completion stamped 1 µs after the loss does not count": Case(
        (), (completed(0, T0 + 25 * S), completed(1, L + 1)), ["", "JobRequeued:g"], None
    ),
    "the lost replica failed before the loss: requeued": Case(
        (), (failed(0, T0 + 25 * S), completed(1, T0 + 25 * S)), ["", "JobRequeued:g"], None
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reports_of_a_lost_gang_with_a_surviving_replica(case: Case) -> None:
    state, log = placed(case.before_loss)
    lose_n0(state, log)
    if case.before_loss:  # nothing of g left on n1: no survivor to stop, requeued at once
        assert (state.jobs["g"].attempt, state.jobs["g"].lost) == (2, LostRun(1, L, frozenset({0})))
    decided = []
    for i, r in enumerate(case.after_loss):
        out = step(state, r, L + (1 + i) * S, CFG)
        decided.append(" ".join(types(out)))
        log += [r, *out]
    assert decided == case.then
    end = L + (1 + len(case.after_loss)) * S
    out = step(state, Tick(max(end, GRACE_END)), max(end, GRACE_END), CFG)  # past the survivor's grace
    log += out
    if case.finished_at is None:
        assert (state.jobs["g"].attempt, state.jobs["g"].status) == (2, "running")
        assert [p.node_id for p in narrow(ev.JobPlaced, out[0]).placements] == ["n1", "n2"]
        return
    assert "g" not in state.jobs and state.finished["g"] == case.finished_at
    assert state.pending_count() == 0 and not state.stopping and not state.cluster.runs
    assert state.cluster.nodes["n1"].free == frozenset({0, 1, 2, 3})  # the survivor's GPUs are free
    assert [t for t in types(out) if t.endswith(":g")] == []  # neither requeued nor placed again
    replay = fold(sorted(log, key=lambda e: e.ts), TREE)  # event time: the reports before the loss
    assert (replay.jobs.keys(), replay.finished.keys(), replay.pending) == (
        state.jobs.keys(),
        state.finished.keys(),
        state.pending,
    )


def test_the_grace_ends_before_the_reports_then_they_finish_the_waiting_attempt() -> None:
    """No report within the grace: requeued at its end; both completions (before the loss) read after that,
    while attempt 2 waits (no room: n1 alone is left), finish the job."""
    state, log = placed()
    assert types(step(state, Tick(L), L, CFG)) == ["NodeLost:n0", "JobLost:g", "StopWorkload:g"]
    step(state, heartbeat("n1", L), L, CFG)
    assert types(step(state, Tick(GRACE_END), GRACE_END, CFG)) == ["JobRequeued:g"]
    assert state.jobs["g"].lost == LostRun(1, L, frozenset({0, 1}))
    assert step(state, completed(1, T0 + 25 * S), GRACE_END + S, CFG) == []
    assert state.jobs["g"].lost == LostRun(1, L, frozenset({0}))
    assert step(state, completed(0, T0 + 24 * S), GRACE_END + 2 * S, CFG) == []
    assert "g" not in state.jobs and state.finished["g"] == T0 + 24 * S and state.pending_count() == 0


def test_the_last_completion_read_after_attempt_2_was_placed_stops_attempt_2() -> None:
    """The survivor's completion read in its grace, the lost replica's only after attempt 2 was placed on n1 and
    n2: attempt 2 is stopped at once on both nodes and cancelled (``completed_before_loss``); its charge ends at
    the read: 2 x 4 GPUs x 1 s on lab/b, besides attempt 1's (both replicas to the lost node's last heartbeat,
    T0: 0; the ledger ends a lost run whole)."""
    state, log = placed()
    lose_n0(state, log)
    assert types(step(state, completed(1, T0 + 25 * S), L + S, CFG)) == ["JobRequeued:g"]
    out = step(state, Tick(L + 2 * S), L + 2 * S, CFG)
    assert types(out) == ["JobPlaced:g", "StartWorkload:g", "StartWorkload:g"]
    out = step(state, completed(0, T0 + 25 * S), L + 3 * S, CFG)
    assert endings(out) == [
        ("StopWorkload", 2, "n1", 0.0, "completed_before_loss"),
        ("StopWorkload", 2, "n2", 0.0, "completed_before_loss"),
        ("JobCancelled", 2, None, None, "completed_before_loss"),
    ]
    assert "g" not in state.jobs and not state.cluster.runs
    assert state.ledger.occupancy_us(L + 10 * S)["lab/b"] == 8 * S
