"""Start-time forecasts of pending jobs (design D12, ``D12.job-forecast``).

:func:`forecast` takes the dispatcher's state folded from the log
(:class:`~apportion.domain.dispatch.DispatchState`) and runs the same
engine forward in event time from ``now``, as the simulator does
(:mod:`apportion.sim.core`): every input goes through
:func:`~apportion.domain.dispatch.step`; a :class:`Tick` at ``now``, at each
time :func:`~apportion.domain.dispatch.wakeups` names (protection ends,
grace ends, reservation age), at each run end and every ``cycle_s`` while
jobs wait (the dispatcher's periodic cycle); ``StartWorkload`` is answered
by ``JobStarted`` at once; a run that ends is answered by ``JobCompleted``
per replica; a preempted run sends no report, so its stop ends at its grace
deadline (the dispatcher's own rule for a run that never reports). Runs
checkpoint at their interval, and an unallocated run saves its progress when
it is preempted, as the simulator's workloads do by default. Future
submissions are left out. Each cycle runs on the forward state and the engine
caches it keeps, the tick's maintenance folded first (the same events as the
dispatcher's scratch copy gives: design D12, the forward run's note).

The cycles are spaced by how far ahead they look (``spacing``, :data:`SPACING`;
:class:`~apportion.sim.core.Debounce`, the simulator's ``min_gap_s`` debounce):
after a cycle at ``t`` the next runs no earlier than ``t + spacing x (t - now)``,
and what it was wanted for waits for it. A stop's end (a preemption's grace) is
folded when due, not spaced: the job that waited for it starts then (exact), and
the cycle after it is spaced like any other. The run stops once every job asked about has started, or at the
horizon: a job not started by then starts after it (``after_us``).

Where each run's end is taken from (its ``basis``), the first that applies:

1. ``simulated``: the job declares its work (``duration_s``, a simulated
   workload) and no time limit comes first: it ends ``duration_s`` minus
   the progress it resumed from after its start;
2. ``time_limit``: the job's time limit in force (``JobQueued.time_limit_s``)
   from its start, where the node agent stops it: when it has no declared
   work, or its limit comes first (then the run fails, ``time_limit``);
3. ``history``: the median run time of its user's completed runs in the
   log that ran longer than this run has so far (:func:`user_history`);
4. ``unknown``: none of these: it is assumed to run ``W / 4`` from its
   start (``W`` the occupancy window), or, once that has passed, until it
   is preempted.

With ``arrivals`` (``--with-arrivals``: :func:`week_before_arrivals`), the next day's submissions are assumed to be
those of the same hours a week before (the last day's when the log is shorter than a week), copies of those jobs
(their budget, user, shape and declared work): later arrivals of budgets ahead in the fair-share order then go
first in the forecast as they will in fact. Nothing is assumed after that day (``arrival_period_s`` replays them
every period instead: a day busier than the cluster then piles up without end, and unallocated work it overtakes
never starts). Such a run is exact (no spacing, no least gap): cycles spaced or a gap apart let the arrivals of
the gap pile up and take every free GPU at one cycle, and an unallocated job, which runs only on GPUs idle after
the allocated work, then starts far later than between arrivals spread over the gap (on Philly week 44,
given the submissions the simulation in fact received, a job that waited 10.4 h was forecast 96.6 h spaced and
11.0 h unspaced; under ``fairtree-10`` the 30 s least gap alone made waits of 6.9 to 8.7 h 10.2 to 11.4 h:
``D12.accuracy``).

A pending job's forecast is the time the forward run starts it
(``StartWorkload``), with the chain of what frees its GPUs: the runs on the
nodes it gets that end before it starts (with their basis), the runs it
preempts (their protection end and rule), and the reason it waits now (the
engine's own explanation, :mod:`apportion.domain.engine.reasons`). Its
``basis`` is the least certain basis among the run ends of its chain:
``now`` (it starts at once), ``rules`` (only protection and grace ends,
exact by the engine's rules), else ``simulated`` < ``time_limit`` <
``history`` < ``unknown``. A job the forward run does not start before
``horizon_s`` (or before nothing is left to happen) has no start.

With ``waits`` (``forecast --recent-waits``: :func:`recent_waits`), an
unallocated job (``D1.unallocated-job``: it runs only on idle GPUs, so later
allocated submissions overtake it and a forward run without them is early) that
the forward run does not start at once gets the later of that start and its
queueing plus the median wait (:func:`median_wait`) of the unallocated jobs of
its size queued in the day before ``now`` that waited longer than it has so far:
basis ``recent_waits``, the forward run's start and basis kept beside it.

Pure: a function of the state, the log's history and ``now`` (event time);
the caller's state is not changed (the forward run works on a copy).
"""

from __future__ import annotations

import functools
import gc
import heapq
import pickle
import uuid
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from datetime import datetime
from statistics import median
from typing import Any, ParamSpec, TypeVar

from apportion.domain.cluster import UNTIL_STARTED, Run, RunKey
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, evolve, maintenance, step, wakeups
from apportion.domain.engine import CycleSnapshot, EngineConfig, run_cycle
from apportion.domain.engine.emit import built, utc_time
from apportion.domain.engine.reasons import reason_dict
from apportion.events import (
    Event,
    JobCancelled,
    JobCheckpointed,
    JobCompleted,
    JobFailed,
    JobLost,
    JobPlaced,
    JobPreempted,
    JobQueued,
    JobRejected,
    JobStarted,
    JobSubmitted,
    StartWorkload,
    StopWorkload,
    det_id,
)
from apportion.sim.core import Debounce
from apportion.timeutil import Micros, from_us, s_to_us, to_us, us_to_s, utc_text

__all__ = [
    "BudgetForecast",
    "BudgetPoint",
    "budget_forecast",
    "protection_notice",
    "protection_of",
    "with_starts",
    "BASES",
    "ChainStep",
    "Forecast",
    "JobForecast",
    "RunEnd",
    "forecast",
    "run_end",
    "burst_arrivals",
    "recent_arrivals",
    "week_before_arrivals",
    "user_history",
    "with_submission",
]

#: Bases of a run's end, most certain first (module docstring); a job's basis is the last of its chain's.
BASES: tuple[str, ...] = ("simulated", "time_limit", "history", "unknown")
#: A job's basis when its start is the recent median wait of unallocated jobs, later than the forward run's.
RECENT_WAITS = "recent_waits"
#: A job's basis when its chain has no run end: it starts at once, or only protection and grace ends delay it.
NOW, RULES = "now", "rules"
#: ``--with-arrivals``: how long a span of submissions is replayed (the day assumed next), seconds.
ARRIVAL_LOOKBACK_S = 86_400.0
#: ``--with-arrivals``: the submissions of the same hours this many seconds before are replayed as many seconds
#: later (:func:`week_before_arrivals`): a week, the occupancy window's natural period.
ARRIVAL_PERIOD_S = 7 * 86_400.0
#: ``burst_arrivals``: a user's submissions less than this many seconds apart are one burst (a longer gap ends it).
BURST_GAP_S = 1800.0
#: ``burst_arrivals``: the rate and the jobs of a burst in progress are those of its last this many submissions.
BURST_RECENT = 10
#: ``burst_arrivals``: the fewest ended bursts of the user, longer than the one in progress, its count is taken from.
BURST_MIN_LONGER = 2
#: The forward run's periodic cycle while jobs wait (the dispatcher service's and the simulator's default).
CYCLE_S = 300.0
#: How far ahead the forward run looks by default, seconds (a job not started by then has no start).
HORIZON_S = 7 * 86_400.0
#: The forward run's resolution (``--min-gap``): no two cycles closer than this many seconds of event time
#: (:class:`~apportion.sim.core.Debounce`, as the simulator's ``min_gap_s``): the run ends, protection ends and
#: deferred cycles inside a gap share one cycle at its end, so each cycle a start waits for may come up to this
#: late (a stop's end is folded when due: a start that waits only for it is exact). Measured on Philly week 44
#: (``D12.accuracy``): 30 s keeps the forecasts of waits over an hour as good (15 of 44 within 25%, 14 with none)
#: and cuts the cycles of a job 3 h deep in the 20,000-job queue from 342 to 151 (``docs/operations.md``).
MIN_GAP_S = 30.0
#: The forward run's spacing (``--spacing``): after a cycle at t the next runs no earlier than
#: ``t + max(MIN_GAP_S, SPACING x (t - now))`` (:class:`~apportion.sim.core.Debounce`). A start found by the spaced
#: run is later than the unspaced run's by at most the gap before it, so at most ``SPACING`` of its wait for the
#: cycle that starts it (the work placed in earlier deferred cycles moves by as little); the error it adds to a
#: start is small next to the 25% of its wait the forecast is measured by (``D12.accuracy``).
SPACING = 0.02
#: ``recent_waits``: the trailing window of the log whose unallocated jobs' waits are used, seconds.
WAITS_LOOKBACK_S = 86_400.0
#: ``recent_waits``: a job that started within this many seconds of its queueing did not wait (left out).
WAITED_S = 60.0
#: ``recent_waits``: the fewest waits a median is taken of (fewer of its size: every size's).
WAITS_MIN_JOBS = 5
_PRODUCER = "forecast"
#: The forward run's report ids (``_Forward._id``): this prefix (not RFC 4122's variant), a counter in the low bits.
_ID_BASE = 0xF0_7EC4_57 << 96
_GONE = (JobCancelled, JobRejected)
_AGENT = f"{_PRODUCER}/agent"
#: what the forward run feeds in itself (its node agent's reports, its arrivals): :func:`wakeups` of each is none
_NO_WAKEUPS: frozenset[type[Event]] = frozenset({JobStarted, JobCompleted, JobFailed, JobCheckpointed, JobSubmitted})
_P = ParamSpec("_P")
_R = TypeVar("_R")
_Rep = TypeVar("_Rep", JobStarted, JobCompleted)


