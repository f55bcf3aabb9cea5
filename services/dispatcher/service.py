"""The dispatcher without Kafka: queue and cluster state from the log, decisions and commands out.

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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from apportion.audit.config import resumed_event
from apportion.bus.intake import Intake
from apportion.clock import Clock
from apportion.domain.admission import NODE_REQUEST_TYPES
from apportion.domain.dispatch import (
    DispatchConfig,
    DispatchState,
    Tick,
    evolve,
    hold_answered,
    overdue_nodes,
    step,
    submission_decided,
)
from apportion.domain.engine import EngineConfig
from apportion.events import (
    DispatcherConfigured,
    Event,
    JobCancelRequested,
    JobHoldRequested,
    JobLost,
    JobRejected,
    JobReleaseRequested,
    JobSubmitted,
    NodeHeartbeat,
    NodeRequestRefused,
    WorkloadRefused,
)
from apportion.heap import settle_heap
from apportion.identity.gates import RequestGate
from apportion.logrecord import log_position, record_order
from apportion.metrics import count_preemptions
from apportion.settings import topic_name
from apportion.timeutil import from_us, s_to_us, to_us
from services.dispatcher import logic, store
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.lease import LeadershipLost, highest_token

log = logging.getLogger("apportion.dispatcher")

#: Requests to hold or release a job (decided like a cancel: once, by its owner or ops).
HOLD_REQUESTS = (JobHoldRequested, JobReleaseRequested)

#: Dead-letter reason of an event older than the window (:meth:`DispatchState.is_stale`).
STALE = "older than the window"

#: Dead-letter reason of an event from too far in the future (``future_tolerance_s``).
FUTURE = "from the future"

#: Wall seconds between read-model writes (a full write of jobs and nodes).
READ_MODEL_EVERY_S = 0.5

#: Wall seconds between two updates of the nodes' newest heartbeats for the metrics.
HEARTBEATS_EVERY_S = 1.0

#: Wall seconds between two rewrites of the read model for the idle times heartbeats report alone (heartbeats
#: are not news: without this the jobs' ``idle_s`` would wait for the next decision or request).
IDLE_TIMES_EVERY_S = 10.0

#: Producer linger, ms: decisions sent within this window leave together (one request per partition).
LINGER_MS = 5

#: Producer batch size, bytes per partition batch (a JobPlaced is about 700 bytes).
BATCH_BYTES = 256 * 1024

#: News-driven ticks take at most about this share of the loop's wall time (see TICK_GAP_MAX_S).
TICK_SHARE = 0.2

#: Longest wait, wall seconds, between news and the tick that decides on it.
TICK_GAP_MAX_S = 0.1

#: Wall seconds between two probes of the broker while nothing is read (:meth:`Term.sight`).
PROBE_EVERY_WALL_S = 0.25

#: Batches a term may fold without a proof of the keys before it waits for one (:meth:`Term.prove`): polls of
#: heartbeats alone commit nothing, so nothing else waits for their proof.
UNPROVEN_MAX = 100


class KeysMoved(Exception):
    """Key events the reader had not read when it judged a batch change how a record of it was judged (rule
    D10.proven-user): nothing decided since the last proof may be committed; the term aborts its transaction
    and a new one rebuilds from the log (:mod:`services.dispatcher.app`)."""


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


def broker_answers(bootstrap: str) -> Callable[[], bool]:
    """``Term``'s ``reachable``: True when a broker of ``bootstrap`` accepts a TCP connection now.

    The readiness probe's test (:func:`apportion.bus.resilience.kafka_probe`), as a yes or no.
    """
    from apportion.bus.resilience import kafka_probe

    probe = kafka_probe(bootstrap)

    def answers() -> bool:
        try:
            probe()
        except ConnectionError:
            return False
        return True

    return answers


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
        refusal_backoff_s=settings.refusal_backoff_s,
        refusal_backoff_cap_s=settings.refusal_backoff_cap_s,
        cordon_after_refusals=settings.cordon_after_refusals if settings.cordon_after_refusals > 0 else None,
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
        signer: signs every value published (:class:`apportion.identity.keys.BatchSigner`, the
            ``service:dispatcher`` key; readers ignore decisions it did not sign); ``None``: unsigned.
    """

    def __init__(
        self,
        settings: DispatcherSettings,
        clock: Clock,
        publish: Callable[[list[tuple[Event, bytes]]], Any],
        metrics: dict | None = None,
        consumed: Iterable[str] = (),
        signer: Any = None,
    ) -> None:
        self.settings = settings
        self.signer = signer
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
        #: who may act in whose name (rule D10.proven-user): refusals replace the request they refuse
        self.gate = RequestGate(settings.producer_name)
        #: the reader edge: screen, de-duplicate by id and payload, dead-letter (published at once),
        #: ignore node reports their node's key did not sign (the gate's)
        self.intake = Intake(
            settings.producer_name, clock.now, on_dead=self._dead_letter, gate=self.gate, window_s=settings.window_s
        )
        self.tick_errors = 0
        #: the highest fencing token of the proven records the rebuild read (a forged decision's never counts)
        self.log_token = 0
        #: this term's DispatcherConfigured (set by :meth:`bootstrap`), the template of :meth:`resume`
        self.configured: DispatcherConfigured | None = None
        #: dead letters held back while not ``None`` (a rebuild, :meth:`Term.start`): a rebuild can take
        #: longer than the transaction timeout, so nothing is sent until its recovery decisions are
        self.held: list[Event] | None = None

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

    def is_echo(self, rec: Any) -> bool:
        """True when ``rec`` is one of this instance's own records coming back (:meth:`_decoded` drops it
        unjudged): the reader needs no read-ahead of the key registrations for it."""
        value = rec.value
        return value is not None and value[:ECHO_LEN] in self._echoes

    def _dead_letter(self, letter: Event) -> None:
        if self.held is not None:  # a rebuild: published with its recovery decisions (Term.start)
            self.held.append(letter)
        else:
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
            if consumed and topic_name(TOPIC_OF[e.type]) in consumed:
                if value.startswith(ECHO_HEAD):
                    echoes[value[:ECHO_LEN]] = None
                if remember is not None:
                    remember(e)  # our ids: another payload under one of them is a reused id
            self.gate.emitted(e)  # a run's placement, for the reports of it (its echo is never checked)
            sent.append((e, value))
        if self.signer is not None:  # one signature per batch of decisions (rule D10.authentication)
            sent = list(zip([e for e, _ in sent], self.signer.values([v for _, v in sent]), strict=True))
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

    def read_from(self, begin: dict[str, int]) -> None:
        """Note where each input partition is read from (``"topic:partition"`` -> offset; after :meth:`restore`).

        A partition no record is read from keeps that offset in :attr:`inputs`, so a snapshot names every
        partition and fits the log on the next start (:func:`apportion.statefile.check_offsets` refuses
        offsets that lack one: every restart of a stack with an empty partition rebuilt from offset 0).
        The audit reads an absent partition as offset 0 (``Decision.inputs``), so nothing else changes.
        """
        for name, off in begin.items():
            self.inputs.setdefault(name, off)

    def restore(self, snap: Any) -> None:
        """Start from a stored snapshot: state, input offsets and id ledger (then :meth:`bootstrap` the tail)."""
        self.state = snap.state
        self.inputs = dict(snap.offsets)
        if snap.ledger is not None:
            self.intake.ledger = snap.ledger
        if snap.keys is not None:
            self.gate.keys = snap.keys

    def bootstrap(self, records: list[Any], configured: DispatcherConfigured | None = None) -> list[Event]:
        """Rebuild from the log as of the start and decide what was left undecided.

        :func:`logic.recover`, one event at a time through the reader edge:
        an event the fold raises on is dead-lettered (``apply failed: ...``)
        and the rebuild goes on. An ops request on a node is not folded when
        the log holds its ``NodeRequestRefused`` (a leader refused it), nor
        when ops did not sign it (a forgery no leader saw: its verdict is
        published now). ``configured`` (the term's record of its knobs) is
        folded after the rebuild and returned first; when the log's newest
        heartbeat is more than half the heartbeat timeout old (the log is
        behind: a start after a broker outage, whose agents have not
        delivered what they buffered yet), it grants the heartbeats a grace
        from now (:func:`apportion.audit.config.resumed_event`), so that no
        node is lost on the log's silence.
        """
        pairs = self._decoded(records)  # without the decisions the dispatcher's key did not sign
        self.log_token = max(self.log_token, highest_token(ev for _, ev in pairs))
        state, now, cfg, apply = self.state, self.now_us(), self.cfg, self.intake.apply
        refused = {ev.refused_event_id for _, ev in pairs if isinstance(ev, NodeRequestRefused)}
        undecided = []
        for rec, ev in pairs:
            self.gate.observe(ev)
            if self._refused_stale(rec, ev):
                continue
            if isinstance(ev, NODE_REQUEST_TYPES):  # not ops' (rule D10.authentication): never folded
                if ev.event_id in refused:
                    continue
                if (no := self.gate.refusal(rec.value, ev, state.requests_view(), now, rebuild=True)) is not None:
                    undecided.append((rec, no))
                    continue
            apply(rec, lambda e: evolve(state, e), ev)
        out: list[Event] = []
        if configured is not None:
            self.configured = configured
            if logic.heartbeats_behind(state, now, cfg):
                configured = resumed_event(configured, from_us(now))
            evolve(state, configured)
            out.append(configured)
        for rec, no in undecided:  # forgeries no leader answered: their verdicts now
            out += apply(rec, lambda e: [e, *step(state, e, now, cfg)], no) or []
        answered = {ev.refused_event_id for _, ev in pairs if isinstance(ev, JobRejected) and ev.refused_event_id}
        # what recover() decides (submissions, cancels, holds, releases, agents' refusals and losses), in log order
        for rec, ev in pairs:
            if isinstance(ev, (JobSubmitted, JobCancelRequested, WorkloadRefused, JobLost, *HOLD_REQUESTS)):
                if isinstance(ev, JobCancelRequested) and (
                    (ev.job_id not in state.jobs and ev.job_id not in state.arrays) or ev.event_id in answered
                ):
                    continue  # carried out (the job ended) or refused by a leader: decided
                if isinstance(ev, HOLD_REQUESTS) and hold_answered(state, ev):
                    continue  # held, released or refused by a leader: decided
                undecided_submission = isinstance(ev, JobSubmitted) and not submission_decided(state, ev)
                owner_request = isinstance(ev, (JobCancelRequested, *HOLD_REQUESTS))
                if owner_request or undecided_submission:
                    place = log_position(rec, ev)  # the keys as of its record, not the log's end
                    if (
                        refused := self.gate.refusal(rec.value, ev, state.requests_view(), now, position=place)
                    ) is not None:
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

    def resume(self) -> list[Event]:
        """The dispatcher can read the log again after it could not: heartbeats get a grace from now.

        Folds and returns this term's ``DispatcherConfigured`` with ``heartbeats_from`` = now
        (:func:`apportion.audit.config.resumed_event`; nothing before :meth:`bootstrap`), so that
        a tick declares no node lost before it has had one heartbeat timeout to read the node's
        heartbeats (:func:`apportion.domain.dispatch.heartbeat_deadline_us`).
        """
        if self.configured is None:
            return []
        ev = resumed_event(self.configured, from_us(self.now_us()))
        evolve(self.state, ev)
        return [ev]

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
            place = log_position(rec, ev)
            if (
                refused := self.gate.refusal(rec.value, ev, state.requests_view(), self.now_us(), position=place)
            ) is not None:
                # a request not proven (rule D10.proven-user): its refusal is published and folded instead
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
        except Exception:  # never stop the service; loud instead
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


