"""Occupancy windows: O_b(t), U_b(t) and the capacity integral K(t) (rule D2.occupancy).

Definitions (all over the trailing window (t - W, t], W = ``window_s``):

* O_b(t) = integral of the GPUs held by running **allocated** runs charged
  to budget b or any descendant of b, in GPU-seconds;
* U_b(t) = the same for **unallocated** runs (``min_runtime_s == 0``);
  reported, never charged;
* K(t)   = integral of the capacity C(tau), the GPUs on ``ready`` and
  ``draining`` nodes (rule D1.capacity).

Exactness. Time is integer microseconds (:mod:`apportion.timeutil`) and every
integral is kept as an integer number of GPU-microseconds, so the incremental
fold (:meth:`OccupancyLedger.apply`) and the bulk :func:`rebuild` agree
*exactly* (not within a tolerance). Values are reported as GPU-seconds
(``float``, ``gpu_us / 1e6``) or, exactly, as GPU-microseconds by the
``*_us`` methods.

The data structure. For each charged budget path (the ``budget`` of the runs,
normally a leaf) and kind (allocated / unallocated), and once for capacity,
the ledger keeps the cumulative integral

    A(x) = integral_{-inf}^{x} G(tau) d tau          (GPU-microseconds)

where G is the step function "GPUs held" (or C for capacity). A is piecewise
linear with a breakpoint wherever G changes, and is stored as three parallel
lists ``times[i], area[i], rate[i]``: ``area[i] = A(times[i])`` and
``rate[i]`` is G on ``[times[i], times[i+1])``. Then

    A(x) = area[i] + rate[i] * (x - times[i]),   i = last breakpoint <= x
    O(t) = A(t) - A(t - W)

A(t) is O(1) (t is at or after the last breakpoint) and A(t - W) is a binary
search, so a query is O(log n) per series, and a full query over 200 budgets
plus their ancestors is a few hundred microseconds. Running runs count up to
t because the last rate extends to the right. Ancestors are not stored: their
values are sums of their descendants', added up at query time by splitting
the slash path.

Memory is bounded by the window: :meth:`OccupancyLedger.expire` drops every
breakpoint except the last one at or before ``clock - W`` (which is all a
query needs), amortised from :meth:`apply` every W/64 of event time.
Dropping changes ``area`` only by a constant that cancels in the difference.

Event semantics (the fold contract):

* ``JobPlaced`` starts run ``(job_id, attempt)``: ``replicas`` replicas of
  ``gpus_per_replica`` GPUs each (one per ``Placement``), charged to
  ``budget`` when ``allocated``, else counted as unallocated.
* The run, or one replica, ends at the event's ``ts`` on ``JobCompleted`` /
  ``JobFailed`` (``replica`` set: that replica only; ``None``: all remaining
  replicas), ``JobPreempted``, ``JobCancelled`` (with an ``attempt``).
* ``JobRequeued`` (attempt a) ends every replica of run ``(job_id, a - 1)``
  still open, at ``refused_at`` when the requeue undid a refused start, else
  at its ``ts`` (``D3.refused-starts``, ``docs/design/README.md``). After a
  preemption or a loss the run already ended earlier, and that end stands;
  after a ``WorkloadRefused`` the requeue is the run's only end, so a refused
  start is charged from its placement up to the refusal's event time and no
  further, in every reader that folds the log (the dispatcher's state, the
  accounting, the audit, the simulator).
* ``JobLost`` ends the whole run at ``charged_until`` (the node's last
  heartbeat, rule D3.node-lost), clamped into [run start, its own time]. The change
  is applied retroactively: breakpoints after ``charged_until`` are corrected.
* Nodes: ``NodeRegistered`` -> ready with ``gpu_count`` (a re-registration
  updates the count); ``NodeCordoned`` -> cordoned; ``NodeDrainRequested``
  -> draining; ``NodeDrained`` -> drained; ``NodeUncordoned`` -> ready;
  ``NodeLost`` -> lost. Ready and draining count toward C. A lost node
  returns only by registering again (its agent restarts); other node events
  for a lost or unknown node are ignored. **Decision:** a lost node's
  capacity ends at ``last_heartbeat`` (clamped into [the time it last became
  counted, clock]), the same instant its runs stop being charged, so E and O
  lose the same dead interval.
* A replica ends at the **earliest** end reported for it: an end later than
  one applied is ignored, an earlier one moves it back (the agent's
  ``JobCompleted`` of a run can be written after the dispatcher's
  ``JobPreempted`` of it, with an earlier time). Ends of unknown runs are
  ignored.
  Duplicates are ignored: a ``JobPlaced`` for a run that is open or ended
  within the last W, and a node event whose ``event_id`` was applied within
  the last W. (De-duplication memory is one window, like everything else.)

Ordering. Per-entity order is given by Kafka keys (a run's events on its
job's partition, a node's on its node's); a stream merged from several
partitions may interleave them in any order. The ledger's clock is the
largest ``ts`` applied so far; an event whose ``ts`` is older (*late*: a
record of another partition polled after newer ones) **takes effect at its
own time**, retroactively (:meth:`_Series._retro`: the breakpoints after it
are corrected). Changes of different entities add up, so the ledger after a
set of events is the same whatever order their partitions were merged in
(exactly: integer GPU-µs), and a service that folds records as they arrive
agrees with a replay that sorts them (``audit verify``). Within one entity an
event never takes effect before the entity's previous one (a run's end is
clamped to its start, a node's change to its latest change), since its
writers' clocks may disagree. (Clamping a late event up to the
clock instead would make the fold depend on the poll batches: snapshots and
decisions would fail ``audit verify`` by a few GPU-s.)
Queries must be at ``t >= clock`` (:class:`ValueError` otherwise): the
answer for an earlier time is whatever a rebuild from the events up to that
time says.
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any

from apportion.domain.budgets import ancestors_of
from apportion.domain.nodes import COUNTED_STATES, NODE_EVENT_TYPES, NodeEvent, NodeState, node_transition
from apportion.events import (
    Event,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobRequeued,
    NodeLost,
    NodeRegistered,
)
from apportion.timeutil import US_PER_S, WEEK_S, Micros, s_to_us, to_us

__all__ = ["OccupancyLedger", "rebuild", "LEDGER_EVENT_TYPES", "requeued_end_us"]

# pragma: any value below every event time is the same sentinel (`2 << 62`, `1 << 63`, `1 >> 62` = 0: event times
# are µs since 1970 and positive), so its mutants are equivalent
_MIN_T = -(1 << 62)  # pragma: no mutate
"""Time of the sentinel breakpoint that starts every series (G = 0 before any change)."""

#: The event types the ledger folds (the module docstring says how); it ignores every other type.
LEDGER_EVENT_TYPES: tuple[type[Event], ...] = (
    JobPlaced,
    JobCompleted,
    JobFailed,
    JobPreempted,
    JobCancelled,
    JobLost,
    JobRequeued,
    *NODE_EVENT_TYPES,
)


def requeued_end_us(ev: JobRequeued) -> Micros:
    """``D3.refused-starts`` (design D3): when a requeue ends the previous attempt's run, µs.

    A start a node refused ends its run at the refusal's event time (``refused_at``), never later: the run is
    charged from its placement up to then and no further. Any other requeue ends the run at its own time, which
    only ever confirms an earlier end (the preemption or the loss that stopped it). The ledger folds this; every
    occupancy reader folds the ledger.
    """
    return to_us(ev.ts if ev.refused_at is None else min(ev.refused_at, ev.ts))


class _Series:
    """Cumulative integral A(x) of one step function G, as breakpoints (see module doc).

    ``times`` is strictly increasing from index ``head``; entries before
    ``head`` are expired and ignored (compacted away now and then). In bulk
    mode, changes are buffered in ``pending`` and merged by :meth:`flush`.
    """

    __slots__ = ("times", "area", "rate", "head", "pending")

    def __init__(self) -> None:
        self.times: list[int] = [_MIN_T]
        self.area: list[int] = [0]  # pragma: no mutate (any constant: A is only ever read as a difference)
        self.rate: list[int] = [0]
        self.head = 0
        self.pending: list[tuple[int, int]] = []

    def change(self, x: int, dg: int) -> None:
        """G += dg from time x on (x in µs, dg in GPUs)."""
        times = self.times
        last = times[-1]
        if x > last:
            rate = self.rate
            self.area.append(self.area[-1] + rate[-1] * (x - last))
            rate.append(rate[-1] + dg)
            times.append(x)
        elif x == last:
            self.rate[-1] += dg
        else:
            self._retro(x, dg)

    def _retro(self, x: int, dg: int) -> None:
        """A change in the past: insert a breakpoint at x and correct every later one.

        For y >= x the corrected integral is A(y) + dg * (y - x) and the rate
        is G(y) + dg. When x precedes the retained history (before ``head``),
        every retained breakpoint is corrected, which is exact for all the
        times a query can still ask about.
        """
        times, area, rate = self.times, self.area, self.rate
        i = bisect_right(times, x, self.head)  # first breakpoint after x
        # `>=` is the same: it would re-insert x next to an expired breakpoint that no query reads
        if i > self.head:  # pragma: no mutate
            k = i - 1
            if times[k] == x:
                rate[k] += dg
            else:
                times.insert(i, x)
                area.insert(i, area[k] + rate[k] * (x - times[k]))
                rate.insert(i, rate[k] + dg)
                i += 1
        for j in range(i, len(times)):
            area[j] += dg * (times[j] - x)
            rate[j] += dg

    def flush(self) -> None:
        """Merge buffered changes (bulk mode): sort by time, then one pass.

        Changes before the last breakpoint (``JobLost``, ``NodeLost``) go
        through :meth:`_retro`; the rest are appended in a tight loop with
        equal times merged. Same resulting function as calling :meth:`change`
        for each change in order.
        """
        pending = self.pending
        if not pending:
            return
        self.pending = []
        pending.sort(key=itemgetter(0))
        times, area, rate = self.times, self.area, self.rate
        lt = times[-1]
        n = len(pending)
        i = 0
        # `<=` is the same: _retro at the last breakpoint's own time adds to its rate, as the loop below does
        while i < n and pending[i][0] < lt:  # pragma: no mutate
            self._retro(*pending[i])
            i += 1
        la, lr = area[-1], rate[-1]
        for j in range(i, n):
            x, dg = pending[j]
            if x == lt:
                lr += dg
                rate[-1] = lr
            else:
                la += lr * (x - lt)
                lr += dg
                times.append(x)
                area.append(la)
                rate.append(lr)
                lt = x

    def at(self, x: int) -> int:
        """A(x) in GPU-µs. ``x`` must not precede the retained history."""
        times = self.times
        last = times[-1]
        if x >= last:  # pragma: no mutate (`>`: at x == last the search below finds the same breakpoint)
            return self.area[-1] + self.rate[-1] * (x - last)
        i = bisect_right(times, x, self.head) - 1
        if i < self.head:  # pragma: no cover - guarded by OccupancyLedger._check_t
            raise ValueError("time precedes the retained window history")  # pragma: no mutate (unreachable)
        return self.area[i] + self.rate[i] * (x - times[i])

    def window(self, t: int, w: int) -> int:
        """Integral of G over (t - w, t] in GPU-µs."""
        return self.at(t) - self.at(t - w)

    def current(self) -> int:
        """G after the last breakpoint (GPUs)."""
        return self.rate[-1]

    def expire(self, lo: int) -> None:
        """Drop breakpoints no query at window start >= lo needs (keep the last <= lo)."""
        times = self.times
        h = bisect_right(times, lo, self.head) - 1
        if h > self.head:  # pragma: no mutate (`>=`: setting head to itself changes nothing)
            self.head = h
            # when to compact changes no answer and no size() (head moves with the lists): memory only
            if h >= 32 and 2 * h >= len(times):  # pragma: no mutate
                del times[:h], self.area[:h], self.rate[:h]
                self.head = 0

    def size(self) -> int:
        """Retained breakpoints."""
        return len(self.times) - self.head


class _Run:
    """A run: where it is charged, when it started, when each replica ended (``None``: still holds its GPUs)."""

    __slots__ = ("series", "start", "g", "ends", "n_open")

    def __init__(self, series: _Series, start: int, g: int, replicas: int) -> None:
        self.series = series
        self.start = start
        self.g = g
        self.ends: list[int | None] = [None] * replicas
        self.n_open = replicas

    def ended_at(self) -> int:
        """When its last replica ended (only for a run with none open)."""
        return max(e for e in self.ends if e is not None)


class _Node:
    __slots__ = ("state", "gpus", "since", "last")

    def __init__(self, state: NodeState, gpus: int, since: int) -> None:
        self.state = state
        self.gpus = gpus
        self.since = since  # when it last became counted toward C
        self.last = since  # time of its latest applied event: a node's changes never go back before it


class OccupancyLedger:
    """Incremental occupancy windows per budget and the capacity integral (rule D2.occupancy).

    Fold events with :meth:`apply`; query at event time ``t`` (int µs since
    the epoch, UTC) with :meth:`occupancy`, :meth:`unallocated`,
    :meth:`capacity_gpu_s` and :meth:`capacity_gpus`. See the module
    docstring for the data structure, event semantics and ordering rules.

    Args:
        window_s: window length W in seconds (default 7 days), > 0.

    Raises:
        ValueError: ``window_s`` is not positive.
    """

    __slots__ = (
        "window_us",
        "clock",
        "_alloc",
        "_unalloc",
        "_cap",
        "_runs",
        "_done",
        "_nodes",
        "_seen",
        "_paths",
        "_next_expire",
        "_step",
        "_bulk",
    )

    def __init__(self, window_s: float = WEEK_S) -> None:
        w = s_to_us(window_s)
        if w <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        #: W in microseconds.
        self.window_us: int = w
        #: The largest event time applied (µs), ``None`` before the first event.
        self.clock: int | None  # pragma: no mutate (an annotation only: never evaluated)
        self.clock = None
        self._alloc: dict[str, _Series] = {}
        self._unalloc: dict[str, _Series] = {}
        self._cap = _Series()
        self._runs: dict[tuple[str, int], _Run] = {}
        self._done: dict[tuple[str, int], _Run] = {}  # ended runs, kept for de-duplication and earlier ends
        self._nodes: dict[str, _Node] = {}
        self._seen: dict[uuid.UUID, int] = {}  # node event_id -> clock when applied
        # sorted paths + ancestors; None = stale (so starting at None would be the same: no mutation)
        self._paths: tuple[str, ...] | None = ()  # pragma: no mutate
        # expiry schedule (every W/64 of event time): amortisation only, an expiry never changes an answer
        self._step = max(w // 64, 1)  # pragma: no mutate
        self._next_expire = _MIN_T  # event time of the next expire; the first event sets it
        # flags read only for their truth (a `None` mutant is the same as False)
        self._bulk = False  # pragma: no mutate

    # ------------------------------------------------------------------ folding

    def apply(self, event: Event) -> None:
        """Fold one event (other event types are ignored).

        Args:
            event: any apportion event; the ones listed in the module
                docstring change the ledger.
        """
        fold = _FOLD.get(type(event))
        if fold is None:
            return  # JobStarted, WorkloadRefused, heartbeats, ...: not occupancy facts
        now = to_us(event.ts)
        clock = self.clock
        if clock is None or now > clock:
            # the clock advances; the first event expires nothing (there is nothing to drop) and sets the first
            # expiry W/64 later
            self.clock = now
            if now >= self._next_expire:  # pragma: no mutate (the schedule: see _step)
                self.expire(now)
                self._next_expire = now + self._step  # pragma: no mutate (the schedule: see _step)
        elif now < clock - self.window_us:
            # older than the window: a change before clock - W changes every window (t - W, t], t >= clock,
            # exactly as one at clock - W does, so it is applied there (de-duplication memory stays one window)
            now = clock - self.window_us
        # else a late event (another partition's record polled after newer ones): it takes effect at its own
        # time, retroactively (_Series._retro), so the fold does not depend on how partitions interleave
        fold(self, event, now)

    def _run_ended(self, ev: JobCompleted | JobFailed, now: int) -> None:
        self._end(ev.job_id, ev.attempt, ev.replica, now)

    def _run_stopped(self, ev: JobPreempted | JobCancelled, now: int) -> None:
        if ev.attempt is not None:  # None: cancelled while pending
            self._end(ev.job_id, ev.attempt, None, now)

    def _run_lost(self, ev: JobLost, now: int) -> None:
        key = (ev.job_id, ev.attempt)
        run = self._runs.get(key) or self._done.get(key)
        if run is not None:
            self._end(ev.job_id, ev.attempt, None, min(max(to_us(ev.charged_until), run.start), now))

    def _run_requeued(self, ev: JobRequeued, now: int) -> None:
        self._end(ev.job_id, ev.attempt - 1, None, min(requeued_end_us(ev), now))

    def apply_all(self, events: Iterable[Event]) -> OccupancyLedger:
        """Fold ``events`` in order; returns ``self`` for chaining."""
        apply = self.apply
        for ev in events:
            apply(ev)
        return self

    def _change(self, series: _Series, x: int, dg: int) -> None:
        if self._bulk:
            series.pending.append((x, dg))
        else:
            series.change(x, dg)

    def _placed(self, ev: JobPlaced, now: int) -> None:
        key = (ev.job_id, ev.attempt)
        runs = self._runs
        if key in runs:
            return
        done = self._done.get(key)
        if done is not None:
            if done.ended_at() >= now - self.window_us:
                return  # duplicate of a run that already ended
            del self._done[key]
        book = self._alloc if ev.allocated else self._unalloc
        series = book.get(ev.budget)
        if series is None:
            series = book[ev.budget] = _Series()
            self._paths = None
        replicas = ev.replicas
        g = ev.gpus_per_replica
        runs[key] = _Run(series, now, g, replicas)
        self._change(series, now, g * replicas)

    def _end(self, job_id: str, attempt: int, replica: int | None, x: int) -> None:
        """End one replica (or every replica) of a run at time x: the earliest end reported wins.

        A replica's end is never before the run's start (another writer's clock
        may be behind the dispatcher's). An end earlier than one already applied
        moves it back: two writers report one run (the dispatcher's
        ``JobPreempted``, the agent's ``JobCompleted``), and the record of the
        earlier end can be written after the later one, so a fold in offset
        order and one in event-time order must agree.
        """
        key = (job_id, attempt)
        run = self._runs.get(key)
        if run is None:
            run = self._done.get(key)
            if run is None:
                return
        if x < run.start:
            x = run.start
        ends = run.ends
        if replica is None:
            which: Iterable[int] = range(len(ends))
        elif 0 <= replica < len(ends):
            which = (replica,)
        else:
            return
        closing = moved = 0
        g = run.g
        change = self._change
        for i in which:
            old = ends[i]
            if old is None:
                closing += 1
            elif x < old:
                change(run.series, old, g)  # it held its GPUs until x, not until old
                moved += 1
            else:
                continue
            ends[i] = x
        if closing or moved:
            change(run.series, x, -g * (closing + moved))
        if closing:
            run.n_open -= closing
            if run.n_open == 0:
                del self._runs[key]
                self._done[key] = run

    def _node_event(self, ev: NodeEvent, now: int) -> None:
        """Capacity follows the node state machine (:func:`apportion.domain.nodes.node_transition`)."""
        seen = self._seen.get(ev.event_id)
        if seen is not None and seen >= now - self.window_us:
            return
        self._seen[ev.event_id] = now
        node_id = ev.node_id
        node = self._nodes.get(node_id)
        cap = self._cap
        if node is not None:  # writers of one node's events (agent, dispatcher, CLI) have their own clocks
            now = node.last = max(now, node.last)
        if isinstance(ev, NodeRegistered):
            old = node.gpus if node is not None and node.state in COUNTED_STATES else 0
            if ev.gpu_count != old:
                self._change(cap, now, ev.gpu_count - old)
            # ready, and counted since now: a registration is a sign of life (NodeLost clamps to it)
            self._nodes[node_id] = _Node(node_transition(None, ev), ev.gpu_count, now)
            return
        if node is None:
            return
        new = node_transition(node.state, ev)
        if new == node.state:
            return  # a lost node ignores all but a registration; a repeat changes nothing
        was, will = node.state in COUNTED_STATES, new in COUNTED_STATES
        if was != will and node.gpus:
            # a lost node's capacity ends at its last heartbeat (clamped into [since, now])
            x = min(max(to_us(ev.last_heartbeat), node.since), now) if isinstance(ev, NodeLost) else now
            self._change(cap, x, node.gpus if will else -node.gpus)
        if will and not was:
            node.since = now
        node.state = new

    # ------------------------------------------------------------------ memory

    def expire(self, t: Micros) -> None:
        """Drop history no query at or after ``min(t, clock)`` can need.

        Keeps, per series, the last breakpoint at or before ``min(t, clock) - W``;
        forgets ended runs and seen node event ids more than one window older
        than that. Never changes an answer for events up to W late. Called from :meth:`apply` every W/64 of event time.
        """
        if self.clock is None:
            return
        self._flush()
        lo = min(t, self.clock) - self.window_us
        for book in (self._alloc, self._unalloc):
            for s in book.values():
                s.expire(lo)
        self._cap.expire(lo)
        # de-duplication memory is kept one window longer than the series: a late duplicate (up to W late)
        # is judged by its own time, as in any other merge order
        keep = lo - self.window_us
        done = self._done
        while done:
            k = next(iter(done))
            if done[k].ended_at() >= keep:
                break
            del done[k]
        seen = self._seen
        while seen:
            eid = next(iter(seen))
            if seen[eid] >= keep:
                break
            del seen[eid]

    def _flush(self) -> None:
        """Merge the changes buffered in bulk mode (none in incremental mode: each series returns at once)."""
        for book in (self._alloc, self._unalloc):
            for s in book.values():
                s.flush()
        self._cap.flush()

    def retained(self) -> int:
        """Breakpoints held across all series (memory measure for tests and benchmarks)."""
        return (
            sum(s.size() for s in self._alloc.values())
            + sum(s.size() for s in self._unalloc.values())
            + self._cap.size()
        )

    # ------------------------------------------------------------------ queries

    def _check_t(self, t: Micros | None) -> int | None:
        if self._bulk:
            raise RuntimeError("ledger is being rebuilt")
        if self.clock is None:
            return None  # nothing folded yet: every answer is empty or 0, at any t
        if t is None:
            return self.clock
        if t < self.clock:
            raise ValueError(f"query time {t} precedes the ledger clock {self.clock} (µs)")
        return t

    def paths(self) -> tuple[str, ...]:
        """Every charged budget path and all of its ancestors, sorted."""
        if self._paths is None:
            out: set[str] = set()
            for book in (self._alloc, self._unalloc):
                for p in book:
                    out.update(ancestors_of(p))
            self._paths = tuple(sorted(out))
        return self._paths

    def _totals_us(self, book: dict[str, _Series], t: Micros | None) -> dict[str, int]:
        t = self._check_t(t)
        out = dict.fromkeys(self.paths(), 0)
        if t is None:
            return out
        lo = t - self.window_us
        for path, s in book.items():
            v = s.at(t) - s.at(lo)
            if v:
                for p in ancestors_of(path):
                    out[p] += v
        return out

    def occupancy_us(self, t: Micros | None = None) -> dict[str, int]:
        """O_b(t) for every path (charged paths and their ancestors) in exact GPU-µs."""
        return self._totals_us(self._alloc, t)

    def unallocated_us(self, t: Micros | None = None) -> dict[str, int]:
        """U_b(t) for every path in exact GPU-µs."""
        return self._totals_us(self._unalloc, t)

    def occupancy(self, t: Micros | None = None) -> dict[str, float]:
        """Allocated occupancy O_b(t) in GPU-seconds (rule D2.occupancy).

        Args:
            t: event time in µs since the epoch (UTC); default the ledger clock.

        Returns:
            ``{path: GPU-seconds}`` sorted by path, for every budget path any
            run was charged to and every ancestor of it (``"a/b"`` includes
            ``"a/b/c"``). Paths with nothing in the window map to 0.0.

        Raises:
            ValueError: ``t`` precedes the ledger clock.
        """
        return {p: v / US_PER_S for p, v in self.occupancy_us(t).items()}

    def unallocated(self, t: Micros | None = None) -> dict[str, float]:
        """Unallocated occupancy U_b(t) in GPU-seconds; same shape as :meth:`occupancy`."""
        return {p: v / US_PER_S for p, v in self.unallocated_us(t).items()}

    def capacity_us(self, t: Micros | None = None) -> int:
        """K(t) = integral of C over (t - W, t] in exact GPU-µs."""
        t = self._check_t(t)
        return 0 if t is None else self._cap.window(t, self.window_us)

    def capacity_gpu_s(self, t: Micros | None = None) -> float:
        """K(t) = integral of C over (t - W, t] in GPU-seconds (rule D2.entitlement).

        Entitlement of budget b is ``abs_share(b) * capacity_gpu_s(t)``.

        Raises:
            ValueError: ``t`` precedes the ledger clock.
        """
        return self.capacity_us(t) / US_PER_S

    def capacity_gpus(self, t: Micros | None = None) -> int:
        """C(t): GPUs on ready and draining nodes at ``t`` (>= clock)."""
        self._check_t(t)
        return self._cap.current()

    def running(self) -> int:
        """Number of open runs."""
        return len(self._runs)


#: How :meth:`OccupancyLedger.apply` folds each event type it folds (every other type is ignored).
_FOLD: dict[type[Event], Callable[[OccupancyLedger, Any, int], None]] = {
    JobPlaced: OccupancyLedger._placed,
    JobCompleted: OccupancyLedger._run_ended,
    JobFailed: OccupancyLedger._run_ended,
    JobPreempted: OccupancyLedger._run_stopped,
    JobCancelled: OccupancyLedger._run_stopped,
    JobLost: OccupancyLedger._run_lost,
    JobRequeued: OccupancyLedger._run_requeued,
    **dict.fromkeys(NODE_EVENT_TYPES, OccupancyLedger._node_event),
}
assert set(_FOLD) == set(LEDGER_EVENT_TYPES), "every folded type has its fold"


def rebuild(events: Iterable[Event], window_s: float = WEEK_S) -> OccupancyLedger:
    """Bulk-build a ledger from an event sequence (in event-time order).

    Runs the same event state machine as :meth:`OccupancyLedger.apply`, but
    buffers the per-series changes and merges them sorted, in batches of
    W/64 of event time (:meth:`_Series.flush`), instead of updating the
    breakpoint lists per event. The result agrees exactly with the
    incremental fold and accepts further :meth:`~OccupancyLedger.apply`.

    Args:
        events: decoded events, in the order they were logged.
        window_s: window length W in seconds.

    Returns:
        A ledger in incremental mode, clock at the last event's ``ts``.
    """
    ledger = OccupancyLedger(window_s)
    # bulk mode is a speed-up with the same result (the incremental fold is the contract): False is equivalent
    ledger._bulk = True  # pragma: no mutate
    try:
        apply = ledger.apply
        for ev in events:
            apply(ev)
        ledger._flush()
    finally:
        ledger._bulk = False  # pragma: no mutate (None: the same falsy flag)
    if ledger.clock is not None:  # pragma: no mutate (a last expiry: memory only, no answer changes)
        ledger.expire(ledger.clock)
    return ledger
