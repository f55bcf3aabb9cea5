"""A dispatcher leading through a broker outage declares no node lost on its own blindness (issue 18).

The term (:class:`services.dispatcher.service.Term`) with everything Kafka and Redis injected: an
in-memory log (``tests.service.test_dispatcher.ListLog``), a manual event clock, a wall clock and a
broker probe the test moves. Heartbeat timeout 30 s; times are event seconds after T0.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from apportion import events
from apportion.audit.verify import rerun_decisions
from apportion.clock import ManualClock
from apportion.events import NodeHeartbeat
from apportion.logrecord import LogRecord
from tests.kit.dispatcher import (
    T0,
    FixedLease,
    ListLog,
    history,
    log_records,
    quiet_term,
    submit,
    timed_out_leader,
)


class Harness:
    """One term: ``poll()`` hands the log's new records to ``Term.handle``, one wall second per call."""

    def __init__(self) -> None:
        self.log = ListLog()
        self.clock = ManualClock(T0)
        self.svc = timed_out_leader(self.log.publish, self.clock)
        settings = self.svc.settings
        self.wall = 0.0
        self.up = True
        self.probes = 0

        def reachable() -> bool:
            self.probes += 1
            return self.up

        self.term = quiet_term(self.svc, settings, lambda: self.wall, reachable=reachable)

    def start(self) -> None:
        from apportion.audit.config import configured_event

        for batch in history():
            self.log.put(*batch)
        # room for a placement later: an 8-GPU node (j3 takes 4 of it at the start)
        self.log.put(events.NodeRegistered(event_id=events.det_id("test", "n3"), node_id="n3", gpu_count=8, ts=T0))
        cfg = configured_event(
            self.svc.cfg, instance="d-1", fencing_token=7, ts=self.clock.now(), producer="dispatcher"
        )
        asyncio.run(self.term.start(self.log.read(), [], cfg, FixedLease()))

    def poll(self, *, read: bool = True) -> None:
        self.wall += 1.0
        batch = self.log.read() if read else []
        asyncio.run(self.term.handle(batch))

    def heartbeat(self, node: str) -> None:
        self.log.put(
            NodeHeartbeat(event_id=events.det_id("hb", node, self.clock.now_us()), node_id=node, ts=self.clock.now())
        )

    def published(self, kind: type) -> list[Any]:
        out = []
        for _topic, value in self.log.published:
            e = events.decode(value)
            if isinstance(e, kind):
                out.append(e)
        return out

    def records(self) -> list[LogRecord]:
        return log_records(self.log)


def test_a_term_blind_through_an_outage_loses_no_node_and_a_node_silent_after_it_is_lost() -> None:
    h = Harness()
    h.start()
    assert [e.heartbeats_from for e in h.published(events.DispatcherConfigured)] == [None]  # the log is current
    h.clock.advance(10)
    for n in ("n1", "n2", "n3"):
        h.heartbeat(n)
    h.poll()
    h.clock.advance(10)
    h.poll()  # quiet for 10 s (< half the timeout): the broker is not asked
    assert h.probes == 0
    h.up = False  # the outage
    for _ in range(18):  # 20 s to 200 s of event time without a record
        h.clock.advance(10)
        h.poll(read=False)
    assert h.term.blind and h.probes > 0
    assert h.published(events.NodeLost) == []  # before the fix: both nodes lost 30 s after 10 s
    h.up = True  # the broker answers again; the agents' buffered heartbeats are still to come
    h.poll(read=False)
    resumed = h.published(events.DispatcherConfigured)[-1]
    assert resumed.heartbeats_from == T0 + timedelta(seconds=200)
    h.clock.advance(20)
    h.poll(read=False)
    assert h.published(events.NodeLost) == []  # 20 s into the grace
    h.heartbeat("n1")  # the agents of n1 and n3 deliver; n2's never does
    h.heartbeat("n3")
    h.poll()
    assert h.published(events.DispatcherConfigured)[-1].heartbeats_from == T0 + timedelta(seconds=220)
    h.log.put(submit("j9", "lab/a", 1, min_runtime_s=0))  # a placement made inside the grace
    h.clock.advance(5)
    h.poll()
    assert [e.job_id for e in h.published(events.JobPlaced)][-1] == "j9"
    for _ in range(3):  # to 252 s, polling as the loop does: n2 silent a whole timeout after the grace (220 s)
        h.clock.advance(9)
        h.heartbeat("n1")
        h.heartbeat("n3")
        h.poll()
    assert [(e.node_id, e.last_heartbeat) for e in h.published(events.NodeLost)] == [("n2", T0 + timedelta(seconds=10))]
    # the audit re-runs every decision, the one inside the grace and the loss's, to the same result
    checks = rerun_decisions(h.records(), h.svc.cfg)
    assert checks and all(c.match for c in checks), [c.diffs for c in checks if not c.match]


def test_a_start_on_a_log_whose_heartbeats_are_behind_grants_the_grace() -> None:
    h = Harness()
    h.clock.advance(100)  # the log's newest heartbeat (the registrations at T0) is 100 s old
    h.start()
    [cfg] = h.published(events.DispatcherConfigured)
    assert cfg.heartbeats_from == T0 + timedelta(seconds=100)
    assert h.published(events.NodeLost) == []  # before the fix: both nodes lost at the rebuild's tick


def test_polls_that_stop_coming_back_make_the_term_blind_too() -> None:
    """No poll returned for 50 s (they raised: ``follow`` retries without calling ``handle``), then one does."""
    h = Harness()
    h.start()
    h.clock.advance(10)
    for n in ("n1", "n2", "n3"):
        h.heartbeat(n)
    h.poll()
    h.clock.advance(50)  # 60 s: every node 50 s silent, as far as this term could read
    h.poll(read=False)
    assert h.published(events.NodeLost) == []  # before the fix: all three lost at 60 s
    assert h.published(events.DispatcherConfigured)[-1].heartbeats_from == T0 + timedelta(seconds=60)


def test_idle_times_heartbeats_report_reach_the_read_model_without_other_news() -> None:
    from services.dispatcher.service import IDLE_TIMES_EVERY_S

    h = Harness()
    writes: list[float] = []
    h.term.write_read_model = lambda: writes.append(h.wall)
    h.start()
    assert writes == [0.0]  # the term's first read model
    writes.clear()
    for _ in range(3):  # quiet: nothing to show
        h.poll()
    assert writes == []

    def idle_beat() -> None:
        w = events.RunningWorkload(job_id="j3", attempt=1, replica=0, gpus=(0,), idle_s=60.0)
        h.log.put(
            NodeHeartbeat(event_id=events.det_id("hb", "n3", h.clock.now_us()), node_id="n3", running=(w,),
                          ts=h.clock.now())
        )  # fmt: skip

    h.clock.advance(10)
    idle_beat()
    h.poll()  # wall 4 s: IDLE_TIMES_EVERY_S (10 s) since the term began, not yet
    assert writes == []
    for _ in range(int(IDLE_TIMES_EVERY_S) - 4):
        h.poll()
    assert writes == [IDLE_TIMES_EVERY_S]  # once the 10 s passed
    for _ in range(int(IDLE_TIMES_EVERY_S) + 2):
        h.poll()  # no new report: no rewrite
    assert writes == [IDLE_TIMES_EVERY_S]
