"""Checkpoints, work lost, preemption counts and node loss as folded state (rules D1.work-lost and D3.checkpoints).

Hand-computed cases for :func:`work_lost_gpu_s`, :func:`protection_s`, the
checkpoint fold of :class:`ClusterState` and the dispatcher's node-loss
handling. Times are µs from the builders' ``T0``.
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import (
    PROTECTION_CAP_W,
    PROTECTION_CHURN_BOUND,
    PROTECTION_DOUBLINGS,
    PROTECTION_UNTIL_DONE_S,
    ClusterState,
    protection_s,
    work_lost_gpu_s,
    work_ref_us,
)
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, evolve, step, wakeups
from apportion.domain.engine import order_key
from apportion.timeutil import from_us, to_us
from tests.kit.builders import T0, h, m, placed, preempted, requeued, s, started, submitted
from tests.kit.narrowing import narrow


def ckpt(job_id: str, at: int, progress_s: float, *, attempt: int = 1, replica: int | None = 0) -> ev.JobCheckpointed:
    return ev.JobCheckpointed(
        job_id=job_id,
        attempt=attempt,
        progress_s=progress_s,
        replica=replica,
        ts=from_us(at),
        event_id=ev.det_id("test-ckpt", job_id, attempt, replica, at),
    )


def fold(*events) -> ClusterState:
    cs = ClusterState()
    for e in events:
        cs.apply(e)
    return cs


# ---------------------------------------------------------------- work lost


def test_work_lost_counts_from_the_start_without_a_checkpoint():
    # 4 GPUs started at 1 h, stopped at 1.5 h: 4 * 1800 s = 7200 GPU-s
    cs = fold(placed("j", gpus=4, at=h(1)), started("j", at=h(1)))
    assert work_lost_gpu_s(cs.runs[("j", 1)], h(1.5)) == 7200.0


def test_work_lost_counts_from_the_last_checkpoint():
    # checkpoints at 1 h 10 min and 1 h 20 min: lost = 4 * 600 s at 1 h 30 min
    cs = fold(placed("j", gpus=4, at=h(1)), started("j", at=h(1)), ckpt("j", m(70), 600.0), ckpt("j", m(80), 1200.0))
    run = cs.runs[("j", 1)]
    assert run.checkpoint_us == m(80) and run.checkpoint_progress_s == 1200.0
    assert work_lost_gpu_s(run, m(90)) == 2400.0
    assert work_lost_gpu_s(run, m(80)) == 0.0 and work_lost_gpu_s(run, m(79)) == 0.0  # never negative


def test_a_gang_checkpoint_is_the_earliest_of_its_replicas_latest():
    # 2 x 2 GPUs; replica 0 checkpoints at 20 and 40 min, replica 1 only at 30 min
    evs = [placed("g", gpus=2, replicas=2, at=h(0)), started("g", at=h(0)), started("g", replica=1, node="n1", at=h(0))]
    cs = fold(*evs, ckpt("g", m(20), 1200.0), ckpt("g", m(40), 2400.0))
    assert cs.runs[("g", 1)].checkpoint_us is None  # replica 1 has none yet: counts from the start
    assert work_lost_gpu_s(cs.runs[("g", 1)], m(50)) == 4 * 3000.0
    cs.apply(ckpt("g", m(30), 1800.0, replica=1))
    run = cs.runs[("g", 1)]
    assert run.checkpoint_us == m(30) and run.checkpoint_progress_s == 1800.0
    assert work_lost_gpu_s(run, m(50)) == 4 * 1200.0  # since 30 min on all 4 GPUs
    assert cs.progress["g"] == 1800.0


def test_a_duplicate_or_older_checkpoint_changes_nothing():
    cs = fold(placed("j", at=h(0)), started("j", at=h(0)), ckpt("j", m(20), 1200.0))
    run = cs.runs[("j", 1)]
    cs.apply(ckpt("j", m(20), 1200.0))
    cs.apply(ckpt("j", m(10), 600.0))
    assert cs.runs[("j", 1)] is run


def test_progress_carries_over_to_the_next_attempt():
    cs = fold(
        placed("j", at=h(0)),
        started("j", at=h(0)),
        ckpt("j", m(30), 1800.0),
        preempted("j", at=h(1)),
        ckpt("j", h(1) + 10_000_000, 3590.0),  # SIGTERM's last checkpoint, while stopping
        requeued("j", at=h(1) + 30_000_000),
        placed("j", attempt=2, at=h(2)),
    )
    run = cs.runs[("j", 2)]
    assert run.resumed_from_s == 3590.0 and run.preemptions == 1
    assert cs.preemptions["j"] == 1


def test_the_job_leaves_the_per_job_tables_when_it_completes():
    cs = fold(placed("j", at=h(0)), started("j", at=h(0)), ckpt("j", m(30), 1800.0), preempted("j", at=h(1)))
    cs.apply(requeued("j", at=h(1)))
    cs.apply(placed("j", attempt=2, at=h(2)))
    cs.apply(ev.JobCompleted(job_id="j", attempt=2, ts=from_us(h(3))))
    assert "j" not in cs.preemptions and "j" not in cs.progress


def test_order_key_refers_to_the_later_of_start_and_checkpoint():
    # equal GPUs: the run checkpointed 5 min ago loses less than the one started 10 min ago
    cs = fold(
        placed("old", at=h(0)),
        started("old", at=h(0)),
        ckpt("old", m(55), 3300.0),
        placed("new", at=m(50)),
        started("new", at=m(50)),
    )
    old, new = cs.runs[("old", 1)], cs.runs[("new", 1)]
    assert work_ref_us(old) == m(55) and work_ref_us(new) == m(50)
    assert sorted([old, new], key=order_key) == [old, new]
    assert work_lost_gpu_s(old, h(1)) < work_lost_gpu_s(new, h(1))


# ---------------------------------------------------------------- protection


W7 = 7 * 86400.0  # a 7-day window, seconds
DOUBLE = None  # doublings=None: min_runtime x 2**p all the way to the cap (policies up to fairtree-4)

PROTECTION_CASES = [
    pytest.param(60.0, 0, None, None, DOUBLE, 60.0, id="first attempt: the minimum runtime"),
    pytest.param(60.0, 1, None, None, DOUBLE, 120.0, id="once preempted: doubled"),
    pytest.param(60.0, 5, None, None, DOUBLE, 1920.0, id="five times: 60 * 32"),
    pytest.param(60.0, 5, 600.0, None, DOUBLE, 600.0, id="capped by the budget's max_min_runtime"),
    pytest.param(3600.0, 8, None, W7, DOUBLE, 604800.0, id="2**8 h = 256 h capped by W (168 h of a 7-day window)"),
    pytest.param(7200.0, 5, None, W7, DOUBLE, 230400.0, id="2 h x 2**5 = 64 h: above W/4 (42 h), under W"),
    pytest.param(3600.0, 3, 1800.0, None, DOUBLE, 3600.0, id="a cap below min_runtime never shortens the promise"),
    pytest.param(0.0, 4, None, None, DOUBLE, 0.0, id="unallocated: no protection"),
    pytest.param(60.0, 10_000, None, 86400.0, DOUBLE, 86400.0, id="huge counts do not overflow (capped by W)"),
    # fairtree-5 (doublings=3, the default): x 1, 2, 4, 8 for the first three preemptions, then the cap
    pytest.param(7200.0, 0, None, W7, 3, 7200.0, id="fairtree-5, first attempt: 2 h"),
    pytest.param(7200.0, 3, None, W7, 3, 57600.0, id="fairtree-5, third preemption: 2 h x 8 = 16 h"),
    pytest.param(7200.0, 4, None, W7, 3, 604800.0, id="fairtree-5, fourth preemption: the cap, W = 168 h"),
    pytest.param(7200.0, 4, 36000.0, W7, 3, 36000.0, id="fairtree-5, the jump stops at max_min_runtime (10 h)"),
    pytest.param(7200.0, 9, None, W7, 3, 604800.0, id="fairtree-5, later preemptions: still the cap"),
    pytest.param(7200.0, 1, None, W7, 0, 604800.0, id="doublings 0: the cap from the first requeue"),
    pytest.param(0.0, 4, None, W7, 3, 0.0, id="fairtree-5, unallocated: no protection"),
]


@pytest.mark.parametrize("min_rt, n, max_rt, window, doublings, expected", PROTECTION_CASES)
def test_protection_s(min_rt, n, max_rt, window, doublings, expected):
    # the growth rule itself, with the cap W and no churn bound (policies fairtree-4 and fairtree-5), pinned here:
    # the defaults of fairtree-6 have their own table below
    assert protection_s(min_rt, n, max_rt, window, 1.0, doublings, None) == expected


UNTIL_DONE_H = 100 * 365 * 24.0  # PROTECTION_UNTIL_DONE_S in hours: 876,000 h

# fairtree-6, the defaults: 3 doublings, then the cap W / 4 (42 h of a 7-day window), and from the 5th preemption
# on protected until done. min_runtime 2 h, no max_min_runtime: 2 x 1, 2, 4, 8 h; p = 4 is past the doublings, so
# the cap, 604,800 s / 4 = 151,200 s = 42 h; p = 5 reaches the churn bound.
FAIRTREE_6 = [
    pytest.param(0, 2.0, id="first attempt: the minimum runtime, 2 h"),
    pytest.param(1, 4.0, id="once preempted: 2 h x 2"),
    pytest.param(2, 8.0, id="twice: 2 h x 4"),
    pytest.param(3, 16.0, id="three times: 2 h x 8, the last doubling"),
    pytest.param(4, 42.0, id="four times: past the doublings, the cap W / 4 = 42 h"),
    pytest.param(5, UNTIL_DONE_H, id="five times: the churn bound, protected until done"),
    pytest.param(6, UNTIL_DONE_H, id="six times (a replayed log): still until done"),
]


@pytest.mark.parametrize("n, hours", FAIRTREE_6)
def test_protection_s_defaults_are_fairtree_6(n, hours):
    assert (PROTECTION_DOUBLINGS, PROTECTION_CAP_W, PROTECTION_CHURN_BOUND) == (3, 0.25, 5)
    assert protection_s(7200.0, n, None, W7) / 3600.0 == hours


def test_protection_s_with_a_churn_bound_lasts_until_the_job_completes():
    # churn_bound 5 with the cap W (the tenth session's variant hard=5): attempts after 0-4 preemptions as without
    # it (2, 4, 8, 16 h, then the cap W = 168 h), and from the fifth preemption on protected until done (100 years)
    got = [protection_s(7200.0, n, None, W7, 1.0, churn_bound=5) / 3600.0 for n in range(7)]
    assert got == [2.0, 4.0, 8.0, 16.0, 168.0, 100 * 365 * 24.0, 100 * 365 * 24.0]
    assert PROTECTION_UNTIL_DONE_S == 3_153_600_000.0
    # a budget's max_min_runtime still caps it (10 h): the most the job could have declared at admission
    assert protection_s(7200.0, 5, 36000.0, W7, churn_bound=5) == 36000.0
    assert protection_s(7200.0, 5, 3600.0, W7, churn_bound=5) == 7200.0  # and never below min_runtime
    assert protection_s(0.0, 9, None, W7, churn_bound=5) == 0.0  # unallocated jobs keep no protection at all
    assert protection_s(7200.0, 9, None, W7, 1.0, churn_bound=None) == 604800.0  # no bound: the cap W (fairtree-5)


def test_a_run_protected_until_done_asks_for_no_wakeup():
    # a placement's wakeup is its protection's end; "until done" has none (the simulator would otherwise
    # jump its clock 100 years ahead)
    short = placed_with("a", 7200.0, min_runtime_s=7200.0)
    assert wakeups(short) == [to_us(short.ts) + 7_200_000_000]
    assert wakeups(placed_with("a", PROTECTION_UNTIL_DONE_S, min_runtime_s=7200.0)) == []


def test_protection_s_with_the_fairtree_3_cap_of_w_over_4():
    # logs decided before fairtree-4 recorded no protection_cap_w: read as 0.25, 42 h of a 7-day window
    # (and had no churn bound)
    assert protection_s(3600.0, 8, None, W7, 0.25, DOUBLE, None) == 151200.0
    assert protection_s(7200.0, 5, None, W7, 0.25, DOUBLE, None) == 151200.0
    assert protection_s(7200.0, 4, None, W7, 0.25, DOUBLE, None) == 115200.0  # 32 h: under either cap


def placed_with(job_id, protection_s_, **kw) -> ev.JobPlaced:
    e = placed(job_id, **kw)
    return e.model_copy(update={"decision": e.decision.model_copy(update={"protection_s": protection_s_})})


GANG_BOUNDARY = [
    # 2-replica gang, min_runtime 3600 s, protection 7200 s recorded; replicas start at 0 and 10 min:
    # protection runs from the LATEST start, 10 min, to 2 h 10 min.
    pytest.param(m(130) - 1, True, id="one µs before the end (from the latest start): protected"),
    pytest.param(m(130), False, id="exactly at the end: not protected"),
    pytest.param(m(120), True, id="the end counted from the first start: still protected"),
]


@pytest.mark.parametrize("at, protected", GANG_BOUNDARY)
def test_gang_protection_runs_from_the_latest_replica_start(at, protected):
    cs = fold(
        placed_with("g", 7200.0, gpus=2, replicas=2, at=h(0)),
        started("g", at=h(0)),
        started("g", replica=1, node="n1", at=m(10)),
    )
    run = cs.runs[("g", 1)]
    assert run.protected_until_us == m(130)
    assert run.protected(at) is protected


def test_a_record_without_protection_s_is_protected_for_min_runtime():
    cs = fold(placed("j", min_runtime_s=600.0, at=h(0)), started("j", at=h(0)))
    assert cs.runs[("j", 1)].protected_until_us == m(10)


# ---------------------------------------------------------------- dispatcher: counts, lost work, node loss

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 0.5, "members": ["alice"]}, "lab/b": 0.5})
CFG = DispatchConfig(heartbeat_timeout_s=None)


def reg(nid: str, gpus: int = 4) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=gpus, ts=from_us(T0), event_id=ev.det_id("reg", nid))


def types(out) -> list[str]:
    return [f"{e.type}:{getattr(e, 'job_id', getattr(e, 'node_id', ''))}" for e in out]


def test_requeued_job_carries_its_preemptions_and_progress_and_gets_a_longer_protection():
    # u (lab/b, allocated 60 s) runs from T0; checkpoint at 30 s; j (lab/a) preempts it at 1 h.
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=60)):
        step(state, e, T0, CFG)
    step(state, Tick(T0), T0, CFG)
    step(state, started("u", at=T0), T0, CFG)
    step(state, ckpt("u", s(30), 30.0), s(30), CFG)
    step(state, submitted("j", budget="lab/a", user="alice", gpus=4, min_runtime_s=60, at=h(1)), h(1), CFG)
    out = step(state, Tick(h(1)), h(1), CFG)
    assert types(out)[:3] == ["JobPreempted:u", "StopWorkload:u", "JobPlaced:j"]
    # work lost: 4 GPUs * (3600 - 30) s
    preempted_u, placed_j = narrow(ev.JobPreempted, out[0]), narrow(ev.JobPlaced, out[2])
    assert preempted_u.lost_gpu_s == 4 * 3570.0 and placed_j.decision.victims[0].lost_gpu_s == 4 * 3570.0
    step(state, Tick(h(1) + 30_000_000), h(1) + 30_000_000, CFG)  # grace over: requeued
    pj = state.pending["lab/b"][0]
    assert (pj.attempt, pj.preemptions, pj.progress_s) == (2, 1, 30.0)


def test_the_start_of_a_requeued_attempt_carries_the_saved_progress_and_the_interval_in_force():
    # u (lab/b, min runtime 60 s; no interval declared, then 45 s declared) runs on n0 from T0, checkpoints 90 s of
    # progress at 100 s; n0 is lost at 2 min: requeued at once, attempt 2 starts on n1 from 90 s of progress
    for declared, every in ((None, 60.0), (45.0, 45.0)):
        state = DispatchState(TREE)
        sub = submitted("u", budget="lab/b", gpus=4, min_runtime_s=60, duration_s=600.0)
        if declared is not None:
            sub = sub.model_copy(update={"checkpoint_interval_s": declared})
        for e in (reg("n0"), sub):
            step(state, e, T0, CFG)
        out = step(state, Tick(T0), T0, CFG)
        (first,) = [narrow(ev.StartWorkload, e) for e in out if isinstance(e, ev.StartWorkload)]
        assert (first.node_id, first.attempt, first.progress_s, first.checkpoint_interval_s) == ("n0", 1, 0.0, every)
        step(state, started("u", at=T0), T0, CFG)
        step(state, ckpt("u", s(100), 90.0), s(100), CFG)
        step(state, reg("n1"), s(110), CFG)
        out = step(state, ev.NodeLost(node_id="n0", last_heartbeat=from_us(m(1)), ts=from_us(m(2))), m(2), CFG)
        assert types(out) == ["JobLost:u", "JobRequeued:u"]
        out = step(state, Tick(m(2)), m(2), CFG)
        (second,) = [narrow(ev.StartWorkload, e) for e in out if isinstance(e, ev.StartWorkload)]
        assert (second.node_id, second.attempt, second.progress_s, second.checkpoint_interval_s) == (
            "n1",
            2,
            90.0,
            every,
        )
        assert second.duration_s == 600.0  # the job's whole work: the agent runs 600 - 90 s of it


def test_node_loss_gives_surviving_gang_replicas_the_normal_grace_then_requeues():
    cfg = DispatchConfig(heartbeat_timeout_s=None)
    state = DispatchState(TREE)
    for e in (reg("n0"), reg("n1"), submitted("g", budget="lab/b", gpus=4, replicas=2, min_runtime_s=60)):
        step(state, e, T0, cfg)
    step(state, Tick(T0), T0, cfg)
    for r, n in ((0, "n0"), (1, "n1")):
        step(state, started("g", replica=r, node=n, at=T0), T0, cfg)
    lost = ev.NodeLost(node_id="n0", last_heartbeat=from_us(m(10)), ts=from_us(m(11)))
    out = step(state, lost, m(11), cfg)
    assert types(out) == ["JobLost:g", "StopWorkload:g"]  # no requeue yet: the survivor is stopping
    job_lost, stop = narrow(ev.JobLost, out[0]), narrow(ev.StopWorkload, out[1])
    assert job_lost.lost_gpu_s == 8 * 600.0  # 8 GPUs, 10 min to the last heartbeat
    assert stop.node_id == "n1" and stop.grace_s == 30.0
    # the survivor's GPUs stay held while it stops; n0's are free
    assert state.cluster.nodes["n1"].free == frozenset() and state.jobs["g"].status == "stopping"
    assert step(state, Tick(m(11) + 29_000_000), m(11) + 29_000_000, cfg) == []
    out = step(state, Tick(m(11) + 30_000_000), m(11) + 30_000_000, cfg)
    assert types(out)[0] == "JobRequeued:g" and narrow(ev.JobRequeued, out[0]).attempt == 2


def test_node_loss_requeue_follows_the_survivors_exit_report():
    state = DispatchState(TREE)
    for e in (reg("n0"), reg("n1"), submitted("g", budget="lab/b", gpus=4, replicas=2, min_runtime_s=60)):
        step(state, e, T0, CFG)
    step(state, Tick(T0), T0, CFG)
    step(state, ev.NodeLost(node_id="n0", last_heartbeat=from_us(m(10)), ts=from_us(m(11))), m(11), CFG)
    report = ev.JobFailed(job_id="g", attempt=1, replica=1, exit_code=-15, ts=from_us(m(11) + 5_000_000))
    out = step(state, report, m(11) + 5_000_000, CFG)
    assert types(out) == ["JobRequeued:g"]
    assert state.cluster.nodes["n1"].free == frozenset(range(4))


def test_node_loss_of_a_single_node_run_requeues_at_once():
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("j", budget="lab/b", gpus=4, min_runtime_s=60)):
        step(state, e, T0, CFG)
    step(state, Tick(T0), T0, CFG)
    out = step(state, ev.NodeLost(node_id="n0", last_heartbeat=from_us(m(1)), ts=from_us(m(2))), m(2), CFG)
    assert types(out) == ["JobLost:j", "JobRequeued:j"]


def test_a_checkpoint_moves_a_run_in_the_kept_victim_index_as_a_rebuild_would():
    from apportion.domain.engine import VictimIndex

    cs = fold(
        ev.NodeRegistered(node_id="n0", gpu_count=8, ts=from_us(T0)),
        placed("u1", allocated=False, at=h(0)),
        started("u1", at=h(0)),
        placed("u2", allocated=False, at=h(1)),
        started("u2", at=h(1)),
    )
    idx = VictimIndex().sync(cs)
    order = [r.job_id for _, r, _ in idx.unalloc["n0"]]
    assert order == ["u2", "u1"]  # u2 started later: less work lost
    cs.apply(ckpt("u1", h(2), 7200.0))  # u1 saved its work at 2 h: now it loses less
    idx.sync(cs)
    assert [r.job_id for _, r, _ in idx.unalloc["n0"]] == ["u1", "u2"]
    assert idx.as_lists() == VictimIndex.build(cs.runs).as_lists()


def test_drain_records_the_work_lost():
    state = DispatchState(TREE)
    for e in (reg("n0"), submitted("u", budget="lab/b", gpus=4, min_runtime_s=0)):
        step(state, e, T0, CFG)
    step(state, Tick(T0), T0, CFG)
    step(state, started("u", at=T0), T0, CFG)
    step(state, ckpt("u", m(20), 1200.0), m(20), CFG)
    out = step(state, ev.NodeDrainRequested(node_id="n0", ts=from_us(m(30))), m(30), CFG)
    assert types(out)[:1] == ["JobPreempted:u"] and narrow(ev.JobPreempted, out[0]).reason == "drain"
    assert narrow(ev.JobPreempted, out[0]).lost_gpu_s == 4 * 600.0  # 10 min on 4 GPUs since the checkpoint


def test_a_lost_gangs_grace_replays_from_the_jobs_topic_alone():
    """The dispatcher does not read the commands topic back: a state recovered from the other
    topics (no StopWorkload) must still wait the grace period before requeueing."""
    state = DispatchState(TREE)
    log: list[ev.Event] = []
    for e in (reg("n0"), reg("n1"), submitted("g", budget="lab/b", gpus=4, replicas=2, min_runtime_s=60)):
        log += [e, *step(state, e, T0, CFG)]
    log += step(state, Tick(T0), T0, CFG)
    lost = ev.NodeLost(node_id="n0", last_heartbeat=from_us(m(10)), ts=from_us(m(11)))
    log += [lost, *step(state, lost, m(11), CFG)]
    recovered = DispatchState(TREE)
    for logged in log:
        if not isinstance(logged, (ev.StartWorkload, ev.StopWorkload)):
            recovered = evolve(recovered, logged)
    assert step(recovered, Tick(m(11) + 29_000_000), m(11) + 29_000_000, CFG) == []
    out = step(recovered, Tick(m(11) + 30_000_000), m(11) + 30_000_000, CFG)
    assert types(out)[0] == "JobRequeued:g"


# EngineConfig.progress_after (a measured variant of D3.bounded-churn, off by default): from the given preemption on
# the protection is at least the checkpointed progress, under the same caps. Defaults otherwise (3 doublings, W / 4 =
# 42 h of a 7-day window, churn bound 5); min_runtime 2 h, so the doubled protection is 2 h x 2**n.
PROGRESS_FLOOR = [
    pytest.param(0, 1, 30.0, 2.0, id="first attempt: the minimum runtime, whatever the progress"),
    pytest.param(1, 1, 30.0, 30.0, id="once preempted after 30 h of work: 30 h, not 2 h x 2 = 4 h"),
    pytest.param(1, 1, 3.0, 4.0, id="once preempted after 3 h of work: the doubling (4 h) is longer"),
    pytest.param(1, 1, 100.0, 42.0, id="100 h of work: capped at W / 4 = 42 h"),
    pytest.param(2, 1, 20.0, 20.0, id="twice preempted after 20 h: 20 h, not 2 h x 4 = 8 h"),
    pytest.param(1, 2, 30.0, 4.0, id="from the second preemption on: once preempted, the doubling"),
    pytest.param(2, 2, 30.0, 30.0, id="from the second preemption on: twice preempted, the progress"),
    pytest.param(5, 1, 30.0, UNTIL_DONE_H, id="the churn bound still applies: until done"),
    pytest.param(1, None, 30.0, 4.0, id="off (the default): the doubling"),
]


@pytest.mark.parametrize("n, after, progress_h, hours", PROGRESS_FLOOR)
def test_protection_s_at_least_the_progress_saved(n, after, progress_h, hours):
    got = protection_s(7200.0, n, None, W7, progress_after=after, progress_s=progress_h * 3600.0)
    assert got / 3600.0 == hours


def test_protection_s_progress_floor_keeps_the_budget_cap_and_skips_unallocated_jobs():
    # a budget max_min_runtime of 10 h caps the floor too; an unallocated job (min_runtime 0) has no protection
    assert protection_s(7200.0, 1, 36000.0, W7, progress_after=1, progress_s=30 * 3600.0) == 36000.0
    assert protection_s(0.0, 1, None, W7, progress_after=1, progress_s=30 * 3600.0) == 0.0


# EngineConfig.at_share_bound (a measured variant of D3.bounded-churn, off by default): a job whose budget's r is at
# most 1 when placed is protected until done from at_share_bound preemptions on; over its share it keeps the churn
# bound 5. Defaults otherwise: min_runtime 2 h, doublings 2, 4, 8, 16 h, then W / 4 = 42 h.
AT_SHARE = [
    pytest.param(3, 0.5, UNTIL_DONE_H, id="under its share, preempted 3 times: until done"),
    pytest.param(3, 1.0, UNTIL_DONE_H, id="exactly at its share (r = 1): until done"),
    pytest.param(3, 1.01, 16.0, id="over its share (r = 1.01), 3 times: 2 h x 8, the bound is still 5"),
    pytest.param(4, 1.5, 42.0, id="over its share, 4 times: the cap W / 4"),
    pytest.param(5, 1.5, UNTIL_DONE_H, id="over its share, 5 times: the churn bound 5"),
    pytest.param(2, 0.5, 8.0, id="under its share, twice: 2 h x 4, before the bound"),
    pytest.param(3, None, 16.0, id="r unknown: as over its share"),
]


@pytest.mark.parametrize("n, ratio, hours", AT_SHARE)
def test_protection_s_churn_bound_at_or_under_share(n, ratio, hours):
    assert protection_s(7200.0, n, None, W7, at_share_bound=3, ratio=ratio) / 3600.0 == hours


def test_protection_s_at_share_bound_never_raises_the_churn_bound():
    # a bound above churn_bound changes nothing (5 stays); with no churn bound at all it is the only one
    assert protection_s(7200.0, 5, None, W7, at_share_bound=7, ratio=0.5) == PROTECTION_UNTIL_DONE_S
    assert protection_s(7200.0, 6, None, W7, at_share_bound=7, ratio=0.5) == PROTECTION_UNTIL_DONE_S
    assert protection_s(7200.0, 6, None, W7, churn_bound=None, at_share_bound=7, ratio=0.5) == 151200.0
    assert protection_s(7200.0, 7, None, W7, churn_bound=None, at_share_bound=7, ratio=0.5) == PROTECTION_UNTIL_DONE_S
    # off (the default): r does not matter
    assert protection_s(7200.0, 3, None, W7, ratio=0.5) == 57600.0


# EngineConfig.grow_over_share = False (rule D3.bounded-churn, the policy since fairtree-10): only a job whose
# budget's r is at most 1 when placed has its protection grown (2 h x 2, 4, 8, 16, then W / 4 = 42 h); over its share
# (or r unknown) it is its minimum runtime, 2 h, until the churn bound 5 protects it until done.
NO_GROW_OVER = [
    pytest.param(1, 1.0, 4.0, id="exactly at its share (r = 1), once: grows to 2 h x 2"),
    pytest.param(3, 1.0, 16.0, id="at its share, 3 times: 2 h x 8"),
    pytest.param(4, 0.5, 42.0, id="under its share, 4 times: the cap W / 4"),
    pytest.param(1, 1.0001, 2.0, id="just over its share (r = 1.0001), once: the minimum runtime"),
    pytest.param(4, 3.0, 2.0, id="over its share, 4 times: still the minimum runtime"),
    pytest.param(3, None, 2.0, id="r unknown: as over its share"),
    pytest.param(5, 3.0, UNTIL_DONE_H, id="over its share, 5 times: the churn bound still applies"),
    pytest.param(0, 3.0, 2.0, id="never preempted: the minimum runtime either way"),
]


@pytest.mark.parametrize("n, ratio, hours", NO_GROW_OVER)
def test_protection_s_grows_only_at_or_under_share(n, ratio, hours):
    assert protection_s(7200.0, n, None, W7, ratio=ratio, grow_over_share=False) / 3600.0 == hours


def test_protection_s_grow_over_share_on_grows_every_job():
    # on (this function's default, for a caller that knows no ratio; the policy up to fairtree-9): r does not
    # matter, 2 h x 8 = 16 h over its share as under it
    assert protection_s(7200.0, 3, None, W7, ratio=3.0) == protection_s(7200.0, 3, None, W7, ratio=0.5) == 57600.0
