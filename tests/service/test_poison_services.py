"""Poison records through the service loops without Kafka: dead-lettered with the reason, never a stop.

The dispatcher runs on the in-memory log of ``test_dispatcher.py`` (its own
decisions come back as echoes); accounting and policy on plain record lists.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from apportion import events
from apportion.clock import ManualClock
from apportion.settings import topic_name
from apportion.topics import BUDGETS, DEADLETTER, JOBS, SUBMISSIONS
from tests.kit.dispatcher import T0, ListLog, drive, history, service, submit
from tests.kit.fakes import FakeRedis, Rec, records
from tests.kit.narrowing import narrow_each


def letters(log: ListLog) -> list[events.DeadLetter]:
    return narrow_each(events.DeadLetter, [events.decode(v) for t, v in log.published if t == topic_name(DEADLETTER)])


def placed(log: ListLog) -> set[str]:
    return {
        e.job_id
        for t, v in log.published
        if t == topic_name(JOBS) and isinstance(e := events.decode(v), events.JobPlaced)
    }


def started_log() -> tuple[Any, ListLog]:
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*history()[0])  # budgets and two 4-GPU nodes
    drive(svc, log)
    return svc, log


def test_every_poison_record_is_dead_lettered_and_the_next_job_placed() -> None:
    svc, log = started_log()
    good = json.loads(events.encode(submit("inf", "lab/a", 1)))
    infinite = json.dumps(dict(good, min_runtime_s="@")).replace('"@"', "Infinity").encode()
    log.append(topic_name(SUBMISSIONS), infinite, b"inf")
    log.append(topic_name(SUBMISSIONS), None, b"tomb")
    log.append(topic_name(SUBMISSIONS), events.encode(submit("k", "lab/a", 1)), b"not-k")
    log.append(topic_name(SUBMISSIONS), json.dumps(dict(good, job_id="t", submitted_at=12345)).encode(), b"t")
    log.put(submit("next", "lab/a", 1))
    drive(svc, log)
    assert [(d.source_key, d.error, d.producer) for d in letters(log)] == [
        ("inf", "min_runtime_s: non-finite number Infinity", "dispatcher"),
        ("tomb", "null record value (tombstone)", "dispatcher"),
        ("not-k", "key: record key 'not-k' is not the event's key 'k'", "dispatcher"),
        ("t", f"submitted_at: {events.NOT_ISO_TIME}, got 12345", "dispatcher"),
    ]
    assert placed(log) == {"next"}
    assert svc.intake.stats.dead_lettered == 4


def test_a_submission_reusing_the_id_of_a_decision_is_a_reused_id() -> None:
    svc, log = started_log()
    log.put(submit("j1", "lab/a", 1))
    drive(svc, log)
    queued = next(events.decode(v) for t, v in log.published if t == topic_name(JOBS))
    forged = submit("forged", "lab/b", 1).model_copy(update={"event_id": queued.event_id})
    log.put(forged)
    drive(svc, log)
    assert [d.error for d in letters(log)] == [
        f"event_id reused: {queued.event_id} was read before with a different payload"
    ]
    assert "forged" not in svc.state.jobs


def test_a_fold_that_raises_is_dead_lettered_and_the_batch_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.dispatcher import service as app

    svc, log = started_log()
    real = app.step

    def step(state, inp, now_us, cfg):  # the domain's signature
        if getattr(inp, "job_id", None) == "boom":
            raise OverflowError("cannot convert float infinity to integer")
        return real(state, inp, now_us, cfg)

    monkeypatch.setattr(app, "step", step)
    log.put(submit("boom", "lab/a", 1), submit("fine", "lab/a", 1))
    drive(svc, log)
    assert [(d.source_key, d.error) for d in letters(log)] == [
        ("boom", "apply failed: OverflowError: cannot convert float infinity to integer")
    ]
    assert placed(log) == {"fine"}


def test_a_cycle_that_raises_is_counted_and_the_service_goes_on() -> None:
    svc, log = started_log()

    def broken(snapshot, now_us, engine):  # the scheduler's signature
        raise ZeroDivisionError("boom")

    good_cfg = svc.cfg
    svc.cfg = replace(good_cfg, scheduler=broken)
    log.put(submit("j1", "lab/a", 1))
    drive(svc, log)
    assert svc.tick_errors >= 1 and placed(log) == set()
    svc.cfg = good_cfg  # fixed: the next cycle places the job
    log.put(submit("j2", "lab/a", 1))
    drive(svc, log)
    assert placed(log) == {"j1", "j2"}


# --------------------------------------------------------------------------- accounting and policy


def accounting(published: list) -> Any:
    from services.accounting.config import AccountingSettings
    from services.accounting.service import AccountingService
    from services.accounting.store import ReadModelStore

    return AccountingService(
        AccountingSettings(snapshot_interval_s=0, checkpoint_interval_wall_s=0),
        ManualClock(T0),
        published.append,
        ReadModelStore(FakeRedis()),
    )


class Raising:
    """An accounting fold that raises on one budget path and folds everything else."""

    def __init__(self, inner: Any, path: str) -> None:
        self.inner, self.path = inner, path

    def apply(self, event: events.Event) -> bool:
        if getattr(event, "path", None) == self.path:
            raise ValueError(f"cannot fold {self.path}")
        return self.inner.apply(event)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_accounting_dead_letters_poison_and_a_failing_fold_and_goes_on() -> None:
    published: list = []
    svc = accounting(published)
    budgets = [e for e in history()[0] if isinstance(e, events.BudgetSet)]
    recs = records(budgets)
    svc.bootstrap(recs[:1])
    svc.acc = Raising(svc.acc, "lab/a")
    tomb = Rec(topic_name(JOBS), 0, 99, b"x", None)
    svc.ingest([tomb, *recs[1:]])
    dead = [e for e in published if isinstance(e, events.DeadLetter)]
    assert [(d.source_offset, d.error) for d in dead] == [
        (99, "null record value (tombstone)"),
        (recs[1].offset, "apply failed: ValueError: cannot fold lab/a"),
    ]
    assert "lab/b" in svc.acc.inner.tree  # folded after the failure


def test_policy_dead_letters_poison_and_a_failing_fold_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.policy import service as policy_app

    published: list = []
    svc = policy_app.PolicyService(ManualClock(T0), published.append)
    real = policy_app.logic.evolve

    def evolve(state, event):  # logic.evolve's signature
        if getattr(event, "path", None) == "lab/a":
            raise RuntimeError("boom")
        return real(state, event)

    monkeypatch.setattr(policy_app.logic, "evolve", evolve)
    budgets = [e for e in history()[0] if isinstance(e, events.BudgetSet)]
    recs = records(budgets, partitions=1)
    svc.fold([recs[0], Rec(topic_name(BUDGETS), 0, 50, b"lab/z", b"\x89PNG"), *recs[1:]])
    assert [(d.source_offset, d.error) for d in published] == [
        (50, "not valid JSON: 'utf-8' codec can't decode byte 0x89 in position 0: invalid start byte"),
        (recs[1].offset, "apply failed: RuntimeError: boom"),
    ]
    assert "lab/b" in svc.state.tree
