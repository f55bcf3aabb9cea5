"""Hold and release: a held job stays queued in its place, is never placed, and comes back in fair-share order.

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5

One node of 4 GPUs; every job asks for all 4, so one placement decides which job goes first.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, fold, step
from apportion.timeutil import from_us, to_us
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, m, submitted
from tests.kit.narrowing import narrow

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 0.5, "members": ["alice"]}, "lab/b": 0.5})
CFG = DispatchConfig(heartbeat_timeout_s=None)


def reg(nid: str = "n0", gpus: int = 4) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=gpus, ts=from_us(T0), event_id=ev.det_id("reg", nid))


def hold(job_id: str, at: int, user: str = "bob") -> ev.JobHoldRequested:
    return ev.JobHoldRequested(
        event_id=ev.det_id("hold", job_id, at), job_id=job_id, user=user, reason="data not ready", ts=from_us(at)
    )


def release(job_id: str, at: int, user: str = "bob") -> ev.JobReleaseRequested:
    return ev.JobReleaseRequested(event_id=ev.det_id("release", job_id, at), job_id=job_id, user=user, ts=from_us(at))


def two_jobs() -> tuple[DispatchState, list[ev.Event]]:
    """j1 (submitted at T0) and j2 (a minute later) of lab/b, 4 GPUs each, queued; the log so far."""
    state = DispatchState(TREE)
    log: list[ev.Event] = []
    for e in (
        reg(),
        submitted("j1", budget="lab/b", user="bob", gpus=4),
        submitted("j2", budget="lab/b", user="bob", gpus=4, at=m(1)),
    ):
        log += [e, *step(state, e, to_us(e.ts), CFG)]
    return state, log


def feed(state: DispatchState, log: list[ev.Event], e: ev.Event | Tick, now: int) -> list[ev.Event]:
    out = step(state, e, now, CFG)
    log += ([] if isinstance(e, Tick) else [e]) + out
    return out


def kinds(out: list[ev.Event]) -> list[str]:
    return [f"{e.type}:{getattr(e, 'job_id', '')}" for e in out]


def test_a_held_job_keeps_its_place_and_is_never_placed() -> None:
    state, log = two_jobs()
    out = feed(state, log, hold("j1", m(2)), m(2))
    held = narrow(ev.JobHeld, out[0])
    assert kinds(out) == ["JobHeld:j1"]
    assert (held.by, held.reason, held.request_id) == ("bob", "data not ready", ev.det_id("hold", "j1", m(2)))
    assert [j.job_id for j in state.pending["lab/b"]] == ["j1", "j2"]  # still queued, in its place
    assert [j.job_id for j in state.pending_now(m(3))["lab/b"]] == ["j2"]  # but no cycle sees it
    assert kinds(feed(state, log, Tick(m(3)), m(3))) == ["JobPlaced:j2", "StartWorkload:j2"]
    assert state.jobs["j1"].status == "pending" and state.jobs["j1"].submitted_at_us == T0


def test_a_released_job_goes_first_again_by_its_submission_time() -> None:
    """Held and released before any cycle: j1 (submitted first) is placed, not j2, and keeps its submitted_at."""
    state, log = two_jobs()
    feed(state, log, hold("j1", m(2)), m(2))
    out = feed(state, log, release("j1", m(3)), m(3))
    released = narrow(ev.JobReleased, out[0])
    assert kinds(out) == ["JobReleased:j1"] and released.request_id == ev.det_id("release", "j1", m(3))
    assert state.held == {}
    placed = feed(state, log, Tick(m(4)), m(4))
    assert kinds(placed) == ["JobPlaced:j1", "StartWorkload:j1"]
    assert state.jobs["j1"].submitted_at_us == T0


def test_submit_hold_queues_the_job_held() -> None:
    state, log = two_jobs()
    sub = submitted("j3", budget="lab/a", user="alice", gpus=4, at=m(2)).model_copy(update={"hold": True})
    out = feed(state, log, sub, m(2))
    assert kinds(out) == ["JobQueued:j3", "JobHeld:j3"]
    held = narrow(ev.JobHeld, out[1])
    assert (held.by, held.reason, held.request_id) == ("alice", "submitted held", sub.event_id)
    assert "lab/a" not in state.pending_now(m(3))  # its only job is held
    assert kinds(feed(state, log, Tick(m(3)), m(3))) == ["JobPlaced:j1", "StartWorkload:j1"]


def test_requests_that_cannot_be_carried_out_are_refused_with_the_reason() -> None:
    state, log = two_jobs()
    feed(state, log, Tick(m(2)), m(2))  # j1 runs
    feed(state, log, hold("j2", m(3)), m(3))
    cases = {
        "running": hold("j1", m(4)),
        "again": hold("j2", m(4)),
        "not held": release("j1", m(4)),
    }
    got = {}
    for name, req in cases.items():
        out = feed(state, log, req, m(4))
        rej = narrow(ev.JobRejected, out[0])
        assert len(out) == 1 and rej.refused_event_id == req.event_id and rej.budget == "lab/b"
        got[name] = (rej.reason.value, rej.request, rej.message)
    assert got == {
        "running": (
            "invalid",
            "JobHoldRequested",
            "job 'j1' is running: only a pending job can be held (cancel stops a running one)",
        ),
        "again": ("invalid", "JobHoldRequested", "job 'j2' is already held"),
        "not held": ("invalid", "JobReleaseRequested", "job 'j1' is not held: nothing to release"),
    }
    assert feed(state, log, hold("nobody", m(5)), m(5)) == []  # a job never seen: no answer, as a cancel


def test_a_cancelled_held_job_is_gone_and_its_release_refused() -> None:
    state, log = two_jobs()
    feed(state, log, hold("j1", m(2)), m(2))
    feed(state, log, ev.JobCancelRequested(job_id="j1", user="bob", ts=from_us(m(3))), m(3))
    assert state.held == {} and [j.job_id for j in state.pending["lab/b"]] == ["j2"]
    rej = narrow(ev.JobRejected, feed(state, log, release("j1", m(4)), m(4))[0])
    assert rej.message == "job 'j1' already finished: nothing to release"


def test_a_fold_of_the_log_agrees_with_the_dispatcher() -> None:
    """What the audit re-runs and a rebuild fold: the log's JobHeld / JobReleased give the same held set and the
    same pending lists a cycle sees, and a cycle on the fold decides what the dispatcher decided."""
    state, log = two_jobs()
    feed(state, log, hold("j1", m(2)), m(2))
    feed(state, log, hold("j2", m(2)), m(2))
    feed(state, log, release("j2", m(3)), m(3))
    folded = fold(log, TREE)
    assert set(folded.held) == set(state.held) == {"j1"}
    assert folded.pending_now(m(4)) == state.pending_now(m(4))
    assert kinds(step(folded, Tick(m(4)), m(4), CFG)) == kinds(step(state, Tick(m(4)), m(4), CFG))


def test_the_queue_says_held_and_who_held_it() -> None:
    state, log = two_jobs()
    feed(state, log, hold("j1", m(2)), m(2))
    rows, _ = read_model(state, m(3), CFG)
    assert rows["j1"]["position"] is None and rows["j2"]["position"] == 0
    assert rows["j1"]["reason"] == (
        "held: held by bob at 2024-01-01 00:02:00 UTC (data not ready); never placed until released "
        "(apportion release JOB)"
    )
    assert rows["j1"]["reason_detail"] == {
        "kind": "held",
        "text": rows["j1"]["reason"],
        "by": "bob",
        "note": "data not ready",
        "since": "2024-01-01T00:02:00+00:00",
    }


def test_a_hold_without_a_reason_says_none_was_given() -> None:
    state, log = two_jobs()
    no_reason = ev.JobHoldRequested(event_id=ev.det_id("hold", "j1"), job_id="j1", user="bob", ts=from_us(m(2)))
    held = narrow(ev.JobHeld, feed(state, log, no_reason, m(2))[0])
    assert held.reason == "no reason given"
    rows, _ = read_model(state, m(3), CFG)
    assert rows["j1"]["reason"] == (
        "held: held by bob at 2024-01-01 00:02:00 UTC (no reason given); never placed until released "
        "(apportion release JOB)"
    )
    released = feed(state, log, release("j1", m(4)), m(4))
    assert narrow(ev.JobReleased, released[0]).reason == "no reason given"
