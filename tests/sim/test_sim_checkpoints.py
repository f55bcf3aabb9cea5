"""Checkpoints in the simulator and the work lost measured from the log (rules D1.work-lost and D3.checkpoints).

One scenario throughout, on one node of 4 GPUs (tree: ``lab`` -> ``a`` 0.5, ``b`` 0.5)::

    a1  lab/a  4 GPUs  min runtime 1 h  (checkpoint interval: the default, 1 h)  5 h of work, at 0:00
    b1  lab/b  4 GPUs  min runtime 1 h  1 h of work, at 2:30

a1's protection ended at 1:00 and lab/a is far ahead of lab/b, so b1 preempts
a1 at 2:30:00; a1 exits 5 s later (fixed stop delay), b1 runs 2:30:05-3:30:05,
then a1's second attempt resumes from its last checkpoint.
"""

from __future__ import annotations

import pytest

from apportion.events import JobCheckpointed, JobCompleted, JobPreempted, StartWorkload, encode
from apportion.report import JobLedger
from apportion.sim.core import SimJob, SimResult
from apportion.sim.report import summarise
from apportion.timeutil import US_PER_S, to_us
from tests.kit.simkit import _off, at, decisions, job, nodes, run

pytestmark = pytest.mark.sim

H = 3600.0
AB_TREE = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}


def scenario(**kw) -> SimResult:
    return run(
        AB_TREE,
        nodes(("n0", 4)),
        [
            job("a1", "lab/a", gpus=4, min_runtime_s=H, duration_s=5 * H),
            job("b1", "lab/b", gpus=4, submit=at(2, 30), min_runtime_s=H, duration_s=H),
        ],
        **kw,
    )


def checkpoints(r) -> list[tuple[str, str, float]]:
    """(time offset, job#attempt, progress s) of every JobCheckpointed."""
    return [
        (decisions_time(e), f"{e.job_id}#{e.attempt}", e.progress_s) for e in r.log if isinstance(e, JobCheckpointed)
    ]


def decisions_time(e) -> str:
    return _off(to_us(e.ts))


def completed_at(r, job_id: str) -> str:
    (e,) = [e for e in r.log if isinstance(e, JobCompleted) and e.job_id == job_id]
    return decisions_time(e)


def test_preempted_job_resumes_from_its_last_checkpoint():
    r = scenario()
    assert decisions(r) == [
        "00:00:00 JobPlaced a1#1 n0[0, 1, 2, 3]",
        "00:00:00 StartWorkload a1#1 n0",
        "02:30:00 JobPreempted a1#1 expired_behind by=b1",
        "02:30:00 StopWorkload a1#1 n0",
        "02:30:00 JobPlaced b1#1 n0[0, 1, 2, 3] victims=a1#1",
        "02:30:05 JobRequeued a1#2",
        "02:30:05 StartWorkload b1#1 n0",
        # queued 1 h ago (reservation_after): placed as the cycle's reservation holder
        "03:30:05 JobPlaced a1#2 n0[0, 1, 2, 3] reserved",
        "03:30:05 StartWorkload a1#2 n0",
    ]
    # every hour of a1's progress, counted across attempts; none at the very end (it completes instead)
    assert checkpoints(r) == [
        ("01:00:00", "a1#1", 3600.0),
        ("02:00:00", "a1#1", 7200.0),
        ("04:30:05", "a1#2", 3 * H),  # attempt 2 starts at progress 2 h: its first checkpoint is 1 h later
        ("05:30:05", "a1#2", 4 * H),
    ]
    # attempt 2 runs the 5 h - 2 h checkpointed = 3 h left
    assert completed_at(r, "a1") == "06:30:05"
    (stop,) = r.jobs_ledger.stops
    assert (stop.job_id, stop.attempt, stop.reason, stop.gpus) == ("a1", 1, "preempted", 4)
    assert stop.at_us - at(2) == 30 * 60 * US_PER_S  # marked at its 2:00 checkpoint, stopped at 2:30
    assert stop.lost_gpu_s == 4 * 1800.0
    assert r.violations == []


def test_checkpoint_on_stop_saves_the_work_up_to_the_sigterm():
    r = scenario(checkpoint_on_stop="all")
    # a1 saves 2.5 h of progress when it exits (5 s into its 30 s grace); nothing is lost
    assert checkpoints(r) == [
        ("01:00:00", "a1#1", 3600.0),
        ("02:00:00", "a1#1", 7200.0),
        ("02:30:05", "a1#1", 2.5 * H),
        ("04:00:05", "a1#2", 3 * H),  # the next multiple of the interval, 0.5 h into attempt 2
        ("05:00:05", "a1#2", 4 * H),
    ]
    assert completed_at(r, "a1") == "06:00:05"  # 3:30:05 + 2.5 h
    (stop,) = r.jobs_ledger.stops
    assert stop.lost_gpu_s == 0.0


