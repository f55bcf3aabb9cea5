"""A dispatcher service without Kafka: a list-backed log, the service on a manual clock, and a short history.

:class:`ListLog` keeps one partition per topic in memory; :func:`drive` runs the service the way its leader loop
does (ingest a batch, tick when news arrived, emit), so its own decisions come back as echoes as on Kafka.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kafka.future import Future

from apportion import events
from apportion.clock import ManualClock
from apportion.events import (
    BudgetSet,
    Event,
    JobStarted,
    JobSubmitted,
    NodeRegistered,
)
from apportion.logrecord import LogRecord, log_order
from apportion.settings import topic_name
from apportion.topics import BUDGETS, JOBS, NODES, SUBMISSIONS
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import DispatcherService, Term
from tests.kit.signing import identity, node_value, registered, with_node_keys

T0 = datetime(2025, 3, 1, tzinfo=UTC)
USER = identity("u")
INPUTS = [topic_name(SUBMISSIONS), topic_name(JOBS), topic_name(NODES), topic_name(BUDGETS)]


@dataclass(frozen=True)
class Rec:
    """The fields of a kafka-python ``ConsumerRecord`` the dispatcher reads (``timestamp_type`` 1: LogAppendTime)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    timestamp_type: int = 0


class ListLog:
    """One partition per topic, in memory; ``read()`` returns what was appended since the last read.

    Record timestamps are the broker's (``LogAppendTime``, as the signed topics are configured): the n-th
    record appended is at n ms.
    """

    def __init__(self) -> None:
        self.records: list[Rec] = []
        self.next_offset: dict[str, int] = {}
        self.read_upto = 0
        self.published: list[tuple[str, bytes]] = []
        self.nodes: set[str] = set()

    def append(self, topic: str, value: bytes | None, key: bytes | None = None) -> None:
        """Append as a broker with ``LogAppendTime`` does: the record's timestamp is its append (1 ms apart)."""
        off = self.next_offset.get(topic, 0)
        self.next_offset[topic] = off + 1
        self.records.append(Rec(topic, 0, off, key, value, len(self.records) + 1, 1))

    def put(self, *evts: Event) -> None:
        """Append outside input; node reports signed by their node's key, registered first (tests.kit.signing)."""
        for e in with_node_keys(evts, self.nodes):
            self.append(topic_name(events.TOPIC_OF[e.type]), node_value(e), events.key_of(e).encode())

    def publish(self, sent: list[tuple[Event, bytes]]) -> None:
        for e, value in sent:
            assert value == events.encode(e)
            topic = topic_name(events.TOPIC_OF[e.type])
            self.published.append((topic, value))
            self.append(topic, value, events.key_of(e).encode())

    def read(self) -> list[Rec]:
        batch = [r for r in self.records[self.read_upto :] if r.topic in INPUTS]
        self.read_upto = len(self.records)
        return batch


class Producer:
    """Records ``begin``/``send``/``commit``/``abort`` in order; every send is acknowledged at once.

    ``at_commit`` False: each record reaches the log when sent (what a reader of uncommitted records sees);
    True: at the commit, and never after an abort (what a ``read_committed`` reader sees).
    """

    def __init__(self, log: ListLog, *, at_commit: bool = False) -> None:
        self.log = log
        self.at_commit = at_commit
        self.calls: list[str] = []
        self.staged: list[tuple[Any, bytes]] = []

    def begin(self) -> None:
        self.calls.append("begin")

    def send_many(self, sent: list[tuple[Any, bytes]]) -> list[Future]:
        futures = []
        for e, value in sent:
            self.calls.append(e.type)
            if self.at_commit:
                self.staged.append((e, value))
            else:
                self.log.publish([(e, value)])
            f = Future()
            f.success("acked")
            futures.append(f)
        return futures

    def commit(self) -> None:
        self.calls.append("commit")
        staged, self.staged = self.staged, []
        self.log.publish(staged)

    def abort(self) -> None:
        self.calls.append("abort")
        self.staged = []


class NoQueue:
    """The metrics' ``queue`` of a term under test: heartbeat ages go nowhere."""

    def heartbeats(self, _: Any) -> None:
        pass


