"""Dispatcher decide/evolve, stated as given (history) / when (input) / then (events).

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5
"""

from __future__ import annotations

import random

from apportion import events as ev
from apportion.domain.dispatch import EMIT_ORDER, DispatchConfig, DispatchState, Tick, emit_rank, evolve, fold, step
from apportion.timeutil import from_us
from tests.kit.builders import T0, h, m, s, submitted
from tests.kit.domain_dispatch import CFG, TREE, given, reg, types
from tests.kit.narrowing import narrow


def test_submission_is_queued_with_attempt_1():
    state = given(reg("n0"))
    out = step(state, submitted("j1", budget="lab/a", user="alice", gpus=2), T0, CFG)
    assert types(out) == ["JobQueued:j1"]
    queued = narrow(ev.JobQueued, out[0])
    assert queued.attempt == 1 and queued.event_id == ev.det_id("JobQueued", "j1", 1)
    assert [j.job_id for j in state.pending["lab/a"]] == ["j1"]


def test_rejections_carry_machine_readable_reasons():
    state = given(reg("n0"))
    cases = {
        "unknown": submitted("x1", budget="lab/zzz", user="alice"),
        "member": submitted("x2", budget="lab/a", user="mallory"),
        "shape": submitted("x3", budget="lab/b", gpus=8),
        "inner": submitted("x4", budget="lab", user="alice"),
    }
    got = {name: narrow(ev.JobRejected, step(state, e, T0, CFG)[0]).reason.value for name, e in cases.items()}
    assert got == {
        "unknown": "unknown_budget",
        "member": "not_a_member",
        "shape": "shape_impossible",
        "inner": "not_a_leaf",
    }
    dup = step(state, submitted("x1", budget="lab/b", at=m(1)), m(1), CFG)
    assert narrow(ev.JobRejected, dup[0]).reason.value == "duplicate_job"


def test_tick_places_and_starts():
    state = given(reg("n0"), submitted("j1", budget="lab/b", gpus=2))
    out = step(state, Tick(m(1)), m(1), CFG)
    assert types(out) == ["JobPlaced:j1", "StartWorkload:j1"]
    assert state.jobs["j1"].status == "running" and not state.pending


