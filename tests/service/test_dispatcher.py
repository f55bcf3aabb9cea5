"""Dispatcher service loop without Kafka: a list-backed log, a manual clock.

:class:`services.dispatcher.service.DispatcherService` is driven the way
``_lead`` drives it (ingest a batch, tick when news arrived, emit), with
what it publishes appended to an in-memory log that it reads back, so its
own decisions come back as echoes exactly as on Kafka.
"""

from __future__ import annotations

from typing import Any

import pytest

from apportion import events
from apportion.events import (
    JobPlaced,
    StartWorkload,
)
from apportion.settings import topic_name
from apportion.topics import BUDGETS, COMMANDS, JOBS, NODES, SUBMISSIONS
from services.dispatcher import logic
from services.dispatcher.lease import Lease
from services.dispatcher.service import ECHO_LEN, DispatcherService, TickPacer
from tests.kit.dispatcher import INPUTS, T0, ListLog, drive, history, service, submit
from tests.kit.narrowing import narrow, narrow_each


def run_history(echoes: bool) -> tuple[DispatcherService, ListLog]:
    log = ListLog()
    svc = service(log, echoes=echoes)
    for inputs in history():
        log.put(*inputs)
        drive(svc, log)
    return svc, log


def test_echo_fast_path_gives_the_same_decisions_bytes_and_state() -> None:
    fast, fast_log = run_history(echoes=True)
    slow, slow_log = run_history(echoes=False)
    assert fast_log.published == slow_log.published
    assert fast.state.seen == slow.state.seen
    assert {j: r.status for j, r in fast.state.jobs.items()} == {
        "j1": "running",
        "j2": "running",
        "j3": "pending",
        "j4": "running",
    }
    assert {j: r.status for j, r in fast.state.jobs.items()} == {j: r.status for j, r in slow.state.jobs.items()}
    assert fast.inputs == slow.inputs
    # every decision on a topic the dispatcher reads came back and was recognised without decoding
    on_inputs = [t for t, _ in fast_log.published if t in INPUTS]
    assert fast.echoes_skipped == len(on_inputs) == 7
    assert slow.echoes_skipped == 0
    assert fast._echoes == {}


def test_decisions_are_fenced_and_placements_carry_their_input_position() -> None:
    svc, log = run_history(echoes=True)
    sent = [events.decode(v) for _, v in log.published]
    assert [e.type for e in sent] == [
        "JobQueued",
        "JobQueued",
        "JobQueued",
        "JobPlaced",
        "StartWorkload",
        "JobPlaced",
        "StartWorkload",
        "JobQueued",
        "JobPlaced",
        "StartWorkload",
    ]
    placed = [e for e in sent if isinstance(e, JobPlaced)]
    assert [(p.job_id, p.fencing_token) for p in placed] == [("j1", 7), ("j2", 7), ("j4", 7)]
    assert [e.fencing_token for e in sent if isinstance(e, StartWorkload)] == [7, 7, 7]
    b, s, j, n = (f"{t}:0" for t in (topic_name(BUDGETS), topic_name(SUBMISSIONS), topic_name(JOBS), topic_name(NODES)))
    # j1 and j2 were placed on budgets (three budgets, one user key, two node keys), nodes and submissions only;
    # j4 after six job events had been read (three JobQueued, two JobPlaced, one JobStarted): its own JobQueued
    # is folded as emitted, not read yet
    assert placed[0].decision.inputs == {b: 6, n: 2, s: 3}
    assert placed[2].decision.inputs == {b: 6, j: 6, n: 2, s: 4}


def test_only_heads_this_instance_published_are_skipped() -> None:
    """A remembered head that never comes back (a lost send) skips nothing else; the rest is folded as usual."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*history()[0])
    drive(svc, log)
    lost = events.encode(submit("j8", "lab/a", 1))[:ECHO_LEN]
    svc._echoes[lost] = None
    log.put(submit("j9", "lab/a", 1))
    drive(svc, log)
    assert svc.state.jobs["j9"].status == "running"
    assert "j8" not in svc.state.jobs
    assert svc.echoes_skipped == 2  # j9's JobQueued and JobPlaced
    assert list(svc._echoes) == [lost]


def test_is_echo_marks_the_own_records_of_a_batch_and_nothing_else() -> None:
    """The reader's ``own``: a batch of only echoes needs no key read-ahead; a submission still does."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*history()[0])
    drive(svc, log)
    log.put(submit("j9", "lab/a", 1))
    batch = log.read()
    assert [svc.is_echo(r) for r in batch] == [False]  # the submission: judged by its user's key
    out, _ = svc.ingest(batch)
    svc._emit(out + svc.tick())
    echoes = log.read()
    assert [events.decode(r.value).type for r in echoes] == ["JobQueued", "JobPlaced"]
    assert [svc.is_echo(r) for r in echoes] == [True, True]
    svc.ingest(echoes)
    assert [svc.is_echo(r) for r in echoes] == [False, False]  # read back: forgotten


