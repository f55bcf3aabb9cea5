"""Rule D3.completed-before-loss: a report of a lost run, stamped before the loss but read after it.

Given: j (4 GPUs, lab/b, one replica) placed at T0 on n0, heartbeat timeout 30 s, no heartbeat after the
registrations at T0. The tick at L = T0 + 30 s + 1 µs loses n0 and n1: ``NodeLost``, ``JobLost`` of j#1 at L,
``JobRequeued`` j#2; n2 and n3 register at L. When: the agent's report of j#1 is read after that, while
attempt 2 waits or once it was placed on n2. Then: as the tables say; the same log folded in event-time order
(the audit's order for the read models, the report first) ends in the same jobs, queue and finished set.
A gang with a replica on a node that survives: ``tests/unit/test_completed_before_loss_gang.py``.

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

CFG = DispatchConfig(heartbeat_timeout_s=30)
L: Micros = T0 + 30_000_001  # the loss: 30 s and 1 µs after the last heartbeat (the registration)
S = 1_000_000


def lost_and_requeued() -> tuple[DispatchState, list[ev.Event]]:
    """j placed at T0 and lost at L: the state and the log so far (inputs and outputs, in the order folded)."""
    state, log = DispatchState(TREE), []
    for e in (reg("n0"), reg("n1"), submitted("j", budget="lab/b", gpus=4)):
        log += [e, *step(state, e, T0, CFG)]
    out = step(state, Tick(T0), T0, CFG)
    assert types(out)[0] == "JobPlaced:j"
    log += out
    out = step(state, Tick(L), L, CFG)
    assert types(out) == ["NodeLost:n0", "JobLost:j", "JobRequeued:j", "NodeLost:n1"]
    log += out
    assert (state.jobs["j"].attempt, state.jobs["j"].status) == (2, "pending")
    for e in (reg("n2", at=L), reg("n3", at=L)):  # room for the next attempt
        log += [e, *step(state, e, L, CFG)]
    return state, log


def completed(at: Micros, replica: int | None = 0, attempt: int = 1) -> ev.JobCompleted:
    return ev.JobCompleted(
        job_id="j", attempt=attempt, replica=replica, ts=from_us(at), event_id=ev.det_id("done", at, replica)
    )


def failed(at: Micros, replica: int | None = 0) -> ev.JobFailed:
    return ev.JobFailed(
        job_id="j", attempt=1, replica=replica, exit_code=1, ts=from_us(at), event_id=ev.det_id("f", at)
    )


@dataclass(frozen=True)
class Case:
    reports: tuple[ev.Event, ...]
    finished_at: Micros | None  # the job's end, or None: attempt 2 still waits


CASES = {
    "a completion stamped before the loss finishes the job": Case((completed(T0 + 20 * S),), T0 + 20 * S),
    "one stamped at the loss too (at or before)": Case((completed(L),), L),
    "one stamped 1 µs after the loss leaves the requeue": Case((completed(L + 1),), None),
    "a whole-run report (no replica) before the loss": Case((completed(T0 + S, replica=None),), T0 + S),
    "a failure before the loss leaves the requeue": Case((failed(T0 + 20 * S),), None),
    "a failure, then a completion: the requeue stands": Case((failed(T0 + S), completed(T0 + 2 * S)), None),
    "a completion of another attempt changes nothing": Case((completed(T0 + S, attempt=2),), None),
    "a second report of the finished job changes nothing": Case(
        (completed(T0 + S), completed(T0 + 3 * S, replica=None)), T0 + S
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_report_of_a_lost_run_read_while_its_next_attempt_waits(case: Case) -> None:
    state, log = lost_and_requeued()
    read_at = L + 5 * S
    for r in case.reports:
        out = step(state, r, read_at, CFG)
        assert out == []  # no decision: the fold alone finishes the job
        log.append(r)
    placed = [t for t in types(step(state, Tick(read_at), read_at, CFG)) if t.startswith("JobPlaced")]
    if case.finished_at is None:
        assert (state.jobs["j"].attempt, state.jobs["j"].status) == (2, "running")
        assert placed == ["JobPlaced:j"]  # the next attempt runs
    else:
        assert "j" not in state.jobs and state.finished["j"] == case.finished_at
        assert state.pending_count() == 0 and placed == []
        # the same log in event-time order (the report before the loss) ends the same way
        replay = fold(sorted(log, key=lambda e: e.ts), TREE)
        assert (replay.jobs.keys(), replay.finished.keys(), replay.pending) == (
            state.jobs.keys(),
            state.finished.keys(),
            state.pending,
        )


def placed_again(started: bool) -> DispatchState:
    """Attempt 2 of j placed on n2 at L + 1 s (started there at once when ``started``)."""
    state, _ = lost_and_requeued()
    out = step(state, Tick(L + S), L + S, CFG)
    assert types(out) == ["JobPlaced:j", "StartWorkload:j"]
    assert narrow(ev.JobPlaced, out[0]).placements[0].node_id == "n2"
    if started:
        step(state, ev.JobStarted(
            job_id="j", attempt=2, replica=0, node_id="n2", gpus=(0, 1, 2, 3), ts=from_us(L + S),
            producer="node-agent", event_id=ev.det_id("started", 2),
        ), L + S, CFG)  # fmt: skip
    return state


@pytest.mark.parametrize("started", [False, True], ids=["placed, not started", "started"])
def test_a_completion_read_after_the_next_attempt_was_placed_ends_that_attempt_at_once(started: bool) -> None:
    """Read at L + 2 s, one second after attempt 2 was placed: the job is done. Attempt 2 is stopped with no
    grace and cancelled with reason ``completed_before_loss``; its GPUs are free and its charge ends at the
    read: 4 GPUs x 1 s (attempt 1 is charged up to n0's last heartbeat, T0: nothing)."""
    state = placed_again(started)
    out = step(state, completed(T0 + 20 * S), L + 2 * S, CFG)
    assert endings(out) == [
        ("StopWorkload", 2, "n2", 0.0, "completed_before_loss"),
        ("JobCancelled", 2, None, None, "completed_before_loss"),
    ]
    assert "j" not in state.jobs and state.finished["j"] == L + 2 * S
    assert ("j", 2) not in state.cluster.runs and state.cluster.nodes["n2"].free == frozenset({0, 1, 2, 3})
    assert state.ledger.occupancy_us(L + 10 * S)["lab/b"] == 4 * S
    assert types(step(state, Tick(L + 3 * S), L + 3 * S, CFG)) == []  # not placed again


PARTIAL = {
    "a completion stamped 1 µs after the loss": (completed(L + 1),),
    "a failure": (failed(T0 + 20 * S),),
    "a completion of the running attempt's own replica is that attempt's": (completed(T0 + S, attempt=2),),
}


@pytest.mark.parametrize("reports", PARTIAL.values(), ids=PARTIAL.keys())
def test_a_report_that_does_not_show_the_lost_run_finished_leaves_the_next_attempt_running(
    reports: tuple[ev.Event, ...],
) -> None:
    state = placed_again(started=True)
    for i, r in enumerate(reports):
        step(state, r, L + (2 + i) * S, CFG)
    if "j" in state.jobs:
        assert (state.jobs["j"].attempt, state.jobs["j"].status) == (2, "running")
        assert state.jobs["j"].lost is None
        assert step(state, completed(T0 + 20 * S), L + 9 * S, CFG) == []  # a later completion no longer counts
        assert (state.jobs["j"].attempt, state.jobs["j"].status) == (2, "running")
    else:  # attempt 2's own completion ended the job: nothing to stop
        assert state.finished["j"] == T0 + S


def test_a_completion_before_an_agents_own_loss_report_finishes_the_job_too() -> None:
    """The loss reported by the node agent (its restart), not by a heartbeat timeout: the same rule."""
    cfg = DispatchConfig(heartbeat_timeout_s=None)
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("j", budget="lab/b", gpus=4)):
        step(state, e, T0, cfg)
    step(state, Tick(T0), T0, cfg)
    lost = ev.JobLost(
        job_id="j", attempt=1, node_id="n0", charged_until=from_us(T0 + 9 * S), ts=from_us(T0 + 10 * S),
        producer="node-agent", event_id=ev.det_id("agent-lost"),
    )  # fmt: skip
    assert types(step(state, lost, T0 + 11 * S, cfg)) == ["JobRequeued:j"]
    assert step(state, completed(T0 + 10 * S), T0 + 12 * S, cfg) == []
    assert "j" not in state.jobs and state.finished["j"] == T0 + 10 * S


