"""Dispatcher wiring: queue and cluster state from the log, decisions and commands out.

Consumes ``apportion.submissions``, ``apportion.jobs``, ``apportion.nodes``
and ``apportion.budgets``; produces ``JobQueued``, ``JobRejected``,
``JobPlaced``, ``JobPreempted``, ``JobRequeued``, ``JobCancelled``,
``JobLost``, ``NodeLost``, ``NodeDrained`` and the ``StartWorkload`` /
``StopWorkload`` commands; writes ``apportion:rm:jobs`` and
``apportion:rm:nodes`` in Redis.

Every decision is :func:`apportion.domain.dispatch.step` - the same code the
simulator runs - applied to each event in log order, and to a
:class:`~apportion.domain.dispatch.Tick` after news (paced by
:class:`TickPacer` so that on a busy log one cycle decides on many events)
and every ``tick_wall_s`` (heartbeat timeouts, grace periods, drains,
reservations).
Event time comes from the service clock (wall, or scaled for demos) and is
written as ``ts`` of every decision, so an audit re-runs a decision at
exactly the time it was made.

Leadership: one active instance holds a Redis lease (:mod:`.lease`) and
stamps its fencing token on ``JobPlaced``/``StartWorkload``/``StopWorkload``.
A standby waits for the lease; on taking over it rebuilds its state from
offset 0 of the four topics (the previous leader's decisions included, so
nothing is placed twice) and then decides what was left undecided
(:func:`services.dispatcher.logic.recover`). The lease is renewed by a thread
(:class:`~services.dispatcher.lease.LeaseKeeper`) while the event loop is
alive, so a long synchronous step does not let it expire. A leader that fails
to renew stops deciding at once (:class:`LeadershipLost`) and goes back to
standby.

Offsets: like accounting, every start reads from offset 0 (the log is the
state); positions are committed under group ``dispatcher`` after the
decisions are acknowledged, for lag monitoring only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from apportion.bus.intake import Intake
from apportion.bus.resilience import pause
from apportion.clock import Clock
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, evolve, step
from apportion.domain.engine import EngineConfig
from apportion.events import Event, JobLost, JobSubmitted, NodeHeartbeat, WorkloadRefused
from apportion.identity import RequestGate
from apportion.metrics import count_preemptions
from apportion.timeutil import from_us, s_to_us, to_us
from services.dispatcher import logic
from services.dispatcher.config import DispatcherSettings

log = logging.getLogger("apportion.dispatcher")

#: Dead-letter reason of an event older than the window (:meth:`DispatchState.is_stale`).
STALE = "older than the window"

#: Dead-letter reason of an event from too far in the future (``future_tolerance_s``).
FUTURE = "from the future"

#: Wall seconds between read-model writes (a full write of jobs and nodes).
READ_MODEL_EVERY_S = 0.5

#: Wall seconds between two updates of the nodes' newest heartbeats for the metrics.
HEARTBEATS_EVERY_S = 1.0

#: Producer linger, ms: decisions sent within this window leave together (one request per partition).
LINGER_MS = 5

#: Producer batch size, bytes per partition batch (a JobPlaced is about 700 bytes).
BATCH_BYTES = 256 * 1024

#: News-driven ticks take at most about this share of the loop's wall time (see TICK_GAP_MAX_S).
TICK_SHARE = 0.2

#: Longest wait, wall seconds, between news and the tick that decides on it.
TICK_GAP_MAX_S = 0.1


class TickPacer:
    """When the leader loop runs a tick: on news, but cycles spaced to a share of the wall time.

    A scheduling cycle costs mostly per cycle (snapshot, maintenance over
    every node), little per job: on a busy log, one cycle per poll batch
    spends most of the loop on cycles that each decide a handful of jobs.
    After a tick that took ``d`` seconds, the next news-driven tick waits
    until ``d * (1 - share) / share`` has passed (capped at ``gap_max_s``),
    so cycles take at most about ``share`` of the time and each decides on
    everything that arrived meanwhile. Idle, a cycle takes about a
    millisecond, so the gap is a few milliseconds and latency barely moves.
    Without news, a tick still runs every ``every_s`` (timeouts, grace
    periods, drains, reservations).

    Args:
        every_s: timer tick period, wall seconds.
        share: target share of wall time in news-driven ticks, in (0, 1].
        gap_max_s: longest wait between news and its tick, wall seconds.
        start: wall time (``loop.time()``) the loop starts at.
    """

    def __init__(
        self, every_s: float, share: float = TICK_SHARE, gap_max_s: float = TICK_GAP_MAX_S, start: float = 0.0
    ) -> None:
        self.every_s = every_s
        self.share = share
        self.gap_max_s = gap_max_s
        self.last = start
        self.gap = 0.0
        self.waiting = False

    def poll_ms(self, now: float, idle_ms: int = 50) -> int:
        """How long the next poll may wait (ms, >= 1): ``idle_ms``, or until news is due its tick."""
        if not self.waiting:
            return idle_ms
        return max(1, min(idle_ms, int(1000 * (self.last + self.gap - now))))

    def due(self, now: float, news: bool) -> bool:
        """Note ``news`` (anything but heartbeats arrived); True when a tick should run now."""
        self.waiting |= news
        since = now - self.last
        return (self.waiting and since >= self.gap) or since >= self.every_s

    def ticked(self, start: float, end: float) -> None:
        """Record a tick that ran from ``start`` to ``end`` (wall seconds)."""
        self.last = end
        self.gap = min(self.gap_max_s, (end - start) * (1 - self.share) / self.share)
        self.waiting = False


class LeadershipLost(RuntimeError):
    """The lease was lost; this instance must stop deciding."""


def _same(pair: Any) -> Any:
    return pair


def dispatch_config(settings: DispatcherSettings) -> DispatchConfig:
    """The pure-core configuration these settings describe."""
    return DispatchConfig(
        engine=EngineConfig(
            delta=settings.delta,
            reservation_after_s=settings.reservation_after_s,
            patience_s=settings.patience_s,
            checkpoint_wait_s=settings.checkpoint_wait_s,
            window_s=settings.window_s,
            grace_s=settings.grace_s,
            producer=settings.producer_name,
        ),
        heartbeat_timeout_s=settings.heartbeat_timeout_s if settings.heartbeat_timeout_s > 0 else None,
        producer=settings.producer_name,
        reconcile_misses=settings.reconcile_misses if settings.reconcile_misses > 0 else None,
    )


#: How every value this dispatcher encodes begins (``event_id`` is the first field of every event's JSON).
ECHO_HEAD = b'{"event_id":"'

#: Bytes of a value that name its event: the head, the 36-character UUID and its closing quote.
ECHO_LEN = len(ECHO_HEAD) + 37

#: At most this many echoes are remembered (about 100 bytes each); past it, the oldest half is forgotten.
ECHO_CAP = 1_000_000


class DispatcherService:
    """The dispatcher loop without Kafka: fold records, decide, hand decisions to ``publish``.

    Args:
        settings: configuration.
        clock: event-time source.
        publish: ``publish([(event, value), ...])`` sends each event with
            ``value`` = :func:`apportion.events.encode` of it (encoded here,
            once); need not wait for the acks.
        metrics: optional prometheus metrics dict.
        consumed: physical names of the topics this instance reads; its own
            events on them come back as echoes (see :meth:`ingest`).
            Default: none (every record is decoded).
    """

    def __init__(
        self,
        settings: DispatcherSettings,
        clock: Clock,
        publish: Callable[[list[tuple[Event, bytes]]], Any],
        metrics: dict | None = None,
        consumed: Iterable[str] = (),
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.publish = publish
        self.cfg = dispatch_config(settings)
        self.state = DispatchState(window_s=settings.window_s)
        self.token = 0
        self.inputs: dict[str, int] = {}  # "topic:partition" -> next offset folded (Decision.inputs)
        self._last_now = 0
        self._m = metrics or {}
        self._consumed = frozenset(consumed)
        # value heads (ECHO_LEN bytes) of events we published to a topic we read, not read back yet
        self._echoes: dict[bytes, None] = {}
        self.echoes_skipped = 0
        #: who may act in whose name (DESIGN section 10): refusals replace the request they refuse
        self.gate = RequestGate(settings.producer_name)
        #: the reader edge: screen, de-duplicate by id and payload, dead-letter (published at once),
        #: ignore node reports their node's key did not sign (the gate's)
        self.intake = Intake(settings.producer_name, clock.now, on_dead=self._dead_letter, gate=self.gate)
        self.tick_errors = 0

    def now_us(self) -> int:
        """Event time now (µs), never going backwards."""
        self._last_now = max(self._last_now, self.clock.now_us())
        return self._last_now

    def _decoded(self, records: list[Any]) -> list[tuple[Any, Event]]:
        """``(record, event)`` of ``records`` in :func:`record_order`, minus our own echoes and the refused.

        Every record goes through the reader edge (:class:`~apportion.bus.intake.Intake`):
        one it refuses is dead-lettered with the reason (and its offset still
        counts as read), a duplicate (same id, same payload) is dropped.

        An echo is a record whose value starts with the head of a value this
        instance published (:meth:`_emit`): the same bytes, so the same
        ``event_id``, and that event was folded into the state before it was
        published. Decoding it only for :meth:`ingest` to skip it as already
        seen is the cost this avoids: the fold and the decisions are exactly
        those of decoding every record. Its offset still counts as read.
        """
        from services._common import record_order

        pairs = []
        echoes = self._echoes
        admit = self.intake.admit
        names: dict[tuple[str, int], str] = {}
        for rec in records:
            # every record of the batch is folded (or dead-lettered) before the next tick decides
            tp = (rec.topic, rec.partition)
            name = names.get(tp)
            if name is None:
                name = names[tp] = f"{rec.topic}:{rec.partition}"
            self.inputs[name] = rec.offset + 1
            if echoes and rec.value is not None:
                head = rec.value[:ECHO_LEN]
                if head in echoes:
                    del echoes[head]
                    self.echoes_skipped += 1
                    continue
            ev = admit(rec)
            if ev is not None:
                pairs.append((rec, ev))
        pairs.sort(key=lambda p: record_order(p[0], p[1]))
        return self.intake.authenticate(pairs, _same)

    def _dead_letter(self, letter: Event) -> None:
        self._emit([letter])
        if "dead" in self._m:
            self._m["dead"].inc()

    def _emit(self, evts: list[Event]) -> None:
        """Fence, encode once, remember the echoes to come, and hand the lot to ``publish``."""
        from apportion.events import TOPIC_OF, encode

        if not evts:
            return
        sent = []
        echoes, consumed = self._echoes, self._consumed
        remember = self.intake.ledger.remember if self.intake.ledger is not None else None
        for e in logic.fence(evts, self.token):
            value = encode(e)
            if consumed and TOPIC_OF[e.type].name in consumed:
                if value.startswith(ECHO_HEAD):
                    echoes[value[:ECHO_LEN]] = None
                if remember is not None:
                    remember(e)  # our ids: another payload under one of them is a reused id
            sent.append((e, value))
        if len(echoes) > ECHO_CAP:  # echoes that never came back (a lost send): forget the oldest half
            for k in list(echoes)[: len(echoes) // 2]:
                del echoes[k]
        self.publish(sent)
        if "decisions" in self._m:
            self._m["decisions"].inc(len(sent))
        if "preemptions" in self._m:
            count_preemptions(self._m, (e for e, _ in sent))

    def _refused_stale(self, rec: Any, ev: Event) -> bool:
        """Dead-letter ``ev`` if its time is outside what the fold may take; True when refused.

        * older than the window (:meth:`DispatchState.is_stale`): never folded, its id may be forgotten;
        * more than ``future_tolerance_s`` after this service's clock: folded, it would move the
          state's clock (and the occupancy ledger's) ahead, and every later event would be stale.
        """
        state = self.state
        if state.is_stale(ev):
            latest = from_us(state.clock_us or 0).isoformat()
            self.intake.refuse(rec, f"{STALE}: {ev.ts.isoformat()} is more than W before {latest}")
            return True
        now = self.now_us()
        if to_us(ev.ts) > now + s_to_us(self.settings.future_tolerance_s):
            self.intake.refuse(
                rec,
                f"{FUTURE}: {ev.ts.isoformat()} is more than {self.settings.future_tolerance_s:g} s after "
                f"{from_us(now).isoformat()}",
            )
            return True
        return False

    def snapshot(self) -> Any:
        """The state to store (:class:`services.dispatcher.snapshot.Snapshot`); the caller has flushed the decisions."""
        from services.dispatcher.snapshot import Snapshot

        return Snapshot(self.state, dict(self.inputs), self.intake.ledger, self.token, self.gate.keys)

    def restore(self, snap: Any) -> None:
        """Start from a stored snapshot: state, input offsets and id ledger (then :meth:`bootstrap` the tail)."""
        self.state = snap.state
        self.inputs = dict(snap.offsets)
        if snap.ledger is not None:
            self.intake.ledger = snap.ledger
        if snap.keys is not None:
            self.gate.keys = snap.keys

    def bootstrap(self, records: list[Any]) -> list[Event]:
        """Rebuild from the log as of the start and decide what was left undecided.

        :func:`logic.recover`, one event at a time through the reader edge:
        an event the fold raises on is dead-lettered (``apply failed: ...``)
        and the rebuild goes on.
        """
        pairs = self._decoded(records)
        state, now, cfg, apply = self.state, self.now_us(), self.cfg, self.intake.apply
        for rec, ev in pairs:
            self.gate.observe(ev)
            if not self._refused_stale(rec, ev):
                apply(rec, lambda e: evolve(state, e), ev)
        out: list[Event] = []
        for rec, ev in pairs:  # what recover() decides (submissions, agents' refusals and losses), in log order
            if isinstance(ev, (JobSubmitted, WorkloadRefused, JobLost)):
                if isinstance(ev, JobSubmitted) and ev.job_id not in state.jobs and ev.job_id not in state.finished:
                    if (refused := self.gate.refusal(rec.value, ev, state.jobs, now)) is not None:
                        out += apply(rec, lambda e: [e, *step(state, e, now, cfg)], refused) or []
                        continue
                out += apply(rec, lambda e: logic.recover(state, [e], now, cfg), ev) or []
        resent = logic.resend_starts(state, now, cfg)  # placed by a leader that died before its StartWorkload
        out += resent
        log.info(
            "rebuilt from %d events: %d jobs active, %d pending, %d nodes; %d recovery decisions (%d starts sent again)",
            len(pairs),
            len(self.state.jobs),
            self.state.pending_count(),
            len(self.state.cluster.nodes),
            len(out),
            len(resent),
        )
        out += self.tick()
        return out

    def ingest(self, records: list[Any]) -> tuple[list[Event], bool]:
        """Fold and decide a live batch; returns (decisions, whether anything but heartbeats arrived).

        Each event is :func:`step` through the reader edge: one the fold
        raises on is dead-lettered (``apply failed: <type>: <message>``) and
        the batch goes on.
        """
        out: list[Event] = []
        news = False
        state, cfg, apply = self.state, self.cfg, self.intake.apply
        for rec, ev in self._decoded(records):
            if self._refused_stale(rec, ev):
                continue
            if ev.event_id in state.seen:
                continue  # our own decision coming back (not recognised as an echo), or a redelivery
            news |= type(ev) is not NodeHeartbeat
            if (refused := self.gate.refusal(rec.value, ev, state.jobs, self.now_us())) is not None:
                # a request not proven (DESIGN section 10): its refusal is published and folded instead
                out += apply(rec, lambda e: [e, *step(state, e, self.now_us(), cfg)], refused) or []
                continue
            out += apply(rec, lambda e: step(state, e, self.now_us(), cfg), ev) or []
            if "events" in self._m:
                self._m["events"].inc()
        return out, news

    def tick(self) -> list[Event]:
        """Maintenance and one scheduling cycle at the current event time (placements fenced and stamped).

        A cycle that raises is logged and counted (``tick_errors``, metric
        ``apportion_dispatcher_tick_errors``) and decides nothing; the
        service stays up. No record is to blame, so nothing is
        dead-lettered: what got into the state that the cycle cannot handle
        is a bug of the screen or the domain (docs/reliability.md).
        """
        now = self.now_us()
        t0 = time.perf_counter()
        try:
            decided = step(self.state, Tick(now), now, self.cfg)
        except Exception:  # noqa: BLE001 - never stop the service (issue 17); loud instead
            self.tick_errors += 1
            log.exception("scheduling cycle failed at event time %d µs; nothing decided", now)
            if "tick_errors" in self._m:
                self._m["tick_errors"].inc()
            return []
        out = logic.fence(decided, self.token, self.inputs)
        if "cycle" in self._m:
            self._m["cycle"].observe(time.perf_counter() - t0)
            self._m["pending"].set(self.state.pending_count())
        return out


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

    from apportion.bus.resilience import readiness_for, supervise
    from apportion.bus.security import redis_auth
    from apportion.metrics import dispatcher_metrics
    from apportion.topics import COMMANDS, JOBS, NODES
    from services._common import start_metrics
    from services.dispatcher.lease import Lease, highest_token_in_log

    clock = clock or settings.make_clock()
    conn = settings.connection()
    readiness = readiness_for(conn.bootstrap, conn.redis_url)
    registry, stop_metrics = start_metrics(settings.metrics_port, settings.metrics_host, readiness)
    metrics = dispatcher_metrics(registry, clock.now)
    current: dict[str, DispatcherService] = {}
    metrics["reader"].watch(lambda: current["svc"].intake.stats if current else None)
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
                await _lead(settings, stop, clock, conn, r, lease, metrics, ready, readiness, current)
            except LeadershipLost:
                log.error("lease lost: stopping decisions, back to standby")
            finally:
                metrics["leader"].set(0)

    try:
        await supervise("dispatcher", session, stop, readiness)
    finally:
        try:
            await asyncio.to_thread(lease.release)
        except Exception as exc:  # noqa: BLE001 - Redis gone at shutdown: the lease expires by itself
            log.warning("could not release the lease (%s); it expires in %.0f s", exc, settings.lease_ttl_wall_s)
        stop_metrics()
        r.close()


async def _lead(
    settings: DispatcherSettings,
    stop: asyncio.Event,
    clock: Clock,
    conn: Any,
    r: Any,
    lease: Any,
    metrics: dict,
    ready: asyncio.Event | None,
    readiness: Any,
    current: dict[str, DispatcherService],
) -> None:
    from apportion import readmodel
    from apportion.audit.config import configured_event
    from apportion.bus.crc import use_compiled_crc32c
    from apportion.bus.producer import EventProducer
    from apportion.topics import BUDGETS, JOBS, NODES, SUBMISSIONS
    from services._common import AssignedConsumer
    from services.dispatcher.lease import LeaseKeeper, highest_token

    log.info("record-batch CRC-32C: %s", use_compiled_crc32c())
    producer = await asyncio.to_thread(
        EventProducer, conn.bootstrap, client_id="dispatcher", linger_ms=LINGER_MS, batch_size=BATCH_BYTES
    )

    undelivered: list[BaseException] = []

    def publish(sent: list[tuple[Event, bytes]]) -> None:
        # Sent without waiting: the producer sends within LINGER_MS and the loop flushes when idle. Decisions are
        # derived state (a new leader re-derives anything unacknowledged from the log, with the same deterministic
        # ids), so the wait for acks need not sit on the loop while it has work. One that is never delivered (a
        # broker outage past the producer's delivery timeout) ends the term: the next one re-derives it.
        for e, value in sent:
            producer.send(e, value).add_errback(undelivered.append)

    def check_delivered() -> None:
        if undelivered:
            raise RuntimeError(f"a decision was not delivered ({undelivered[0]!r}): rebuilding from the log")

    inputs = [SUBMISSIONS.name, JOBS.name, NODES.name, BUDGETS.name]
    consumer = await asyncio.to_thread(AssignedConsumer, conn.bootstrap, inputs, "dispatcher")
    svc = DispatcherService(settings, clock, publish, metrics, consumed=inputs)
    svc.token = lease.token
    current["svc"] = svc
    consumer.lag.sink = metrics["reader"].set_lag
    loop = asyncio.get_running_loop()

    def write_read_model() -> None:
        jobs, nodes = logic.read_model(svc.state, svc.now_us(), svc.cfg)
        readmodel.replace_hash(r, readmodel.jobs_key(), jobs)
        readmodel.replace_hash(r, readmodel.nodes_key(), nodes)
        metrics["queue"].update(jobs, nodes, svc.state.tree.paths())

    every = settings.lease_ttl_wall_s / 3
    keeper = LeaseKeeper(lease, every, stall_s=max(30.0, 10 * settings.lease_ttl_wall_s)).start()

    def check_lease() -> None:
        """Before each publish: still leading, by the keeper and by the local lease clock (which keeps counting
        through a SIGSTOP, so a paused leader that resumes stops here instead of publishing stale decisions)."""
        if keeper.lost.is_set() or lease.expires_in() <= settings.lease_ttl_wall_s / 3:
            raise LeadershipLost()

    def load_snapshot() -> Any:
        """The stored snapshot if it fits the log as it is now, else ``None`` (rebuild from offset 0)."""
        from apportion.statefile import CheckpointError, check_offsets
        from apportion.topics import prefix
        from services.dispatcher import snapshot as snapmod

        if settings.snapshot_every_wall_s <= 0:
            return None
        try:
            fields = r.hgetall(snapmod.snapshot_key())
            snap = snapmod.decode(fields, window_s=settings.window_s, topic_prefix=prefix())
            begin = {f"{tp.topic}:{tp.partition}": off for tp, off in consumer.start_begin.items()}
            end = {f"{tp.topic}:{tp.partition}": off for tp, off in consumer.start_end.items()}
            check_offsets(snap.offsets, begin, end)
        except CheckpointError as exc:
            (log.info if exc.reason == "missing" else log.warning)("no usable snapshot (%s): rebuilding from 0", exc)
            return None
        except Exception as exc:  # Redis down: the log is the state, rebuild from it
            log.warning("cannot read the snapshot (%s): rebuilding from offset 0", exc)
            return None
        return snap

    def write_snapshot() -> None:
        """Store the state (never over a snapshot of a higher token); a failure is logged, never raised."""
        import redis as redis_lib

        from apportion.topics import prefix
        from services.dispatcher import snapshot as snapmod

        t0 = time.perf_counter()
        key = snapmod.snapshot_key()
        try:
            fields = snapmod.encode(svc.snapshot(), topic_prefix=prefix())
            with r.pipeline() as pipe:
                pipe.watch(key)
                if not snapmod.newer_than_stored(pipe.hgetall(key), svc.token):
                    log.warning("not writing the snapshot: a newer leader's is stored")
                    return
                pipe.multi()
                pipe.delete(key)
                pipe.hset(key, mapping=fields)
                pipe.execute()
        except redis_lib.WatchError:
            log.warning("snapshot not written: written concurrently by another instance")
            return
        except Exception as exc:  # noqa: BLE001 - a snapshot is an optimisation: never stop deciding for it
            log.warning("snapshot not written (%s)", exc)
            return
        log.info(
            "snapshot written: %d bytes, %d jobs, in %.2f s",
            len(fields["state"]),
            len(svc.state.jobs),
            time.perf_counter() - t0,
        )

    async def beats() -> None:  # the event loop's sign of life for the keeper
        while True:
            keeper.beat()
            await asyncio.sleep(every)

    beating = asyncio.create_task(beats(), name="lease-beats")
    try:
        t_start = loop.time()
        snap = await asyncio.to_thread(load_snapshot)
        if snap is not None:
            lease.observe(snap.fencing_token)
            if snap.fencing_token > lease.token:  # a newer leader stored it: we are deposed
                raise LeadershipLost()
            svc.restore(snap)
            consumer.seek(snap.offsets)
        caught = await consumer.catch_up(stop)
        if caught is None:
            return
        backlog, late = caught  # the log as of the start (or its tail after the snapshot): rebuild
        out = svc.bootstrap(backlog)
        log.info(
            "started from %s: %d records read, rebuilt in %.2f s",
            "a snapshot" if snap is not None else "offset 0",
            len(backlog),
            loop.time() - t_start,
        )
        if late:
            more, _ = svc.ingest(late)
            out += more
        newest = highest_token(rec.event for rec in backlog if getattr(rec, "event", None) is not None)
        lease.observe(newest)
        if newest > lease.token:  # a newer leader wrote after we took the lease: we are deposed
            raise LeadershipLost()
        # the knobs it decides with, first, so the audit needs no flags (DESIGN section 4)
        out.insert(
            0,
            configured_event(
                svc.cfg,
                instance=settings.owner(),
                fencing_token=lease.token,
                ts=from_us(svc.now_us()),
                producer=settings.producer_name,
            ),
        )
        check_lease()
        await asyncio.to_thread(svc._emit, out)
        await asyncio.to_thread(producer.flush)
        await asyncio.to_thread(write_read_model)
        if settings.snapshot_every_wall_s > 0:
            await asyncio.to_thread(write_snapshot)
        readiness.set(True)
        if ready is not None:
            ready.set()
        last_tick = last_rm = last_beats = last_snap = loop.time()
        rm_gap = READ_MODEL_EVERY_S
        unflushed = dirty = False
        pacer = TickPacer(settings.tick_wall_s, start=last_tick)
        while not stop.is_set():
            batch = await asyncio.to_thread(consumer.poll, pacer.poll_ms(loop.time()))
            out, news = svc.ingest(batch) if batch else ([], False)
            now = loop.time()
            if pacer.due(now, news):
                out += svc.tick()
                pacer.ticked(now, loop.time())
            # The keeper thread renews the lease (LeaseKeeper). Safety does not rest on it: every decision
            # carries the fencing token and agents refuse stale tokens.
            if out:
                check_lease()
                await asyncio.to_thread(svc._emit, out)
                unflushed = True
            elif keeper.lost.is_set():
                raise LeadershipLost()
            if unflushed and not batch:  # idle: nothing to decide, so waiting for the acks costs nothing
                await asyncio.to_thread(producer.flush)
                unflushed = False
            check_delivered()
            dirty |= bool(out) or news
            if now - last_beats >= HEARTBEATS_EVERY_S:  # heartbeats are not news: their ages are kept apart
                metrics["queue"].heartbeats(logic.heartbeats(svc.state))
                last_beats = now
            if dirty and now - last_rm >= rm_gap:
                t0 = loop.time()
                await asyncio.to_thread(write_read_model)
                await asyncio.to_thread(consumer.commit)
                # at most ~10% of the loop on read models, however large the queue grows
                rm_gap = max(READ_MODEL_EVERY_S, 10 * (loop.time() - t0))
                last_rm, dirty = loop.time(), False
            if settings.snapshot_every_wall_s > 0 and now - last_snap >= settings.snapshot_every_wall_s:
                check_lease()  # every decision in the state must be in the log: publish, flush, then store
                await asyncio.to_thread(producer.flush)
                unflushed = False
                await asyncio.to_thread(write_snapshot)
                last_snap = loop.time()
    finally:
        beating.cancel()
        await asyncio.to_thread(keeper.stop)
        log.info("stopped leading: %d own decisions read back without decoding", svc.echoes_skipped)
        await asyncio.to_thread(consumer.close)
        await asyncio.to_thread(producer.close)
