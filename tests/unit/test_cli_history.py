"""apportion history: the fold of a job's log into sacct-like rows (pure; times by hand)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

from apportion.cli.history import fold_jobs
from tests.kit.builders import (
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


# --------------------------------------------------------------------------- the table at 80 columns


def _rows() -> list:
    from datetime import UTC, datetime, timedelta

    from apportion.cli.history import JobHistory

    t = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    done = JobHistory("alice-3f9c2a1b7d0e", "alice", "lab/prior/robotics", 8, 4, 3600.0, t, state="completed")
    done.attempts, done.preemptions, done.first_start = 2, 1, t + timedelta(minutes=12)
    done.ended_at, done.run_s, done.lost_gpu_s = t + timedelta(hours=5), 4.5 * 3600, 1800.0
    oom = JobHistory("bob-99aa00bb11cc", "bob", "lab/vision", 1, 1, 0.0, t, state="failed", attempts=1)
    oom.first_start, oom.ended_at, oom.run_s = t + timedelta(seconds=5), t + timedelta(hours=1), 3595.0
    oom.reason = "exit 1: CUDA out of memory while allocating 20.00 GiB on device 0"
    return [done, oom]


def _render(table, width: int) -> list[str]:
    import io

    from rich.console import Console

    c = Console(width=width, record=True, file=io.StringIO())
    c.print(table)
    return c.export_text().splitlines()


def test_history_fits_80_columns_and_a_reason_that_does_not_fit_follows_the_table_whole() -> None:
    """At 80 columns bob's reason (65 characters) does not fit: the reason leaves the table for a line after it,
    whole (it was cut to ``exit 1: CUDA o…``); alice's ``-`` gets no line."""
    from apportion.cli.history import history_table

    lines = _render(history_table(_rows(), width=80), 80)
    assert [ln.rstrip() for ln in lines] == [
        "                      history (2 finished jobs)",
        "job                 user   state      GPUs  wait     run  end",
        "─────────────────────────────────────────────────────────────────────",
        "alice-3f9c2a1b7d0e  alice  completed  4x8    12m   4h30m  12-01 14:00",
        "bob-99aa00bb11cc    bob    failed     1x1     5s  59m55s  12-01 10:00",
        "bob-99aa00bb11cc: exit 1: CUDA out of memory while allocating 20.00 GiB on",
        "device 0",
    ]
    assert max(len(ln) for ln in lines) <= 80


def test_history_wide_on_an_80_column_terminal_keeps_every_column_and_the_whole_reason(monkeypatch) -> None:
    """``history --wide`` on an 80-column terminal: the table is laid out at its own width (194 columns) and the
    terminal wraps it; laid out at the console's measure (capped at 80) it dropped columns and cut the reason."""
    from typer.testing import CliRunner

    import apportion.bus.reader
    import apportion.cli.history as hist
    from apportion.cli.main import app

    rows = {j.job_id: j for j in _rows()}
    monkeypatch.setattr(hist, "_require_topics", lambda *a: type("C", (), {"bootstrap": "x"})())
    monkeypatch.setattr(apportion.bus.reader, "read_log", lambda *a, **k: [])
    monkeypatch.setattr(hist, "fold_jobs", lambda evts: rows)
    res = CliRunner().invoke(app, ["history", "--wide"], env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = [ln.rstrip() for ln in res.stdout.splitlines()]
    assert lines[1:] == [
        "job                 user   budget              state      GPUs  att  pre  wait     run   GPU-h  lost GPU-h  "
        "end                  reason",
        "─" * 194,
        "bob-99aa00bb11cc    bob    lab/vision          failed     1x1     1    0    5s  59m55s    1.00           -  "
        "2026-12-01 10:00:00  exit 1: CUDA out of memory while allocating 20.00 GiB on device 0",
        "alice-3f9c2a1b7d0e  alice  lab/prior/robotics  completed  4x8     2    1   12m   4h30m  144.00        0.50  "
        "2026-12-01 14:00:00  -",
    ]


NO_ACCOUNT = "no_account: no Unix account 'mallory' for user 'mallory' on node n0"


def test_a_job_whose_start_failed_is_failed_not_pending() -> None:
    #  placed at 5, never started: the dispatcher fails the whole run for want of an account at 6
    no_account = failed("j", node="n0", at=s(6)).model_copy(update={"reason": NO_ACCOUNT})
    job = fold_jobs([submitted("j", at=s(0)), placed("j", at=s(5)), no_account])["j"]
    assert (job.state, job.ended_at, job.reason, job.attempts) == ("failed", dt(s(6)), NO_ACCOUNT, 1)
    assert (job.first_start, job.wait_s, job.run_s, job.gpu_hours) == (None, None, 0.0, 0.0)
    spawn = failed("k", replica=0, node="n0", at=s(7)).model_copy(update={"reason": "spawn failed: [Errno 1] x"})
    job = fold_jobs([submitted("k", at=s(0)), placed("k", at=s(5)), spawn])["k"]
    assert (job.state, job.ended_at, job.reason) == ("failed", dt(s(7)), "spawn failed: [Errno 1] x")


def test_a_gang_replica_that_failed_to_start_fails_the_job_only_with_the_runs_failure() -> None:
    evs = [
        submitted("g", gpus=8, replicas=2, at=s(0)),
        placed("g", gpus=8, replicas=2, nodes=["n0", "n1"], at=s(5)),
        failed("g", replica=1, node="n1", at=s(6)),
    ]
    assert fold_jobs(evs)["g"].state == "pending"
    job = fold_jobs([*evs, failed("g", at=s(7))])["g"]
    assert (job.state, job.ended_at) == ("failed", dt(s(7)))


def test_a_failure_of_an_earlier_attempt_or_a_preempted_one_leaves_the_job_pending() -> None:
    #  attempt 1 placed at 5 and preempted at 8 before it started; its stopped replica fails at 9; requeued
    evs = [
        submitted("j", at=s(0)),
        placed("j", at=s(5)),
        preempted("j", at=s(8)),
        failed("j", replica=0, at=s(9)),
    ]
    job = fold_jobs(evs)["j"]
    assert (job.state, job.ended_at, job.reason) == ("pending", None, "")
    late = failed("j", replica=0, at=s(12)).model_copy(update={"event_id": uuid.uuid4()})  # attempt 1, read late
    job = fold_jobs([*evs, requeued("j", attempt=2, submitted_at=s(0), at=s(10)), late])["j"]
    assert (job.state, job.attempts, job.ended_at) == ("pending", 2, None)


def test_the_dashboards_history_shows_a_job_whose_start_failed_as_failed(monkeypatch) -> None:
    from services.web.store import Sources

    no_account = failed("j", node="n0", at=s(6)).model_copy(update={"reason": NO_ACCOUNT})
    log = [SimpleNamespace(event=e) for e in (submitted("j", at=s(0)), placed("j", at=s(5)), no_account)]
    sources = Sources.__new__(Sources)  # no Redis or Kafka: the log is given
    monkeypatch.setattr(sources, "log", lambda: log, raising=False)
    [row] = sources.history()
    assert (row["job_id"], row["state"], row["reason"], row["ended_at"]) == (
        "j",
        "failed",
        NO_ACCOUNT,
        dt(s(6)).isoformat(),
    )


def test_the_title_counts_one_finished_job_in_the_singular() -> None:
    from apportion.cli.history import history_table

    assert _render(history_table(_rows()[:1], width=80), 80)[0].strip() == "history (1 finished job)"
