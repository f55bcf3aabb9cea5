"""The policy service: its state without Kafka (:class:`PolicyService`) and its faust agents (:class:`PolicyApp`).

Consumes ``apportion.budgets`` and ``apportion.usage`` with a faust app
(:mod:`apportion.bus.faust_app`, consumer group = app id =
``APPORTION_TOPIC_PREFIX`` + ``group_id``), one agent per topic with
``concurrency=1``; produces ``BudgetRejected`` on ``apportion.budgets``,
``FairShareRanking`` on ``apportion.ranking`` and ``DeadLetter`` on
``apportion.deadletter``. The decisions are :mod:`services.policy.logic`.

Group membership is static (``group.instance.id`` = ``instance_id``,
default ``policy-0``): a restart after ``kill -9`` takes the dead member's
place at once, where a dynamic member would wait out faust's 60 s session
timeout before being assigned anything. Run one instance per group: a second
member would take some of the partitions (its tree would then miss the
budget changes the other reads), and a second one with the same instance id
fences the first. A redundant instance needs its own ``group_id`` and
``instance_id``; it then writes the same events with the same ids.

Start-up, in this order:

1. **Catch-up** (kafka-python, manual assignment, no group): fold the
   whole ``apportion.budgets`` log from offset 0 up to its end offset as of
   the start, and the newest record of each ``apportion.usage`` partition.
   Nothing is published yet: the policy's own earlier ``BudgetRejected``
   events are further down the log than the changes they reject, so only
   changes still unanswered after the catch-up are rejected
   (:func:`services.policy.logic.decide`).
2. **faust app started** in the caller's event loop (``await app.start()``,
   a mode service: no worker, no signal handlers, web server off, a fresh
   data dir). Its agents resume from the group's committed offsets
   (``earliest`` on the very first start of a group, which reads every
   snapshot once and discards the older ones); what they meet again that
   the catch-up already folded changes nothing: budget events are folded
   once per event id, an older snapshot is ignored and the same one again
   gives the same ranking id.
3. The decisions owed after the catch-up (and dead letters met by it) are
   published, each acked, then ``ready`` is set. Start to ready takes about 1.3 s on an idle local
   broker (the kafka-python version: 0.2-0.3 s), mostly faust's group join
   and a fixed 1 s sleep in faust's table manager.

An undecodable record is dead-lettered when met, by the catch-up or an
agent, with an id derived from (topic, partition, offset): the catch-up of
a restart writes the same dead letter again, and readers keep one. Each
instance gets a fresh ``apportion-policy-*`` data dir under ``faust_dir``
(the system temp dir by default), removed at stop; a ``kill -9`` leaves an
empty one behind (the memory store keeps nothing on disk).

Why the tree comes from re-reading the budgets log and not from a faust
Table: the log is the source of truth (kept forever, one partition, small:
one event per budget change) and the tree is defined as its fold under the
skip rule (:mod:`services.policy.logic`), including the ``BudgetRejected``
events that sit *after* the changes they name. A Table would be a second
copy of that log: with ``store='memory://'`` faust replays the whole
changelog on every start anyway (no saving), ``rocksdb://`` needs rocksdict
(not a dependency), and a table is sharded by the partition of the event
that writes it, while this state is one value fed by a 1-partition and a
3-partition topic. Re-reading also makes the output independent of when
offsets were committed: each start re-derives every rejection still owed
and the current ranking, so a crash anywhere (after a commit, before a
publish) loses nothing.

Live: each agent folds its event, then, once its stream has nothing more
buffered (faust's ``Channel.queue`` is empty), asks
:func:`~services.policy.logic.decide` what is owed and publishes it,
waiting for the broker's ack before the event is acked; so the changes
fetched together are ranked once, as a poll batch was. One lock
serialises fold + decide + publish across the two agents, so rankings are
written in the order they were decided. Published events have ids derived
from their inputs, so a crash between publishing and committing only
produces duplicates that readers drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from apportion.clock import Clock
from apportion.settings import topic_name, topic_prefix
from apportion.timeutil import WEEK_S
from services.policy import logic
from services.policy.config import PolicySettings

log = logging.getLogger("apportion.policy")

#: Wall seconds between two measurements of the faust consumer's lag (metrics).
LAG_EVERY_S = 1.0

#: The group session of the policy's static member, seconds (faust's ``broker_session_timeout``, its
#: default): a member that stopped stays listed in the group this long; a restart with its ids takes its place.
SESSION_S = 60.0


def member_client_id(pid: int | None = None, host: str | None = None) -> str:
    """The Kafka client id a policy process runs its group member with: ``policy-<pid>-on-<host>``, so that
    the broker's description of the group says which process on which machine holds an instance id."""
    import os
    import socket

    return f"policy-{os.getpid() if pid is None else pid}-on-{socket.gethostname() if host is None else host}"