def reg(nid: str, at: Micros = T0) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=4, ts=from_us(at), event_id=ev.det_id("reg", nid, at))


def test_the_loss_survives_a_snapshot_of_the_state() -> None:
    """A restart from a snapshot taken between the requeue and the report: the report still finishes the job."""
    import pickle

    state, _ = lost_and_requeued()
    restored = pickle.loads(pickle.dumps(state))
    assert restored.jobs["j"].lost == state.jobs["j"].lost == LostRun(1, L, frozenset({0}))
    assert step(restored, completed(T0 + 20 * S), L + 5 * S, CFG) == []
    assert "j" not in restored.jobs and restored.finished["j"] == T0 + 20 * S


@pytest.mark.parametrize(
    ("stamp", "finished"),
    [(T0 + 10 * S, True), (T0 + 12 * S, False)],
    ids=["a completion stamped before the preemption finishes the job", "one between preemption and loss does not"],
)
def test_a_run_preempted_then_lost_counts_only_completions_before_its_preemption(stamp: Micros, finished: bool) -> None:
    """j (placed at T0 on n0, no heartbeat timeout) is preempted at P = T0 + 10 s (drain, grace 30 s); its agent
    reports it lost at T0 + 15 s, within the grace: requeued at once. A completion stamped after the preemption
    may be the workload's answer to SIGTERM, so only one stamped at or before P shows the work was done."""
    cfg = DispatchConfig(heartbeat_timeout_s=None)
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("j", budget="lab/b", gpus=4, min_runtime_s=0)):
        step(state, e, T0, cfg)
    step(state, Tick(T0), T0, cfg)
    preempted = ev.JobPreempted(
        job_id="j", attempt=1, budget="lab/b", allocated=False, reason="drain", ts=from_us(T0 + 10 * S),
        event_id=ev.det_id("preempted"),
    )  # fmt: skip
    step(state, preempted, T0 + 10 * S, cfg)
    lost = ev.JobLost(
        job_id="j", attempt=1, node_id="n0", charged_until=from_us(T0 + 14 * S), ts=from_us(T0 + 15 * S),
        producer="node-agent", event_id=ev.det_id("agent-lost"),
    )  # fmt: skip
    assert types(step(state, lost, T0 + 15 * S, cfg)) == ["JobRequeued:j"]
    assert state.jobs["j"].lost == LostRun(1, T0 + 10 * S, frozenset({0}))
    assert step(state, completed(stamp), T0 + 16 * S, cfg) == []
    if finished:
        assert "j" not in state.jobs and state.finished["j"] == stamp
    else:
        assert (state.jobs["j"].attempt, state.jobs["j"].status, state.jobs["j"].lost) == (2, "pending", None)