def test_without_checkpoints_a_requeued_job_restarts_from_scratch():
    r = scenario(checkpoints=False)
    assert checkpoints(r) == []
    assert completed_at(r, "a1") == "08:30:05"  # 3:30:05 + the whole 5 h
    (stop,) = r.jobs_ledger.stops
    assert stop.lost_gpu_s == 4 * 2.5 * H


def test_unallocated_job_without_a_declared_interval_never_checkpoints_but_a_declared_one_does():
    def unalloc(interval: float | None) -> SimJob:
        return SimJob("u1", "lab/a", "u", at(0), 4, 1, 0.0, 3 * H, None, interval)

    r = run(AB_TREE, nodes(("n0", 4)), [unalloc(None)])
    assert checkpoints(r) == []
    r = run(AB_TREE, nodes(("n0", 4)), [unalloc(1800.0)])
    assert [c[2] for c in checkpoints(r)] == [1800.0 * k for k in range(1, 6)]


def test_goodput_and_the_new_columns_of_the_scenario_by_hand():
    r = scenario()
    rep = summarise(r, _tree(), "fairshare", 1)
    # measured span = first to last submission, [0:00, 2:30]: a1 held the 4 GPUs throughout (36,000
    # GPU-s of 36,000) and lost the 30 min since its 2:00 checkpoint at 2:30 (7,200 GPU-s)
    assert rep.utilisation == 1.0
    assert rep.goodput == pytest.approx((36_000 - 7_200) / 36_000)
    # whole run: held = a1#1 0:00-2:30:00, b1 2:30:00 (placed) - 3:30:05, a1#2 3:30:05-6:30:05, 4 GPUs each
    runs_s = 9000 + 3605 + 10800
    assert rep.held_gpu_h == pytest.approx(4 * runs_s / 3600)
    assert rep.lost_gpu_h == pytest.approx(2.0)
    assert rep.lost_pct == pytest.approx(100 * 7200 / (4 * runs_s))
    assert (rep.completed, rep.unfinished, rep.max_preemptions_per_job, rep.checkpoints) == (2, 0, 1, 4)
    assert rep.max_preemptions_allocated == 1  # a1 is allocated
    assert (rep.jct_p50_s, rep.jct_p95_s) == (3605.0, 23405.0)  # b1 2:30:00 -> 3:30:05; a1 0:00 -> 6:30:05
    assert rep.preemptions_per_job_hour == pytest.approx(1 / (runs_s / 3600))
    a, b = rep.budgets
    assert (a.path, a.lost_gpu_h, a.completed, a.max_preemptions_per_job, a.jct_p50_s) == ("lab/a", 2.0, 1, 1, 23405.0)
    assert (b.path, b.lost_gpu_h, b.completed, b.preemptions, b.goodput) == ("lab/b", 0.0, 1, 0, 0.0)
    assert a.goodput == pytest.approx(rep.goodput)


def test_the_log_fold_gives_what_the_live_fold_gave():
    r = scenario(checkpoint_on_stop="all", stop_delay_s=None, seed=7)
    again = JobLedger().apply_all(r.log)
    live = r.jobs_ledger
    assert [(s.job_id, s.attempt, s.at_us, s.mark_us, s.gpus) for s in again.stops] == [
        (s.job_id, s.attempt, s.at_us, s.mark_us, s.gpus) for s in live.stops
    ]
    assert (again.completed, again.preempted, again.checkpoints) == (live.completed, live.preempted, live.checkpoints)


def test_recorded_lost_gpu_s_agrees_with_the_log():
    # the domain fills JobPreempted.lost_gpu_s; the log's own figure must agree with it
    r = scenario()
    for recorded, disagree in ((7200.0, 0), (7000.0, 1)):
        log = [e.model_copy(update={"lost_gpu_s": recorded}) if isinstance(e, JobPreempted) else e for e in r.log]
        led = JobLedger().apply_all(log)
        assert len(led.disagreements()) == disagree
    # and whatever the engine records in a contended run agrees with the log (vacuous until it records it)
    for s in scenario().jobs_ledger.stops:
        if s.recorded_lost_gpu_s is not None:
            assert s.recorded_lost_gpu_s == pytest.approx(s.lost_gpu_s, abs=1.0)


