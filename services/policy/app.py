"""Policy wiring: budgets and snapshots in; BudgetRejected and FairShareRanking out.

Consumes ``apportion.budgets`` (from offset 0, every start) and
``apportion.usage`` (only the newest record of each partition at start, then
live); produces ``BudgetRejected`` on ``apportion.budgets`` and
``FairShareRanking`` on ``apportion.ranking`` (and ``DeadLetter``).

Start-up: the budgets log is folded up to its end offset as of the start
*before* anything is published, because the policy's own earlier
``BudgetRejected`` events are further down the log than the changes they
reject; only changes still unanswered after the catch-up are rejected
(:func:`services.policy.logic.decide`). Published events have ids derived
from their inputs, so a crash between publishing and committing only
produces duplicates that readers drop. Why not faust: see
:class:`services._common.AssignedConsumer`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apportion.clock import Clock
from services.policy import logic
from services.policy.config import PolicySettings

log = logging.getLogger("apportion.policy")


class PolicyService:
    """The policy loop without Kafka: fold records, publish what :func:`logic.decide` says.

    Args:
        clock: event time for rejections and snapshot-less rankings.
        publish: ``publish(event)``, blocking until acked.
        name: ``producer`` for dead letters.
    """

    def __init__(self, clock: Clock, publish: Any, name: str = "policy", metrics: dict | None = None) -> None:
        self.clock = clock
        self.publish = publish
        self.name = name
        self.state = logic.PolicyState()
        self._m = metrics or {}

    def fold(self, records: list[Any]) -> None:
        """Fold records (in their topic-partition offset order); dead-letter undecodable ones."""
        from services._common import decode_record

        for rec in records:
            ev, letter = decode_record(rec, self.name, self.clock.now())
            if letter is not None:
                log.warning("dead-lettering %s@%s: %s", rec.topic, rec.offset, letter.error)
                self.publish(letter)
                continue
            self.state = logic.evolve(self.state, ev)

    def flush(self) -> list[Any]:
        """Publish the rejections and ranking now owed; returns them."""
        self.state, out = logic.decide(self.state, self.clock.now())
        for ev in out:
            self.publish(ev)
            if ev.type == "BudgetRejected":
                log.warning("rejected budget change %s: %s", ev.path, ev.message)
            if "published" in self._m:
                self._m["published"].labels(type=ev.type).inc()
        return out


async def run(settings: PolicySettings, stop: asyncio.Event, *, clock: Clock | None = None,
              ready: asyncio.Event | None = None) -> None:
    """Run the policy service until ``stop`` is set (``ready`` set after the catch-up)."""
    from prometheus_client import Counter

    from apportion.bus.producer import EventProducer
    from apportion.topics import BUDGETS, USAGE
    from services._common import AssignedConsumer, start_metrics

    clock = clock or settings.make_clock()
    conn = settings.connection()
    registry, stop_metrics = start_metrics(settings.metrics_port, settings.metrics_host)
    metrics = {"published": Counter("apportion_policy_published", "Events published", ["type"],
                                    registry=registry)}
    producer = await asyncio.to_thread(EventProducer, conn.bootstrap, client_id="policy")
    consumer = await asyncio.to_thread(AssignedConsumer, conn.bootstrap, [BUDGETS.name, USAGE.name],
                                       settings.group_id, tail={USAGE.name: 1})
    svc = PolicyService(clock, producer.publish, settings.producer_name, metrics)
    try:
        while not await asyncio.to_thread(consumer.caught_up):
            if stop.is_set():
                return
            svc.fold(await asyncio.to_thread(consumer.poll, 200))
        await asyncio.to_thread(svc.flush)
        await asyncio.to_thread(consumer.commit)
        log.info("caught up: %d budgets", len(svc.state.tree))
        if ready is not None:
            ready.set()
        while not stop.is_set():
            batch = await asyncio.to_thread(consumer.poll, 200)
            if batch:
                svc.fold(batch)
                await asyncio.to_thread(svc.flush)
                await asyncio.to_thread(consumer.commit)
    finally:
        await asyncio.to_thread(consumer.close)
        await asyncio.to_thread(producer.close)
        stop_metrics()
