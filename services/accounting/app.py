"""Accounting wiring: jobs, nodes and budgets in; OccupancySnapshot and a Redis read model out.

Consumes ``apportion.jobs``, ``apportion.nodes`` and ``apportion.budgets``;
produces ``OccupancySnapshot`` on ``apportion.usage`` (and ``DeadLetter`` for
records that do not decode); writes ``apportion:rm:budgets`` and
``apportion:rm:usage`` in Redis.

State and restarts: **every start rebuilds from offset 0.** The three topics
are read up to their end offsets as of the start, merged in the documented
log order ((event time, topic, partition, offset), as the audit does) and
bulk-folded (:func:`services.accounting.logic.rebuild`); then the service
follows new records live, sorting each polled batch the same way. The
committed offsets (group ``accounting``) are written after the read model
and also stored in it, for lag monitoring; a start does not resume from
them because an exact window needs the log, not a checkpoint, and the
rebuild of a busy week is seconds (DESIGN section 9). ``--rebuild`` also
wipes the Redis read model first, so a reader never sees rows of budgets
that no longer exist.

Why not faust here: faust (like the group-based
:class:`~apportion.bus.consumer.EventConsumer`) resumes from committed
offsets and cannot say "read these three topics from 0, tell me when you
reached today's end, in a deterministic merged order" without fighting its
assignor; :class:`services._common.AssignedConsumer` does that in a few
lines with kafka-python.

Snapshots: after changes, debounced by ``snapshot_debounce_wall_s`` wall
seconds, at event time ``max(ledger clock, last snapshot's at)``; and
periodically at each multiple of ``snapshot_interval_s`` event seconds
passed by the service clock. Each snapshot is published (acked) before the
read model is written and the offsets committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from apportion.clock import Clock
from apportion.events import DeadLetter, Event, OccupancySnapshot
from apportion.timeutil import to_us
from services.accounting import logic
from services.accounting.config import AccountingSettings
from services.accounting.store import ReadModelStore

log = logging.getLogger("apportion.accounting")


class AccountingService:
    """The accounting loop without Kafka: ingest records, publish snapshots, store the read model.

    Args:
        settings: configuration.
        clock: event-time source (periodic snapshots).
        publish: ``publish(event)``, blocking until acked.
        store: the read-model store.
        metrics: optional prometheus metrics dict.
    """

    def __init__(self, settings: AccountingSettings, clock: Clock, publish: Callable[[Event], Any],
                 store: ReadModelStore, metrics: dict | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.publish = publish
        self.store = store
        self.acc = logic.Accounting(settings.window_s)
        self.last: OccupancySnapshot | None = None
        self.dirty = False
        self.offsets: dict[str, int] = {}
        self._m = metrics or {}

    def _decoded(self, records: list[Any]) -> list[tuple[Any, Event]]:
        from services._common import decode_record, record_order

        out = []
        for rec in records:
            ev, letter = decode_record(rec, self.settings.producer_name, self.clock.now())
            self.offsets[f"{rec.topic}:{rec.partition}"] = rec.offset + 1
            if letter is not None:
                self._dead_letter(letter)
                continue
            out.append((rec, ev))
        out.sort(key=lambda re: record_order(re[0], re[1]))
        return out

    def _dead_letter(self, letter: DeadLetter) -> None:
        log.warning("dead-lettering %s[%s]@%s: %s", letter.source_topic, letter.source_partition,
                    letter.source_offset, letter.error)
        self.publish(letter)
        if "dead" in self._m:
            self._m["dead"].inc()

    def bootstrap(self, records: list[Any]) -> OccupancySnapshot | None:
        """Bulk-build from every record up to the start's end offsets; publish the first snapshot."""
        evs = [ev for _, ev in self._decoded(records)]
        self.acc = logic.rebuild(evs, self.settings.window_s)
        if "events" in self._m:
            self._m["events"].inc(len(evs))
        log.info("rebuilt from %d events (ledger clock %s, %d budgets)", len(evs),
                 self.acc.clock_us, len(self.acc.tree))
        return self.snapshot_now() if self.acc.clock_us is not None or len(self.acc.tree) else None

    def ingest(self, records: list[Any]) -> None:
        """Fold a live batch (sorted into log order first)."""
        for _, ev in self._decoded(records):
            self.dirty |= self.acc.apply(ev)
            if "events" in self._m:
                self._m["events"].inc()

    def due(self) -> int | None:
        """Event time (µs) of the periodic snapshot due now, or ``None``."""
        last = to_us(self.last.at) if self.last else None
        return logic.periodic_due(last, self.clock.now_us(), self.acc.clock_us,
                                  self.settings.snapshot_interval_s)

    def snapshot_now(self, at_us: int | None = None) -> OccupancySnapshot | None:
        """Publish the snapshot at ``at_us`` (default: max(ledger clock, last at)) and store it."""
        if at_us is None:
            cands = [t for t in (self.acc.clock_us, to_us(self.last.at) if self.last else None) if t is not None]
            at_us = max(cands) if cands else self.clock.now_us()
        snap = self.acc.snapshot(at_us)
        if snap is None:
            return None
        self.publish(snap)
        meta, rows = logic.read_model(snap, self.acc.tree, self.offsets)
        self.store.write(meta, rows)
        self.last, self.dirty = snap, False
        if "snapshots" in self._m:
            self._m["snapshots"].inc()
            self._m["at"].set(to_us(snap.at) / 1e6)
        return snap