def test_node_loss_loses_the_work_since_the_last_checkpoint_up_to_the_last_heartbeat():
    # a1 (4 GPUs, 3 h, checkpoint every hour) on n0; n0 dies silently at 1:30:00. Heartbeats every 10 s:
    # the last is 1:29:50, so the run is charged (and loses work) up to then: 4 x 1,790 GPU-s since 1:00.
    r = run(
        AB_TREE,
        nodes(("n0", 4), ("n1", 4)),
        [job("a1", "lab/a", gpus=4, min_runtime_s=H, duration_s=3 * H)],
        heartbeat_s=10.0,
        node_failures=(("n0", at(1, 30)),),
        until_us=at(6),  # heartbeats keep a run going: stop the clock
    )
    (stop,) = r.jobs_ledger.stops
    assert (stop.reason, stop.at_us, stop.mark_us) == ("node lost", at(1, 29, 50), at(1))
    assert stop.lost_gpu_s == 4 * 1790.0
    # the second attempt resumes from the 1 h checkpoint: 2 h more
    (start2,) = [to_us(e.ts) for e in r.log if isinstance(e, StartWorkload) and e.attempt == 2]
    (done,) = [to_us(e.ts) for e in r.log if isinstance(e, JobCompleted)]
    assert done - start2 == 2 * 3600 * US_PER_S


def test_same_seed_gives_a_byte_identical_log_with_checkpoints():
    def full_log() -> bytes:
        r = scenario(checkpoint_on_stop="all", stop_delay_s=None, seed=3)
        return b"\n".join(encode(e) for e in r.log)

    assert full_log() == full_log()


def _tree():
    from apportion.domain.budgets import BudgetTree

    return BudgetTree.from_mapping(AB_TREE)


def test_log_report_and_simulator_report_give_the_same_per_budget_work_figures():
    from apportion.audit.report import log_report

    r = scenario()
    sim = summarise(r, _tree(), "fairshare", 1)
    log = log_report(r.log, _tree(), r.start_us, r.end_us + 1)
    fields = ("path", "lost_gpu_h", "completed", "jct_p50_s", "jct_p95_s", "preemptions", "max_preemptions_per_job")
    assert [[getattr(b, f) for f in fields] for b in log.budgets] == [
        [getattr(b, f) for f in fields] for b in sim.budgets
    ]
    assert (log.lost_gpu_h, log.completed, log.held_gpu_h) == (sim.lost_gpu_h, sim.completed, sim.held_gpu_h)
    # the log report measures goodput over its whole span: (held - lost) / capacity
    assert log.goodput == pytest.approx((log.held_gpu_h - log.lost_gpu_h) * 3600 / log.capacity_gpu_s)
    assert type(log.budgets[0]) is type(sim.budgets[0])


def test_max_preemptions_allocated_leaves_out_unallocated_victims():
    # u1 (unallocated, 4 GPUs) runs from 0:00; a1 (allocated, 4 GPUs, 1 h) comes at 1:00 and preempts it
    jobs = [
        SimJob("u1", "lab/a", "u", at(0), 4, 1, 0.0, 3 * H, None, None),
        SimJob("a1", "lab/b", "u", at(1), 4, 1, 3600.0, 2 * H, None, None),
    ]
    rep = summarise(run(AB_TREE, nodes(("n0", 4)), jobs), _tree(), "fairshare", 1)
    assert (rep.max_preemptions_per_job, rep.max_preemptions_allocated, rep.completed) == (1, 0, 2)


def starts(r) -> list[tuple[str, str, float | None, float | None]]:
    """(time offset, job#attempt, progress_s, checkpoint_interval_s) of every StartWorkload."""
    return [
        (decisions_time(e), f"{e.job_id}#{e.attempt}", e.progress_s, e.checkpoint_interval_s)
        for e in r.log
        if isinstance(e, StartWorkload)
    ]


@pytest.mark.parametrize(
    "on_stop, a1_resumes_from",
    [("unallocated", 2 * H), ("all", 2.5 * H)],  # a1 is allocated: "all" adds its SIGTERM save of 2:30
)
def test_start_workload_carries_the_saved_progress_and_the_interval_in_force(on_stop, a1_resumes_from):
    # b1's start waits for its victim's exit (the dispatcher's _start_waiting), a1#2's comes from a cycle
    assert starts(scenario(checkpoint_on_stop=on_stop)) == [
        ("00:00:00", "a1#1", 0.0, H),  # interval: the minimum runtime (none declared)
        ("02:30:05", "b1#1", 0.0, H),
        ("03:30:05", "a1#2", a1_resumes_from, H),
    ]
