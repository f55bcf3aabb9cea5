"""``apportion.report.JobLedger`` on hand-written logs: work lost, gangs, SIGTERM checkpoints, completions.

Every log is one gang ``g1`` of 2 replicas x 4 GPUs on n0 and n1 (8 GPUs),
placed at 0:00 and started at 0:01 unless stated; times are offsets from T0.
"""

from __future__ import annotations

import pytest

from apportion.events import (
    Decision,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobStarted,
    JobSubmitted,
    Placement,
)
from apportion.report import JobLedger
from apportion.timeutil import from_us
from tests.kit.simkit import T0, at

pytestmark = pytest.mark.sim


def ts(t: int) -> dict:
    return {"ts": from_us(t), "producer": "test"}


def gang(attempt: int = 1, placed: int = T0, started: int | None = at(0, 1)) -> list:
    evs: list = []
    if attempt == 1:
        evs.append(
            JobSubmitted(
                **ts(T0),
                job_id="g1",
                budget="lab/a",
                user="u",
                gpus_per_replica=4,
                replicas=2,
                min_runtime_s=3600,
                duration_s=36000,
                submitted_at=from_us(T0),
            )
        )
    evs.append(
        JobPlaced(
            **ts(placed),
            job_id="g1",
            attempt=attempt,
            budget="lab/a",
            allocated=True,
            gpus_per_replica=4,
            replicas=2,
            min_runtime_s=3600,
            placements=(Placement(node_id="n0", gpus=(0, 1, 2, 3)), Placement(node_id="n1", gpus=(0, 1, 2, 3))),
            submitted_at=from_us(T0),
            decision=Decision(rank=0, budget_rank=0, ratio=0.0),
        )
    )
    if started is not None:
        evs += [JobStarted(**ts(started), job_id="g1", attempt=attempt, replica=r, node_id=f"n{r}") for r in (0, 1)]
    return evs


def ckpt(t: int, progress: float, replica: int | None = None, attempt: int = 1) -> JobCheckpointed:
    return JobCheckpointed(**ts(t), job_id="g1", attempt=attempt, progress_s=progress, replica=replica)


def preempted(t: int, attempt: int = 1, **kw) -> JobPreempted:
    return JobPreempted(**ts(t), job_id="g1", attempt=attempt, budget="lab/a", allocated=True, **kw)


def lost_of(log: list) -> list[float]:
    return [s.lost_gpu_s for s in JobLedger().apply_all(log).stops]


CASES = {
    "no checkpoint: since the latest replica start (0:01)": (gang() + [preempted(at(1, 1))], [8 * 3600.0]),
    "whole-run checkpoint at 0:31": (gang() + [ckpt(at(0, 31), 1800), preempted(at(1, 1))], [8 * 1800.0]),
    # a gang's checkpoint is the oldest of its replicas' latest ones, once every replica reported
    "replica checkpoints 0:31 and 0:46: the gang's is 0:31": (
        gang() + [ckpt(at(0, 31), 1800, 0), ckpt(at(0, 46), 2700, 1), preempted(at(1, 1))],
        [8 * 1800.0],
    ),
    "only one replica checkpointed: none for the gang": (
        gang() + [ckpt(at(0, 31), 1800, 0), preempted(at(1, 1))],
        [8 * 3600.0],
    ),
    "checkpoint on SIGTERM (after the stop, same attempt): nothing lost": (
        gang() + [ckpt(at(0, 31), 1800), preempted(at(1, 1)), ckpt(at(1, 1, 20), 3600)],
        [0.0],
    ),
    "stopped before it started: since its placement": (
        gang(started=None) + [preempted(at(0, 0, 30))],
        [8 * 30.0],
    ),
    "node lost: up to the last heartbeat": (
        gang()
        + [
            ckpt(at(0, 31), 1800),
            JobLost(**ts(at(2)), job_id="g1", attempt=1, node_id="n0", charged_until=from_us(at(1, 1))),
        ],
        [8 * 1800.0],
    ),
    "a failure is not work lost": (
        gang() + [JobFailed(**ts(at(1)), job_id="g1", attempt=1, replica=None, exit_code=1)],
        [],
    ),
    "cancelled preemption record is not work lost": (gang() + [preempted(at(1), reason="cancelled")], []),
}


@pytest.mark.parametrize("log, lost", CASES.values(), ids=CASES.keys())
def test_work_lost(log, lost):
    assert lost_of(log) == lost


def test_completion_needs_every_replica_and_jct_counts_from_submission():
    # attempt 1 preempted at 1:01 (last checkpoint 0:31); attempt 2 placed 2:00, started 2:00, replicas end 6:00
    log = gang() + [ckpt(at(0, 31), 1800), preempted(at(1, 1))]
    log += gang(attempt=2, placed=at(2), started=at(2))
    log.append(JobCompleted(**ts(at(6)), job_id="g1", attempt=2, replica=0))
    led = JobLedger().apply_all(log)
    assert led.completed == {}
    led.apply(JobCompleted(**ts(at(6)), job_id="g1", attempt=2, replica=1))
    assert led.completed == {"g1": at(6)}
    assert led.jct_s() == {"lab/a": [6 * 3600.0]}
    assert led.preempted == {"g1": 1}
    # runs held GPUs 0:00-1:01 and 2:00-6:00
    assert led.run_hours() == {"lab/a": pytest.approx((61 + 240) / 60)}


def test_recorded_lost_gpu_s_is_read_from_the_event_or_its_victim():
    from apportion.events import Victim

    v = Victim(job_id="g1", attempt=1, budget="lab/a", allocated=True, gpus=8, rule="expired_behind", lost_gpu_s=28800)
    for ev in (preempted(at(1, 1), lost_gpu_s=28800.0), preempted(at(1, 1), victim=v)):
        led = JobLedger().apply_all(gang() + [ev])
        (stop,) = led.stops
        assert (stop.recorded_lost_gpu_s, stop.lost_gpu_s, led.disagreements()) == (28800.0, 28800.0, [])
    led = JobLedger().apply_all(gang() + [preempted(at(1, 1), lost_gpu_s=100.0)])
    assert [s.job_id for s in led.disagreements()] == ["g1"]
