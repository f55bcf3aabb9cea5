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
from services.policy.config import PolicySettings
from services.policy.service import PolicyApp, PolicyService, catch_up

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
    coordinator_waits_at_info()
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
    outbox: list[Any] = []
    svc = PolicyService(clock, outbox.append, settings.producer_name, metrics, settings.window_s)
    current["svc"] = svc
    datadir = tempfile.mkdtemp(prefix="apportion-policy-", dir=settings.faust_dir)
    pol = None
    try:
        if not await catch_up(svc, bootstrap, settings.group_id, stop):
            return
        pol = PolicyApp(settings, bootstrap, datadir, svc, outbox)
        await pol.app.start()
        await pol.decide()
        log.info("caught up: %d budgets", len(svc.state.tree))
        started()
        await pol.run_until(stop, metrics["reader"])
    finally:
        if pol is not None:
            await pol.stop()
        shutil.rmtree(datadir, ignore_errors=True)


#: The logger of aiokafka's group coordinator, under which the faust app's consumer looks for its group.
GROUP_COORDINATOR_LOGGER = "aiokafka.consumer.group_coordinator"

#: How long the coordinator may stay unavailable before a lookup's failure is a WARNING that says what to check.
COORDINATOR_PATIENCE_S = 30.0


class CoordinatorWait(logging.Filter):
    """aiokafka logs each failed lookup of the group's coordinator at ERROR, those it retries too. A fresh broker
    answers "not available" (Kafka error 15) until it has made its offsets topic, which the first lookup makes it
    create; one that is loading the topic or has moved the group answers 14 or 16. Such a failure, retriable
    (``KafkaError.retriable``), is part of a normal start: INFO, saying it waits. Past
    :data:`COORDINATOR_PATIENCE_S` since the first (by the records' own times) it is a WARNING that says what
    to check. A failure aiokafka does not retry stays an ERROR."""

    def __init__(self) -> None:
        super().__init__()
        self.first_s: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.args[0] if isinstance(record.args, tuple) and record.args else None
        if not (record.msg == "Group Coordinator Request failed: %s" and getattr(err, "retriable", False)):
            return True
        if self.first_s is None:
            self.first_s = record.created
        waited = record.created - self.first_s
        if waited < COORDINATOR_PATIENCE_S:
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg = "waiting for the group coordinator (%s): the broker may still be creating its offsets topic"
            record.args = (err,)
        else:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = (
                "no group coordinator after %.0f s (%s): check that the brokers are up and that the broker's "
                "offsets.topic.replication.factor is at most the number of brokers; retrying"
            )
            record.args = (waited, err)
        return True


def coordinator_waits_at_info() -> None:
    """Put :class:`CoordinatorWait` on aiokafka's group coordinator logger (once)."""
    logger = logging.getLogger(GROUP_COORDINATOR_LOGGER)
    if not any(isinstance(f, CoordinatorWait) for f in logger.filters):
        logger.addFilter(CoordinatorWait())