class Term:
    """One leadership term after the takeover: rebuild, then the loop body run after each poll.

    Everything that touches Kafka or Redis is injected, so the term's pacing is the same in a test.

    Args:
        svc: the state and decisions (:class:`DispatcherService`, its ``token`` set to the lease's).
        settings: configuration (tick period, snapshot interval, lease TTL).
        metrics: the prometheus metrics dict (``queue`` for heartbeat ages).
        check_lease: raises :class:`LeadershipLost` unless still leading (before every publish).
        lost: set by the lease keeper when a renewal failed.
        flush: blocks until every decision sent is acknowledged.
        check_delivered: raises when a decision could not be delivered (the term ends; the next rebuilds).
        write_read_model, write_snapshot: blocking writes to Redis (:mod:`services.dispatcher.store`).
        commit: commits the consumer's positions (lag tools only).
        now: wall seconds now (``loop.time()``), the start of the pacing.
        reachable: True when the broker answers now (a TCP probe, run in a worker thread); ``None``
            (tests without Kafka): always. Asked only after half a heartbeat timeout (event time)
            without a record: while it says no, the term is *blind* and runs no tick (no decision,
            above all no node lost on heartbeats it could not read); when it answers again, and
            again when the first records come, :meth:`DispatcherService.resume` grants the heartbeats
            a grace of one timeout.
        pending: True while records sent are not yet committed (a transactional writer,
            ``Unacked.open``): then every iteration that sent anything ends with ``flush`` (the commit),
            after the lease is checked, so readers on ``read_committed`` see each iteration's decisions at
            once and a deposed leader's never. ``None``: not transactional, ``flush`` waits for the acks
            only when idle.
        ends, positions: the input partitions' end offsets asked of the broker now, and how far the
            consumer has read each (``"topic:partition"`` -> offset; run in a worker thread). A tick that
            would declare a node lost by heartbeat timeout waits until the positions reach end offsets
            taken after that node came due (rule D3.loss-barrier, :meth:`read_barrier`). ``None``: no barrier.
        settle: the proof of the keys (rule D10.proven-user): ``settle(wait)`` waits (``wait`` False: only if
            answered already, else returns ``None``) for the key topic's end offsets the last poll asked for
            and returns the key records up to them that the reader had not read
            (:meth:`apportion.bus.consumer.AssignedConsumer.settle`). Every commit waits for it
            (:meth:`prove`). ``None``: the poll read the keys to their end itself.
    """

    def __init__(
        self,
        svc: DispatcherService,
        settings: DispatcherSettings,
        metrics: dict,
        *,
        check_lease: Callable[[], None],
        lost: Any,
        flush: Callable[[], None],
        check_delivered: Callable[[], None],
        write_read_model: Callable[[], None],
        write_snapshot: Callable[[], None],
        commit: Callable[[], None],
        now: Callable[[], float],
        reachable: Callable[[], bool] | None = None,
        pending: Callable[[], bool] | None = None,
        ends: Callable[[], Mapping[str, int]] | None = None,
        positions: Callable[[], Mapping[str, int]] | None = None,
        settle: Callable[[bool], list[Any] | None] | None = None,
    ) -> None:
        self.svc, self.settings, self._m = svc, settings, metrics
        self.settle = settle
        self.unproven: list[list[Any]] = []  # the batches folded since the last proof of the keys (settle)
        self.pending = pending
        self.ends, self.positions = ends, positions
        self.barrier: Mapping[str, int] | None = None  # the end offsets a loss waits for (read_barrier)
        self.barrier_for: frozenset[str] = frozenset()  # the nodes due when they were taken
        self.check_lease, self.lost, self.check_delivered = check_lease, lost, check_delivered
        self._flush = flush
        self.write_read_model, self.write_snapshot, self.commit, self.now = (
            write_read_model,
            write_snapshot,
            commit,
            now,
        )
        t = now()
        self.last_rm = self.last_beats = self.last_snap = self.last_idle = t
        self.idle_reports = svc.state.idle.reports  # idle reports folded when the read model last showed them
        self.rm_gap = READ_MODEL_EVERY_S
        self.unflushed = self.dirty = False
        #: what a batch decided while its news waits for the pacer's tick (a submission's ``JobQueued``): sent
        #: with that tick's decisions, one transaction instead of two (:meth:`handle`)
        self.carried: list[Event] = []
        self.pacer = TickPacer(settings.tick_wall_s, start=t)
        self.reachable = reachable
        self.last_read_us = svc.now_us()  # event time of the last poll that returned records
        self.last_handle_us = self.last_read_us  # event time of the last poll that came back at all
        self.last_probe = t - PROBE_EVERY_WALL_S
        self.blind = False  # the broker did not answer since the last records
        self.unread = False  # it answered again, but no record came since
        hb = settings.heartbeat_timeout_s
        self.quiet_us = s_to_us(hb / 2) if hb > 0 else None

    async def start(self, backlog: list[Any], late: list[Any], configured: DispatcherConfigured, lease: Any) -> None:
        """Rebuild from the log as of the start (``backlog``), fold ``late``, publish the recovery decisions.

        ``configured`` (the knobs it decides with, rule D4.configured) goes first, so the audit needs no
        flags. Raises :class:`LeadershipLost` when the log shows a newer leader's token than ``lease``'s.
        """
        svc = self.svc
        svc.held = []
        try:
            out = svc.bootstrap(backlog, configured)
            if svc.signer is not None:  # never decide with a key the readers do not know (docs/security.md)
                svc.signer.check_registered(svc.gate.keys, svc.now_us())
            if late:
                more, _ = svc.ingest(late)
                out += more
        finally:
            held, svc.held = svc.held, None
        out += held
        newest = svc.log_token  # the proven records' (a forged decision's token must not depose us)
        lease.observe(newest)
        if newest > lease.token:  # a newer leader wrote after we took the lease: we are deposed
            raise LeadershipLost()
        self.last_read_us = self.last_handle_us = svc.now_us()
        self.check_lease()
        await asyncio.to_thread(svc._emit, out)
        self.check_lease()  # as in handle: a deposed leader's transaction is never committed
        await asyncio.to_thread(self.flush)
        self.check_delivered()  # every decision the read model and the snapshot show is in the log
        await asyncio.to_thread(self.write_read_model)
        if self.settings.snapshot_every_wall_s > 0:
            await asyncio.to_thread(self.write_snapshot)

    def poll_ms(self) -> int:
        """How long the next poll may wait (:meth:`TickPacer.poll_ms`)."""
        return self.pacer.poll_ms(self.now())

    async def sight(self, batch: list[Any]) -> list[Event]:
        """Whether this term can see the log (``blind``), and the grace it grants when it can again.

        Returns the ``DispatcherConfigured`` records of :meth:`DispatcherService.resume` to publish.
        """
        svc = self.svc
        now_us = svc.now_us()
        if self.quiet_us is not None and now_us - self.last_handle_us > self.quiet_us:
            self.blind = True  # no poll came back for half a timeout (they raised): nothing was read either
        self.last_handle_us = now_us
        if batch:
            self.last_read_us = now_us
            if self.blind or self.unread:
                self.blind = self.unread = False
                log.info("reading the log again after an outage: heartbeats get a grace of one timeout")
                return svc.resume()
            return []
        if self.blind and self.reachable is None:  # nothing to ask: it reads again, as far as it can tell
            self.blind, self.unread = False, True
            return svc.resume()
        if self.reachable is None or self.quiet_us is None:
            return []
        if not self.blind and now_us - self.last_read_us <= self.quiet_us:
            return []
        wall = self.now()
        if wall - self.last_probe < PROBE_EVERY_WALL_S:
            return []
        self.last_probe = wall
        if not await asyncio.to_thread(self.reachable):
            if not self.blind:
                log.warning("the broker does not answer: no decisions (and no node lost) until it does")
            self.blind, self.unread = True, False
            return []
        if self.blind:  # it answers again; the records it kept for us are still to come
            self.blind, self.unread = False, True
            return svc.resume()
        return []

    async def handle(self, batch: list[Any]) -> None:
        """After a poll: fold, tick when due, publish (lease checked), flush when idle, write what is due.

        No tick while the term is blind (:meth:`sight`).
        """
        svc, pacer = self.svc, self.pacer
        if batch and self.settle is not None:
            self.unproven.append(batch)
        out, self.carried = self.carried, []
        out += await self.sight(batch)
        more, news = svc.ingest(batch) if batch else ([], False)
        out += more
        now = self.now()
        due = not self.blind and pacer.due(now, news)
        if due and await self.read_barrier():
            out += svc.tick()
            pacer.ticked(now, self.now())
        elif out and not due and not self.blind and pacer.waiting:
            # the news waits for its tick (the pacer's gap: at most TICK_GAP_MAX_S, the next poll's wait):
            # what it decided so far goes out with that tick's decisions, in one transaction instead of two
            # (a submission's JobQueued, then its JobPlaced and StartWorkload). Nothing is sent or shown
            # meanwhile: no read model or snapshot holds a decision the log does not.
            self.carried, out = out, []
        # The keeper thread renews the lease (LeaseKeeper). Safety does not rest on it: every decision
        # carries the fencing token and agents refuse stale tokens.
        if out:
            self.check_lease()
            # one worker-thread call sends and, transactional, commits: a thread hand-off less per decision
            await asyncio.to_thread(self._emit_and_commit, out)
            self.unflushed = self.pending is None
        elif self.lost.is_set():
            raise LeadershipLost()
        if self.pending is not None:
            if self.pending():  # dead letters in an open transaction (published by the intake): commit them
                self.check_lease()  # a deposed leader's transaction is never committed (aborted by the next)
                await asyncio.to_thread(self.flush)
            self.unflushed = False
        elif self.unflushed and not batch:  # idle: nothing to decide, so waiting for the acks costs nothing
            await asyncio.to_thread(self.flush)
            self.unflushed = False
        self.check_delivered()
        self.dirty |= bool(out) or news
        if now - self.last_beats >= HEARTBEATS_EVERY_S:  # heartbeats are not news: their ages are kept apart
            self._m["queue"].heartbeats(logic.heartbeats(svc.state))
            self.last_beats = now
        if now - self.last_idle >= IDLE_TIMES_EVERY_S and svc.state.idle.reports != self.idle_reports:
            self.dirty, self.idle_reports, self.last_idle = True, svc.state.idle.reports, now
        if self.dirty and not self.carried and now - self.last_rm >= self.rm_gap:
            t0 = self.now()
            await asyncio.to_thread(self.write_read_model)
            await asyncio.to_thread(self.commit)
            # at most ~10% of the loop on read models, however large the queue grows
            self.rm_gap = max(READ_MODEL_EVERY_S, 10 * (self.now() - t0))
            self.last_rm, self.dirty = self.now(), False
        every = self.settings.snapshot_every_wall_s
        if every > 0 and not self.carried and now - self.last_snap >= every:
            self.check_lease()  # every decision in the state must be in the log: publish, flush, then store
            await asyncio.to_thread(self.flush)
            self.unflushed = False
            await asyncio.to_thread(self.write_snapshot)
            self.last_snap = self.now()
        if len(self.unproven) > UNPROVEN_MAX:  # folded, nothing committed: wait for the proof
            await asyncio.to_thread(self.prove)
        elif self.unproven:  # proven if the answer is in (no wait: on the loop)
            self.prove(wait=False)

    def prove(self, wait: bool = True) -> None:
        """Rule D10.proven-user at the commit: the batches folded since the last proof were judged with every
        key event appended before them, or :class:`KeysMoved` is raised.

        A poll returns its records without waiting for the key topic's end offsets (asked after the records
        were read, on another connection); the term judges and decides on them meanwhile, and waits for the
        answer here, before anything decided is committed (:meth:`flush`; a ``read_committed`` reader sees
        nothing of a transaction before). The key records up to those end offsets that the reader had not
        read are read now; when none of them bears on a record folded since the last proof
        (:func:`logic.keys_bear`), every judgment stands, as if the poll had read them first, and they are
        folded at the head of the next batch. ``wait`` False: only if the answer is in already.
        """
        if self.settle is None or not self.unproven:
            return
        late = self.settle(wait)
        if late is None:
            return
        folded, self.unproven = self.unproven, []
        if late and logic.keys_bear(late, (rec for batch in folded for rec in batch)):
            raise KeysMoved(f"{len(late)} key records read after the batch they bear on was judged")

    def flush(self) -> None:
        """Prove the keys of what was folded (:meth:`prove`), then ``flush`` (commit) what was sent."""
        self.prove()
        self._flush()

    async def read_barrier(self) -> bool:
        """Rule D3.loss-barrier: whether the tick due now may run.

        Yes when it would declare no node lost by heartbeat timeout
        (:func:`apportion.domain.dispatch.overdue_nodes`). Else the input partitions' end offsets are
        taken (again whenever a node comes due after they were) and the tick waits until the consumer
        has read up to them: a node is declared lost only on a view that holds every heartbeat and
        report appended before it came due, so a node is not lost, nor a completed run requeued, on
        records the dispatcher had not read yet. A broker that does not give its end offsets leaves the
        tick waiting (logged).
        """
        if self.ends is None or self.positions is None:
            return True
        svc = self.svc
        due = frozenset(overdue_nodes(svc.state, svc.now_us(), svc.cfg))
        if not due:
            self.barrier, self.barrier_for = None, frozenset()
            return True
        if self.barrier is None or not due <= self.barrier_for:  # a node came due after these ends were taken
            try:
                self.barrier = await asyncio.to_thread(self.ends)
            except Exception as exc:  # noqa: BLE001 - any failure to ask means no loss on an unchecked view
                log.warning("a node is due lost, but the log's end is not known (%s): waiting", exc)
                self.barrier = None
                return False
            self.barrier_for = due
        if logic.read_to(await asyncio.to_thread(self.positions), self.barrier):
            self.barrier, self.barrier_for = None, frozenset()
            return True
        return False

    def _emit_and_commit(self, out: list[Event]) -> None:
        """Publish ``out``; when transactional, commit what is open at once (in the caller's thread).

        The lease is checked before the commit, as before the send: a deposed leader's transaction is
        never committed (aborted by the next leader's ``init_transactions``)."""
        self.svc._emit(out)
        if self.pending is not None and self.pending():
            self.check_lease()
            self.flush()

    def close(self) -> None:
        """A clean stop (blocking): commit an open transaction while this term still leads and sees the
        log; else leave it to be aborted (by the next leader's ``init_transactions`` or the timeout). Decisions
        carried to the next tick (:meth:`handle`) are sent first."""
        if self.blind:
            return
        if self.carried:
            self.check_lease()
            out, self.carried = self.carried, []
            self.svc._emit(out)
        if self.pending is not None and self.pending():
            self.check_lease()
            self.flush()


