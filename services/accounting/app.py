"""Accounting wiring: jobs, nodes and budgets in; OccupancySnapshot and a Redis read model out.

Consumes ``apportion.jobs``, ``apportion.nodes`` and ``apportion.budgets``; produces ``OccupancySnapshot`` on
``apportion.usage`` (and ``DeadLetter``); writes ``apportion:rm:budgets``, ``apportion:rm:usage`` and its
checkpoint ``apportion:ckpt:accounting`` in Redis. What a start does (resume from the checkpoint or rebuild
from offset 0), when snapshots and checkpoints are written: :mod:`services.accounting.service`. Outages:
each connected session runs under :func:`apportion.bus.resilience.supervise` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from apportion.clock import Clock
from apportion.settings import topic_name
from services.accounting.config import AccountingSettings
from services.accounting.service import AccountingService, StartReport

log = logging.getLogger("apportion.accounting")


async def run(
    settings: AccountingSettings,
    stop: asyncio.Event,
    *,
    clock: Clock | None = None,
    ready: asyncio.Event | None = None,
    on_start: Callable[[StartReport], None] | None = None,
) -> None:
    """Run accounting until ``stop`` is set, riding out Kafka and Redis outages of any length.

    A session that fails (broker or Redis gone, a snapshot that could not be published) is started again
    after a backoff and resumes from the checkpoint; ``/ready`` on the metrics port answers 503 until a
    session has caught up, and while a dependency does not answer.

    Args:
        settings: configuration (:mod:`services.accounting.config`).
        stop: set it to shut down (SIGTERM does, from ``__main__``).
        clock: event-time source; default from settings.
        ready: set once the first connected session is caught up with the log as of its start and stored its snapshot.
        on_start: called with each session's :class:`StartReport` just before it is ready.
    """
    from apportion.bus.service import wire
    from apportion.heap import settle_heap
    from apportion.metrics import accounting_metrics

    # the start folds the whole log into a ledger of hundreds of thousands of long-lived objects: with the
    # collector's default thresholds the bulk rebuild of 1,000,000 events spent 13% of its CPU time collecting
    settle_heap()
    w = wire(settings, clock)
    metrics = accounting_metrics(w.registry)
    w.watch_reader(metrics["reader"])
    rebuild = [settings.rebuild]  # --rebuild applies to the first connected session only; later ones resume

    def started(report: StartReport) -> None:
        rebuild[0] = False
        settle_heap()  # the rebuilt ledger leaves the collector's working set (rule D9.scale)
        if on_start is not None:
            on_start(report)
        w.became_ready(ready)

    async def session() -> None:
        await _session(settings, stop, w.clock, w.conn, metrics, w.current, rebuild[0], started)

    await w.supervise("accounting", session, stop)


async def _session(
    settings: AccountingSettings,
    stop: asyncio.Event,
    clock: Clock,
    conn: Any,
    metrics: dict,
    current: dict[str, AccountingService],
    rebuild: bool,
    started: Callable[[StartReport], None],
) -> None:
    """One connected run: start, then follow live until ``stop``; raises when a dependency fails. The final
    checkpoint is stored only on a clean stop (a failed session never stores offsets past what it folded)."""
    import redis as redis_lib

    from apportion.bus.consumer import AssignedConsumer
    from apportion.bus.producer import EventProducer
    from apportion.bus.security import redis_auth
    from apportion.bus.service import close_quietly
    from apportion.topics import BUDGETS, JOBS, NODES
    from services.accounting.store import ReadModelStore

    r = redis_lib.Redis.from_url(conn.redis_url, **redis_auth())
    store, producer, consumer = ReadModelStore(r), None, None
    try:
        if rebuild:
            await asyncio.to_thread(store.wipe)
            log.info("--rebuild: read model and checkpoint wiped")
        producer = await asyncio.to_thread(EventProducer, conn.bootstrap, client_id="accounting")
        topics = [topic_name(JOBS), topic_name(NODES), topic_name(BUDGETS)]
        consumer = await asyncio.to_thread(AssignedConsumer, conn.bootstrap, topics, settings.group_id)
        svc = current["svc"] = AccountingService(settings, clock, producer.publish, store, metrics, stopped=stop.is_set)
        consumer.lag.sink = metrics["reader"].set_lag
        await svc.serve(consumer, stop, rebuild, started)
    finally:
        await close_quietly(consumer, producer, r)
