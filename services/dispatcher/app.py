"""Dispatcher wiring: queue and cluster state from the log, decisions and commands out.

Consumes ``apportion.submissions``, ``apportion.jobs``, ``apportion.nodes`` and ``apportion.budgets``;
produces the decisions and commands; writes ``apportion:rm:jobs`` and ``apportion:rm:nodes`` in Redis. What
a term does (rebuild, pacing, fencing, echoes) and how it is wired: :mod:`services.dispatcher.service`; the lease:
:mod:`services.dispatcher.lease`; the Redis writes: :mod:`services.dispatcher.store`. Outages:
:func:`apportion.bus.resilience.supervise` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Any

from apportion.clock import Clock
from apportion.settings import topic_name
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.lease import LeadershipLost
from services.dispatcher.service import (
    BATCH_BYTES,
    LINGER_MS,
    DispatcherService,
    KeysMoved,
    lead_term,
    rebuild_and_start,
)

log = logging.getLogger("apportion.dispatcher")


async def run(
    settings: DispatcherSettings, stop: asyncio.Event, *, clock: Clock | None = None, ready: asyncio.Event | None = None
) -> None:
    """Run the dispatcher until ``stop`` is set: stand by until leader, then decide; never exits on an outage.

    Under :func:`apportion.bus.resilience.supervise`: an error of Kafka or Redis (a Redis restart under the
    lease, a broker outage while leading, a decision not delivered) ends the term, is logged in one line and,
    after a backoff, the instance stands by again (a new term rebuilds from the log). ``/ready`` answers 200
    once the instance stands by or leads with its state rebuilt; ``ready`` is set when it leads rebuilt.
    ``clock``: event-time source (default from ``settings``, :mod:`services.dispatcher.config`).
    """
    import redis as redis_lib

    from apportion.bus.security import redis_auth
    from apportion.bus.service import wire
    from apportion.metrics import dispatcher_metrics
    from services.dispatcher.lease import Lease, lead_when_elected

    w = wire(settings, clock)
    metrics = dispatcher_metrics(w.registry, w.clock.now)
    w.watch_reader(metrics["reader"])
    r = redis_lib.Redis.from_url(w.conn.redis_url, **redis_auth())
    lease = Lease(r, settings.owner(), settings.lease_ttl_wall_s)

    async def terms() -> None:  # one after another while a term ends on keys it had not read (KeysMoved)
        while await _lead(settings, stop, w, r, lease, metrics, ready):
            # the next term's init_transactions fences whoever holds the transactional id: only while the
            # lease is still ours (renewed, never a new token); else back to standby, which acquires anew
            if not await asyncio.to_thread(lease.renew):
                return
            log.info("leading again with token %d, rebuilt from the log with the keys read", lease.token)

    async def standby_and_lead() -> None:
        await lead_when_elected(lease, w.conn.bootstrap, w.readiness, stop, metrics["leader"], terms)

    try:
        await w.supervise("dispatcher", standby_and_lead, stop)
    finally:
        await asyncio.to_thread(lease.release)  # a standby takes over at once; the lease expires if Redis is gone
        r.close()


async def _lead(
    settings: DispatcherSettings,
    stop: asyncio.Event,
    w: Any,
    r: Any,
    lease: Any,
    metrics: dict,
    ready: asyncio.Event | None,
) -> bool:
    """One term as the leader: rebuild from the snapshot (if it fits) and the log, then decide until ``stop``.

    Returns True when the term ended on key events it had not read when it judged a batch that they bear on
    (:class:`KeysMoved`, rule D10.proven-user): its open transaction is aborted, and the next term rebuilds
    from the log, judging that batch with them."""
    from apportion.bus.consumer import AssignedConsumer
    from apportion.bus.producer import EventProducer, Unacked, is_fenced
    from apportion.bus.service import close_quietly, follow, open_in_thread
    from apportion.signers import decision_signer
    from apportion.topics import BUDGETS, JOBS, NODES, SUBMISSIONS
    from services.dispatcher.lease import LeaseKeeper

    conn, loop, inputs = w.conn, asyncio.get_running_loop(), list(map(topic_name, (SUBMISSIONS, JOBS, NODES, BUDGETS)))
    signer = await asyncio.to_thread(  # every decision is signed with service:dispatcher's key (docs/security.md)
        lambda: decision_signer(key_file=settings.dispatcher_key, bootstrap=conn.bootstrap, now=w.clock.now())
    )
    producer = await open_in_thread(  # a cancel meanwhile closes it once made (a stop leaves no client running)
        partial(
            EventProducer,
            conn.bootstrap,
            client_id="dispatcher",
            transactional_id=settings.transactional_id(),
            transaction_timeout_s=settings.transaction_timeout_wall_s,
            linger_ms=LINGER_MS,
            batch_size=BATCH_BYTES,
        )
    )
    consumer = None
    try:
        # Before reading the log: this fences every earlier leader's producer (its open transaction is
        # aborted, its next send or commit fails), so what the rebuild reads is all a stale leader will
        # ever have made visible (docs/leadership.md).
        await asyncio.to_thread(producer.init_transactions)
        sends = Unacked(producer, transactional=True)  # one transaction per loop iteration (Term.handle)
        # the key read-ahead overlaps the decisions: each commit waits for it (Term.prove)
        consumer = await open_in_thread(partial(AssignedConsumer, conn.bootstrap, inputs, "dispatcher", overlap=True))
    except BaseException:
        await close_quietly(consumer, producer)
        raise
    svc = w.current["svc"] = DispatcherService(
        settings, w.clock, sends.send_all, metrics, consumed=inputs, signer=signer
    )
    svc.token = lease.token
    consumer.lag.sink = metrics["reader"].set_lag
    consumer.own = svc.is_echo  # a poll of only our own decisions coming back needs no key read-ahead
    keeper = LeaseKeeper.for_ttl(lease, settings.lease_ttl_wall_s).start()
    term = lead_term(svc, settings, metrics, keeper, sends, consumer, r, loop.time)
    beating = asyncio.create_task(keeper.beats(), name="lease-beats")
    try:
        if not await rebuild_and_start(term, settings, consumer, r, lease, stop):
            return False
        w.became_ready(ready)
        await follow(consumer.poll, term.handle, stop, term.poll_ms)
        await asyncio.to_thread(term.close)  # a clean stop: commit what is open (the lease checked)
        return False
    except KeysMoved as exc:
        log.warning("%s: its decisions are aborted and decided again after a rebuild", exc)
        if sends.open:  # raises when the broker is gone (the next term's init_transactions aborts it then)
            await asyncio.to_thread(producer.abort)
        return not stop.is_set()
    except Exception as exc:
        # a newer leader took the transactional id over (it took the lease first, so the lease says so
        # even while kafka-python still takes the refused produce for an epoch to bump)
        if is_fenced(exc) or producer.fenced() or not keeper.holds():
            raise LeadershipLost() from exc
        if sends.open:  # not fenced: abort, so that readers do not wait at it until the timeout
            await asyncio.to_thread(_abort_quietly, producer)
        raise
    finally:
        beating.cancel()
        await asyncio.to_thread(keeper.stop)
        log.info("stopped leading: %d own decisions read back without decoding", svc.echoes_skipped)
        await close_quietly(consumer, producer)


def _abort_quietly(producer: Any) -> None:
    """Abort the producer's open transaction; a failure (the broker is gone) is only logged: the next
    leader's ``init_transactions`` or the transaction timeout aborts it then."""
    from apportion.bus.resilience import describe

    try:
        producer.abort()
    except Exception as exc:  # noqa: BLE001 - best effort at the end of a failed term
        log.warning("could not abort the open transaction (%s)", describe(exc))
