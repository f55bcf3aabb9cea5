"""The accounting service without Kafka: fold records, publish snapshots, store the read model and checkpoint.

Consumes ``apportion.jobs``, ``apportion.nodes`` and ``apportion.budgets``;
produces ``OccupancySnapshot`` on ``apportion.usage`` (and ``DeadLetter`` for
records that do not decode); writes ``apportion:rm:budgets``,
``apportion:rm:usage`` and its checkpoint ``apportion:ckpt:accounting`` in
Redis.

State and restarts: **a start resumes from the checkpoint.** Each time the
read model is written with a checkpoint due (at most every
``checkpoint_interval_wall_s``, and at a graceful stop), the same Redis
MULTI/EXEC also stores the whole folded state (:class:`logic.Accounting`:
ledger, budget log, tree), the last published snapshot and, per partition,
the next offset to read (:mod:`services.accounting.checkpoint`). The Kafka
group offsets (group ``accounting``) are committed right after, for lag
tools. The offsets stored *with* the state are the source of truth: the
committed group offsets equal them except after a crash between the two
writes, and a start never reads them. On start the service loads the
checkpoint, checks its format version and class layout, window, topic
namespace and that every partition's offset is still in the log, seeks
there, catches up to the end offsets as of the start (one batch in the
merge order below), then follows live. A kill -9 loses at most the work
since the last checkpoint, which is read again: nothing is lost, nothing is
counted twice (the offsets and the state were written together).

If there is no checkpoint, or it is unusable (other format or layout,
window or namespace, corrupt, a partition missing, offsets before the log
start or after its end), the start logs why and **rebuilds from offset 0**:
the three topics are read up to their end offsets as of the start, merged
in the documented log order ((event time, topic, partition, offset), as the
audit does) and bulk-folded (:func:`services.accounting.logic.rebuild`).
``--rebuild`` ignores and wipes the checkpoint and the read model and does
the same.

Resume equals rebuild: a resumed state caught up with the log equals a
rebuild from offset 0 of the same log exactly (tests prove it at every cut,
with duplicates and shuffled arrival). A *late* record (an event time older
than one folded before it: cross-partition skew between polls, or across the
checkpoint) takes effect at its own time, as in the rebuild
(:mod:`apportion.domain.occupancy`); the service counts them
(``apportion_accounting_late_events``, ``late_events`` in the checkpoint
header, ``late_across_cut`` in the start log line) as a measure of skew.

Why not faust here: faust (like the group-based
:class:`~apportion.bus.consumer.EventConsumer`) resumes from the group's
committed offsets, which cannot be written in one transaction with the
state in Redis, and cannot say "read these three topics from 0 (or from
these offsets), tell me when you reached today's end, in a deterministic
merged order" without fighting its assignor; :class:`apportion.bus.consumer.AssignedConsumer` does that in a few
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from apportion.bus.intake import Intake
from apportion.bus.memory import trim
from apportion.bus.resilience import publish_until_acked
from apportion.clock import Clock
from apportion.events import DeadLetter, Event, OccupancySnapshot
from apportion.identity.gates import ReportGate
from apportion.logrecord import record_order
from apportion.timeutil import to_us
from services.accounting import checkpoint, logic
from services.accounting.config import AccountingSettings
from services.accounting.store import ReadModelStore

log = logging.getLogger("apportion.accounting")


@dataclass(frozen=True)
class StartReport:
    """How a start obtained its state (logged, and passed to ``run``'s ``on_start``).

    Attributes:
        mode: ``"resume"`` (from the Redis checkpoint) or ``"rebuild"`` (from offset 0).
        reason: why it rebuilt (``"--rebuild"``, or the checkpoint's
            :class:`~services.accounting.checkpoint.CheckpointError`); ``""`` on resume.
        offsets: ``"topic:partition"`` -> the offset reading began at.
        records: records read to catch up with the log as it was at start.
        late_across_cut: on resume, state-changing records with an event
            time older than the newest one folded before them (the
            checkpoint's, or the catch-up's own); each took effect at its own
            time, as in a rebuild from offset 0.
        seconds: wall seconds from the consumer's assignment to caught up.
    """

    mode: str
    reason: str
    offsets: dict[str, int]
    records: int
    late_across_cut: int
    seconds: float


class AccountingService:
    """The accounting loop without Kafka: ingest records, publish snapshots, store the read model.

    Args:
        settings: configuration.
        clock: event-time source (periodic snapshots).
        publish: ``publish(event)``, blocking until acked.
        store: the read-model store (it also holds the checkpoint).
        metrics: optional prometheus metrics dict.
        wall: monotonic wall seconds, for the checkpoint interval (default ``time.monotonic``).
        stopped: when given, a dead letter whose publish fails is sent again until acked or
            ``stopped()`` (:func:`apportion.bus.resilience.publish_until_acked`); default: sent once.
    """

    def __init__(
        self,
        settings: AccountingSettings,
        clock: Clock,
        publish: Callable[[Event], Any],
        store: ReadModelStore,
        metrics: dict | None = None,
        wall: Callable[[], float] = time.monotonic,
        stopped: Callable[[], bool] | None = None,
    ) -> None:
        from apportion.settings import topic_prefix

        self.settings = settings
        self.clock = clock
        self.publish = publish
        self.store = store
        self.acc = logic.Accounting(settings.window_s)
        self.last: OccupancySnapshot | None = None
        self.dirty = False
        #: ``"topic:partition"`` -> next offset to fold (every partition read).
        self.offsets: dict[str, int] = {}
        #: merge key of the newest state-changing record folded; records older than one folded before them.
        self.last_key: checkpoint.RecordKey | None = None
        self.late = 0
        self.topic_prefix = topic_prefix()
        self._m = metrics or {}
        self._wall = wall
        self._stopped = stopped
        self._unsaved = True  # state or offsets changed since the stored checkpoint
        self._ckpt_wall: float | None = None
        self._last_pub = 0.0  # wall time (monotonic) of the last snapshot published by :meth:`follow`
        self._ckpt_cost = 0.0
        #: the reader edge: screen, de-duplicate by id and payload, dead-letter (published at once)
        # duplicates go on to the fold (idempotent), so a resumed service counts late records as this one
        # node reports count only when signed by their node's key (rule D10.authentication); the registry is the state's
        self.intake = Intake(
            settings.producer_name,
            clock.now,
            on_dead=self._dead_letter,
            drop_duplicates=False,
            gate=ReportGate(lambda: self.acc.keys, folds=logic.LEDGER_TYPES),
            window_s=settings.window_s,
        )

    # ------------------------------------------------------------------ start

    def prepare(self, begin: dict[str, int], end: dict[str, int], rebuild: bool) -> tuple[str, str]:
        """Choose how to start: restore the stored checkpoint, or rebuild from the log start.

        Args:
            begin: every partition read -> its log start offset now.
            end: every partition read -> its end offset now.
            rebuild: ``--rebuild`` was given (the checkpoint is ignored).

        Returns:
            ``(mode, reason)``: ``("resume", "")`` with the state and
            :attr:`offsets` restored (seek the consumer to them), or
            ``("rebuild", reason)`` with :attr:`offsets` = ``begin``. Never
            raises for a bad checkpoint: the reason says what was wrong.
        """
        self.offsets = dict(begin)
        if rebuild:
            return "rebuild", "--rebuild"
        try:
            ck = checkpoint.decode(
                self.store.read_checkpoint(), window_s=self.settings.window_s, topic_prefix=self.topic_prefix
            )
            checkpoint.check_offsets(ck.offsets, begin, end)
        except checkpoint.CheckpointError as exc:
            return "rebuild", str(exc)
        self.restore(ck)
        return "resume", ""

    def restore(self, ck: checkpoint.Checkpoint) -> None:
        """Take over a checkpoint's state, offsets and counters."""
        self.acc, self.last, self.dirty = ck.acc, ck.last, ck.dirty
        self.offsets = dict(ck.offsets)
        self.last_key, self.late = ck.last_key, ck.late_events
        if ck.ids is not None:  # the reader edge de-duplicates as the process that wrote the checkpoint did
            self.intake.ledger = ck.ids
        self._unsaved = False
        self._ckpt_wall = self._wall()

    def bootstrap(self, records: list[Any]) -> OccupancySnapshot | None:
        """Bulk-build from every record up to the start's end offsets; publish the first snapshot."""
        decoded = self._decoded(records)
        evs = [ev for _, _, ev in decoded]
        # the reader edge has just folded these records' keys and placed runs into the state's registry:
        # the rebuilt state keeps it (a new one would let a node report the replica of another node's run)
        keys = self.acc.keys
        try:
            self.acc = logic.rebuild(evs, self.settings.window_s, keys)
        except Exception:  # find the record at fault: fold one by one, dead-lettering it
            log.exception("bulk rebuild failed: folding event by event")
            self.acc = logic.Accounting(self.settings.window_s, keys=keys)
            for _, rec, ev in decoded:
                self.intake.apply(rec, self.acc.apply, ev)
        # decoded is in merge order: the newest state-changing record is the last one
        self.last_key = next((k for k, _, ev in reversed(decoded) if isinstance(ev, logic.STATE_TYPES)), None)
        if "events" in self._m:
            self._m["events"].inc(len(evs))
        log.info(
            "rebuilt from %d events (ledger clock %s, %d budgets)", len(evs), self.acc.clock_us, len(self.acc.tree)
        )
        return self.snapshot_now() if self.acc.clock_us is not None or len(self.acc.tree) else None

    def resume(self, records: list[Any]) -> int:
        """Fold the records after the checkpoint (one batch, in merge order); publish if anything changed.

        Returns:
            How many folded records were older than the checkpoint's newest
            state-changing record (see :class:`StartReport`).
        """
        before = self.late
        self.ingest(records)
        if records:
            self._ckpt_wall = None  # the catch-up may have been long: checkpoint with the next write
        if self.dirty:
            self.snapshot_now()
        return self.late - before

    # ------------------------------------------------------------------ folding

    def _decoded(self, records: list[Any]) -> list[tuple[checkpoint.RecordKey, Any, Event]]:
        """Screen (dead-lettering what a reader refuses), advance the offsets; ``(merge key, record, event)`` sorted.

        The reader edge (:class:`~apportion.bus.intake.Intake`) also drops
        duplicates (same id, same payload) and dead-letters a reused id.
        """
        out = []
        admit = self.intake.admit
        for rec in records:
            ev = admit(rec)
            self.offsets[f"{rec.topic}:{rec.partition}"] = rec.offset + 1
            if ev is not None:
                out.append((record_order(rec, ev), rec, ev))
        if records:
            self._unsaved = True
        out.sort(key=itemgetter(0))
        return self.intake.authenticate(out, itemgetter(1, 2))

    def _dead_letter(self, letter: DeadLetter) -> None:
        if self._stopped is None:
            self.publish(letter)
        else:  # never lost, never fatal: its record's offset is stored only after it is acked
            publish_until_acked(self.publish, letter, self._stopped)
        if "dead" in self._m:
            self._m["dead"].inc()

    def ingest(self, records: list[Any]) -> None:
        """Fold a live batch (sorted into log order first); an event the fold raises on is dead-lettered."""
        apply = self.intake.apply
        for key, rec, ev in self._decoded(records):
            self.dirty |= bool(apply(rec, self.acc.apply, ev))
            if isinstance(ev, logic.STATE_TYPES):
                if self.last_key is None or key > self.last_key:
                    self.last_key = key
                elif key[0] < self.last_key[0]:
                    # older than an event already folded (a measure of skew: the ledger folds it
                    # at its own time, as a rebuild does; same-instant events commute, so only
                    # older ones count)
                    self.late += 1
                    if "late" in self._m:
                        self._m["late"].inc()
            if "events" in self._m:
                self._m["events"].inc()

    # ------------------------------------------------------------------ output

    def due(self) -> int | None:
        """Event time (µs) of the periodic snapshot due now, or ``None``."""
        last = to_us(self.last.at) if self.last else None
        return logic.periodic_due(last, self.clock.now_us(), self.acc.clock_us, self.settings.snapshot_interval_s)

    def snapshot_now(self, at_us: int | None = None) -> OccupancySnapshot | None:
        """Publish the snapshot at ``at_us`` (default: max(ledger clock, last at)) and store it.

        The read model is written with a checkpoint when one is due
        (:meth:`checkpoint_due`), in the same Redis transaction.
        """
        t0 = self._wall()
        if at_us is None:
            cands = [t for t in (self.acc.clock_us, to_us(self.last.at) if self.last else None) if t is not None]
            at_us = max(cands) if cands else self.clock.now_us()
        snap = self.acc.snapshot(at_us)
        if snap is None:
            return None
        snap = snap.model_copy(update={"inputs": dict(sorted(self.offsets.items()))})
        self.publish(snap)
        self.last, self.dirty, self._unsaved = snap, False, True
        self._store(snap, self.checkpoint_due())
        if "snapshots" in self._m:
            self._m["snapshots"].inc()
            self._m["at"].set(to_us(snap.at) / 1e6)
            self._m["snapshot_seconds"].observe(self._wall() - t0)
        return snap

    def checkpoint_due(self) -> bool:
        """True when the state changed since the stored checkpoint and the interval passed.

        The interval is ``checkpoint_interval_wall_s`` (0: every write),
        stretched to 20 times the last encode time so checkpointing a large
        state costs at most about 5% of the loop.
        """
        if not self._unsaved:
            return False
        if self._ckpt_wall is None:
            return True
        interval = self.settings.checkpoint_interval_wall_s
        if interval <= 0:
            return True
        return self._wall() - self._ckpt_wall >= max(interval, 20 * self._ckpt_cost)

    def checkpoint_now(self) -> bool:
        """Store the read model of the last snapshot with a checkpoint of the current state.

        Returns:
            False when there is nothing to store (no snapshot yet, or nothing
            changed since the stored checkpoint).
        """
        if self.last is None or not self._unsaved:
            return False
        self._store(self.last, True)
        return True

    def _store(self, snap: OccupancySnapshot, with_checkpoint: bool) -> None:
        meta, rows = logic.read_model(snap, self.acc.tree, self.offsets)
        fields = None
        if with_checkpoint:
            t = self._wall()
            fields = checkpoint.encode(
                checkpoint.Checkpoint(
                    self.acc, self.last, self.dirty, dict(self.offsets), self.last_key, self.late, self.intake.ledger
                ),
                topic_prefix=self.topic_prefix,
            )
            self._ckpt_cost = self._wall() - t
        self.store.write(meta, rows, fields)
        if "budgets" in self._m:
            self._m["budgets"].update(meta, rows, self.acc.users.parts(to_us(snap.at)))
        if fields is not None:
            trim()  # the checkpoint's buffers were the largest allocations: give their pages back
            self._unsaved, self._ckpt_wall = False, self._wall()
            if "checkpoints" in self._m:
                self._m["checkpoints"].inc()
                self._m["checkpoint_bytes"].set(len(fields[checkpoint.STATE]))

    # ------------------------------------------------------------------ the connected run (services.accounting.app)

    async def start(self, consumer: Any, stop: asyncio.Event, rebuild: bool) -> StartReport | None:
        """Resume from the checkpoint (or rebuild from offset 0) and catch up with the log as of the start.

        Args:
            consumer: an :class:`apportion.bus.consumer.AssignedConsumer` of the three topics, not read yet.
            stop: checked while catching up.
            rebuild: ``--rebuild`` (the checkpoint is ignored).

        Returns:
            The :class:`StartReport` (logged, metrics set), or ``None`` when ``stop`` was set first.
        """
        t0 = time.monotonic()
        begin, end = consumer.offsets_at_start()
        mode, reason = await asyncio.to_thread(self.prepare, begin, end, rebuild)
        from_offsets = dict(self.offsets)
        if mode == "resume":
            consumer.seek(self.offsets)
            log.info(
                "resuming from the checkpoint (ledger clock %s, %d records behind the log end)",
                self.acc.clock_us,
                sum(end[p] - self.offsets[p] for p in end),
            )
        elif reason != "--rebuild":
            (log.info if reason.startswith("missing") else log.warning)(
                "no usable checkpoint (%s): rebuilding from offset 0", reason
            )
        caught = await consumer.catch_up(stop)
        if caught is None:
            return None
        backlog, late = caught  # the log as of the start; appended meanwhile: folded live
        if mode == "resume":
            crossed = await asyncio.to_thread(self.resume, backlog)
        else:
            await asyncio.to_thread(self.bootstrap, backlog)
            crossed = 0
        if late:
            await asyncio.to_thread(self.ingest, late)
        report = StartReport(mode, reason, from_offsets, len(backlog) + len(late), crossed, time.monotonic() - t0)
        log.info(
            "started by %s from %s: %d records read in %.2f s%s",
            mode,
            "the checkpoint" if mode == "resume" else "offset 0",
            report.records,
            report.seconds,
            f"; {crossed} of them older than the checkpoint's newest event" if crossed else "",
            extra={"start_mode": mode, "start_records": report.records, "late_across_cut": crossed},
        )
        if self._m:
            self._m["start_records"].set(report.records)
            # what the read model holds now (a resumed start may store no snapshot until something changes)
            meta, rows = await asyncio.to_thread(self.store.read)
            self._m["budgets"].update(meta, rows, self.acc.users.parts(to_us(self.last.at)) if self.last else {})
            self._m["resumed"].set(1 if mode == "resume" else 0)
        self._last_pub = time.monotonic()
        return report

    async def serve(
        self, consumer: Any, stop: asyncio.Event, rebuild: bool, started: Callable[[StartReport], None]
    ) -> None:
        """:meth:`start`, then :meth:`follow` ``consumer`` live until ``stop``; the group offsets are committed
        after each store. On a clean stop a final checkpoint is stored; a failed session (an exception out of
        here) never stores offsets past what it folded.

        Args:
            consumer: an :class:`apportion.bus.consumer.AssignedConsumer` of the three topics, not read yet.
            stop: set it to stop.
            rebuild: ``--rebuild`` (the checkpoint is ignored).
            started: called with the :class:`StartReport` once caught up (not when ``stop`` came first).
        """
        from apportion.bus.service import commit_quietly, follow

        if (report := await self.start(consumer, stop, rebuild)) is None:
            return
        await asyncio.to_thread(commit_quietly, consumer, dict(self.offsets))
        started(report)

        async def handle(batch: list[Any]) -> None:
            if await self.follow(batch):
                await asyncio.to_thread(commit_quietly, consumer, dict(self.offsets))

        await follow(consumer.poll, handle, stop)
        try:  # graceful stop: the next start resumes exactly here
            if await asyncio.to_thread(self.checkpoint_now):
                await asyncio.to_thread(commit_quietly, consumer, dict(self.offsets))
        except Exception:  # a failed final checkpoint only costs a longer catch-up
            log.exception("final checkpoint failed; the next start resumes from the previous one")

    async def follow(self, batch: list[Any]) -> bool:
        """Fold one poll's records, then publish and store what is due; True when something was stored.

        After changes, a snapshot debounced by ``snapshot_debounce_wall_s``; else the periodic one; else,
        with only heartbeats since, a checkpoint when one is due (keeps the resume point fresh).
        """
        if batch:
            await asyncio.to_thread(self.ingest, batch)
        now = time.monotonic()
        if self.dirty and now - self._last_pub >= self.settings.snapshot_debounce_wall_s:
            stored = await asyncio.to_thread(self.snapshot_now) is not None
        elif (at := self.due()) is not None:
            stored = await asyncio.to_thread(self.snapshot_now, at) is not None
        elif not self.dirty and self.checkpoint_due():
            return bool(await asyncio.to_thread(self.checkpoint_now))
        else:
            return False
        if stored:
            self._last_pub = now
        return stored