def _metrics(registry: Any) -> dict:
    from prometheus_client import Counter, Gauge

    return {
        "events": Counter("apportion_accounting_events", "Events folded", registry=registry),
        "dead": Counter("apportion_accounting_dead_letters", "Records dead-lettered", registry=registry),
        "snapshots": Counter("apportion_accounting_snapshots", "Snapshots published", registry=registry),
        "at": Gauge("apportion_accounting_snapshot_at_seconds", "Event time of the last snapshot",
                    registry=registry),
    }


async def run(settings: AccountingSettings, stop: asyncio.Event, *, clock: Clock | None = None,
              ready: asyncio.Event | None = None) -> None:
    """Run accounting until ``stop`` is set.

    Args:
        settings: configuration (:mod:`services.accounting.config`).
        stop: set it to shut down (SIGTERM does, from ``__main__``).
        clock: event-time source; default from settings.
        ready: set once the rebuild is done and the first snapshot (if any) is stored.
    """
    import redis as redis_lib

    from apportion.bus.producer import EventProducer
    from apportion.topics import BUDGETS, JOBS, NODES
    from services._common import AssignedConsumer, start_metrics

    clock = clock or settings.make_clock()
    conn = settings.connection()
    registry, stop_metrics = start_metrics(settings.metrics_port, settings.metrics_host)
    r = redis_lib.Redis.from_url(conn.redis_url)
    store = ReadModelStore(r)
    if settings.rebuild:
        store.wipe()
        log.info("--rebuild: read model wiped")
    producer = await asyncio.to_thread(EventProducer, conn.bootstrap, client_id="accounting")
    consumer = await asyncio.to_thread(AssignedConsumer, conn.bootstrap,
                                       [JOBS.name, NODES.name, BUDGETS.name], settings.group_id)
    svc = AccountingService(settings, clock, producer.publish, store, _metrics(registry))
    loop = asyncio.get_running_loop()
    try:
        caught = await consumer.catch_up(stop)
        if caught is None:
            return
        backlog, late = caught  # the log as of the start: bulk rebuild; appended meanwhile: folded live
        await asyncio.to_thread(svc.bootstrap, backlog)
        if late:
            svc.ingest(late)
        await asyncio.to_thread(consumer.commit)
        if ready is not None:
            ready.set()
        last_pub = loop.time()
        while not stop.is_set():
            batch = await asyncio.to_thread(consumer.poll, 200)
            if batch:
                svc.ingest(batch)
            now = loop.time()
            published = False
            if svc.dirty and now - last_pub >= settings.snapshot_debounce_wall_s:
                published = await asyncio.to_thread(svc.snapshot_now) is not None
            elif (at := svc.due()) is not None:
                published = await asyncio.to_thread(svc.snapshot_now, at) is not None
            if published:
                last_pub = now
                await asyncio.to_thread(consumer.commit)
    finally:
        await asyncio.to_thread(consumer.close)
        await asyncio.to_thread(producer.close)
        r.close()
        stop_metrics()