def pid_on(client_id: str, host: str) -> int | None:
    """The pid of a :func:`member_client_id` that names ``host``; ``None`` for another host or another form."""
    head, sep, on = client_id.partition("-on-")
    pid = head.removeprefix("policy-")
    return int(pid) if sep and on == host and head.startswith("policy-") and pid.isdigit() else None


class PolicyService:
    """The policy loop without Kafka: fold records or events, publish what :func:`logic.decide` says.

    Args:
        clock: event time for rejections, snapshot-less rankings and dead letters.
        publish: ``publish(event)``, synchronous: it either writes the event
            (blocking until acked) or queues it for the caller to write.
        name: ``producer`` for dead letters.
        metrics: optional ``{"published": Counter(labels=type)}``.
        window_s: the window W bounding de-duplication (:class:`~services.policy.logic.PolicyState`).
    """

    def __init__(
        self,
        clock: Clock,
        publish: Any,
        name: str = "policy",
        metrics: dict | None = None,
        window_s: float = float(WEEK_S),
    ) -> None:
        from apportion.bus.intake import Intake
        from apportion.timeutil import s_to_us

        self.clock = clock
        self.publish = publish
        self.name = name
        self.state = logic.PolicyState(window_us=s_to_us(window_s))
        self._m = metrics or {}
        #: the reader edge shared by the catch-up and the agents (one id -> payload ledger)
        self.intake = Intake(name, clock.now, on_dead=publish, window_s=window_s)

    def fold(self, records: list[Any]) -> None:
        """Fold kafka-python records (in their topic-partition offset order); dead-letter what a reader refuses.

        A record the reader edge refuses, or whose event the fold raises on
        (``apply failed: ...``), is dead-lettered and the fold goes on.
        """
        intake = self.intake
        for rec in records:
            ev = intake.admit(rec)
            if ev is not None:
                intake.apply(rec, self.apply, ev)

    def apply(self, event: Any) -> None:
        """Fold one decoded event (:func:`logic.evolve`); publishes nothing."""
        self.state = logic.evolve(self.state, event)

    def flush(self) -> list[Any]:
        """Publish the rejections and ranking now owed; returns them."""
        import time

        from apportion.events import BudgetRejected

        t0 = time.perf_counter()
        self.state, out = logic.decide(self.state, self.clock.now())
        if out and "decide" in self._m:
            self._m["decide"].observe(time.perf_counter() - t0)
        for ev in out:
            self.publish(ev)
            if isinstance(ev, BudgetRejected):
                log.warning("rejected budget change %s: %s", ev.path, ev.message)
            if "published" in self._m:
                self._m["published"].labels(type=ev.type).inc()
        return out


#: The kafka-python 3 loggers of a client's connections and metadata: closing a client aborts the connections it
#: has open and cancels a metadata refresh in flight, and each says so at ERROR (``Abort (KafkaConnectionError)``,
#: ``Connection lost``, ``Metadata refresh: failed Cancelled``). The catch-up's reader is closed as soon as it has
#: read the log, often while it is still opening its connection to the group's coordinator.
CLIENT_LOGGERS = ("kafka.net.transport", "kafka.net.connection", "kafka.cluster")