class FixedLease:
    """The lease a term under test starts with: token 7, never deposed by the log."""

    token = 7

    def observe(self, _: int) -> None:
        pass


def timed_out_leader(publish: Callable[[list[tuple[Event, bytes]]], Any], clock: ManualClock) -> DispatcherService:
    """A leading dispatcher (token 7) reading :data:`INPUTS`, with a heartbeat timeout of 30 s and no
    reconciliation (heartbeats listing no runs)."""
    settings = DispatcherSettings(
        heartbeat_timeout_s=30.0, reconcile_misses=0, kafka_bootstrap="unused:1", redis_url="redis://unused"
    )
    svc = DispatcherService(settings, clock, publish, consumed=INPUTS)
    svc.token = 7
    return svc


def quiet_term(svc: DispatcherService, settings: DispatcherSettings, now: Callable[[], float], **kw: Any) -> Term:
    """A leader's :class:`Term` with nothing of Kafka or Redis: no lease, flush, read model, snapshot or commit
    (each a no-op unless ``kw`` gives it), ``now`` as its wall clock, ``kw`` as given (``reachable``, ``ends``,
    ``positions``, ``pending``, ``settle``, or one of the no-ops)."""
    parts: dict[str, Any] = {
        "check_lease": lambda: None,
        "lost": threading.Event(),
        "flush": lambda: None,
        "check_delivered": lambda: None,
        "write_read_model": lambda: None,
        "write_snapshot": lambda: None,
        "commit": lambda: None,
    }
    return Term(svc, settings, {"queue": NoQueue()}, now=now, **{**parts, **kw})


def log_records(log: ListLog) -> list[LogRecord]:
    """Every record of ``log`` decoded, as the audit reads them (:func:`apportion.logrecord.log_order`)."""
    out = []
    for r in log.records:
        ev = events.decode(r.value) if r.value is not None else None
        out.append(LogRecord(r.topic, r.partition, r.offset, r.key.decode() if r.key else None, 0, r.value, ev))
    out.sort(key=log_order)
    return out


def service(log: ListLog, *, echoes: bool, token: int = 7) -> DispatcherService:
    settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
    svc = DispatcherService(settings, ManualClock(T0), log.publish, consumed=INPUTS if echoes else ())
    svc.token = token
    return svc


def drive(svc: DispatcherService, log: ListLog) -> None:
    """What ``_lead`` does per poll, until the log is read to its end."""
    while batch := log.read():
        out, news = svc.ingest(batch)
        if news:
            out += svc.tick()
        svc._emit(out)


def submit(job_id: str, budget: str, gpus: int, min_runtime_s: float = 60.0, ts: datetime = T0) -> JobSubmitted:
    """A submission signed by the test user, submitted (and stamped) at ``ts``."""
    return USER.sign(
        JobSubmitted(
            event_id=events.det_id("test", job_id),
            job_id=job_id,
            budget=budget,
            user="u",
            gpus_per_replica=gpus,
            min_runtime_s=min_runtime_s,
            duration_s=600.0,
            submitted_at=ts,
            ts=ts,
            producer="test",
        )
    )


def history() -> list[list[Event]]:
    """Rounds of outside input: budgets and two 4-GPU nodes, then submissions, then a start report."""
    return [
        [
            BudgetSet(event_id=events.det_id("test", p), path=p, share=s, ts=T0, producer="test")
            for p, s in (("lab", 1.0), ("lab/a", 0.5), ("lab/b", 0.5))
        ]
        + [
            NodeRegistered(event_id=events.det_id("test", n), node_id=n, gpu_count=4, ts=T0, producer="test")
            for n in ("n1", "n2")
        ]
        + [registered(USER, T0)],
        [submit("j1", "lab/a", 2), submit("j2", "lab/b", 4), submit("j3", "lab/a", 4)],
        [
            JobStarted(
                event_id=events.det_id("test", "started"),
                job_id="j1",
                attempt=1,
                node_id="n1",
                gpus=(0, 1),
                ts=T0,
                producer="agent",
            ),
            submit("j4", "lab/b", 2, min_runtime_s=0),
        ],
    ]
