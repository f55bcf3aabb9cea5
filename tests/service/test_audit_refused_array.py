"""``audit verify`` re-runs the ticks of a throttled array whose starts are refused ``no_account`` as the
dispatcher decided them (rules D3.refused-starts, D11.verify-clean).

The dispatcher fails a job whose start is refused ``no_account`` with a ``JobFailed`` stamped at the refusal's
event time (its occupancy ends there), not at the time it read the refusal. A refusal stamped before a tick but
read after it is answered by a ``JobFailed`` stamped before that tick, emitted after it. The audit folds the
dispatcher's own events up to a tick by event time; it folded that ``JobFailed`` before the tick, the throttle
(``%2``) let the re-run place one more element than the dispatcher could, and the tick's recorded ratio and
GPUs differed from the re-run's (a new user's first array, run as root: every element refused).

One 4-GPU node; ``s`` of lab/a, ``1`` GPU each, array ``0-3%2``, submitted at 0 s::

    0 s   s_0, s_1 placed (the throttle: 2 running)
    0.2 s the agent refuses s_0 (no_account)  - read at 1 s: JobFailed s_0 @0.2 s, tick 1 s places s_2
    0.3 s the agent refuses s_1 (no_account)  - read at 2 s: JobFailed s_1 @0.3 s, tick 2 s places s_3

At the 1 s tick the dispatcher had not read the refusal of s_1: s_1 still ran, one element could start.
"""

from __future__ import annotations

from apportion import events
from apportion.audit.verify import check_read_models, rerun_decisions
from apportion.events import JobFailed, JobPlaced, JobSubmitted, WorkloadRefused
from apportion.timeutil import to_us
from services.dispatcher.logic import read_model
from tests.kit.audit_replay import at, lab
from tests.kit.dispatcher import USER, log_records
from tests.service.test_audit_out_of_order import leader


def refused(job: str, ts_s: float) -> WorkloadRefused:
    return WorkloadRefused(
        event_id=events.det_id("agent", "refused", job), job_id=job, attempt=1, node_id="n1", ts=at(ts_s),
        reason="no_account: account 'root' of user 'root' has uid or gid 0 on node n1", producer="node-agent",
    )  # fmt: skip


def test_a_refusal_read_after_a_tick_it_predates_fails_its_element_after_that_tick_in_the_re_run() -> None:
    svc, log, poll_at = leader(heartbeat_timeout_s=0)
    sweep = USER.sign(
        JobSubmitted(
            event_id=events.det_id("test", "s"), job_id="s", budget="lab/a", user="u", gpus_per_replica=1,
            min_runtime_s=60.0, duration_s=600.0, array="0-3%2", submitted_at=at(0), ts=at(0), producer="test",
        )
    )  # fmt: skip
    log.put(*lab("n1"), sweep)
    poll_at(0)
    log.put(refused("s_0", 0.2))
    poll_at(1)
    log.put(refused("s_1", 0.3))  # stamped before the 1 s tick, read after it
    poll_at(2)

    recs = log_records(log)
    placed = [(r.event.job_id, r.event.ts) for r in recs if isinstance(r.event, JobPlaced)]
    assert sorted(placed) == [("s_0", at(0)), ("s_1", at(0)), ("s_2", at(1)), ("s_3", at(2))]
    failed = sorted((r.event.job_id, r.event.ts) for r in recs if isinstance(r.event, JobFailed))
    assert failed == [("s_0", at(0.2)), ("s_1", at(0.3))]  # at the refusals' event times (their charge ends there)
    checks = rerun_decisions(recs, svc.cfg)
    assert [c.at_us for c in checks] == [to_us(at(s)) for s in (0, 1, 2)]
    assert all(c.match for c in checks), [d for c in checks for d in c.diffs]
    jobs, nodes = read_model(svc.state, svc.state.clock_us or 0, svc.cfg)
    assert check_read_models(recs, {"jobs": jobs, "nodes": nodes}, svc.cfg) == []