class ClosingClient(logging.Filter):
    """While a kafka-python client is being closed (:func:`closing_quietly`), its connections' ERROR records are
    the close's own doing: DEBUG (left out unless the logger logs DEBUG), not an alarm in the log of a healthy
    start."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        # the logger let it through as an ERROR; at DEBUG it goes on only where its logger logs DEBUG (the
        # services' handlers take every level their loggers pass)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def closing_quietly() -> Iterator[None]:
    """Put :class:`ClosingClient` on :data:`CLIENT_LOGGERS` for the block (the only kafka-python client of the
    process then is the one it closes: the faust app speaks through aiokafka, whose loggers are not touched)."""
    quiet = ClosingClient()
    loggers = [logging.getLogger(name) for name in CLIENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


async def catch_up(svc: PolicyService, bootstrap: str, group_id: str, stop: asyncio.Event) -> bool:
    """Fold the budgets log from offset 0 and the newest snapshot, up to the end offsets at start.

    Runs the blocking kafka-python reads in worker threads; publishes
    nothing itself (``svc.publish`` receives only dead letters here).

    Returns:
        True when caught up, False when ``stop`` was set first.

    Raises:
        TimeoutError: a topic does not exist (not provisioned).
    """
    from apportion.bus.consumer import AssignedConsumer
    from apportion.topics import BUDGETS, USAGE

    consumer = await asyncio.to_thread(
        AssignedConsumer, bootstrap, [topic_name(BUDGETS), topic_name(USAGE)], group_id, tail={topic_name(USAGE): 1}
    )
    try:
        caught = await consumer.catch_up(stop)
        if caught is None:
            return False
        svc.fold(caught[0] + caught[1])  # the log as of the start, then what was appended meanwhile
        return True
    finally:
        with closing_quietly():  # its close aborts a connection it may still be opening: not an error
            await asyncio.to_thread(consumer.close)


class PolicyApp:
    """The faust app around a :class:`PolicyService`: one ``concurrency=1`` agent per input topic.

    Args:
        settings: the service settings (group id, producer name).
        bootstrap: Kafka ``host:port``.
        datadir: this instance's faust data directory.
        svc: the policy state, already caught up.
        outbox: the list ``svc.publish`` appends to; :meth:`drain` writes it.

    Attributes:
        app: the :class:`faust.App` (not started by the constructor).
        failed: future set to the exception of a failed agent, so :func:`run`
            stops instead of running on without it.
    """

    def __init__(
        self, settings: PolicySettings, bootstrap: str, datadir: str, svc: PolicyService, outbox: list[Any]
    ) -> None:
        from apportion.bus.faust_app import agent, event_topic, make_app
        from apportion.topics import BUDGETS, USAGE

        self.svc = svc
        self.outbox = outbox
        self.producer_name = settings.producer_name
        self.lock = asyncio.Lock()
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()
        self.app = make_app(
            topic_prefix() + settings.group_id,
            bootstrap,
            datadir=datadir,
            web_port=None,
            consumer_group_instance_id=settings.instance_id,
            # the group's description names this process and machine, and how long a stopped member stays
            # listed (services.policy.__main__.group_member_in_the_way)
            broker_client_id=member_client_id(),
            broker_session_timeout=SESSION_S,
        )
        agent(self.app, event_topic(self.app, BUDGETS), name="policy-budgets")(self._follow)
        agent(self.app, event_topic(self.app, USAGE), name="policy-usage")(self._follow)

    async def drain(self) -> None:
        """Write the queued events in order, each acked by the broker before the next."""
        from apportion.bus.faust_app import publish_acked

        while self.outbox:
            await publish_acked(self.app, self.outbox[0])
            self.outbox.pop(0)

    async def decide(self) -> list[Any]:
        """Publish what is owed now (under the lock); returns the events."""
        async with self.lock:
            out = self.svc.flush()
            await self.drain()
        return out

    async def run_until(self, stop: asyncio.Event, reader: Any) -> None:
        """Follow (the started app's agents) until ``stop`` is set or an agent fails, measuring the lag meanwhile.

        Args:
            stop: set it to return.
            reader: the reader metrics (``set_lag``), set every :data:`LAG_EVERY_S` seconds.

        Raises:
            the exception of a failed agent.
        """
        stopping = asyncio.ensure_future(stop.wait())
        lagging = asyncio.ensure_future(self.measure_lag(reader))
        try:
            await asyncio.wait([stopping, self.failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            lagging.cancel()
        if self.failed.done():
            exc = self.failed.exception()
            if exc is not None:
                raise exc

    async def measure_lag(self, reader: Any) -> None:
        """Set the consumer lag of the two input topics on ``reader`` every :data:`LAG_EVERY_S` s, until cancelled."""
        from apportion.bus.faust_app import consumer_lag
        from apportion.topics import BUDGETS, USAGE

        while True:  # metrics only: a failed measurement is logged and retried
            try:
                reader.set_lag(await consumer_lag(self.app, (topic_name(BUDGETS), topic_name(USAGE))))
            except Exception:  # never let the lag gauge stop the service
                log.warning("could not measure the consumer lag", exc_info=True)
            await asyncio.sleep(LAG_EVERY_S)

    async def stop(self) -> None:
        """Stop the faust app; a failure (its broker gone) is logged, not raised."""
        try:
            await self.app.stop()
        except Exception as exc:  # noqa: BLE001 - stopping an app whose broker is gone
            log.warning("stopping the faust app failed (%s)", exc)

    async def _follow(self, stream: Any) -> None:
        """Agent body: fold each event; decide and publish once the stream's buffer is empty.

        Events come through the same screen and id ledger as the catch-up
        (:func:`apportion.bus.faust_app.decoded`); an event the fold raises on
        is dead-lettered (``apply failed: ...``) and the agent goes on.
        """
        from apportion.bus.faust_app import decoded, refuse
        from apportion.bus.intake import apply_failure

        clock = self.svc.clock.now
        try:
            async for event in decoded(
                self.app,
                stream,
                producer=self.producer_name,
                clock=clock,
                ledger=self.svc.intake.ledger,
                stats=self.svc.intake.stats,
            ):
                async with self.lock:
                    try:
                        self.svc.apply(event)
                    except Exception as exc:  # a pure fold's error is this record's poison
                        log.error("applying %s failed", event.type, exc_info=exc)
                        msg = stream.current_event.message
                        await refuse(
                            self.app, msg, msg.value, apply_failure(exc), producer=self.producer_name, now=clock
                        )
                        continue
                    queue = getattr(stream.channel, "queue", None)
                    if queue is None or queue.empty():
                        self.svc.flush()
                    await self.drain()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("policy agent failed")
            if not self.failed.done():
                self.failed.set_exception(exc)
            raise
