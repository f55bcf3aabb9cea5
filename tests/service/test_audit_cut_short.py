"""``audit verify`` on a tick its leader published only in part (issue 17: decisions reproducible after crashes).

Found in the full chaos campaign (seed 1, ninth session): a dispatcher killed -9 while its producer sent a
tick's batch left one ``JobPlaced`` of that tick in the log (no ``StartWorkload``; its re-run places 12 jobs
and preempts 13 runs); the next leader rebuilt from the log and decided again. The missing decisions never
happened, so the audit lists them as ``cut_short`` instead of a mismatch, but only for the last tick its
term published, and only when every recorded decision of it re-runs the same
(:func:`apportion.audit.verify.term_cut_short`).

Here: two 4-GPU nodes, x1 and y1 submitted together; leader 7's tick places both and its publish is cut
after x1's ``JobPlaced``. Leader 8 rebuilds from the log one second later, sends x1's start again and
places y1.
"""

from __future__ import annotations

from typing import Any

from apportion import events
from apportion.audit.verify import rerun_decisions
from apportion.clock import ManualClock
from apportion.events import JobPlaced
from apportion.timeutil import to_us
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import DispatcherService
from tests.kit.audit_replay import at, lab, submission
from tests.kit.dispatcher import INPUTS, T0, ListLog, log_records

SETTINGS = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")


def leader(log: ListLog, clock: ManualClock, token: int, publish: Any = None) -> DispatcherService:
    svc = DispatcherService(SETTINGS, clock, publish or log.publish, consumed=INPUTS)
    svc.token = token
    return svc


def cut_after_first_placement(log: ListLog) -> Any:
    """``publish`` of a leader killed -9 right after the first ``JobPlaced`` of a batch reached the broker."""

    def publish(sent: list[tuple[events.Event, bytes]]) -> None:
        first = next(i for i, (e, _) in enumerate(sent) if isinstance(e, JobPlaced))
        log.publish(sent[: first + 1])

    return publish


def placed(log: ListLog) -> list[tuple[str, int | None]]:
    return [(r.event.job_id, r.event.fencing_token) for r in log_records(log) if isinstance(r.event, JobPlaced)]


def test_a_tick_cut_short_by_its_leaders_death_lists_the_missing_decisions_and_is_no_mismatch() -> None:
    log, clock = ListLog(), ManualClock(T0)
    log.put(*lab("n1", "n2"), submission("x1", "lab/a", 60.0, 0), submission("y1", "lab/b", 60.0, 0))
    old = leader(log, clock, 7, cut_after_first_placement(log))
    out, _ = old.ingest(log.read())
    old._emit(out + old.tick())  # JobQueued x1, y1; JobPlaced x1 (StartWorkload x1, JobPlaced y1 ... lost)
    assert placed(log) == [("x1", 7)]
    clock.set(at(1))
    new = leader(log, clock, 8)
    new._emit(new.bootstrap(log.records))  # rebuild from the log, x1's start sent again, y1 placed
    assert placed(log) == [("x1", 7), ("y1", 8)]
    checks = rerun_decisions(log_records(log), old.cfg)
    assert [(c.at_us, c.match) for c in checks] == [(to_us(at(0)), True), (to_us(at(1)), True)]
    assert checks[0].cut_short == ["JobPlaced y1#1: the re-run decides it, but it was not recorded"]
    assert checks[1].cut_short == []


def test_the_same_gap_in_a_tick_its_term_published_after_is_a_mismatch() -> None:
    log, clock = ListLog(), ManualClock(T0)
    log.put(*lab("n1", "n2", "n3"), submission("x1", "lab/a", 60.0, 0), submission("y1", "lab/b", 60.0, 0))
    old = leader(log, clock, 7, cut_after_first_placement(log))
    out, _ = old.ingest(log.read())
    old._emit(out + old.tick())
    old.publish = log.publish  # the same leader goes on: its next tick is published whole
    log.put(submission("z1", "lab/a", 60.0, 1))
    clock.set(at(1))
    out, _ = old.ingest(log.read())
    old._emit(out + old.tick())
    assert placed(log) == [("x1", 7), ("z1", 7)]
    checks = rerun_decisions(log_records(log), old.cfg)
    assert checks[0].cut_short == [] and not checks[0].match
    assert checks[0].diffs == ["JobPlaced y1#1: the re-run decides it, but it was not recorded"]