def test_cancel_pending_job():
    state = given(reg("n0"), submitted("j1", budget="lab/b", gpus=8 // 2))
    out = step(state, ev.JobCancelRequested(job_id="j1", user="bob", ts=from_us(m(1))), m(1), CFG)
    assert types(out) == ["JobCancelled:j1"] and narrow(ev.JobCancelled, out[0]).attempt is None
    assert "j1" in state.finished and not state.pending


def test_cancel_of_a_completed_job_is_refused_at_once_and_of_an_unknown_job_answers_nothing():
    state = given(reg("n0"), submitted("j1", budget="lab/b", gpus=2))
    step(state, Tick(m(1)), m(1), CFG)
    done = ev.JobCompleted(job_id="j1", attempt=1, replica=0, exit_code=0, ts=from_us(m(2)))
    assert step(state, done, m(2), CFG) == [] and "j1" in state.finished
    req = ev.JobCancelRequested(job_id="j1", user="bob", ts=from_us(m(3)))
    out = step(state, req, m(3), CFG)
    assert types(out) == ["JobRejected:j1"]
    r = narrow(ev.JobRejected, out[0])
    assert (r.request, r.reason.value, r.refused_event_id, r.user, r.budget) == (
        "JobCancelRequested", "invalid", req.event_id, "bob", ""
    )  # fmt: skip
    assert r.message == "job 'j1' already finished: nothing to cancel"
    assert r.event_id == ev.det_id("JobRejected", "j1", req.event_id)
    assert "j1" in state.finished and "j1" not in state.jobs  # the refusal changes nothing
    other = ev.JobCancelRequested(job_id="nope", user="bob", ts=from_us(m(3)))
    assert step(state, other, m(3), CFG) == []


def test_preempted_victim_is_requeued_with_original_submitted_at_and_preemptor_starts():
    state = given(reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=0))
    step(state, Tick(T0), T0, CFG)
    step(state, submitted("j", budget="lab/a", user="alice", gpus=4, at=h(1)), h(1), CFG)
    out = step(state, Tick(h(1)), h(1), CFG)
    assert types(out) == ["JobPreempted:u", "StopWorkload:u", "JobPlaced:j"]
    # the victim reports its exit 3 s later
    report = ev.JobFailed(job_id="u", attempt=1, replica=0, exit_code=-15, ts=from_us(h(1) + 3_000_000))
    out = step(state, report, h(1) + 3_000_000, CFG)
    assert types(out) == ["JobRequeued:u", "StartWorkload:j"]
    requeued = narrow(ev.JobRequeued, out[0])
    assert requeued.attempt == 2 and requeued.submitted_at == from_us(T0)
    assert state.jobs["u"].status == "pending" and state.pending["lab/b"][0].attempt == 2
    # its attained service (rule D3.free-las): 4 GPUs held from its placement at T0 to its exit 1 h 3 s later
    assert state.pending["lab/b"][0].attained_gpu_s == 4 * 3603.0


def test_a_victim_that_completed_before_the_stop_reached_it_is_finished_not_requeued():
    # u completes 1 s before the dispatcher preempts it; the agent's JobCompleted is read only after the
    # JobPreempted (it was in flight). The job is done: no JobRequeued, and j starts on the freed GPUs.
    state, log = DispatchState(TREE), []
    for e in (reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=0)):
        log += [e, *step(state, e, T0, CFG)]
    log += step(state, Tick(T0), T0, CFG)
    log.append(submitted("j", budget="lab/a", user="alice", gpus=4, at=h(1)))
    log += step(state, log[-1], h(1), CFG)
    out = step(state, Tick(h(1)), h(1), CFG)
    assert types(out) == ["JobPreempted:u", "StopWorkload:u", "JobPlaced:j"]
    log += out
    done = ev.JobCompleted(job_id="u", attempt=1, replica=0, exit_code=0, ts=from_us(h(1) - 1_000_000))
    out = step(state, done, h(1) + 2_000_000, CFG)
    assert types(out) == ["StartWorkload:j"]
    log += [done, *out]
    assert "u" not in state.jobs and "u" in state.finished and not state.stopping and not state.awaiting
    assert list(state.cluster.runs) == [("j", 1)] and state.cluster.node_runs["n0"] == {("j", 1)}  # u's GPUs freed
    assert step(state, Tick(h(1) + 60_000_000), h(1) + 60_000_000, CFG) == []  # nothing left to finish
    # a replay that folds the log in event-time order (the report before the preemption) agrees
    replay = fold(sorted(log, key=lambda e: e.ts), TREE)
    assert replay.cluster.runs.keys() == state.cluster.runs.keys()
    assert (replay.jobs.keys(), replay.finished.keys(), replay.stopping, replay.awaiting) == (
        state.jobs.keys(),
        state.finished.keys(),
        state.stopping,
        state.awaiting,
    )
    # and both charge u until its completion, not its preemption: 4 GPUs x (1 h - 1 s)
    want = 4 * 3599 * 10**6
    assert replay.ledger.unallocated_us(h(2))["lab/b"] == state.ledger.unallocated_us(h(2))["lab/b"] == want


def test_a_completion_stamped_after_the_preemption_is_a_stop_report_and_the_victim_is_requeued():
    # the workload ran out its duration during the grace period (the agent read the stop late): it was stopped
    # by the dispatcher's decision, so it is requeued, as a replay in event-time order also says
    state = given(reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=0))
    step(state, Tick(T0), T0, CFG)
    step(state, submitted("j", budget="lab/a", user="alice", gpus=4, at=h(1)), h(1), CFG)
    step(state, Tick(h(1)), h(1), CFG)
    late = ev.JobCompleted(job_id="u", attempt=1, replica=0, exit_code=0, ts=from_us(h(1) + 5_000_000))
    out = step(state, late, h(1) + 6_000_000, CFG)
    assert types(out) == ["JobRequeued:u", "StartWorkload:j"]
    assert state.jobs["u"].attempt == 2


def test_grace_expiry_finishes_the_stop_without_a_report():
    state = given(reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=0))
    step(state, Tick(T0), T0, CFG)
    step(state, submitted("j", budget="lab/a", user="alice", gpus=4, at=h(1)), h(1), CFG)
    step(state, Tick(h(1)), h(1), CFG)
    assert step(state, Tick(h(1) + 29_000_000), h(1) + 29_000_000, CFG) == []
    out = step(state, Tick(h(1) + 30_000_000), h(1) + 30_000_000, CFG)
    assert types(out) == ["JobRequeued:u", "StartWorkload:j"]