@pytest.mark.parametrize(
    "token, inputs, expect_copy",
    [
        pytest.param(7, None, False, id="already fenced with the same token: unchanged object"),
        pytest.param(8, None, True, id="new token: copied"),
        pytest.param(7, {"t:0": 5}, True, id="inputs asked: copied"),
    ],
)
def test_fence_copies_only_when_something_changes(token: int, inputs: dict[str, int] | None, expect_copy: bool) -> None:
    placed = JobPlaced(
        job_id="j",
        attempt=1,
        budget="lab/a",
        allocated=True,
        gpus_per_replica=1,
        replicas=1,
        min_runtime_s=60,
        placements=(events.Placement(node_id="n1", gpus=(0,)),),
        submitted_at=T0,
        decision=events.Decision(rank=0, budget_rank=0, ratio=0.0),
        ts=T0,
        fencing_token=7,
    )
    queued_like: Any = submit("k", "lab/a", 1)
    out = logic.fence([placed, queued_like], token, inputs)
    assert (out[0] is not placed) == expect_copy
    assert out[1] is queued_like
    fenced = narrow(events.JobPlaced, out[0])
    assert fenced.fencing_token == token
    assert fenced.decision.inputs == inputs
    assert fenced.event_id == placed.event_id


def test_tick_pacer_spaces_news_driven_ticks_to_a_share_of_the_time() -> None:
    pacer = TickPacer(every_s=0.2, share=0.2, gap_max_s=0.1, start=10.0)
    assert pacer.poll_ms(10.0) == 50  # nothing waiting: the idle poll
    assert pacer.due(10.001, news=True) is True  # first news: no gap yet
    pacer.ticked(10.001, 10.006)  # a 5 ms cycle -> 20 ms gap (cycles <= 20% of time)
    assert pacer.gap == pytest.approx(0.020)
    assert pacer.due(10.010, news=True) is False  # news 4 ms later waits for the gap
    assert pacer.poll_ms(10.010) == 16  # and the poll only until then
    assert pacer.due(10.020, news=False) is False  # still waiting, still inside the gap
    assert pacer.due(10.027, news=False) is True  # gap over: the waiting news gets its tick
    pacer.ticked(10.027, 10.127)  # a 100 ms cycle: gap capped at gap_max_s
    assert pacer.gap == 0.1
    assert pacer.due(10.200, news=False) is False  # no news: only the timer
    assert pacer.due(10.328, news=False) is True  # every_s after the last tick


def test_tick_pacer_idle_news_is_ticked_at_once_after_a_cheap_cycle() -> None:
    pacer = TickPacer(every_s=0.2, share=0.2, gap_max_s=0.1, start=0.0)
    pacer.ticked(0.2, 0.2005)  # a timer tick of 0.5 ms -> 2 ms gap
    assert pacer.due(0.25, news=True) is True


class FakeLease(Lease):
    """Stands for :class:`services.dispatcher.lease.Lease`: answers renewals from a script."""

    def __init__(self, token: int, answers: list[Any]) -> None:  # no Redis: Lease.__init__ is not called
        self.token = token
        self.answers = answers
        self.calls = 0

    def try_acquire(self, floor: int | None = None) -> int:
        self.calls += 1
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


@pytest.mark.parametrize(
    "answers, stalled, keeps, calls",
    [
        pytest.param([5], False, True, 1, id="renewed with the same token: still leading"),
        pytest.param([6], False, False, 1, id="lease had expired, new token drawn: lost"),
        pytest.param([0], False, False, 1, id="another instance holds it: lost"),
        pytest.param([ConnectionError("redis down")], False, False, 1, id="renewal failed: lost"),
        pytest.param([], True, True, 0, id="event loop stalled: no renewal, lease runs out"),
    ],
)
def test_lease_keeper_round(answers: list[Any], stalled: bool, keeps: bool, calls: int) -> None:
    from services.dispatcher.lease import LeaseKeeper

    lease = FakeLease(5, answers)
    keeper = LeaseKeeper(lease, every_s=1.0, stall_s=30.0)
    if stalled:
        keeper._beat -= 31.0
    assert keeper.renew_once() is keeps
    assert keeper.lost.is_set() is not keeps
    assert lease.calls == calls


def test_lease_keeper_thread_reports_a_loss() -> None:
    from services.dispatcher.lease import LeaseKeeper

    lease = FakeLease(5, [5, 5, 9])
    keeper = LeaseKeeper(lease, every_s=0.001, stall_s=30.0).start()
    assert keeper.lost.wait(10.0) is True
    keeper.stop()
    assert lease.calls == 3


def test_a_new_leader_sends_again_the_starts_of_runs_that_never_started() -> None:
    """A leader killed between JobPlaced and StartWorkload: its successor re-sends the start, same id."""
    from services.dispatcher import logic

    svc, log = run_history(echoes=True)
    first = {
        e.job_id: e
        for e in narrow_each(
            events.StartWorkload, [events.decode(v) for t, v in log.published if t == topic_name(COMMANDS)]
        )
    }
    fresh = service(ListLog(), echoes=False)
    out = fresh.bootstrap([r for r in log.records if r.topic in INPUTS])
    again = [e for e in out if isinstance(e, StartWorkload)]
    # j1 reported JobStarted; j2 and j4 did not
    assert [(e.job_id, e.replica, e.event_id) for e in again] == [
        ("j2", 0, first["j2"].event_id),
        ("j4", 0, first["j4"].event_id),
    ]
    assert logic.resend_starts(fresh.state, fresh.now_us(), fresh.cfg) == again  # the same on every call
