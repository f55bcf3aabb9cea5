"""Policy wiring: budgets and snapshots in; BudgetRejected and FairShareRanking out (faust, one agent per topic).

How a start catches up, how the agents decide and publish, static membership: :mod:`services.policy.service`.
Outages: each session (catch-up, faust app, decisions owed) runs under
:func:`apportion.bus.resilience.supervise`, and a new session catches up from the log again (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from typing import Any

from apportion.clock import Clock
from apportion.settings import topic_name
from services.policy.config import PolicySettings
from services.policy.service import LAG_EVERY_S, PolicyApp, PolicyService, catch_up

log = logging.getLogger("apportion.policy")


async def run(
    settings: PolicySettings, stop: asyncio.Event, *, clock: Clock | None = None, ready: asyncio.Event | None = None
) -> None:
    """Run the policy service in this event loop until ``stop`` is set, riding out broker outages.

    Each session (:func:`_session`: catch-up, faust app, decisions owed) runs under
    :func:`apportion.bus.resilience.supervise`: it waits for Kafka (a log line per try), and a session that
    fails (broker gone, a failed agent, topics not provisioned) is stopped and started again after a
    backoff; a new session catches up from the log again, so nothing owed is lost. ``ready`` is set (and
    ``/ready`` on the metrics port answers 200) once a session's catch-up is folded, the faust app has
    joined its group and the decisions owed were published (acked).
    """
    from apportion.bus.faust_app import quiet_client_logs
    from apportion.bus.service import wire
    from apportion.metrics import policy_metrics

    quiet_client_logs()
    w = wire(settings, clock, redis=False)
    metrics = policy_metrics(w.registry)
    w.watch_reader(metrics["reader"])

    async def session() -> None:
        await _session(settings, stop, w.clock, w.conn.bootstrap, metrics, w.current, lambda: w.became_ready(ready))

    await w.supervise("policy", session, stop)


async def _session(
    settings: PolicySettings,
    stop: asyncio.Event,
    clock: Clock,
    bootstrap: str,
    metrics: dict,
    current: dict[str, PolicyService],
    started: Any,
) -> None:
    """One connected run: catch up, start the faust app, publish what is owed, follow until ``stop``.

    Raises:
        the exception of a failed agent (after the app stopped), or ``TimeoutError`` when the topics
        do not exist; :func:`run` starts another session.
    """
    from apportion.bus.faust_app import consumer_lag
    from apportion.topics import BUDGETS, USAGE

    outbox: list[Any] = []
    svc = PolicyService(clock, outbox.append, settings.producer_name, metrics, settings.window_s)
    current["svc"] = svc
    datadir = tempfile.mkdtemp(prefix="apportion-policy-", dir=settings.faust_dir)
    app = None
    try:
        if not await catch_up(svc, bootstrap, settings.group_id, stop):
            return
        pol = PolicyApp(settings, bootstrap, datadir, svc, outbox)
        app = pol.app
        await app.start()
        await pol.decide()
        log.info("caught up: %d budgets", len(svc.state.tree))
        started()
        stopping = asyncio.ensure_future(stop.wait())

        async def measure_lag() -> None:  # metrics only: a failed measurement is logged and retried
            while True:
                try:
                    metrics["reader"].set_lag(await consumer_lag(app, (topic_name(BUDGETS), topic_name(USAGE))))
                except Exception:  # noqa: BLE001 - never let the lag gauge stop the service
                    log.warning("could not measure the consumer lag", exc_info=True)
                await asyncio.sleep(LAG_EVERY_S)

        lagging = asyncio.ensure_future(measure_lag())
        try:
            await asyncio.wait([stopping, pol.failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            lagging.cancel()
        if pol.failed.done():
            exc = pol.failed.exception()
            if exc is not None:
                raise exc
    finally:
        if app is not None:
            try:
                await app.stop()
            except Exception as exc:  # noqa: BLE001 - stopping an app whose broker is gone
                log.warning("stopping the faust app failed (%s)", exc)
        shutil.rmtree(datadir, ignore_errors=True)
