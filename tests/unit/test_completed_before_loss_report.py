"""Rule D3.completed-before-loss in the readers of the log: the job report (:class:`apportion.report.JobLedger`,
which the simulator's and the log's reports share) and the audit's share deficit.

Given: the log of ``tests/unit/test_completed_before_loss.py``: j (4 GPUs, lab/b, one replica, submitted at
T0) placed at T0 on n0, its node lost at L = T0 + 30 s + 1 µs (charged up to T0, the last heartbeat), attempt 2
requeued at L. When: the agent's report of attempt 1 is read after that, while attempt 2 waits or once it was
placed at L + 1 s. Then: a completion stamped at or before the loss counts the job completed (not cancelled);
anything else leaves it as it was.

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.audit.report import share_deficits
from apportion.cli.history import fold_jobs
from apportion.domain.dispatch import COMPLETED_BEFORE_LOSS, Tick, step
from apportion.report import JobLedger
from apportion.timeutil import US_PER_S, from_us
from tests.kit import builders as b
from tests.kit.builders import T0
from tests.kit.domain_dispatch import TREE, types
from tests.unit.test_completed_before_loss import CFG, L, S, completed, failed, lost_and_requeued

READ = L + 5 * S  # when the report is read (log order)

WAITING = {
    "a completion stamped before the loss: completed then": ((completed(T0 + 20 * S),), T0 + 20 * S),
    "one stamped at the loss": ((completed(L),), L),
    "one stamped 1 µs after the loss: not completed": ((completed(L + 1),), None),
    "a failure before the loss: not completed": ((failed(T0 + 20 * S),), None),
    "a failure, then a completion: not completed": ((failed(T0 + S), completed(T0 + 2 * S)), None),
}


def waiting_log(reports: tuple[ev.Event, ...]) -> list[ev.Event]:
    state, log = lost_and_requeued()
    for r in reports:
        log += [r, *step(state, r, READ, CFG)]
    return log


@pytest.mark.parametrize(("reports", "done_at"), WAITING.values(), ids=WAITING.keys())
def test_the_job_report_counts_a_job_finished_while_its_next_attempt_waits(
    reports: tuple[ev.Event, ...], done_at: int | None
) -> None:
    ledger = JobLedger().apply_all(waiting_log(reports))
    if done_at is None:
        assert ledger.completed == {} and ledger.jct_s() == {}
    else:  # JCT: the report's stamp - T0 (the dispatcher's finish time)
        assert ledger.completed == {"j": done_at}
        assert ledger.jct_s() == {"lab/b": [(done_at - T0) / US_PER_S]}


def test_the_job_report_counts_a_job_whose_next_attempt_was_ended_completed() -> None:
    """Attempt 2 placed at L + 1 s, the report (stamped T0 + 20 s) read at L + 2 s: attempt 2 is cancelled with
    reason ``completed_before_loss``; the job is completed then, attempt 2 held its GPUs 1 s."""
    state, log = lost_and_requeued()
    log += step(state, Tick(L + S), L + S, CFG)
    r = completed(T0 + 20 * S)
    out = step(state, r, L + 2 * S, CFG)
    assert types(out) == ["StopWorkload:j", "JobCancelled:j"]
    assert [o.reason for o in out if isinstance(o, ev.JobCancelled)] == [COMPLETED_BEFORE_LOSS]
    ledger = JobLedger().apply_all([*log, r, *out])
    assert ledger.completed == {"j": L + 2 * S}
    # attempt 1: T0 to its stop at T0 (charged_until, the last heartbeat); attempt 2: L + 1 s to L + 2 s
    assert ledger.run_hours(L + 10 * S) == {"lab/b": 1 / 3600}


def test_the_job_report_counts_a_run_preempted_after_it_completed() -> None:
    """A run preempted at T0 + 10 s whose report, stamped T0 + 5 s, is read while it stops: completed at
    T0 + 5 s (the dispatcher finishes it there); one stamped T0 + 11 s (its stop) is no completion."""
    base = [
        b.submitted("k", budget="lab/b"),
        b.placed("k", budget="lab/b", at=T0),
        b.preempted("k", budget="lab/b", at=T0 + 10 * S),
    ]

    def report(at: int) -> ev.JobCompleted:
        return b.completed("k", replica=0, at=at)

    assert JobLedger().apply_all([*base, report(T0 + 5 * S)]).completed == {"k": T0 + 5 * S}
    assert JobLedger().apply_all([*base, report(T0 + 11 * S)]).completed == {}


@pytest.mark.parametrize(("reports", "done_at"), WAITING.values(), ids=WAITING.keys())
def test_the_audit_deficit_drops_a_job_finished_while_waiting(
    reports: tuple[ev.Event, ...], done_at: int | None
) -> None:
    """Samples each second from L to L + 10 s. lab/b held nothing (attempt 1 was charged up to T0): its deficit
    is (0.5 - 0) x 100 = 50 pp at each of the 11 samples while attempt 2 waits, none once j is finished."""
    out = share_deficits(waiting_log(reports), TREE, L, L + 10 * S, sample_s=1.0)
    assert out["lab/b"] == ([] if done_at is not None else [50.0] * 11)
    assert out["lab/a"] == []


@pytest.mark.parametrize(("reports", "done_at"), WAITING.values(), ids=WAITING.keys())
def test_history_shows_a_job_finished_while_waiting_completed(
    reports: tuple[ev.Event, ...], done_at: int | None
) -> None:
    job = fold_jobs(waiting_log(reports))["j"]
    if done_at is None:
        assert (job.state, job.ended_at) == ("pending", None)
    else:
        assert (job.state, job.ended_at, job.reason) == ("completed", from_us(done_at), COMPLETED_BEFORE_LOSS)


def test_history_shows_a_job_whose_next_attempt_was_ended_completed() -> None:
    state, log = lost_and_requeued()
    log += step(state, Tick(L + S), L + S, CFG)
    r = completed(T0 + 20 * S)
    job = fold_jobs([*log, r, *step(state, r, L + 2 * S, CFG)])["j"]
    assert (job.state, job.ended_at, job.reason) == ("completed", from_us(L + 2 * S), COMPLETED_BEFORE_LOSS)


def test_a_report_read_after_the_next_attempt_was_refused_changes_nothing_in_any_reader() -> None:
    """The rule's limit: attempt 2, placed on n2 at L + 1 s, is refused there at L + 2 s (requeued as attempt 3);
    the report of attempt 1 (stamped T0 + 20 s) is read at L + 3 s, after that end. The dispatcher does nothing
    (attempt 3 waits and is placed again), and every reader agrees: not completed, waiting, pending."""
    state, log = lost_and_requeued()
    log += step(state, Tick(L + S), L + S, CFG)
    refused = ev.WorkloadRefused(
        node_id="n2", job_id="j", attempt=2, reason="gpus_busy: held by another process", ts=from_us(L + 2 * S),
        producer="node-agent", event_id=ev.det_id("refused", 2),
    )  # fmt: skip
    out = step(state, refused, L + 2 * S, CFG)
    assert [t for t in types(out) if t.startswith("Job")] == ["JobRequeued:j"]
    log += [refused, *out]
    r = completed(T0 + 20 * S)
    assert step(state, r, L + 3 * S, CFG) == []
    log.append(r)
    assert (state.jobs["j"].attempt, state.jobs["j"].status, state.jobs["j"].lost) == (3, "pending", None)
    assert JobLedger().apply_all(log).completed == {}
    assert fold_jobs(log)["j"].state == "pending"
    # lab/b waits from L to L + 1 s and again from L + 2 s: samples at L, L + 2 s, L + 3 s (the sample at L + 1 s
    # sees the placement). (0.5 - O/K) x 100: O = attempt 2's 4 GPUs x 1 s; K = n2 and n3's 8 GPUs since L (n0 and
    # n1 counted up to their last heartbeat, T0): 0 at L, 4/16 at L + 2 s, 4/24 at L + 3 s.
    waits = share_deficits(log, TREE, L, L + 3 * S, sample_s=1.0)["lab/b"]
    assert waits == pytest.approx([50.0, (0.5 - 4 / 16) * 100, (0.5 - 4 / 24) * 100])
