"""The dispatcher's de-duplication state is bounded by the window W (issue 18, bounded memory).

``DispatchState.seen`` maps event id -> event time, leaves heartbeats out and forgets ids older than
W once it has doubled; ``finished`` forgets jobs that ended more than W ago; an event older than W is
not folded (``is_stale``), so de-duplication never depends on when the sweep ran.

W = 1 h in these tests; events at 1 per second.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.dispatch import DispatchState, Tick, evolve, step
from apportion.domain.seen import FORGET_MIN
from apportion.timeutil import from_us
from tests.kit.builders import T0, h, s, submitted
from tests.kit.domain_dispatch import CFG, TREE, reg
from tests.kit.narrowing import narrow_each

W_S = 3600.0


def noise(i: int) -> ev.JobCancelRequested:
    """A cheap event with a new id at T0 + i s (a cancel of a job nobody knows)."""
    return ev.JobCancelRequested(
        job_id=f"x{i}", ts=from_us(s(i)), producer="test", event_id=ev.det_id("noise", i), user="test"
    )


def beat(i: int) -> ev.NodeHeartbeat:
    return ev.NodeHeartbeat(node_id="n0", ts=from_us(s(i)), producer="test", event_id=ev.det_id("beat", i))


def test_seen_stays_within_twice_the_window_over_five_windows():
    state = DispatchState(TREE, window_s=W_S)
    biggest = 0
    for i in range(5 * 3600):
        evolve(state, noise(i))
        biggest = max(biggest, len(state.seen))
    # one window holds 3,601 ids (both ends inclusive); the map is swept when it passes 2 * max(kept, 4096)
    assert FORGET_MIN == 4096
    assert biggest == 2 * FORGET_MIN
    assert len(state.seen) <= 2 * FORGET_MIN
    state.forget_old()
    assert len(state.seen) == 3601
    assert min(state.seen.values()) == s(5 * 3600 - 1 - 3600)


def test_heartbeats_are_not_recorded():
    state = DispatchState(TREE, window_s=W_S)
    evolve(state, reg("n0"))
    for i in range(1, 10_001):
        evolve(state, beat(i))
    assert list(state.seen) == [reg("n0").event_id]
    assert state.cluster.nodes["n0"].last_heartbeat_us == s(10_000)


def test_a_duplicate_inside_the_window_is_still_dropped_after_sweeps():
    state = DispatchState(TREE, window_s=W_S)
    step(state, reg("n0"), T0, CFG)
    sub = submitted("j1", budget="lab/a", user="alice", gpus=1, at=T0)
    assert [e.type for e in step(state, sub, T0, CFG)] == ["JobQueued"]
    for i in range(1, 3000):  # 50 min of noise, then a sweep
        evolve(state, noise(i))
    state.forget_old()
    assert sub.event_id in state.seen
    assert step(state, sub, s(3000), CFG) == []  # the redelivered submission: nothing decided
    assert [j.job_id for j in state.pending["lab/a"]] == ["j1"]


def test_an_event_older_than_the_window_is_not_folded_and_counted():
    state = DispatchState(TREE, window_s=W_S)
    step(state, reg("n0"), T0, CFG)
    sub = submitted("j1", budget="lab/a", user="alice", gpus=1, at=T0)
    step(state, sub, T0, CFG)
    evolve(state, noise(2 * 3600))  # the clock is now T0 + 2 h
    state.forget_old()
    assert sub.event_id not in state.seen
    assert state.is_stale(sub)
    assert step(state, sub, h(2), CFG) == []  # a redelivery two windows late: not a new job
    assert state.stale == 1
    assert not state.is_stale(noise(3600))  # exactly W before the clock: still inside


def test_whether_the_sweep_ran_does_not_change_what_is_folded():
    def run(sweep_every: int | None) -> tuple:
        state = DispatchState(TREE, window_s=W_S)
        evolve(state, reg("n0"))
        for i in range(3 * 3600):
            evolve(state, noise(i))
            if sweep_every and i % sweep_every == 0:
                state.forget_old()
            if i % 500 == 0:  # redeliveries of events one minute, half a window and two windows old
                for back in (60, 1800, 7200):
                    if i >= back:
                        evolve(state, noise(i - back))
        assert state.clock_us is not None
        horizon = state.clock_us - state.window_us
        return state.stale, sorted((t, k) for k, t in state.seen.items() if t >= horizon)

    unswept, often, always = run(None), run(49), run(7)
    assert unswept == often == always
    assert unswept[0] == 7  # the two-window-old redeliveries, at i = 7500, 8000, ..., 10500


def test_finished_jobs_are_forgotten_after_the_window_and_remembered_inside_it():
    state = DispatchState(TREE, window_s=W_S)
    step(state, reg("n0"), T0, CFG)
    step(state, submitted("j1", budget="lab/a", user="alice", gpus=1, at=T0), T0, CFG)
    cancel = ev.JobCancelRequested(
        job_id="j1", ts=from_us(s(1)), producer="test", event_id=ev.det_id("c"), user="alice"
    )
    assert [e.type for e in step(state, cancel, s(1), CFG)] == ["JobCancelled"]
    assert state.finished == {"j1": s(1)}
    again = submitted("j1", budget="lab/a", user="alice", gpus=1, at=s(1800), event_id=ev.det_id("again", 1))
    out = step(state, again, s(1800), CFG)
    assert [(e.type, e.reason) for e in narrow_each(ev.JobRejected, out)] == [
        ("JobRejected", ev.RejectReason.DUPLICATE_JOB)
    ]
    evolve(state, noise(2 * 3600))
    state.forget_old()
    assert state.finished == {}
    later = submitted("j1", budget="lab/a", user="alice", gpus=1, at=s(2 * 3600), event_id=ev.det_id("again", 2))
    assert [e.type for e in step(state, later, s(2 * 3600), CFG)] == ["JobQueued"]


def test_a_tick_still_decides_after_sweeps():
    state = DispatchState(TREE, window_s=W_S)
    step(state, reg("n0"), T0, CFG)
    for i in range(1, 2 * FORGET_MIN + 2):
        evolve(state, noise(i))
    sub = submitted("j2", budget="lab/a", user="alice", gpus=1, at=s(2 * FORGET_MIN + 2))
    step(state, sub, s(2 * FORGET_MIN + 2), CFG)
    out = step(state, Tick(s(2 * FORGET_MIN + 2)), s(2 * FORGET_MIN + 2), CFG)
    assert [e.type for e in out] == ["JobPlaced", "StartWorkload"]