def lead_term(
    svc: DispatcherService,
    settings: DispatcherSettings,
    metrics: dict,
    keeper: Any,
    sends: Any,
    consumer: Any,
    r: Any,
    now: Callable[[], float],
) -> Term:
    """The :class:`Term` of a leader: ``svc`` wired to its lease ``keeper``, its producer's unacked ``sends``
    (:class:`apportion.bus.producer.Unacked`; transactional: a commit per iteration), ``consumer`` and Redis
    ``r`` (:mod:`services.dispatcher.store`); ``now``: ``loop.time``.
    Its blindness probe (``reachable``) asks the broker of ``settings``' connection (:func:`broker_answers`)."""
    from apportion.bus.service import commit_quietly

    def check_lease() -> None:  # by the keeper, and by the local lease clock (it counts through a SIGSTOP)
        if not keeper.holds():
            raise LeadershipLost()

    return Term(
        svc,
        settings,
        metrics,
        check_lease=check_lease,
        lost=keeper.lost,
        flush=sends.flush,
        check_delivered=sends.check,
        write_read_model=lambda: store.write_read_model(r, svc, metrics),
        write_snapshot=lambda: store.write_snapshot(r, svc),
        commit=lambda: commit_quietly(consumer),
        now=now,
        reachable=broker_answers(settings.connection().bootstrap),
        pending=(lambda: sends.open) if sends.transactional else None,
        ends=consumer.end_offsets_now,
        positions=consumer.positions,
        settle=consumer.settle if consumer.overlap else None,
    )


async def rebuild_and_start(
    term: Term, settings: DispatcherSettings, consumer: Any, r: Any, lease: Any, stop: asyncio.Event
) -> bool:
    """Rebuild the term's state from the stored snapshot (if it fits) and the log, then :meth:`Term.start`.

    Returns False when ``stop`` was set before the log was read up to its end (nothing started).
    """
    from apportion.audit.config import configured_event

    svc = term.svc
    t_start = term.now()
    snap = await asyncio.to_thread(store.restore_snapshot, r, settings, svc, consumer, lease)
    svc.read_from(consumer.offsets_at_start()[0])  # the log start of a partition the snapshot did not name
    if (caught := await consumer.catch_up(stop)) is None:
        return False
    ts = from_us(svc.now_us())
    configured = configured_event(
        svc.cfg, instance=settings.owner(), fencing_token=lease.token, ts=ts, producer=settings.producer_name
    )
    backlog, late = caught
    await term.start(backlog, late, configured, lease)
    settle_heap()  # the rebuilt state leaves the collector's working set (rule D9.scale)
    took, origin = term.now() - t_start, "a snapshot" if snap else "offset 0"
    log.info("started from %s: %d records read, rebuilt in %.2f s", origin, len(backlog), took)
    return True
