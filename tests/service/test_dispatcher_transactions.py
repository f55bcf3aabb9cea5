"""The leader's commit cadence with a transactional producer (docs/leadership.md, item 4).

The term (:class:`services.dispatcher.service.Term`) publishes through a real
:class:`apportion.bus.producer.Unacked` in transactional mode over a recording producer, so the order of
``begin``, sends and ``commit`` is what the dispatcher does on Kafka: every iteration that sent anything
(decisions or the reader edge's dead letters) ends with one commit after the lease is checked, and a leader
deposed between its sends and its commit never commits them.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from kafka.future import Future

from apportion.audit.config import configured_event
from apportion.bus.producer import Unacked
from apportion.clock import ManualClock
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.lease import LeadershipLost
from services.dispatcher.service import DispatcherService, Term
from tests.kit.dispatcher import INPUTS, T0, FixedLease, ListLog, NoQueue, Producer, history, submit


class Harness:
    def __init__(self) -> None:
        self.log = ListLog()
        self.producer = Producer(self.log)
        self.sends = Unacked(self.producer, transactional=True)
        self.deposed = False
        self.checks = 0
        settings = DispatcherSettings(
            heartbeat_timeout_s=0, reconcile_misses=0, kafka_bootstrap="unused:1", redis_url="redis://unused"
        )
        self.svc = DispatcherService(settings, ManualClock(T0), self._publish, consumed=INPUTS)
        self.svc.token = 7
        self.depose_on_send = False
        self.wall = 0.0

        def check_lease() -> None:
            self.checks += 1
            if self.deposed:
                raise LeadershipLost()

        self.term = Term(
            self.svc,
            settings,
            {"queue": NoQueue()},
            check_lease=check_lease,
            lost=threading.Event(),
            flush=self.sends.flush,
            check_delivered=self.sends.check,
            write_read_model=lambda: None,
            write_snapshot=lambda: None,
            commit=lambda: None,
            now=lambda: self.wall,
            pending=lambda: self.sends.open,
        )

    def _publish(self, sent: list[tuple[Any, bytes]]) -> None:
        self.sends.send_all(sent)
        if self.depose_on_send:  # the lease runs out while the decisions are on their way
            self.deposed = True

    def start(self) -> None:
        for batch in history()[:1]:
            self.log.put(*batch)
        cfg = configured_event(self.svc.cfg, instance="d-1", fencing_token=7, ts=T0, producer="dispatcher")
        asyncio.run(self.term.start(self.log.read(), [], cfg, FixedLease()))

    def poll(self) -> None:
        self.wall += 1.0
        asyncio.run(self.term.handle(self.log.read()))


def test_each_iteration_that_decides_ends_with_one_commit_after_the_lease_check() -> None:
    h = Harness()
    h.start()
    assert h.producer.calls == ["begin", "DispatcherConfigured", "commit"]  # the recovery decisions
    h.producer.calls.clear()
    h.log.put(submit("j1", "lab/a", 2))
    checks = h.checks
    h.poll()
    assert h.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload", "commit"]
    assert h.checks == checks + 2  # before the sends and again before the commit
    assert not h.sends.open
    h.producer.calls.clear()
    h.poll()  # nothing new: no transaction at all
    assert h.producer.calls == []


def test_a_leader_deposed_between_its_sends_and_its_commit_never_commits_them() -> None:
    h = Harness()
    h.start()
    h.producer.calls.clear()
    h.log.put(submit("j1", "lab/a", 2))
    h.depose_on_send = True
    with pytest.raises(LeadershipLost):
        h.poll()
    assert h.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload"]  # no commit
    assert h.sends.open  # left to the next leader's init_transactions (or the timeout) to abort
    h.term.blind = False
    with pytest.raises(LeadershipLost):
        h.term.close()  # a clean stop checks the lease too
    assert "commit" not in h.producer.calls


def test_a_dead_letter_alone_is_committed_in_its_iteration() -> None:
    h = Harness()
    h.start()
    h.producer.calls.clear()
    h.log.append(next(iter(INPUTS)), b"not json", b"k")
    h.poll()
    assert h.producer.calls == ["begin", "DeadLetter", "commit"]


def test_a_rebuild_sends_its_dead_letters_with_its_recovery_decisions_in_one_transaction() -> None:
    """A rebuild can take longer than the transaction timeout: a dead letter found in it must not open the
    transaction early (the broker would abort it and the later sends be lost), so it goes out with the
    recovery decisions."""
    h = Harness()
    for batch in history()[:1]:
        h.log.put(*batch)
    h.log.append(next(iter(INPUTS)), b"not json", b"k")
    cfg = configured_event(h.svc.cfg, instance="d-1", fencing_token=7, ts=T0, producer="dispatcher")
    asyncio.run(h.term.start(h.log.read(), [], cfg, FixedLease()))
    assert h.producer.calls == ["begin", "DispatcherConfigured", "DeadLetter", "commit"]
    assert h.svc.held is None


def test_a_start_whose_decisions_were_not_delivered_writes_no_read_model_nor_snapshot() -> None:
    h = Harness()
    writes: list[str] = []
    h.term.write_read_model = lambda: writes.append("read model")
    h.term.write_snapshot = lambda: writes.append("snapshot")

    def lost(sent: list[tuple[Any, bytes]]) -> list[Future]:
        futures = []
        for e, _ in sent:
            h.producer.calls.append(e.type)
            f = Future()
            f.failure(RuntimeError("InvalidProducerEpochError"))  # the broker aborted the transaction
            futures.append(f)
        return futures

    h.producer.send_many = lost  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="not delivered"):
        h.start()
    assert h.producer.calls == ["begin", "DispatcherConfigured", "commit"]
    assert writes == []


def carry_a_submission(h: Harness) -> list[str]:
    """A submission read 10 ms after a 10 ms cycle ended: its tick waits for the pacer's gap of 40 ms
    (4 x the cycle at the 20% share); returns what the term wrote to Redis meanwhile."""
    writes: list[str] = []
    h.term.write_read_model = lambda: writes.append("read model")
    h.term.write_snapshot = lambda: writes.append("snapshot")
    h.producer.calls.clear()
    h.wall = 100.0  # the read model (every 0.5 s) and the snapshot (every 60 s) are due
    h.term.pacer.ticked(h.wall - 0.01, h.wall)
    h.wall += 0.01
    h.log.put(submit("j1", "lab/a", 2))
    asyncio.run(h.term.handle(h.log.read()))
    return writes


def test_a_submission_read_while_its_tick_waits_goes_out_with_its_placement_in_one_transaction() -> None:
    h = Harness()
    h.start()
    writes = carry_a_submission(h)
    assert h.producer.calls == [] and [e.type for e in h.term.carried] == ["JobQueued"]
    assert writes == []  # nothing shows a decision the log does not hold
    assert 0 < h.term.poll_ms() <= 40  # the next poll waits until the tick is due
    h.wall += 0.04
    asyncio.run(h.term.handle([]))
    assert h.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload", "commit"]
    assert h.term.carried == [] and writes == ["read model", "snapshot"]


def test_a_clean_stop_sends_and_commits_what_waited_for_its_tick() -> None:
    h = Harness()
    h.start()
    carry_a_submission(h)
    h.term.close()
    assert h.producer.calls == ["begin", "JobQueued", "commit"]
    assert h.term.carried == [] and not h.sends.open