def _collector_paused(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` with Python's cyclic garbage collector paused while it runs, as the simulator's run
    (``SimConfig.pause_gc``): a forward run makes and drops some millions of objects, none in reference
    cycles, so reference counting frees them; a young collection would also walk every large map a cycle
    builds (5-10% of a forecast's CPU time). Nothing is decided differently."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused


@dataclass(frozen=True, slots=True)
class RunEnd:
    """When a run is taken to end, and from what.

    Attributes:
        job_id, attempt, budget, user: the run.
        end_us: its end, µs UTC; ``None``: no known end (it runs until preempted).
        basis: one of :data:`BASES`.
        note: how the end was found, for people.
    """

    job_id: str
    attempt: int
    budget: str
    user: str
    end_us: Micros | None
    basis: str
    note: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (times ISO 8601 UTC)."""
        return {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "budget": self.budget,
            "user": self.user,
            "end": None if self.end_us is None else from_us(self.end_us).isoformat(),
            "basis": self.basis,
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class ChainStep:
    """One link of a job's reason chain.

    ``kind``: ``run_ends`` (a run on the nodes it gets ends: ``basis`` says from what), ``preempts`` (it
    preempts that run at ``at_us``), ``protection_ends`` (that victim's protection ended at ``at_us``).
    """

    kind: str
    at_us: Micros
    job_id: str
    attempt: int
    budget: str
    basis: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "kind": self.kind,
            "at": from_us(self.at_us).isoformat(),
            "job_id": self.job_id,
            "attempt": self.attempt,
            "budget": self.budget,
            "basis": self.basis,
            "text": self.text,
        }


@dataclass(frozen=True, slots=True)
class JobForecast:
    """A pending job's estimated start.

    Attributes:
        start_us: the estimated start, µs UTC; ``None``: not within the forecast (see ``note``).
        wait_s: seconds from the forecast's ``now`` to ``start_us``.
        basis: ``now``, ``rules`` or one of :data:`BASES` (module docstring).
        reason: why it waits now (the engine's reason, ``kind: facts``; empty when a cycle now places it).
        reason_detail: the reason's fields (:func:`~apportion.domain.engine.reasons.reason_dict`).
        chain: what frees its GPUs, in time order.
        note: for a job without a start, why; for basis ``recent_waits``, what the estimate rests on.
        forward_start_us, forward_basis: the forward run's start and its basis (``start_us`` and ``basis`` but
            for basis ``recent_waits``: an unallocated job whose recent median wait is later; module docstring).
        after_us: for a job the forward run did not start before its horizon, the horizon (it starts after it,
            as ``squeue --start`` says N/A beyond its backfill window); ``None`` otherwise.
    """

    job_id: str
    budget: str
    user: str
    gpus_per_replica: int
    replicas: int
    start_us: Micros | None
    wait_s: float | None
    basis: str
    reason: str
    reason_detail: dict[str, Any] | None
    chain: tuple[ChainStep, ...]
    note: str = ""
    forward_start_us: Micros | None = None
    forward_basis: str = ""
    after_us: Micros | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "job_id": self.job_id,
            "budget": self.budget,
            "user": self.user,
            "gpus_per_replica": self.gpus_per_replica,
            "replicas": self.replicas,
            "start": None if self.start_us is None else from_us(self.start_us).isoformat(),
            "wait_s": self.wait_s,
            "basis": self.basis,
            "reason": self.reason,
            "reason_detail": self.reason_detail,
            "chain": [c.to_dict() for c in self.chain],
            "note": self.note,
            "forward_start": None if self.forward_start_us is None else from_us(self.forward_start_us).isoformat(),
            "forward_basis": self.forward_basis,
            "after": None if self.after_us is None else from_us(self.after_us).isoformat(),
        }


@dataclass
class Forecast:
    """The answer: per pending job its forecast, and the end taken for every run the forward run met.

    Attributes:
        now_us: the forecast's event time.
        horizon_us: how far the forward run looked.
        jobs: the pending jobs asked about, in queue order (budget, then the queue's own order).
        runs: ``(job_id, attempt)`` -> :class:`RunEnd` of each run running at ``now`` or started by the forward run.
        cycles: scheduling cycles the forward run ran.
        spacing: the forward run's spacing (:data:`SPACING`; 0: a cycle at every run end).
        min_gap_s: the forward run's least gap between two cycles, seconds (:data:`MIN_GAP_S`): its resolution.
    """

    now_us: Micros
    horizon_us: Micros
    jobs: list[JobForecast] = field(default_factory=list)
    runs: dict[RunKey, RunEnd] = field(default_factory=dict)
    cycles: int = 0
    spacing: float = 0.0
    min_gap_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "now": from_us(self.now_us).isoformat(),
            "horizon": from_us(self.horizon_us).isoformat(),
            "spacing": self.spacing,
            "min_gap_s": self.min_gap_s,
            "jobs": [j.to_dict() for j in self.jobs],
            "runs": [r.to_dict() for _, r in sorted(self.runs.items())],
        }


def user_history(events: Iterable[Event]) -> dict[str, tuple[float, ...]]:
    """User -> run times (seconds, sorted) of the completed runs in ``events``.

    A run (job, attempt) that a ``JobCompleted`` ended: from its first ``JobStarted`` to its last
    ``JobCompleted``; the user is its ``JobQueued``'s. Runs that failed or were preempted are left out.
    """
    user: dict[str, str] = {}
    started: dict[RunKey, Micros] = {}
    ended: dict[RunKey, Micros] = {}
    for ev in events:
        t = type(ev)
        if t is JobQueued:
            user[ev.job_id] = ev.user  # type: ignore[attr-defined]
        elif t is JobStarted:
            key = (ev.job_id, ev.attempt)  # type: ignore[attr-defined]
            at = to_us(ev.ts)
            if key not in started or at < started[key]:
                started[key] = at
        elif t is JobCompleted:
            key = (ev.job_id, ev.attempt)  # type: ignore[attr-defined]
            ended[key] = max(ended.get(key, 0), to_us(ev.ts))
    out: dict[str, list[float]] = {}
    for key, end in ended.items():
        begin = started.get(key)
        who = user.get(key[0])
        if begin is not None and who is not None and end >= begin:
            out.setdefault(who, []).append(us_to_s(end - begin))
    return {u: tuple(sorted(ds)) for u, ds in out.items()}


def recent_arrivals(
    events: Iterable[Event], now_us: Micros, lookback_s: float = ARRIVAL_LOOKBACK_S, shift_s: float | None = None
) -> list[tuple[Micros, JobQueued]]:
    """An earlier span's submissions replayed (the last day by default; ``forecast --with-arrivals`` takes the same
    hours a week before, :func:`week_before_arrivals`): each job first queued
    (``JobQueued``, attempt 1) in the ``lookback_s`` from ``shift_s`` (default ``lookback_s``) before ``now_us``, and
    before ``now_us``, at its time plus ``shift_s`` (budgets, users and shapes carried forward), in time order."""
    lb = s_to_us(lookback_s)
    shift = lb if shift_s is None else s_to_us(shift_s)
    out: list[tuple[Micros, JobQueued]] = []
    for ev in events:
        if isinstance(ev, JobQueued) and ev.attempt == 1:
            t = to_us(ev.ts)
            if now_us - shift <= t < min(now_us, now_us - shift + lb):
                out.append((t + shift, ev))
    out.sort(key=lambda a: (a[0], a[1].job_id))
    return out


def week_before_arrivals(
    events: Sequence[Event], now_us: Micros, period_s: float = ARRIVAL_PERIOD_S, span_s: float = ARRIVAL_LOOKBACK_S
) -> list[tuple[Micros, JobQueued]]:
    """The submissions assumed by ``forecast --with-arrivals``: those of the same hours a week (``period_s``)
    before, each job first queued in the ``span_s`` (at most ``period_s``) from ``now_us - period_s``,
    ``period_s`` later (:func:`recent_arrivals`): the next day's by default; when the log does not reach back
    that far (its first event is later), the last day's, a day later."""
    first = min((to_us(e.ts) for e in events), default=now_us)
    if first <= now_us - s_to_us(period_s):
        return recent_arrivals(events, now_us, min(span_s, period_s), period_s)
    return recent_arrivals(events, now_us)


def _bursts(times: Sequence[Micros], gap: Micros) -> list[tuple[int, int]]:
    """``times`` (sorted) cut into bursts where two in a row are more than ``gap`` apart: ``(first, end)`` indices."""
    out: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(times) + 1):
        if i == len(times) or times[i] - times[i - 1] > gap:
            out.append((first, i))
            first = i
    return out


def burst_arrivals(
    events: Iterable[Event],
    now_us: Micros,
    users: Set[str] | None = None,
    gap_s: float = BURST_GAP_S,
    recent: int = BURST_RECENT,
    min_longer: int = BURST_MIN_LONGER,
    again_s: float = 0.0,
) -> list[tuple[Micros, JobQueued]]:
    """The rest of each burst in progress at ``now_us``, as ``forecast``'s ``arrivals`` (measured, not a mode:
    ``bench_forecast.py``'s ``forecast + bursts``; docs/operations.md, Accuracy).

    A user's submissions (``JobQueued``, attempt 1, before ``now_us``) in time order are cut into bursts by gaps
    longer than ``gap_s``; the burst in progress is the last one when its last submission is at most ``gap_s``
    before ``now_us``. It is assumed to reach the median count of the user's earlier (ended) bursts that had more
    submissions than it has so far, when there are at least ``min_longer`` of them (none otherwise: a user's
    history too short to say); the submissions it lacks come at the mean gap of its last ``recent`` ones (the median
    gap within those earlier bursts when it has one submission), from its last one on, each a copy of those last
    jobs in turn (their budget, user, shape, allocation and declared work). With ``again_s``, a burst with too
    few such is taken to go on at that rate as long again as it has lasted, at most ``again_s``. Only the users of ``users``
    (``None``: every user with a burst in progress). Sorted by time, then job id.
    """
    gap = s_to_us(gap_s)
    subs: dict[str, list[tuple[Micros, JobQueued]]] = {}
    for ev in events:
        if type(ev) is JobQueued and ev.attempt == 1 and (users is None or ev.user in users):
            t = to_us(ev.ts)
            if t <= now_us:
                subs.setdefault(ev.user, []).append((t, ev))
    out: list[tuple[Micros, JobQueued]] = []
    for who in sorted(subs):
        jobs = sorted(subs[who], key=lambda a: (a[0], a[1].job_id))
        times = [t for t, _ in jobs]
        if now_us - times[-1] > gap:
            continue  # no burst in progress
        *ended, (first, end) = _bursts(times, gap)
        n = end - first
        longer = [e - f for f, e in ended if e - f > n]
        tail = max(first, end - recent) if recent > 0 else first
        if len(longer) >= min_longer:
            more = int(median(longer)) - n
        elif again_s > 0 and end - tail > 1:
            more = -1  # as long again as it has lasted, at most again_s, at its rate (below)
        else:
            continue
        if end - tail > 1:
            step_us = (times[end - 1] - times[tail]) // (end - tail - 1)
        else:  # one submission so far: the median gap within the user's longer bursts
            step_us = int(median([times[i] - times[i - 1] for f, e in ended if e - f > n for i in range(f + 1, e)]))
        if more < 0:
            more = min(times[end - 1] - times[first], s_to_us(again_s)) // max(1, step_us)
        burst = [ev for _, ev in jobs[tail:end]]
        n = len(burst)
        out.extend((times[end - 1] + k * max(1, step_us), burst[(k - 1) % n]) for k in range(1, more + 1))
    out.sort(key=lambda a: (a[0], a[1].job_id))
    return out


def recent_waits(
    events: Iterable[Event], now_us: Micros, lookback_s: float = WAITS_LOOKBACK_S
) -> dict[int, tuple[tuple[float, bool], ...]]:
    """Size (GPUs, g x k) -> the waits of the unallocated jobs first queued in the ``lookback_s`` before
    ``now_us`` that did not start within :data:`WAITED_S` (the module docstring's ``recent_waits`` estimate).

    Each wait is ``(seconds, ended)``: from its first ``JobQueued`` to its first ``JobStarted`` (``ended``); for a
    job not started by ``now_us``, ``now_us`` minus its queueing (``ended`` false: it waits at least that).
    Jobs cancelled or rejected before they started are left out. Sorted by seconds, ended waits first.
    """
    lb = s_to_us(lookback_s)
    queued: dict[str, tuple[Micros, int]] = {}
    gone: set[str] = set()
    begun: dict[str, Micros] = {}
    for ev in events:
        t = type(ev)
        if t is JobQueued:
            q = to_us(ev.ts)
            if ev.attempt == 1 and not ev.allocated and now_us - lb <= q < now_us:  # type: ignore[attr-defined]
                queued.setdefault(ev.job_id, (q, ev.gpus_per_replica * ev.replicas))  # type: ignore[attr-defined]
        elif t is JobStarted:
            begun.setdefault(ev.job_id, to_us(ev.ts))  # type: ignore[attr-defined]
        elif t in _GONE:
            gone.add(ev.job_id)  # type: ignore[attr-defined]
    out: dict[int, list[tuple[float, bool]]] = {}
    waited = s_to_us(WAITED_S)
    for job_id, (q, size) in queued.items():
        start = begun.get(job_id)
        if start is not None and start <= now_us:
            wait, ended = start - q, True
        elif job_id in gone:
            continue
        else:
            wait, ended = now_us - q, False
        if wait > waited:
            out.setdefault(size, []).append((us_to_s(wait), ended))
    return {k: tuple(sorted(v, key=lambda w: (w[0], not w[1]))) for k, v in sorted(out.items())}


def median_wait(waits: Sequence[tuple[float, bool]]) -> float | None:
    """The median of ``waits`` (:func:`recent_waits`: ``(seconds, ended)``, sorted) with the waits not ended
    counted as at least as long (the Kaplan-Meier estimate): the first ended wait at which the share of jobs
    still waiting falls to one half or below; ``None`` when it never does (too many still waiting, or none)."""
    at_risk, surviving = len(waits), 1.0
    for secs, ended in waits:
        if ended:
            surviving *= 1.0 - 1.0 / at_risk
            if surviving <= 0.5:
                return secs
        at_risk -= 1
    return None


def waits_for(waits: Mapping[int, Sequence[tuple[float, bool]]], size: int) -> tuple[float, int, str] | None:
    """The recent median wait for an unallocated job of ``size`` GPUs: ``(seconds, jobs, which)``, from the
    jobs of that size when at least :data:`WAITS_MIN_JOBS` waited, else from every size (``which``: ``"of its
    size"`` or ``"of any size"``); ``None`` when neither gives a median (:func:`median_wait`)."""
    same = waits.get(size, ())
    if len(same) >= WAITS_MIN_JOBS:
        m = median_wait(same)
        if m is not None:
            return m, len(same), "of its size"
    every = sorted((w for ws in waits.values() for w in ws), key=lambda w: (w[0], not w[1]))
    if len(every) >= WAITS_MIN_JOBS:
        m = median_wait(every)
        if m is not None:
            return m, len(every), "of any size"
    return None


def run_end(
    job: JobQueued,
    attempt: int,
    start_us: Micros,
    progress_s: float,
    now_us: Micros,
    history: Mapping[str, Sequence[float]],
    window_s: float,
    declared: bool = True,
) -> RunEnd:
    """The end of a run of ``job`` that started at ``start_us`` resuming from ``progress_s`` (module docstring).

    ``now_us``: the time of the question (a history estimate only counts runs longer than this one has run).
    ``declared=False`` ignores a declared duration, as for a real command (the benchmark's second forecast).
    """
    who = (job.job_id, attempt, job.budget, job.user)
    limit = job.time_limit_s
    if declared and job.duration_s is not None:
        left = max(0.0, job.duration_s - progress_s)
        if limit is not None and limit < left:  # the node agent stops it at its limit
            return RunEnd(
                *who, start_us + s_to_us(limit), "time_limit", f"time limit {limit:g} s, before its work ends"
            )
        return RunEnd(
            *who, start_us + s_to_us(left), "simulated", f"simulated duration: {left:g} s of work in this attempt"
        )
    if limit is not None:
        return RunEnd(*who, start_us + s_to_us(limit), "time_limit", f"time limit {limit:g} s")
    ran = us_to_s(max(0, now_us - start_us))
    longer = [d for d in history.get(job.user, ()) if d > ran]
    if longer:
        m = median(longer)
        return RunEnd(
            *who,
            start_us + s_to_us(m),
            "history",
            f"median run time of {len(longer)} completed run(s) of {job.user} longer than {ran:.0f} s: {m:.0f} s",
        )
    cap = start_us + s_to_us(window_s / 4)
    if cap > now_us:
        return RunEnd(*who, cap, "unknown", "no duration, time limit or history: assumed to run W/4")
    return RunEnd(*who, None, "unknown", "no duration, time limit or history, past W/4: runs until preempted")


def _report(cls: type[_Rep], values: dict[str, Any]) -> _Rep:
    """A node agent's report of the forward run, ``cls(**values)``, made without validating again when its values
    are what validation returns (an id, a UTC time, strings and integers from the state: :func:`built`)."""
    return built(
        cls,
        values,
        type(values["event_id"]) is uuid.UUID
        and utc_time(values["ts"])
        and type(values["job_id"]) is str
        and type(values["attempt"]) is int
        and type(values["replica"]) is int
        and type(values["node_id"]) is str,
    )


class _EngineCycle:
    """The engine's cycle as the dispatcher runs it (:func:`~apportion.domain.engine.run_cycle` on the live
    snapshot and the state's kept indices: ``reads_snapshot_only``), asked once for its explanation.

    ``explain``: the next cycle also says why each job it leaves pending waits (``reasons``, then off again),
    each job of ``only`` when set; the decisions are the same either way.
    """

    reads_snapshot_only = True

    def __init__(self) -> None:
        self.explain = False
        self.only: Set[str] | None = None
        self.reasons: dict[str, Any] | None = None

    def __call__(self, snapshot: CycleSnapshot, now_us: Micros, config: EngineConfig) -> list[Event]:
        explain, self.explain = self.explain, False
        res = run_cycle(snapshot, now_us, config, explain=explain, explain_only=self.only)
        if explain:
            self.reasons = res.reasons
        return res.events


class _Forward:
    """The forward run: the simulator's loop, reduced to what a forecast needs (module docstring)."""

    _EV, _TICK, _END, _CKPT, _PERIODIC, _ARRIVAL, _STOP, _AGE = range(8)

    def __init__(
        self,
        state: DispatchState,
        now_us: Micros,
        cfg: DispatchConfig,
        history: Mapping[str, Sequence[float]],
        horizon_us: Micros,
        cycle_s: float | None,
        declared: bool = True,
        min_gap_s: float = 0.0,
        spacing: float = 0.0,
        reasons: bool = False,
    ) -> None:
        self.declared = declared
        # the engine's cycle, run by the dispatcher's step on the forward state (:class:`_EngineCycle`)
        self.engine = _EngineCycle()
        if cfg.scheduler is None:
            cfg = replace(cfg, scheduler=self.engine)
        self.reasons = reasons and cfg.scheduler is self.engine  # explain the first cycle when it is one at now
        self.touched = False  # an event or a maintenance folded into the forward state before its first cycle
        self.debounce = Debounce(s_to_us(min_gap_s), spacing, now_us)
        self.state = state
        self.now = now_us
        self.cfg = cfg
        self.history = history
        self.horizon = horizon_us
        self.cycle_us = s_to_us(cycle_s) if cycle_s else None
        self.window_s = us_to_s(state.window_us)
        self.heap: list[tuple[Micros, int, int, Any]] = []
        # happenings due at the instant being done (``at``), in the order they were pushed: after those the heap
        # holds for it (pushed before it began, so with lower sequence numbers), as the heap would give them
        self.at: Micros | None = None
        self.same: deque[tuple[int, Any]] = deque()
        self.seq = 0
        self.real = 0
        self.ticks: set[Micros] = set()  # the times of the ticks in the heap (one tick a time stands for all)
        self.ages: list[Micros] = []  # reservation ages still to come, latest first (``seed``)
        self.periodic_at: Micros | None = None
        self.cycles = 0
        self.ends: dict[RunKey, RunEnd] = {}
        self.live: dict[RunKey, tuple[Micros, float, Micros | None]] = {}  # run -> (start, progress, interval)
        self.started: dict[str, Micros] = {}  # job -> first start in the forward run
        self.waiting: set[str] | None = None  # the jobs asked about not started yet (``run``)
        self.placed: dict[str, JobPlaced] = {}  # job -> its JobPlaced that started
        self.freed: list[tuple[Micros, RunKey, frozenset[str]]] = []  # run ends: (time, run, its nodes)
        self.freed_on: dict[str, list[int]] = {}  # node -> the indices in ``freed`` of the run ends on it
        self.nodes_of: dict[RunKey, frozenset[str]] = {}
        self.period_us: Micros = 0  # arrivals replayed every period (``arrive``)
        self._ids: dict[tuple[Any, ...], uuid.UUID] = {}  # the forward run's reports' event ids (``_id``)
        self._at: tuple[Micros, datetime] = (now_us, from_us(now_us))  # the last report time (``_ts``)

    def arrive(self, arrivals: Sequence[tuple[Micros, JobQueued]], period_s: float) -> None:
        """Replay ``arrivals`` (their first time, the job they copy) every ``period_s`` until the horizon."""
        self.period_us = s_to_us(period_s)
        copies: dict[str, int] = {}  # a job copied more than once (a burst's jobs in turn): its k-th copy
        for t, job in arrivals:
            if self.now <= t <= self.horizon:
                k = copies[job.job_id] = copies.get(job.job_id, 0) + 1
                self.push(t, self._ARRIVAL, (job, k))

    def _arrival(self, payload: tuple[JobQueued, int], t: Micros) -> bool:
        job, k = payload
        jid = f"{job.job_id}~{k}"
        sub = JobSubmitted(
            event_id=det_id(_PRODUCER, "arrival", job.job_id, k),
            ts=from_us(t),
            producer=_PRODUCER,
            job_id=jid if len(jid) <= 200 else f"~{det_id(_PRODUCER, jid)}",
            budget=job.budget,
            user=job.user,
            gpus_per_replica=job.gpus_per_replica,
            replicas=job.replicas,
            min_runtime_s=job.min_runtime_s,
            gpu_model=job.gpu_model,
            command=job.command,
            duration_s=job.duration_s if job.duration_s is not None or job.command is not None else 1.0,
            submitted_at=from_us(t),
            checkpoint_interval_s=job.checkpoint_interval_s,
            time_limit_s=job.time_limit_s,
        )
        if self.period_us and t + self.period_us <= self.horizon:
            self.push(t + self.period_us, self._ARRIVAL, (job, k + 1))
        return self._feed(sub, t)

    def push(self, t: Micros, kind: int, payload: Any = None) -> None:
        if kind == self._TICK:
            if t in self.ticks:
                return  # a cycle is wanted then already: a tick only marks its time
            self.ticks.add(t)
        self.seq += 1
        if kind != self._PERIODIC:
            self.real += 1
        if t == self.at:
            self.same.append((kind, payload))  # (no sift through the heap for a report of the same instant)
        else:
            heapq.heappush(self.heap, (t, self.seq, kind, payload))

    # ------------------------------------------------------------------ set-up

    def seed(self) -> None:
        """Happenings already due from the state: run ends, checkpoints, protection, grace and reservation ends."""
        st, now = self.state, self.now
        for key, run in sorted(st.cluster.runs.items()):
            self.nodes_of[key] = frozenset(p.node_id for p in run.placements)
            if run.stopping:
                continue
            rec = st.jobs.get(run.job_id)
            if rec is None:
                continue
            missing = sorted(set(range(run.replicas)) - run.started_replicas)
            for r in missing:  # placed, not yet reported started: taken to start now
                self.push(now, self._EV, self._started(run, r, now))
            start = run.started_at_us if run.started_at_us is not None and not missing else now
            self._begin(key, rec.spec, start, run.resumed_from_s, run.checkpoint_interval_us)
            until = run.protected_until_us
            if run.allocated and until is not None and now < until < UNTIL_STARTED:
                self.push(until, self._TICK)
        for _key, stop in sorted(st.stopping.items()):
            deadline = stop.deadline_us + (s_to_us(self.cfg.engine.grace_s) if stop.plus_grace else 0)
            self.push(max(now, deadline), self._STOP)
        after = s_to_us(self.cfg.engine.reservation_after_s)
        # the pending jobs' reservation ages: one in the heap at a time, the next pushed as it is popped
        ages = {job.queued_at_us + after for jobs in st.pending.values() for job in jobs}
        self.ages = sorted((a for a in ages if a > now), reverse=True)
        if self.ages:
            self.push(self.ages.pop(), self._AGE)
            self.real += len(self.ages)  # (counted as happenings while they wait their turn)
        self.push(now, self._TICK)

    def _begin(self, key: RunKey, spec: JobQueued, start: Micros, progress: float, every_us: Micros | None) -> None:
        end = run_end(spec, key[1], start, progress, self.now, self.history, self.window_s, self.declared)
        self.ends[key] = end
        self.live[key] = (start, progress, every_us)
        if end.end_us is not None:
            self.push(max(self.now, end.end_us), self._END, key)
        if every_us:
            self._next_checkpoint(key, start, progress, every_us, end.end_us, max(start, self.now))

    def _next_checkpoint(
        self, key: RunKey, start: Micros, progress: float, every_us: Micros, end_us: Micros | None, after: Micros
    ) -> None:
        """Schedule the run's first checkpoint after ``after``: progress a multiple of its interval, not at its end."""
        every = us_to_s(every_us)
        k = max(int(progress // every), int((progress + us_to_s(after - start)) // every)) + 1
        at = start + s_to_us(k * every - progress)
        if at <= after:  # float rounding at a multiple: the next one (a checkpoint never repeats an instant)
            k += 1
            at = start + s_to_us(k * every - progress)
        if (end_us is None or at < end_us) and at <= self.horizon:
            self.push(at, self._CKPT, (key, k * every))

    def _id(self, *parts: Any) -> uuid.UUID:
        """The event id of the forward run's report named by ``parts`` (kind, job, attempt, replica or progress):
        the same parts give the same id, so a report made twice is folded once, as with a hashed id; the ids are
        numbered in order of first use, outside RFC 4122's variant (a log event's id is a version 4 or 5 UUID, so
        none equals one the state has seen). Cheaper than hashing the parts, once per replica started."""
        got = self._ids.get(parts)
        if got is None:
            got = self._ids[parts] = uuid.UUID(int=_ID_BASE | len(self._ids))
        return got

    def _ts(self, t: Micros) -> datetime:
        """``from_us(t)``, made once for the reports of one instant (a datetime is immutable)."""
        at = self._at
        if at[0] != t:
            at = self._at = (t, from_us(t))
        return at[1]

    def _started(self, run: Run, replica: int, t: Micros) -> JobStarted:
        return _report(
            JobStarted,
            {
                "event_id": self._id("JobStarted", run.job_id, run.attempt, replica),
                "ts": self._ts(t),
                "producer": _AGENT,
                "job_id": run.job_id,
                "attempt": run.attempt,
                "replica": replica,
                "node_id": run.placements[replica].node_id,
            },
        )

    # ------------------------------------------------------------------ loop

    @property
    def cut(self) -> bool:
        """The run stopped at its horizon with happenings left after it."""
        return not self.same and bool(self.heap) and self.heap[0][0] > self.horizon and self.real > 0

    def run(self, wanted: set[str] | None, until_us: Micros | None = None) -> None:
        """Run until every job of ``wanted`` has started, nothing is left to happen, or the horizon; with
        ``wanted`` ``None``, until every happening up to ``until_us`` (default the horizon) is done."""
        heap, same = self.heap, self.same
        until = self.horizon if until_us is None else min(until_us, self.horizon)
        self.waiting = None if wanted is None else wanted - self.started.keys()  # (emptied as they start)
        while (heap or same) and (wanted is None or self.waiting):
            at = self.at
            t = at if same and at is not None and not (heap and heap[0][0] < at) else heap[0][0]
            if t > until or self.real == 0:
                break
            if not same:
                self.at = at = t
            dirty = stop = False
            while True:
                if heap and heap[0][0] == t:
                    _, _, kind, payload = heapq.heappop(heap)
                elif same and t == at:
                    kind, payload = same.popleft()
                else:
                    break
                if kind != self._PERIODIC:
                    self.real -= 1
                if kind == self._EV:
                    dirty |= self._feed(payload, t)
                elif kind == self._END:
                    self._end(payload, t)
                elif kind == self._CKPT:
                    self._checkpoint(payload, t)
                elif kind == self._ARRIVAL:
                    dirty |= self._arrival(payload, t)
                else:
                    dirty = True
                    if kind == self._TICK:
                        self.ticks.discard(t)
                    elif kind == self._STOP:
                        stop = True
                    elif kind == self._PERIODIC:
                        self.periodic_at = None
                    elif self.ages:  # _AGE: the next reservation age (counted in ``real`` already)
                        self.seq += 1
                        heapq.heappush(heap, (self.ages.pop(), self.seq, self._AGE, None))
            st = self.state
            if stop and not st.draining:
                self._stops(t)
            if dirty and (st.pending or st.stopping or st.draining):
                now, tick_at = self.debounce.want(t, force=stop and bool(st.draining))
                if tick_at is not None:  # spaced: one cycle at the gap's end
                    self.push(tick_at, self._TICK)
                if now:
                    self._tick(t)
            if self.cycle_us and self.state.pending and self.periodic_at is None:
                self.periodic_at = t + self.cycle_us
                self.push(self.periodic_at, self._PERIODIC)

    def _tick(self, t: Micros) -> None:
        """The dispatcher's cycle at ``t`` (``step`` of a :class:`Tick`: maintenance, then the cycle), on the
        state itself: the maintenance's events (stops that end at ``t``) are folded first, so that the cycle
        runs on the forward state and its engine caches, not on a scratch copy that would index every run
        and node again. The same events in the same order: the ledger's occupancy and capacity up to ``t``
        are those of the scratch copy (a requeue of a stopped run ends it no earlier than its preemption did),
        and the maintenance has nothing left to emit at ``t`` once its stops are folded. A state with
        draining nodes keeps the dispatcher's own path (a drain may emit more once its preemptions are folded).
        """
        st, cfg = self.state, self.cfg
        self.cycles += 1
        out = [] if st.draining else self._maintain(t)
        # the first cycle, at now with nothing folded before it, is a cycle at now on the caller's state
        first = self.cycles == 1 and t == self.now and not self.touched and not out and not st.draining
        self.engine.explain = self.reasons and first
        self.touched = True
        out += step(st, Tick(t), t, cfg)
        self._outputs(out, t)

    def _maintain(self, t: Micros) -> list[Event]:
        """The maintenance's events at ``t`` (stops that end then), folded into the forward state."""
        out = maintenance(self.state, t, self.cfg)
        for e in out:
            evolve(self.state, e)
        return out

    def _stops(self, t: Micros) -> None:
        """The stops that end at ``t``: the maintenance's events (each stopped run requeued, the preemptors that
        waited only for it started: ``StartWorkload``) folded at their time, ahead of the cycle, which the
        spacing may defer (the same events as the maintenance of a cycle at ``t`` gives; a start that only
        protection and grace ends delay stays exact)."""
        out = self._maintain(t)
        if out:
            self.touched = True
            self._outputs(out, t)

    def _feed(self, ev: Event, t: Micros) -> bool:
        self.touched = True
        out = step(self.state, ev, t, self.cfg)
        if type(ev) is JobStarted:
            run = self.state.cluster.runs.get((ev.job_id, ev.attempt))
            until = run.protected_until_us if run is not None and run.allocated else None
            if until is not None and t < until < UNTIL_STARTED:
                self.push(until, self._TICK)
        if type(ev) not in _NO_WAKEUPS:
            for w in wakeups(ev, self.cfg):
                self.push(w, self._wake_kind(ev))
        self._outputs(out, t)
        return type(ev) in (JobCompleted, JobFailed) or bool(out)

    def _outputs(self, out: list[Event], t: Micros) -> None:
        for e in out:
            if type(e) is StartWorkload:  # (a command: no wake-up)
                self._start(e, t)
                continue
            if type(e) is not StopWorkload:
                for w in wakeups(e, self.cfg):
                    if w > t:
                        self.push(w, self._wake_kind(e))
            if type(e) is JobPlaced:
                self.placed[e.job_id] = e
            elif type(e) is JobPreempted:
                key = (e.job_id, e.attempt)
                live = self.live.pop(key, None)
                self._freed(t, key)
                if live is not None and not e.allocated and e.grace_s > 0:
                    # an unallocated workload saves its progress on SIGTERM (as the simulator's default)
                    self.push(t, self._EV, self._checkpointed(key, live[1] + us_to_s(max(0, t - live[0])), t))

    def _wake_kind(self, e: Event) -> int:
        """A stop's end (a preemption's or a lost gang's grace) is folded when due, not spaced (``_stops``): it
        starts the job placed on the stopped run's GPUs, at a time the engine's rules fix (basis ``rules``); the
        cycle it wants is spaced like every other wake-up's (it forces one only while nodes drain)."""
        return self._STOP if type(e) in (JobPreempted, JobLost) else self._TICK

    def _start(self, e: StartWorkload, t: Micros) -> None:
        key = (e.job_id, e.attempt)
        run = self.state.cluster.runs.get(key)
        rec = self.state.jobs.get(e.job_id)
        if run is None or rec is None:
            return
        self.started.setdefault(e.job_id, t)
        if self.waiting:
            self.waiting.discard(e.job_id)
        self.push(t, self._EV, self._started(run, e.replica, t))
        if key not in self.live:
            self.nodes_of[key] = frozenset(p.node_id for p in run.placements)
            every = s_to_us(e.checkpoint_interval_s) if e.checkpoint_interval_s else None
            self._begin(key, rec.spec, t, e.progress_s or 0.0, every)

    def _end(self, key: RunKey, t: Micros) -> None:
        if self.live.pop(key, None) is None:
            return
        run = self.state.cluster.runs.get(key)
        if run is None or run.stopping:
            return
        self._freed(t, key)
        limited = self.ends[key].basis == "time_limit"  # stopped at its limit: the agent reports it failed
        for r in sorted(run.open_replicas):
            common: dict[str, Any] = {
                "event_id": self._id("JobFailed" if limited else "JobCompleted", key[0], key[1], r),
                "ts": self._ts(t),
                "producer": _AGENT,
                "job_id": key[0],
                "attempt": key[1],
                "replica": r,
                "node_id": run.placements[r].node_id,
            }
            self.push(
                t, self._EV, JobFailed(**common, reason="time_limit") if limited else _report(JobCompleted, common)
            )

    def _freed(self, t: Micros, key: RunKey) -> None:
        """Run ``key`` ended or was preempted at ``t``: recorded for the chains, indexed by its nodes."""
        where = self.nodes_of.get(key, frozenset())
        for n in where:
            self.freed_on.setdefault(n, []).append(len(self.freed))
        self.freed.append((t, key, where))

    def _checkpointed(self, key: RunKey, progress: float, t: Micros) -> JobCheckpointed:
        return JobCheckpointed(
            event_id=self._id("JobCheckpointed", key[0], key[1], progress),
            ts=self._ts(t),
            producer=f"{_PRODUCER}/agent",
            job_id=key[0],
            attempt=key[1],
            progress_s=progress,
        )

    def _checkpoint(self, payload: tuple[RunKey, float], t: Micros) -> None:
        key, progress = payload
        live = self.live.get(key)
        if live is None:
            return
        self._feed(self._checkpointed(key, progress, t), t)
        start, base, every = live
        if every:
            end = self.ends.get(key)
            self._next_checkpoint(key, start, base, every, end.end_us if end else None, t)


def _copy(state: DispatchState) -> DispatchState:
    """A copy of the state the forward run may fold into without changing ``state``: its copy-on-write fork
    (:meth:`~apportion.domain.dispatch.DispatchState.fork`: records, runs and pending lists are immutable and
    shared) with its own occupancy ledger, which the forward run folds (the one part that changes in place)."""
    copied = state.fork()
    copied.ledger = pickle.loads(pickle.dumps(state.ledger, protocol=pickle.HIGHEST_PROTOCOL))
    copied._ledger_on = True
    return copied


def _forward_config(config: DispatchConfig | None) -> DispatchConfig:
    """The dispatcher's knobs (the log's, defaults when ``None``) for a forward run: no heartbeat comes in it, so
    no node is lost for want of one (the heartbeat timeout off; the rest as the dispatcher runs)."""
    return replace(config or DispatchConfig(), heartbeat_timeout_s=None)


@_collector_paused
def forecast(
    state: DispatchState,
    now_us: Micros,
    config: DispatchConfig | None = None,
    *,
    job_ids: Iterable[str] | None = None,
    history: Mapping[str, Sequence[float]] | None = None,
    horizon_s: float = HORIZON_S,
    cycle_s: float | None = CYCLE_S,
    declared_durations: bool = True,
    arrivals: Sequence[tuple[Micros, JobQueued]] = (),
    arrival_period_s: float = 0.0,
    min_gap_s: float = MIN_GAP_S,
    spacing: float = SPACING,
    waits: Mapping[int, Sequence[tuple[float, bool]]] | None = None,
    chains_out: bool = True,
) -> Forecast:
    """Estimated start of each pending job of ``state`` (or of ``job_ids``) at event time ``now_us``.

    Args:
        state: the dispatcher's state folded from the log (not changed).
        now_us: the event time of the question, µs UTC (not before the state's clock).
        config: the dispatcher's knobs (the log's ``DispatcherConfigured``); defaults when ``None``.
        job_ids: only these pending jobs (the forward run stops once they have all started).
        history: :func:`user_history` of the log (``None``: no history estimates).
        horizon_s: how far ahead to look.
        cycle_s: the periodic cycle while jobs wait; ``None``: cycles on events and wake-ups only.
        declared_durations: ``False`` ignores the jobs' declared durations (basis ``simulated``), as if every
            job ran a real command: what a forecast of real work would know.
        arrivals: future submissions to assume (``--with-arrivals``: :func:`week_before_arrivals`): each is submitted
            at its time as a copy of the job it names (again every ``arrival_period_s`` when that is positive;
            0, the default: once); none by default.
        min_gap_s: the forward run's debounce (:data:`MIN_GAP_S`): a cycle wanted less than ``min_gap_s`` after
            the last one runs at the gap's end; 0 (the default) cycles at every run end, as the simulator does by default.
        waits: :func:`recent_waits` of the log: an unallocated job the forward run does not start at once gets
            the later of that start and its queueing plus the recent median wait (``estimate``
            ``recent_waits``); ``None``: the forward run's start for every job (``estimate`` ``forward``).
        spacing: the forward run's cycles spaced by how far ahead they look (:data:`SPACING`): after a cycle at
            ``t`` the next runs no earlier than ``t + max(min_gap_s, spacing x (t - now))``; 0: not spaced.
            With ``arrivals`` the run is exact: spacing and least gap 0 (reported in the result).
        chains_out: ``False`` leaves each job's chain out (``chain`` empty; its basis is still its chain's), as
            ``queue --start`` shows no chain: a chain lists every run end on the job's nodes before its start.

    Raises:
        KeyError: a job of ``job_ids`` is not pending.
    """
    cfg = _forward_config(config)
    pending = [j for leaf in sorted(state.pending) for j in state.pending[leaf]]
    by_id = {j.job_id: j for j in pending}
    if job_ids is not None:
        wanted = list(dict.fromkeys(job_ids))
        missing = [j for j in wanted if j not in by_id]
        if missing:
            raise KeyError(missing[0])
        targets = [by_id[j] for j in wanted]
    else:
        targets = pending
    horizon = now_us + s_to_us(horizon_s)
    if spacing < 0 or min_gap_s < 0 or horizon_s <= 0:
        raise ValueError("spacing and min_gap_s must not be negative, horizon_s must be positive")
    if arrivals:
        # replayed submissions set the pace: cycles spaced or a gap apart would let them pile up between cycles
        # and take every free GPU at once, ahead of the unallocated work they in fact leave room for (module docstring)
        spacing = min_gap_s = 0.0
    fwd = _Forward(
        _copy(state), now_us, cfg, history or {}, horizon, cycle_s, declared_durations, min_gap_s, spacing, True
    )
    asked = None if job_ids is None else {j.job_id for j in targets}  # the jobs whose reasons are shown
    fwd.engine.only = asked
    fwd.seed()
    fwd.arrive(arrivals, arrival_period_s)
    fwd.run({j.job_id for j in targets})
    result = Forecast(now_us, horizon, runs=dict(fwd.ends), cycles=fwd.cycles, spacing=spacing, min_gap_s=min_gap_s)
    starts = {j.job_id: fwd.started.get(j.job_id) for j in targets}
    chains = {j: () if t is None else _chain(fwd, j, t) for j, t in starts.items()} if chains_out else {}
    # job -> (its chain has a step, the bases of its chain's run ends)
    links = (
        {j: (bool(c), [x.basis for x in c if x.kind == "run_ends"]) for j, c in chains.items()}
        if chains_out
        else {j: (False, []) if t is None else _links(fwd, j, t) for j, t in starts.items()}
    )
    reasons: dict[str, Any] = fwd.engine.reasons or {}
    if (
        fwd.engine.reasons is None
        and cfg.scheduler is None
        and any(t != now_us or links[j][0] for j, t in starts.items())
    ):
        # why the jobs that do not start at once wait: the engine's explanation of a cycle at now on the
        # caller's state (the forward run left it unchanged); the forward run's first cycle is that cycle when
        # nothing was folded before it (explained then); not needed when every one starts at once
        reasons = run_cycle(state.cycle_snapshot(now_us), now_us, cfg.engine, explain=True, explain_only=asked).reasons
    for job in targets:
        why = state.waiting_reason(job.job_id, now_us) or reasons.get(job.job_id)
        start, chain, (linked, bases) = starts[job.job_id], chains.get(job.job_id, ()), links[job.job_id]
        forward, why_later = start, ""
        if waits is not None and start is not None and start > now_us and job.min_runtime_s <= 0:
            later = _recent_start(waits, job, now_us)
            if later is not None and later[0] > start:
                start, why_later = later
        if start is None:
            basis, note = "-", _no_start(fwd, horizon)
            if job.job_id in state.held:
                note = "held: no start until it is released"
        elif not linked and start == now_us:
            basis, note = NOW, ""
        else:
            basis = max(bases, key=BASES.index) if bases else RULES
            note = ""
        forward_basis = basis
        if why_later:
            basis, note = RECENT_WAITS, why_later
        result.jobs.append(
            JobForecast(
                job_id=job.job_id,
                budget=job.budget,
                user=job.user,
                gpus_per_replica=job.gpus_per_replica,
                replicas=job.replicas,
                start_us=start,
                wait_s=None if start is None else us_to_s(start - now_us),
                basis=basis,
                reason="" if why is None else why.text(),
                reason_detail=None if why is None else reason_dict(why),
                chain=chain,
                note=note,
                forward_start_us=forward,
                forward_basis=forward_basis,
                after_us=horizon if start is None and fwd.cut else None,
            )
        )
    return result


def _recent_start(
    waits: Mapping[int, Sequence[tuple[float, bool]]], job: Any, now_us: Micros
) -> tuple[Micros, str] | None:
    """An unallocated pending job's start from the recent waits (:func:`waits_for`): its queueing plus the
    median of the waits longer than it has waited so far, with why (``None``: no such median)."""
    waited = us_to_s(now_us - job.queued_at_us)
    longer = {k: [w for w in ws if w[0] > waited] for k, ws in waits.items()}
    got = waits_for(longer, job.gpus_per_replica * job.replicas)
    if got is None:
        return None
    secs, n, which = got
    return job.queued_at_us + s_to_us(secs), (
        f"unallocated: runs only on idle GPUs, behind later allocated work; the median wait of {n} recent "
        f"unallocated job(s) {which} that waited longer than {waited:.0f} s is {secs / 3600:.2f} h, later than the "
        "forward run's start"
    )


def with_submission(
    state: DispatchState, job: JobSubmitted, now_us: Micros, config: DispatchConfig | None = None
) -> tuple[DispatchState, JobRejected | None]:
    """A copy of ``state`` with ``job`` submitted at ``now_us`` (``forecast --submit``: "if I submit this now").

    The submission goes through the dispatcher's own admission (:func:`~apportion.domain.dispatch.step`):
    returns the copy, with the job queued, and ``None``; or the copy unchanged and the ``JobRejected``
    admission gives. ``state`` is not changed.
    """
    copy = _copy(state)
    out = step(copy, job, now_us, config or DispatchConfig(heartbeat_timeout_s=None))
    return copy, next((e for e in out if isinstance(e, JobRejected)), None)


def iso_seconds(us: Micros) -> str:
    """``us`` as ISO 8601 UTC at whole seconds (``2024-01-01T00:10:00+00:00``): the times the text outputs of
    ``forecast``, ``queue --start`` and ``share --forecast`` print; their ``--json`` keeps the microseconds."""
    return from_us(us).isoformat(timespec="seconds")


def _no_start(fwd: _Forward, horizon: Micros) -> str:
    if fwd.cut:
        return f"not started before {iso_seconds(horizon)} (the forecast's horizon)"
    return "not started by the runs with a known end: it waits for runs that end only when preempted"


_STEP_ORDER = {"protection_ends": 0, "run_ends": 1, "preempts": 2}


def _ends_before(fwd: _Forward, placed: JobPlaced, start: Micros) -> Iterator[tuple[Micros, RunKey, RunEnd]]:
    """The run ends on the nodes of ``placed`` up to ``start``, in time order, each run once: neither its victims'
    nor the job's own earlier runs'."""
    nodes = {p.node_id for p in placed.placements}
    victims = {(v.job_id, v.attempt) for v in placed.decision.victims}
    freed = fwd.freed
    on: list[int] = []
    for n in nodes:  # each node's list is in time order
        got = fwd.freed_on.get(n, [])
        on += got[: bisect_right(got, start, key=lambda i: freed[i][0])]
    if len(nodes) > 1:
        on = sorted(set(on))  # a gang's: in time order, each run once
    for t, key, _where in (freed[i] for i in on):
        if key in victims or key[0] == placed.job_id:
            continue
        end = fwd.ends.get(key)
        if end is not None:
            yield t, key, end


def _links(fwd: _Forward, job_id: str, start: Micros) -> tuple[bool, list[str]]:
    """What a job's basis needs of its chain (:func:`_chain`) without the chain: whether it has a step, and the
    bases of its run ends."""
    placed = fwd.placed.get(job_id)
    if placed is None:
        return False, []
    bases = [end.basis for _t, _key, end in _ends_before(fwd, placed, start)]
    return bool(bases) or bool(placed.decision.victims), bases


def _chain(fwd: _Forward, job_id: str, start: Micros) -> tuple[ChainStep, ...]:
    """What freed the GPUs ``job_id`` started on: run ends on its nodes before ``start``, and its victims."""
    placed = fwd.placed.get(job_id)
    if placed is None:
        return ()
    victims = {(v.job_id, v.attempt): v for v in placed.decision.victims}
    steps: list[ChainStep] = []
    for t, key, end in _ends_before(fwd, placed, start):
        steps.append(
            ChainStep(
                "run_ends",
                t,
                key[0],
                key[1],
                end.budget,
                end.basis,
                f"{key[0]} (attempt {key[1]}, {end.budget}) ends: {end.note}",
            )
        )
    placed_at = to_us(placed.ts)
    for _key, v in sorted(victims.items()):
        if v.protected_until is not None:
            until = to_us(v.protected_until)
            steps.append(
                ChainStep(
                    "protection_ends", until, v.job_id, v.attempt, v.budget, RULES, f"{v.job_id}'s protection ends"
                )
            )
        steps.append(
            ChainStep(
                "preempts",
                placed_at,
                v.job_id,
                v.attempt,
                v.budget,
                RULES,
                f"preempts {v.job_id} (attempt {v.attempt}, {v.budget}; rule {v.rule}), "
                f"then waits out its grace period",
            )
        )
    steps.sort(key=lambda s: (s.at_us, _STEP_ORDER[s.kind], s.job_id))
    return tuple(steps)


# --------------------------------------------------------------------------- queue --start, protection notice


def with_starts(rows: Sequence[Mapping[str, Any]], fc: Forecast) -> list[dict[str, Any]]:
    """``apportion queue --start``: the queue's rows, each pending one with its forecast start (``est_start``,
    ISO UTC, ``None`` when not within the forecast), ``est_basis`` (:attr:`JobForecast.basis`) and ``est_after``
    (the horizon, ISO UTC, for a job not started within it, else ``None``); other rows
    as they are. A pending row the forecast does not cover (it came after the log read) gets ``None`` and
    basis ``""``."""
    by_id = {j.job_id: j for j in fc.jobs}
    out = []
    for row in rows:
        r = dict(row)
        if r.get("state") == "pending":
            j = by_id.get(str(r.get("job_id")))
            r["est_start"] = None if j is None or j.start_us is None else from_us(j.start_us).isoformat()
            r["est_basis"] = "" if j is None else j.basis
            r["est_after"] = None if j is None or j.after_us is None else from_us(j.after_us).isoformat()
        out.append(r)
    return out


def protection_of(state: DispatchState, job_id: str, now_us: Micros) -> str:
    """:func:`protection_notice` of ``job_id``'s current run in ``state`` (``""`` when it is not running)."""
    rec = state.jobs.get(job_id)
    run = state.cluster.runs.get((job_id, rec.attempt)) if rec is not None else None
    if rec is None or run is None or rec.status != "running":
        return ""
    until = run.protected_until_us
    row = {
        "state": "running",
        "allocated": run.allocated,
        "protected_until": None
        if until is None
        else ("until started" if until >= UNTIL_STARTED else from_us(until).isoformat()),
    }
    return protection_notice(row, now_us)


def protection_notice(row: Mapping[str, Any], now_us: Micros) -> str:
    """What a running job's protection promises (rules ``D1.allocated-job``, ``D3.victims``), for ``queue`` and
    ``explain``: ``protected until T; preemptible after`` while it lasts, ``preemptible since T`` once it has
    ended, ``protected until started`` for a run not yet started; ``""`` for a row without protection (an
    unallocated run: preemptible at any time, said as ``unallocated: preemptible at any time``).

    ``row``: a queue row (``state``, ``allocated``, ``protected_until``: ISO UTC or ``"until started"``).
    """
    if row.get("state") != "running":
        return ""
    if row.get("allocated") is False:
        return "unallocated: preemptible at any time"
    until = row.get("protected_until")
    if until is None:
        return ""
    if until == "until started":
        return "protected until started"
    from datetime import datetime

    t = to_us(datetime.fromisoformat(str(until)))
    stamp = utc_text(t)
    return f"protected until {stamp}; preemptible after" if t > now_us else f"preemptible since {stamp}"


# --------------------------------------------------------------------------- budget forecast


@dataclass(frozen=True, slots=True)
class BudgetPoint:
    """One budget at one time of a budget forecast.

    Attributes:
        path: the budget.
        at_us: the time, µs UTC.
        ratio: its usage ratio r (``D2.usage-ratio``) as the window stands then.
        rank: its place in the fair-share order of leaves (0 first), ``None`` for an inner budget.
        can_preempt: leaves whose branch at the lowest common ancestor is then ahead of this leaf's by at least
            delta and that hold allocated GPUs (``D3.victims``, rule 2: their runs are victims for this budget's
            jobs once their protection ends); empty for an inner budget.
    """

    path: str
    at_us: Micros
    ratio: float
    rank: int | None
    can_preempt: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``ratio`` ``"inf"`` when infinite)."""
        return {
            "path": self.path,
            "at": from_us(self.at_us).isoformat(),
            "ratio": self.ratio if self.ratio != float("inf") else "inf",
            "rank": self.rank,
            "can_preempt": list(self.can_preempt),
        }


@dataclass
class BudgetForecast:
    """Each budget's r and rank at each sample time (``D12.budget-forecast``).

    Attributes:
        now_us: the forecast's time; ``step_s``: seconds between samples.
        times: the sample times, ``now_us`` first.
        points: budget path -> its :class:`BudgetPoint` per sample time, in ``times`` order.
    """

    now_us: Micros
    step_s: float
    times: list[Micros] = field(default_factory=list)
    points: dict[str, list[BudgetPoint]] = field(default_factory=dict)

    def first_preempting(self, path: str) -> BudgetPoint | None:
        """The first sample at which leaf ``path`` can preempt another budget's expired runs, or ``None``."""
        return next((p for p in self.points.get(path, ()) if p.can_preempt), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        out = []
        for path, pts in self.points.items():
            first = self.first_preempting(path)
            out.append(
                {
                    "path": path,
                    "points": [p.to_dict() for p in pts],
                    "can_preempt_from": None if first is None else from_us(first.at_us).isoformat(),
                }
            )
        return {
            "now": from_us(self.now_us).isoformat(),
            "step_s": self.step_s,
            "times": [from_us(t).isoformat() for t in self.times],
            "budgets": out,
        }


@_collector_paused
def budget_forecast(
    state: DispatchState,
    now_us: Micros,
    config: DispatchConfig | None = None,
    *,
    days: float = 7.0,
    step_s: float = 86_400.0,
    history: Mapping[str, Sequence[float]] | None = None,
    cycle_s: float | None = CYCLE_S,
) -> BudgetForecast:
    """Each budget's r and rank every ``step_s`` from ``now_us`` for ``days`` as its window slides
    (``D12.budget-forecast``; ``apportion share --forecast 7d``).

    The same forward run as :func:`forecast`: running work ends per its basis (declared work, time limit, its
    user's median, W/4), pending jobs start as the engine would start them, and nothing new is submitted. At
    each sample time the occupancy windows (``D2.occupancy``) and the capacity integral (``D2.entitlement``)
    are read from the forward run's ledger, so work that ended days ago drops out of the window as it would.
    Pure; ``state`` is not changed.

    Raises:
        ValueError: ``now_us`` before the state's clock, or ``step_s``/``days`` not positive.
    """
    from apportion.domain.fairshare import branches_at_lca, budget_order, ratios

    if state.clock_us is not None and now_us < state.clock_us:
        raise ValueError("a budget forecast cannot start before the state's latest event")
    if step_s <= 0 or days <= 0:
        raise ValueError("--forecast and its step must be positive")
    cfg = _forward_config(config)
    end_us = now_us + s_to_us(days * 86_400.0)
    fwd = _Forward(_copy(state), now_us, cfg, history or {}, end_us, cycle_s)
    fwd.seed()
    delta = cfg.engine.delta
    result = BudgetForecast(now_us, step_s)
    k = 0
    while (t := now_us + s_to_us(k * step_s)) <= end_us:
        fwd.run(None, t)
        st = fwd.state
        tree = st.tree
        occ, cap = st.ledger.occupancy(t), st.ledger.capacity_gpu_s(t)
        r = ratios(tree, occ, cap)
        order = budget_order(tree, occ, cap)
        rank = {p: i for i, p in enumerate(order)}
        holding = {run.budget for run in st.cluster.runs.values() if run.allocated and not run.stopping}
        result.times.append(t)
        for path in tree.paths():
            can: list[str] = []
            if path in rank:
                for other in order:
                    if other == path or other not in holding:
                        continue
                    try:
                        _, mine, theirs = branches_at_lca(path, other)
                    except ValueError:
                        continue
                    if r.get(theirs, 0.0) - r.get(mine, 0.0) >= delta:
                        can.append(other)
            result.points.setdefault(path, []).append(BudgetPoint(path, t, r[path], rank.get(path), tuple(can)))
        k += 1
    return result
