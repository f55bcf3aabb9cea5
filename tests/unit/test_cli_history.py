"""apportion history: the fold of a job's log into sacct-like rows (pure; times by hand)."""

from __future__ import annotations

import pytest

from apportion.cli.history import fold_jobs
from tests.unit.builders import (
    cancelled,
    completed,
    dt,
    failed,
    job_lost,
    placed,
    preempted,
    requeued,
    s,
    started,
    submitted,
)


def test_completed_job_wait_run_time_and_gpu_hours() -> None:
    #  submitted at 0, started at 30 s, ran 3570 s on 2 GPUs: wait 30 s, 1.9833 GPU-h
    [job] = fold_jobs(
        [
            submitted("j", gpus=2, at=s(0)),
            placed("j", gpus=2, at=s(29)),
            started("j", at=s(30)),
            completed("j", replica=0, at=s(3600)),
        ]
    ).values()
    assert (job.state, job.attempts, job.preemptions, job.wait_s, job.run_s) == ("completed", 1, 0, 30.0, 3570.0)
    assert job.gpu_hours == pytest.approx(2 * 3570 / 3600)
    assert job.lost_gpu_s is None  # the log never recorded a loss


def test_preempted_requeued_then_completed_counts_both_attempts_and_the_work_lost() -> None:
    #  attempt 1 runs 100..700 (600 s), preempted losing 200 GPU-s; attempt 2 runs 800..1000 (200 s)
    pre = preempted("j", at=s(700)).model_copy(update={"lost_gpu_s": 200.0})
    [job] = fold_jobs(
        [
            submitted("j", at=s(0)),
            placed("j", at=s(100)),
            started("j", at=s(100)),
            pre,
            failed("j", replica=0, at=s(710)),  # the stopped replica: not the end of the job
            requeued("j", attempt=2, submitted_at=s(0), at=s(710)),
            placed("j", attempt=2, at=s(800)),
            started("j", attempt=2, at=s(800)),
            completed("j", attempt=2, replica=0, at=s(1000)),
        ]
    ).values()
    assert (job.state, job.attempts, job.preemptions) == ("completed", 2, 1)
    assert (job.wait_s, job.run_s, job.lost_gpu_s) == (100.0, 800.0, 200.0)


def test_gang_completes_only_when_every_replica_has() -> None:
    evs = [
        submitted("g", gpus=8, replicas=2, at=s(0)),
        placed("g", gpus=8, replicas=2, nodes=["n0", "n1"], at=s(0)),
        started("g", replica=0, node="n0", at=s(10)),
        started("g", replica=1, node="n1", at=s(11)),
        completed("g", replica=0, at=s(100)),
    ]
    assert fold_jobs(evs)["g"].state == "running"
    job = fold_jobs([*evs, completed("g", replica=1, at=s(110))])["g"]
    assert (job.state, job.run_s, job.ended_at) == ("completed", 100.0, dt(s(110)))
    assert job.gpu_hours == pytest.approx(16 * 100 / 3600)


@pytest.mark.parametrize(
    ("tail", "state"),
    [
        pytest.param([cancelled("j", at=s(50))], "cancelled", id="cancelled while running"),
        pytest.param([failed("j", replica=0, at=s(50))], "failed", id="single replica failed"),
        pytest.param([job_lost("j", charged_until=s(40), at=s(50))], "running", id="lost: requeue comes next"),
    ],
)
def test_terminal_states(tail: list, state: str) -> None:
    job = fold_jobs([submitted("j", at=s(0)), placed("j", at=s(0)), started("j", at=s(10)), *tail])["j"]
    assert job.state == state


def test_lost_run_is_charged_to_its_last_heartbeat_and_duplicates_fold_once() -> None:
    lost = job_lost("j", charged_until=s(40), at=s(90)).model_copy(update={"lost_gpu_s": 30.0})
    evs = [submitted("j", at=s(0)), placed("j", at=s(0)), started("j", at=s(10)), lost, lost]
    job = fold_jobs(evs)["j"]
    assert (job.run_s, job.lost_gpu_s) == (30.0, 30.0)


def test_events_of_unknown_jobs_are_ignored() -> None:
    assert fold_jobs([started("ghost", at=s(1)), completed("ghost", at=s(2))]) == {}


def test_a_refused_resubmission_of_the_id_leaves_the_running_job_as_it_was() -> None:
    from apportion import events as ev

    dup = ev.JobRejected(
        job_id="j",
        budget="lab/a",
        user="eve",
        reason=ev.RejectReason.DUPLICATE_JOB,
        message="job j exists",
        ts=dt(s(60)),
        producer="dispatcher",
    )
    [job] = fold_jobs(
        [submitted("j", gpus=2, at=s(0)), placed("j", gpus=2, at=s(29)), started("j", at=s(30)), dup]
    ).values()
    assert job.state == "running"