def test_two_victims_expiring_in_the_same_tick_start_the_preemptor():
    """Found live (main job at 1440x, 18 of 2,317 placements): the 30 s grace ends before either victim
    reports its exit. Both stops finish in one maintenance pass; the preemptor must start once."""
    state = given(
        reg("n0"),
        submitted("u1", budget="lab/b", gpus=2, min_runtime_s=0),
        submitted("u2", budget="lab/b", gpus=2, min_runtime_s=0),
    )
    step(state, Tick(T0), T0, CFG)
    step(state, submitted("j", budget="lab/a", user="alice", gpus=4, at=h(1)), h(1), CFG)
    out = step(state, Tick(h(1)), h(1), CFG)
    assert types(out) == ["JobPreempted:u1", "StopWorkload:u1", "JobPreempted:u2", "StopWorkload:u2", "JobPlaced:j"]
    out = step(state, Tick(h(1) + 30_000_000), h(1) + 30_000_000, CFG)
    assert types(out) == ["JobRequeued:u1", "JobRequeued:u2", "StartWorkload:j"]
    start = narrow(ev.StartWorkload, out[2])
    assert start.gpus == (0, 1, 2, 3) and start.attempt == 1
    # the late exit reports change nothing
    for u in ("u1", "u2"):
        late = ev.JobFailed(job_id=u, attempt=1, replica=0, exit_code=-15, ts=from_us(h(1) + 40_000_000))
        assert step(state, late, h(1) + 40_000_000, CFG) == []
    assert not state.awaiting


def test_heartbeat_timeout_loses_the_node_and_requeues():
    cfg = DispatchConfig(heartbeat_timeout_s=30)
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("j", budget="lab/b", gpus=4)):
        step(state, e, T0, cfg)
    step(state, Tick(T0), T0, cfg)
    assert step(state, Tick(T0 + 30_000_000), T0 + 30_000_000, cfg) == []
    out = step(state, Tick(T0 + 30_000_001), T0 + 30_000_001, cfg)
    assert types(out) == ["NodeLost:n0", "JobLost:j", "JobRequeued:j"]
    assert narrow(ev.JobLost, out[1]).charged_until == from_us(T0)


def test_redelivered_and_replayed_events_give_the_same_state():
    rng = random.Random(5)
    state = given(reg("n0", 8))
    log: list[ev.Event] = [reg("n0", 8)]
    for i in range(12):
        e: ev.Event = submitted(
            f"j{i}",
            budget=rng.choice(["lab/a", "lab/b"]),
            user="alice",
            gpus=rng.choice([1, 2, 4]),
            min_runtime_s=rng.choice([0.0, 600.0]),
            at=m(i),
        )
        log.append(e)
        log.extend(step(state, e, m(i), CFG))
        log.extend(step(state, Tick(m(i)), m(i), CFG))
    # duplicates change nothing and produce nothing
    before = (dict(state.jobs), {k: list(v) for k, v in state.pending.items()}, dict(state.cluster.runs))
    for e in log:
        assert step(state, e, m(20), CFG) == [] or e.type == "NodeRegistered"
    assert (dict(state.jobs), {k: list(v) for k, v in state.pending.items()}, dict(state.cluster.runs)) == before
    # a fold of the log (recovery) is the same state
    again = fold(log, TREE)
    assert again.jobs == state.jobs and again.cluster.runs == state.cluster.runs
    assert {k: list(v) for k, v in again.pending.items()} == {k: list(v) for k, v in state.pending.items()}


def test_memo_of_pending_lists_is_carried_exactly_through_enqueue_and_dequeue():
    """The engine's memo of a pending list ([list, floors, shape codes]) follows every change.

    After each submission or cancellation, every carried entry must equal what
    the engine would compute afresh for the new list (random shapes, both
    allocated and unallocated jobs, seeded).
    """
    from apportion.domain.engine import allocated_count, shape_floor

    rng = random.Random(7)
    state = given(reg("n0", 8), reg("n1", 8))
    live: list[str] = []
    for i in range(300):
        if live and rng.random() < 0.35:
            job_id = live.pop(rng.randrange(len(live)))
            step(state, ev.JobCancelRequested(job_id=job_id, user="alice", ts=from_us(T0 + i)), T0 + i, CFG)
        else:
            job_id = f"j{i}"
            live.append(job_id)
            step(
                state,
                submitted(
                    job_id,
                    budget="lab/a",
                    gpus=rng.choice([1, 2, 4, 8]),
                    replicas=rng.choice([1, 2]),
                    min_runtime_s=rng.choice([0.0, 60.0]),
                    at=T0 + i,
                    submitted_at=T0 + rng.randrange(1000),
                ),
                T0 + i,
                CFG,
            )
        lst = state.pending.get("lab/a")
        if not lst:
            continue
        ent = state._engine.memo.get(id(lst))
        if ent is not None:
            b = allocated_count(lst)
            assert ent[0] is lst
            assert ent[2] == state._engine.memo.shapes.codes(lst)
            assert ent[3] == b  # the allocated count moved with the job
            for (lo, hi), f in ent[1].items():
                assert (lo, hi) in ((0, b), (b, len(lst))) and f == shape_floor(lst, lo, hi)
        # seed the memo as the engine would, so that the next change is carried
        b = allocated_count(lst)
        state._engine.memo[id(lst)] = [
            lst,
            {(0, b): shape_floor(lst, 0, b), (b, len(lst)): shape_floor(lst, b, len(lst))},
            state._engine.memo.shapes.codes(lst),
            b,
        ]


