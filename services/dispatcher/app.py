"""Dispatcher wiring: queue and cluster state from the log, decisions and commands out.

Consumes ``apportion.submissions``, ``apportion.jobs``, ``apportion.nodes`` and ``apportion.budgets``;
produces the decisions and commands; writes ``apportion:rm:jobs`` and ``apportion:rm:nodes`` in Redis. What
a term does (rebuild, pacing, fencing, echoes): :mod:`services.dispatcher.service`; the lease:
:mod:`services.dispatcher.lease`; the Redis writes: :mod:`services.dispatcher.store`. Outages:
:func:`apportion.bus.resilience.supervise` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from apportion.bus.resilience import pause
from apportion.clock import Clock
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import BATCH_BYTES, LINGER_MS, DispatcherService, LeadershipLost, Term

log = logging.getLogger("apportion.dispatcher")


async def run(
    settings: DispatcherSettings, stop: asyncio.Event, *, clock: Clock | None = None, ready: asyncio.Event | None = None
) -> None:
    """Run the dispatcher until ``stop`` is set: standby until leader, then decide; never exits on an outage.

    The standby-and-lead loop runs under :func:`apportion.bus.resilience.supervise`: it waits for Kafka and
    Redis (a log line per try), and an error of either (a Redis restart under the lease, a broker outage
    while leading, a decision the producer could not deliver) ends the term, is logged in one line and,
    after a backoff, the instance stands by again (a new term rebuilds from the log). ``/ready`` on the
    metrics port answers 200 once the instance stands by or leads with its state rebuilt.

    Args:
        settings: configuration (:mod:`services.dispatcher.config`).
        stop: set it to shut down (SIGTERM does, from ``__main__``).
        clock: event-time source; default from settings.
        ready: set once this instance leads and has rebuilt its state.
    """
    import redis as redis_lib

    from apportion.bus.security import redis_auth
    from apportion.bus.service import wire
    from apportion.metrics import dispatcher_metrics
    from apportion.topics import COMMANDS, JOBS, NODES
    from services.dispatcher.lease import Lease, highest_token_in_log

    w = wire(settings, clock)
    conn, readiness = w.conn, w.readiness
    metrics = dispatcher_metrics(w.registry, w.clock.now)
    w.watch_reader(metrics["reader"])
    r = redis_lib.Redis.from_url(conn.redis_url, **redis_auth())
    lease = Lease(r, settings.owner(), settings.lease_ttl_wall_s)

    async def session() -> None:
        while not stop.is_set():
            floor: int | None = None
            if not await asyncio.to_thread(lease.held_by_another):  # a take-over is possible: pay for the floor
                try:  # the newest token in the log is the floor: a Redis that lost its counter cannot go back
                    floor = await asyncio.to_thread(
                        highest_token_in_log, conn.bootstrap, [COMMANDS.name, JOBS.name, NODES.name]
                    )
                except Exception as exc:  # Kafka unreachable: never lead without a floor
                    log.warning("cannot read the newest fencing token from the log (%s): standing by", exc)
            token = await asyncio.to_thread(lease.try_acquire, floor) if floor is not None else 0
            if not token:
                if floor is not None:
                    readiness.set(True)  # standing by, both dependencies answered
                if await pause(stop, settings.lease_ttl_wall_s / 3):  # standby: wait a third of the TTL
                    return
                continue
            log.info("leading with fencing token %d", token)
            metrics["leader"].set(1)
            readiness.set(False, "rebuilding as the leader")
            try:
                await _lead(settings, stop, w, r, lease, metrics, ready)
            except LeadershipLost:
                log.error("lease lost: stopping decisions, back to standby")
            finally:
                metrics["leader"].set(0)

    try:
        await w.supervise("dispatcher", session, stop)
    finally:
        try:
            await asyncio.to_thread(lease.release)
        except Exception as exc:  # noqa: BLE001 - Redis gone at shutdown: the lease expires by itself
            log.warning("could not release the lease (%s); it expires in %.0f s", exc, settings.lease_ttl_wall_s)
        r.close()


async def _lead(
    settings: DispatcherSettings,
    stop: asyncio.Event,
    w: Any,
    r: Any,
    lease: Any,
    metrics: dict,
    ready: asyncio.Event | None,
) -> None:
    """One term as the leader: rebuild from the snapshot (if it fits) and the log, then decide until ``stop``."""
    from apportion.audit.config import configured_event
    from apportion.bus.consumer import AssignedConsumer
    from apportion.bus.crc import use_compiled_crc32c
    from apportion.bus.producer import EventProducer
    from apportion.bus.service import close_quietly, commit_quietly, follow
    from apportion.identity import decision_signer
    from apportion.timeutil import from_us
    from apportion.topics import BUDGETS, JOBS, NODES, SUBMISSIONS
    from services.dispatcher import store
    from services.dispatcher.lease import LeaseKeeper

    log.info("record-batch CRC-32C: %s", use_compiled_crc32c())
    clock, conn = w.clock, w.conn
    signer = await asyncio.to_thread(  # every decision is signed with service:dispatcher's key (docs/security.md)
        lambda: decision_signer(key_file=settings.dispatcher_key, bootstrap=conn.bootstrap, now=clock.now())
    )
    producer = await asyncio.to_thread(
        EventProducer, conn.bootstrap, client_id="dispatcher", linger_ms=LINGER_MS, batch_size=BATCH_BYTES
    )
    undelivered: list[BaseException] = []

    def publish(sent: list[Any]) -> None:  # not waiting for acks: the loop flushes when idle (Term.handle)
        for e, value in sent:  # one never delivered ends the term: the next re-derives it (same ids)
            producer.send(e, value).add_errback(undelivered.append)

    def check_delivered() -> None:
        if undelivered:
            raise RuntimeError(f"a decision was not delivered ({undelivered[0]!r}): rebuilding from the log")

    inputs = [SUBMISSIONS.name, JOBS.name, NODES.name, BUDGETS.name]
    consumer = await asyncio.to_thread(AssignedConsumer, conn.bootstrap, inputs, "dispatcher")
    svc = w.current["svc"] = DispatcherService(settings, clock, publish, metrics, consumed=inputs, signer=signer)
    svc.token = lease.token
    consumer.lag.sink = metrics["reader"].set_lag
    loop = asyncio.get_running_loop()
    every = settings.lease_ttl_wall_s / 3
    keeper = LeaseKeeper(lease, every, stall_s=max(30.0, 10 * settings.lease_ttl_wall_s)).start()

    def check_lease() -> None:  # by the keeper, and by the local lease clock (it counts through a SIGSTOP)
        if keeper.lost.is_set() or lease.expires_in() <= settings.lease_ttl_wall_s / 3:
            raise LeadershipLost()

    async def beats() -> None:  # the event loop's sign of life for the keeper
        while True:
            keeper.beat()
            await asyncio.sleep(every)

    term = Term(
        svc,
        settings,
        metrics,
        check_lease=check_lease,
        lost=keeper.lost,
        flush=producer.flush,
        check_delivered=check_delivered,
        write_read_model=lambda: store.write_read_model(r, svc, metrics),
        write_snapshot=lambda: store.write_snapshot(r, svc),
        commit=lambda: commit_quietly(consumer),
        now=loop.time,
    )
    beating = asyncio.create_task(beats(), name="lease-beats")
    try:
        t_start = loop.time()
        snap = await asyncio.to_thread(store.load_snapshot, r, settings, *consumer.offsets_at_start())
        if snap is not None:
            lease.observe(snap.fencing_token)
            if snap.fencing_token > lease.token:  # a newer leader stored it: we are deposed
                raise LeadershipLost()
            svc.restore(snap)
            consumer.seek(snap.offsets)
        if (caught := await consumer.catch_up(stop)) is None:
            return
        configured = configured_event(
            svc.cfg,
            instance=settings.owner(),
            fencing_token=lease.token,
            ts=from_us(svc.now_us()),
            producer=settings.producer_name,
        )
        await term.start(*caught, configured, lease)
        log.info(
            "started from %s: %d records read, rebuilt in %.2f s",
            "a snapshot" if snap else "offset 0",
            len(caught[0]),
            loop.time() - t_start,
        )
        w.became_ready(ready)
        await follow(consumer.poll, term.handle, stop, term.poll_ms)
    finally:
        beating.cancel()
        await asyncio.to_thread(keeper.stop)
        log.info("stopped leading: %d own decisions read back without decoding", svc.echoes_skipped)
        await close_quietly(consumer, producer)
