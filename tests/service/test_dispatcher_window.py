"""The dispatcher service refuses an event older than the window W: dead-lettered with the reason, not folded.

Runs on the in-memory log of ``test_dispatcher.py``, W = 1 h.
"""

from __future__ import annotations

from apportion import events
from apportion.clock import ManualClock
from apportion.settings import topic_name
from apportion.timeutil import to_us
from apportion.topics import DEADLETTER
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import FUTURE, STALE, DispatcherService
from tests.kit.dispatcher import INPUTS, T0, USER, ListLog, drive, history, submit
from tests.kit.narrowing import narrow_each


def test_a_submission_two_windows_late_is_dead_lettered_and_the_next_one_queued() -> None:
    log = ListLog()
    settings = DispatcherSettings(
        heartbeat_timeout_s=0, window_s=3600.0, kafka_bootstrap="unused:1", redis_url="redis://unused"
    )
    clock = ManualClock(T0)
    svc = DispatcherService(settings, clock, log.publish, consumed=INPUTS)
    svc.token = 7
    log.put(*history()[0])  # budgets and two nodes at T0
    drive(svc, log)
    later = clock.advance(2 * 3600)
    fresh = USER.sign(
        submit("fresh", "lab/a", 1).model_copy(update={"ts": later, "submitted_at": later})
    )  # signed again: the time is signed
    old = submit("old", "lab/a", 1)  # at T0: two hours before the latest event folded
    log.put(fresh)
    drive(svc, log)
    log.put(old)  # a later batch (one batch is folded in event-time order)
    drive(svc, log)
    letters = narrow_each(
        events.DeadLetter, [events.decode(v) for t, v in log.published if t == topic_name(DEADLETTER)]
    )
    assert [(d.source_key, d.error) for d in letters] == [
        ("old", f"{STALE}: {T0.isoformat()} is more than W before {later.isoformat()}")
    ]
    assert "fresh" in svc.state.jobs and "old" not in svc.state.jobs
    assert svc.state.stale == 0  # refused at the service's edge, never handed to the fold


def test_an_event_from_the_far_future_is_dead_lettered_and_moves_no_clock() -> None:
    log = ListLog()
    settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
    svc = DispatcherService(settings, ManualClock(T0), log.publish, consumed=INPUTS)
    svc.token = 7
    log.put(*history()[0])
    drive(svc, log)
    year = T0.replace(year=T0.year + 100)
    log.put(
        USER.sign(submit("ahead", "lab/a", 1).model_copy(update={"ts": year, "submitted_at": year}))
    )  # signed again: the time is signed
    drive(svc, log)
    log.put(submit("now", "lab/a", 1))
    drive(svc, log)
    letters = narrow_each(
        events.DeadLetter, [events.decode(v) for t, v in log.published if t == topic_name(DEADLETTER)]
    )
    assert [(d.source_key, d.error) for d in letters] == [
        ("ahead", f"{FUTURE}: {year.isoformat()} is more than 3600 s after {T0.isoformat()}")
    ]
    assert "now" in svc.state.jobs and svc.state.clock_us == to_us(T0)