def test_the_checkpoint_interval_in_force_travels_from_submission_to_the_run():
    # declared 900 s; undeclared: the minimum runtime (rule D1.checkpoint); unallocated and undeclared: none
    state = given(reg("n0", 8))
    sub = submitted("j1", budget="lab/b", gpus=2).model_copy(update={"checkpoint_interval_s": 900.0})
    queued = [
        narrow(ev.JobQueued, step(state, e, T0, CFG)[0])
        for e in (sub, submitted("j2", budget="lab/b", min_runtime_s=1200.0))
    ]
    queued.append(narrow(ev.JobQueued, step(state, submitted("j3", budget="lab/b", min_runtime_s=0.0), T0, CFG)[0]))
    assert [q.checkpoint_interval_s for q in queued] == [900.0, 1200.0, None]
    out = step(state, Tick(m(1)), m(1), CFG)
    got = {e.job_id: e.checkpoint_interval_s for e in out if isinstance(e, ev.JobPlaced)}
    assert got == {"j1": 900.0, "j2": 1200.0, "j3": None}
    runs = {r.job_id: r.checkpoint_interval_us for r in state.cluster.runs.values()}
    assert runs == {"j1": 900_000_000, "j2": 1_200_000_000, "j3": None}


def test_a_tick_folded_grouped_by_emit_order_gives_the_state_its_emission_order_gave():
    """The audit and the chaos checks fold a tick's own events, spread over three topics, by
    ``emit_rank`` (the log keeps no order between topics): two nodes lost with their runs and a
    preemption in one tick, whose emission interleaves the kinds per node."""
    cfg = DispatchConfig(heartbeat_timeout_s=30)

    def before_tick() -> DispatchState:
        state = DispatchState(TREE)
        jobs = [
            submitted(j, budget="lab/b", user="bob", gpus=g, min_runtime_s=0) for j, g in (("u", 4), ("v", 4), ("w", 2))
        ]
        for e in (reg("n0"), reg("n1"), reg("n2", 2), *jobs):
            step(state, e, T0, cfg)
        step(state, Tick(T0), T0, cfg)  # u on n0, v on n1, w on n2
        step(state, ev.NodeHeartbeat(node_id="n0", ts=from_us(s(20)), event_id=ev.det_id("hb", "n0")), s(20), cfg)
        step(state, submitted("j", gpus=4, at=s(31)), s(31), cfg)
        return state

    live = before_tick()
    out = step(live, Tick(s(31)), s(31), cfg)  # n1 and n2 silent 31 s; j (lab/a) preempts u on n0
    assert types(out) == [
        "NodeLost:n1", "JobLost:v", "JobRequeued:v", "NodeLost:n2", "JobLost:w", "JobRequeued:w",
        "JobPreempted:u", "StopWorkload:u", "JobPlaced:j",
    ]  # fmt: skip
    grouped = sorted(out, key=lambda e: emit_rank(e.type))
    assert types(grouped)[:6] == [
        "NodeLost:n1",
        "NodeLost:n2",
        "JobLost:v",
        "JobLost:w",
        "JobRequeued:v",
        "JobRequeued:w",
    ]
    replay = before_tick()
    for e in grouped:
        evolve(replay, e)

    def seen(st: DispatchState) -> tuple:
        return (
            {j: (r.status, r.attempt) for j, r in st.jobs.items()},
            {b: [p.job_id for p in q] for b, q in st.pending.items() if q},
            {k: r.placements for k, r in st.cluster.runs.items()},
            {n: x.state for n, x in st.cluster.nodes.items()},
            sorted(st.stopping),
            st.ledger.occupancy_us(s(3600)),
            st.ledger.unallocated_us(s(3600)),
        )

    assert seen(replay) == seen(live)
    assert seen(live)[0] == {"u": ("stopping", 1), "v": ("pending", 2), "w": ("pending", 2), "j": ("running", 1)}
    # every kind the dispatcher makes has its place; other producers' kinds come after all of them
    assert [emit_rank(k) for k in ("NodeLost", "JobLost", "JobPreempted", "StartWorkload")] == [0, 1, 3, 7]
    assert emit_rank("NodeHeartbeat") == len(EMIT_ORDER)
