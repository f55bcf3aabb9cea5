"""Accuracy of start-time forecasts (design D12, ``D12.accuracy``): measured on a replayed Philly slice.

The slice is simulated with the fair-share engine (:mod:`apportion.sim.core`, reference budgets
``infra/budgets/philly.yaml``, seeded). Then the simulator's log is folded again, event by event, and at the
submission of each sampled job (right after its ``JobQueued``) three estimates of its start are made from
that prefix alone:

* ``forecast``: :func:`apportion.forecast.forecast`, the engine run forward, running work ending at its
  declared duration (basis ``simulated``: a Philly job's duration is in the trace), its cycles spaced by
  ``--spacing`` and ``--min-gap`` (defaults :data:`apportion.forecast.SPACING`, :data:`apportion.forecast.MIN_GAP_S`);
* ``forecast, unspaced``: the same forward run with ``spacing`` 0 (the least gap kept);
* ``forecast + recent waits``: the same forward run, an unallocated job that it does not start at once given the
  later of that start and the recent median wait of unallocated jobs of its size (``forecast --recent-waits``,
  :func:`apportion.forecast.recent_waits`);
* ``forecast, no durations``: the same with the declared durations ignored (``declared_durations=False``),
  so that runs end at their user's median run time in the log prefix, or W/4: what a forecast of real
  commands knows;
* ``forecast + arrivals``: ``forecast`` with the submissions of the day before replayed once, a day later
  (:func:`apportion.forecast.recent_arrivals`: the next day assumed like the last, nothing after it; a forward
  run with arrivals is exact, :func:`apportion.forecast.forecast`);
* ``forecast + arrivals every day``: the same submissions replayed a day later and every day after;
* ``forecast + arrivals, mean day``: the mean day of the last 7 as the next (:func:`mean_day_arrivals`: one in 7
  of each day's submissions at the same hours, fewer days when the log prefix is shorter), once; ``... every
  day``: replayed every day;
* ``forecast + arrivals ahead``: the day before replayed, only the submissions that can go before the job
  (:func:`arrivals_ahead`: budgets ahead of its own in the fair-share order at the question, and every allocated
  one for an unallocated job);
* ``forecast + arrivals, median of days``: a forward run per day replayed (the day k days before, k days later,
  k = 1 .. :data:`REPLAY_DAYS` as far as the log prefix reaches), the median start (the range in ``--dump``);
* ``forecast + arrivals a week before``: the same hours of the week before, a week later (``forecast
  --with-arrivals``, :func:`apportion.forecast.week_before_arrivals`; the last day on a log shorter than a week);
* ``forecast + the week before``: the whole week before, each submission a week later (``span_s`` a week: the
  same hours of the week before over the whole 7-day horizon, not only the next day);
* ``forecast + recent hours``: the recent rate taken to go on: the submissions of the last :data:`RECENT_S` (6 h)
  replayed every 6 h over the whole horizon (each budget's recent rate and job mix, by hour); ``forecast + the
  last hour``: the last hour's submissions replayed once, an hour later (a burst going on);
* ``forecast + bursts``: the rest of the job's own user's burst in progress (:func:`apportion.forecast.burst_arrivals`:
  submissions at most ``--burst-gap-m`` minutes apart are a burst, continued to the median count of the user's
  longer ended bursts at the rate of its last 10, copies of them); ``forecast + all bursts``: every user's;
* ``forecast + actual arrivals``: a diagnostic, not an estimate: ``forecast`` given the submissions the
  simulation in fact received after the question (their times and shapes, from the rest of the log); what is
  left of its error is the forward run's own (resolution, the model of running work), the rest of
  ``forecast``'s error is the later arrivals'; ``forecast + actual allocated arrivals``: only the allocated ones
  (what overtakes an unallocated job: ``D1.unallocated-job``);
* ``slurm-style``: a backfill plan as ``squeue --start`` gives it: running jobs end at their duration, no
  preemption, the pending jobs in fair-share order at the time (budget order, then submission), each at
  the earliest time it fits on k nodes with g free GPUs for its duration without moving the plans before it.

Each is compared with the start the job got in the simulation (its first ``JobStarted``). Printed per
estimate, for all the jobs and then for the allocated and the unallocated ones apart: jobs with an estimate, median and p90 absolute error (hours), mean signed error (bias, hours;
positive = later than it started), share within 1 h and within 25% of the job's actual wait, and the same
shares for the jobs that waited more than 1 h. Future submissions are unknown to every estimate but
the arrival replays. Below the table, what the misses have in common: of the jobs that waited more than
1 h and whose estimate is off by more than 25% of the wait, how many were estimated too early or too late, how
many are unallocated (``min_runtime_s`` 0: they run only on idle GPUs, after every allocated job and behind
the unallocated jobs of budgets ahead in the fair-share order) and how many were overtaken (a job submitted
after them started before them).

Sampling, for a loaded machine: ``--sample N`` (N forecasts evenly spread over the slice's submissions) or
``--every K`` (every K-th), ``--long-only`` (of those, only the jobs that waited more than 1 h in the simulation),
``--skip N`` (leave out the first N: a second run's share); ``--table`` prints a row per long wait (each
estimate's wait, the budgets whose later submissions overtook it); ``--estimates`` makes only some of the four (names separated by ``;``); ``--dump
FILE`` writes each sample as one JSON line as soon as it is made (times in µs), so a run cut short still leaves
its samples; a progress line goes to stderr every 20 forecasts.

Speed (``--timing``): ``bench_engine``'s steady snapshot (10,000 GPUs, 20,000 pending jobs) folded into a
dispatcher state, then the wall time of ``forecast`` of one job (the head of the fair-share order, and the middle
of the queue) and of ``queue --start`` (every pending job), against the targets 2 s and 10 s, the forward run
spaced by ``--spacing`` and ``--min-gap`` and looking ``--horizon-d`` days ahead (``queue --start`` without the
chains, as the command shows none). With ``--dump FILE`` each of these forecasts is written whole as a JSON line
(``Forecast.to_dict``), so that two builds' forecasts can be compared byte for byte (``cmp``).
With ``--while-waiting N`` the forecast is made again every hour while each sampled job waits (at most N
times a job) and its median error is printed by how long before the start it was made (convergence).
With ``--overtakers`` nothing is forecast: a row per chosen job that waited more than 1 h says whose later
submissions started before it (its own user's, allocated or not, and how many of them within its burst; other
budgets', allocated or not) and the median minutes after it that its own user's came.
With ``--calibrate FIT.jsonl [SCORE.jsonl ...]`` (``--dump`` files) nothing is run: a correction is fitted on
the first file's waits over 1 h and scored on each (fit on one week, report on the others): the factor on the
unallocated waits of ``--calibrate-estimate`` (default ``forecast``) that puts the most within 25%, or with
``--calibrate-blend NAME`` the point between the two estimates (:data:`WEIGHTS`) that does.
Figures only: nothing is asserted.

Run: ``.venv/bin/python bench/bench_forecast.py [--slice 2017-10-30..2017-10-31] [--sample 200] [--seed 1]``
(defaults: Thursday of ISO week 44, 200 forecasts evenly spread over its submissions; the simulation also
runs the submissions of the 2 days before it, so that the cluster is busy, and of the day after it, so that
the jobs it forecasts meet the later arrivals their forecasts cannot know). The week's Monday
(``--slice week44+1d``) measures little: with the same warm-up none of 20 of its jobs sampled waited at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from apportion.domain.dispatch import DispatchConfig, DispatchState, evolve
from apportion.domain.engine import EngineConfig
from apportion.domain.fairshare import budget_order
from apportion.events import Decision, Event, JobQueued, JobStarted
from apportion.forecast import (
    ARRIVAL_LOOKBACK_S,
    ARRIVAL_PERIOD_S,
    BURST_GAP_S,
    HORIZON_S,
    MIN_GAP_S,
    SPACING,
    burst_arrivals,
    forecast,
    recent_arrivals,
    recent_waits,
    user_history,
    week_before_arrivals,
)
from apportion.sim.core import SimConfig, Simulator, default_horizon_us
from apportion.sim.traces import ITP_T0, load_budget_file, load_trace, parse_itp_slice, parse_slice, trace_format
from apportion.timeutil import Micros, from_us, s_to_us, to_us, us_to_s

TRACE = "/work/shared/data/philly/philly.csv"
BUDGETS = "infra/budgets/philly.yaml"
_DECISION = Decision(rank=0, budget_rank=0, ratio=0.0)


# --------------------------------------------------------------------------- slurm-style backfill plan


@dataclass
class _NodePlan:
    """A node's GPUs over time: ``(start, end, gpus)`` holds, for the backfill plan."""

    gpus: int
    model: str | None
    holds: list[tuple[Micros, Micros, int]]

    def peak(self, t0: Micros, t1: Micros) -> int:
        """Most GPUs held at once in ``[t0, t1)`` (holds change only at their starts and ends)."""
        points = [t0] + [s for s, _, _ in self.holds if t0 < s < t1]
        return max(sum(g for s, e, g in self.holds if s <= p < e) for p in points)


def slurm_estimate(state: DispatchState, now: Micros, target: str) -> Micros | None:
    """The backfill plan's start of ``target`` (module docstring); ``None`` when no node shape fits it."""
    nodes = {
        nid: _NodePlan(n.gpu_count, n.gpu_model, [])
        for nid, n in sorted(state.cluster.nodes.items())
        if n.state == "ready"
    }
    for run in state.cluster.runs.values():
        rec = state.jobs.get(run.job_id)
        dur = rec.spec.duration_s if rec is not None and rec.spec.duration_s is not None else 0.0
        start = run.started_at_us if run.started_at_us is not None else now
        end = max(now + 1, start + s_to_us(max(0.0, dur - run.resumed_from_s)))
        if run.stopping:
            stop = state.stopping.get(run.key)
            end = max(now + 1, stop.deadline_us) if stop is not None else now + 1
        for p in run.placements:
            if p.node_id in nodes:
                nodes[p.node_id].holds.append((now, end, len(p.gpus)))
    snap = state.cycle_snapshot(now)
    rank = {leaf: i for i, leaf in enumerate(budget_order(snap.tree, snap.occupancy, snap.capacity_gpu_s))}
    queue = sorted(
        (j for jobs in state.pending.values() for j in jobs),
        key=lambda j: (rank.get(j.budget, len(rank)), j.submitted_at_us, j.job_id),
    )
    for job in queue:
        dur = s_to_us(max(1.0, (job.duration_s or 0.0) - job.progress_s))
        g, k = job.gpus_per_replica, job.replicas
        usable = [n for n in nodes.values() if n.gpus >= g and (job.gpu_model is None or n.model == job.gpu_model)]
        if len(usable) < k:
            if job.job_id == target:
                return None
            continue
        times = sorted({now} | {e for n in usable for _, e, _ in n.holds if e > now})
        for t in times:
            fits = [n for n in usable if n.peak(t, t + dur) + g <= n.gpus]
            if len(fits) >= k:
                for n in fits[:k]:
                    n.holds.append((t, t + dur, g))
                if job.job_id == target:
                    return t
                break
    return None


# --------------------------------------------------------------------------- the measurement

#: The estimates made of each sampled job (module docstring), in the order they are printed.
ESTIMATES: tuple[str, ...] = (
    "forecast",
    "forecast, unspaced",
    "forecast + recent waits",
    "forecast, no durations",
    "forecast + arrivals",
    "forecast + arrivals every day",
    "forecast + actual arrivals",
    "forecast + arrivals ahead",
    "forecast + arrivals, median of days",
    "forecast + arrivals a week before",
    "forecast + the week before",
    "forecast + arrivals, mean day",
    "forecast + arrivals, mean day every day",
    "forecast + recent hours",
    "forecast + the last hour",
    "forecast + actual allocated arrivals",
    "forecast + bursts",
    "forecast + all bursts",
    "slurm-style",
)
#: The estimates that are one forward run: name -> (declared durations known, the arrivals assumed, as
#: :func:`arrivals_of` names them), in the order they are made.
RUNS: dict[str, tuple[bool, str]] = {
    "forecast": (True, ""),
    "forecast, unspaced": (True, ""),
    "forecast, no durations": (False, ""),
    "forecast + arrivals": (True, "once"),
    "forecast + arrivals every day": (True, "daily"),
    "forecast + actual arrivals": (True, "actual"),
    "forecast + arrivals ahead": (True, "ahead"),
    "forecast + arrivals a week before": (True, "week"),
    "forecast + the week before": (True, "whole week"),
    "forecast + arrivals, mean day": (True, "mean"),
    "forecast + arrivals, mean day every day": (True, "mean daily"),
    "forecast + recent hours": (True, "recent"),
    "forecast + the last hour": (True, "hour"),
    "forecast + actual allocated arrivals": (True, "actual allocated"),
    "forecast + bursts": (True, "burst"),
    "forecast + all bursts": (True, "all bursts"),
}
#: ``forecast + recent hours``: the submissions of the last this many seconds, replayed every as many seconds over
#: the horizon (the recent rate and mix of each budget taken to go on).
RECENT_S = 6 * 3600.0
#: The arrivals replayed again every period (seconds), by :func:`arrivals_of`'s name; the others once.
PERIODS: dict[str, float] = {"daily": ARRIVAL_LOOKBACK_S, "mean daily": ARRIVAL_LOOKBACK_S, "recent": RECENT_S}
#: ``forecast + arrivals, median of days``: the days replayed (each the day k days before, k days later, k = 1..N
#: where the log prefix reaches back that far), one forward run each; the median start is the estimate.
REPLAY_DAYS = 3


@dataclass
class Sample:
    job_id: str
    submitted: Micros
    actual: Micros
    estimates: dict[str, Micros | None]
    basis: str = ""
    overtaken: int = 0
    allocated: bool = True
    range_: tuple[Micros | None, Micros | None] | None = None

    def row(self) -> dict[str, Any]:
        """The sample as one line of ``--dump`` (times in µs)."""
        return {
            "job_id": self.job_id,
            "submitted": self.submitted,
            "actual": self.actual,
            "estimates": self.estimates,
            "basis": self.basis,
            "overtaken": self.overtaken,
            "allocated": self.allocated,
            "range": self.range_,
        }


def actual_arrivals(log: Sequence[Event], idx: int, until: Micros) -> list[tuple[Micros, JobQueued]]:
    """The submissions the simulation received after ``log[idx]`` and before ``until`` (first ``JobQueued`` of
    each job), as ``forecast``'s ``arrivals``: the ``forecast + actual arrivals`` diagnostic."""
    out: list[tuple[Micros, JobQueued]] = []
    for e in log[idx + 1 :]:
        t = to_us(e.ts)
        if t >= until:
            break
        if type(e) is JobQueued and e.attempt == 1:
            out.append((t, e))
    return out


def mean_day_arrivals(events: Sequence[Event], now_us: Micros, days: int = 7) -> list[tuple[Micros, JobQueued]]:
    """The mean of the last ``days`` days' submissions as the next day's (``forecast + arrivals, mean day``): of the jobs
    first queued (``JobQueued``, attempt 1) in the day ``k`` days before ``now_us`` (k = 1 .. n), in time order, every
    n-th (the i-th where i mod n = k - 1), each at its time plus ``k`` days; n is ``days``, or the whole days the
    log covers before ``now_us`` when fewer (at least 1). So the next day gets a 1/n sample of each of the last n
    days at the same hours: the arrival rate of the week's mean day, with its daily shape; nothing after it."""
    day = s_to_us(ARRIVAL_LOOKBACK_S)
    first = min((to_us(e.ts) for e in events), default=now_us)
    n = max(1, min(days, (now_us - first) // day))
    per_day: list[list[tuple[Micros, JobQueued]]] = [[] for _ in range(n)]
    for ev in events:
        if isinstance(ev, JobQueued) and ev.attempt == 1:
            t = to_us(ev.ts)
            if now_us - n * day <= t < now_us:
                per_day[(now_us - 1 - t) // day].append((t, ev))
    out: list[tuple[Micros, JobQueued]] = []
    for k, jobs in enumerate(per_day, start=1):
        jobs.sort(key=lambda a: (a[0], a[1].job_id))
        out.extend((t + k * day, ev) for i, (t, ev) in enumerate(jobs) if i % n == k - 1)
    out.sort(key=lambda a: (a[0], a[1].job_id))
    return out


def arrivals_ahead(
    arrivals: Sequence[tuple[Micros, JobQueued]], budget: str, allocated: bool, order: Sequence[str]
) -> list[tuple[Micros, JobQueued]]:
    """The ``arrivals`` that can go before a job of ``budget`` (allocated or not) in the fair-share ``order`` of the
    leaves at the forecast's time (:func:`~apportion.domain.fairshare.budget_order`): those of leaves ahead of its
    own, and, for an unallocated job, every allocated one (``D1.unallocated-job``: it runs only on GPUs the
    allocated work leaves idle). A leaf not in ``order`` is taken to be behind every leaf in it."""
    rank = {leaf: i for i, leaf in enumerate(order)}
    mine = rank.get(budget, len(rank))
    return [(t, j) for t, j in arrivals if rank.get(j.budget, len(rank)) < mine or (not allocated and j.allocated)]


def arrivals_of(
    kind: str,
    log: Sequence[Event],
    idx: int,
    hist: Sequence[Event],
    state: DispatchState,
    now: Micros,
    horizon_d: float,
    burst_gap_s: float = BURST_GAP_S,
    burst_again_s: float = 0.0,
) -> list[tuple[Micros, JobQueued]]:
    """The future submissions an estimate assumes (module docstring): none (``""``), the day before replayed once
    (``once``, ``daily``), those of it that can go before the job (``ahead``), the same hours of the week before
    (``week``), the last 6 h every 6 h (``recent``), the last hour once (``hour``), or the ones the simulation in
    fact received (``actual``; the allocated ones only: ``actual allocated``)."""
    if not kind:
        return []
    if kind.startswith("actual"):
        got = actual_arrivals(log, idx, now + s_to_us(horizon_d * 86_400))
        return got if kind == "actual" else [(t, j) for t, j in got if j.min_runtime_s > 0]
    if kind in ("mean", "mean daily"):
        return mean_day_arrivals(hist, now)
    if kind == "week":
        return week_before_arrivals(hist, now)
    if kind == "recent":
        return recent_arrivals(hist, now, RECENT_S, RECENT_S)
    if kind == "hour":
        return recent_arrivals(hist, now, 3600.0, 3600.0)
    if kind in ("burst", "all bursts"):
        who = {log[idx].user} if kind == "burst" else None  # type: ignore[attr-defined]
        return burst_arrivals(hist, now, who, burst_gap_s, again_s=burst_again_s)
    if kind == "whole week":
        return week_before_arrivals(hist, now, span_s=ARRIVAL_PERIOD_S)
    got = recent_arrivals(hist, now)
    if kind == "ahead":
        snap = state.cycle_snapshot(now)
        job: JobQueued = log[idx]  # type: ignore[assignment]
        return arrivals_ahead(
            got, job.budget, job.allocated, budget_order(snap.tree, snap.occupancy, snap.capacity_gpu_s)
        )
    return got


def median_of_days(
    state: DispatchState,
    now: Micros,
    dcfg: DispatchConfig,
    job_id: str,
    history: dict[str, tuple[float, ...]],
    hist: Sequence[Event],
    args: Any,
) -> tuple[Micros | None, tuple[Micros | None, Micros | None]]:
    """``forecast + arrivals, median of days``: a forward run per day replayed (:data:`REPLAY_DAYS`), the median
    start (a run that does not start the job counts as later than any), and the least and greatest start."""
    day = 86_400.0
    first = to_us(hist[0].ts) if hist else now
    starts: list[Micros | None] = []
    for k in range(1, REPLAY_DAYS + 1):
        if now - s_to_us(k * day) < first:
            break
        arr = recent_arrivals(hist, now, day, k * day)
        fc = forecast(state, now, dcfg, job_ids=[job_id], history=history, horizon_s=args.horizon_d * day, arrivals=arr)
        starts.append(fc.jobs[0].forward_start_us)
    if not starts:
        return None, (None, None)
    order = sorted(starts, key=lambda t: (t is None, t or 0))
    return order[(len(order) - 1) // 2], (order[0], order[-1])


#: The rows by actual wait (hours, lower bound exclusive, upper inclusive) printed below the table.
WAIT_BUCKETS: tuple[tuple[float, float], ...] = ((0.0, 1.0), (1.0, 6.0), (6.0, 24.0), (24.0, 1e9))


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def summary(samples: list[Sample], name: str) -> str:
    """One row of figures for estimate ``name`` (module docstring)."""
    got = [(s, s.estimates[name]) for s in samples]
    est = [(s, e) for s, e in got if e is not None]
    err = [us_to_s(e - s.actual) / 3600 for s, e in est]
    absd = [abs(x) for x in err]
    wait = [us_to_s(s.actual - s.submitted) / 3600 for s, _ in est]
    h1 = sum(1 for x in absd if x <= 1.0)
    q25 = sum(1 for x, w in zip(absd, wait, strict=True) if x <= 0.25 * w)
    long = [(x, w) for x, w in zip(absd, wait, strict=True) if w > 1.0]
    l25 = sum(1 for x, w in long if x <= 0.25 * w)
    l1 = sum(1 for x, _ in long if x <= 1.0)
    n = len(est) or 1
    return (
        f"{name:<24} {len(est):>4}/{len(samples):<4} {_quantile(absd, 0.5):>7.2f} {_quantile(absd, 0.9):>7.2f} "
        f"{sum(err) / n:>+7.2f} {h1 / n:>6.0%} {q25 / n:>6.0%}   {len(long):>4} {l1 / (len(long) or 1):>6.0%} "
        f"{l25 / (len(long) or 1):>6.0%}"
    )


def misses(samples: list[Sample], name: str) -> str:
    """What the misses of ``name`` have in common: of the jobs that waited more than 1 h and whose estimate is off
    by more than 25% of the wait (or missing), how many were estimated too early, too late, or not at all."""
    early = late = none = unalloc = overtaken = 0
    for s in samples:
        wait = s.actual - s.submitted
        if wait <= s_to_us(3600):
            continue
        e = s.estimates[name]
        if e is not None and abs(e - s.actual) <= 0.25 * wait:
            continue
        none += e is None
        early, late = early + (e is not None and e < s.actual), late + (e is not None and e > s.actual)
        unalloc += not s.allocated
        overtaken += s.overtaken > 0
    return (
        f"misses of {name:<24} (waited > 1 h, off by > 25%): {early} too early, {late} too late, {none} no estimate;"
        f" {unalloc} unallocated, {overtaken} overtaken by later submissions"
    )


def long_table(
    samples: list[Sample],
    names: Sequence[str],
    log: Sequence[Event],
    queued_at: dict[str, int],
    first_start: dict[str, Micros],
) -> str:
    """A row per sampled job that waited more than 1 h: its budget, allocated or not, the actual wait and each
    estimate's wait (hours; ``-`` none), and the budgets whose later submissions started before it (the jobs
    that overtook it, ``a`` allocated / ``u`` unallocated, most first)."""
    head = ["job", "budget", "a/u", "actual"] + [n.replace("forecast", "fc") for n in names] + ["overtaken by"]
    rows = [head]
    for s in sorted(samples, key=lambda s: s.actual - s.submitted):
        wait = s.actual - s.submitted
        if wait <= s_to_us(3600):
            continue
        q: JobQueued = log[queued_at[s.job_id]]  # type: ignore[assignment]
        by: dict[str, int] = {}
        for j, i in queued_at.items():
            if i > queued_at[s.job_id] and first_start.get(j, s.actual) < s.actual:
                e: JobQueued = log[i]  # type: ignore[assignment]
                k = f"{e.budget} {'a' if e.min_runtime_s > 0 else 'u'}"
                by[k] = by.get(k, 0) + 1
        over = ", ".join(f"{k} {n}" for k, n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))[:3])
        ests = [
            "-" if s.estimates.get(n) is None else f"{us_to_s(s.estimates[n] - s.submitted) / 3600:.2f}"  # type: ignore[operator]
            for n in names
        ]
        rows.append([s.job_id, q.budget, "a" if s.allocated else "u", f"{us_to_s(wait) / 3600:.2f}", *ests, over])
    widths = [max(len(r[c]) for r in rows) for c in range(len(head) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


def overtakers(
    chosen: Sequence[tuple[int, str]],
    log: Sequence[Event],
    queued_at: dict[str, int],
    first_start: dict[str, Micros],
    gap_s: float,
) -> str:
    """``--overtakers``: a row per chosen job that waited more than 1 h: the later submissions that started before it,
    by whose they are (its own user, allocated / unallocated; its budget's other users; other budgets, allocated /
    unallocated), how many of its own user's are of its burst (submitted after it with no gap over ``gap_s`` among
    the user's submissions from it on), and the median minutes after it that its own user's came."""
    by_user: dict[str, list[Micros]] = {}
    for _j, i in sorted((j, i) for j, i in queued_at.items()):
        e: JobQueued = log[i]  # type: ignore[assignment]
        by_user.setdefault(e.user, []).append(to_us(e.ts))
    for ts in by_user.values():
        ts.sort()
    gap = s_to_us(gap_s)
    head = [
        "job",
        "budget",
        "a/u",
        "wait h",
        "over",
        "own a",
        "own u",
        "burst",
        "budget",
        "other a",
        "other u",
        "own +min",
    ]
    rows = [head]
    tot = [0] * 7
    for idx, job_id in chosen:
        q: JobQueued = log[idx]  # type: ignore[assignment]
        t0, actual = to_us(q.ts), first_start[job_id]
        if actual - t0 <= s_to_us(3600):
            continue
        ts = by_user[q.user]
        end = ts.index(t0)
        while end + 1 < len(ts) and ts[end + 1] - ts[end] <= gap:
            end += 1
        burst_end = ts[end]
        c = [0] * 7  # over, own a, own u, own in burst, budget, other a, other u
        after: list[float] = []
        for j, i in queued_at.items():
            if i > idx and first_start.get(j, actual) < actual:
                e: JobQueued = log[i]  # type: ignore[no-redef]
                c[0] += 1
                if e.user == q.user:
                    c[1 if e.allocated else 2] += 1
                    c[3] += to_us(e.ts) <= burst_end
                    after.append(us_to_s(to_us(e.ts) - t0) / 60)
                elif e.budget == q.budget:
                    c[4] += 1
                else:
                    c[5 if e.allocated else 6] += 1
        tot = [a + b for a, b in zip(tot, c, strict=True)]
        own = f"{_quantile(after, 0.5):.0f}" if after else "-"
        wait = f"{us_to_s(actual - t0) / 3600:.2f}"
        rows.append([job_id, q.budget, "a" if q.allocated else "u", wait, *map(str, c), own])
    rows.append(["all", "", "", "", *map(str, tot), ""])
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(w) if k > 2 else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    )


#: ``--calibrate``: the factors tried on the forward run's wait of unallocated jobs, and the blend weights tried
#: between two estimates (0: the first, 1: the second, above 1: beyond it).
FACTORS: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
WEIGHTS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


def long_rows(path: str) -> list[dict[str, Any]]:
    """The samples of a ``--dump`` file that waited more than 1 h."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["actual"] - r["submitted"] > s_to_us(3600)]


def adjusted(r: dict[str, Any], base: str, other: str | None, how: float) -> Micros | None:
    """A sample's start by ``--calibrate``'s rule: with ``other``, ``base`` + ``how`` x (``other`` - ``base``) (none
    when either is none); else the submission plus ``how`` times ``base``'s wait for an unallocated job, ``base``'s
    start for an allocated one."""
    b = r["estimates"].get(base)
    if b is None:
        return None
    if other is not None:
        o = r["estimates"].get(other)
        return None if o is None else round(b + how * (o - b))
    return b if r["allocated"] else round(r["submitted"] + how * (b - r["submitted"]))


def scored(rows: Sequence[dict[str, Any]], base: str, other: str | None, how: float) -> tuple[int, float]:
    """Of ``rows`` (waits over 1 h): how many ``adjusted`` puts within 25% of the wait (none: a miss), and the
    median absolute error in hours over those it gives a start (NaN: none)."""
    hits, errs = 0, []
    for r in rows:
        e = adjusted(r, base, other, how)
        if e is None:
            continue
        errs.append(abs(e - r["actual"]) / 3.6e9)
        hits += abs(e - r["actual"]) <= 0.25 * (r["actual"] - r["submitted"])
    return hits, _quantile(errs, 0.5)


def calibrate(fit: str, score: Sequence[str], base: str, other: str | None) -> None:
    """``--calibrate``: the factor on ``base``'s unallocated waits (or, with ``other``, the blend weight) that puts the
    most waits over 1 h of ``fit`` within 25% (ties: the nearest to no change), then each file scored with it and
    with no change; fitted on one week, reported on the others."""
    grid = WEIGHTS if other is not None else FACTORS
    plain = 0.0 if other is not None else 1.0
    fit_rows = long_rows(fit)
    how = max(grid, key=lambda h: (scored(fit_rows, base, other, h)[0], -abs(h - plain)))
    rule = f"{base} + {how:g} x ({other} - {base})" if other else f"{base}, unallocated waits x {how:g}"
    print(f"fitted on {fit}: {rule}")
    print(f"{'file':<40} {'long':>5} {'<=25% plain':>12} {'med |e|':>8} {'<=25% fitted':>13} {'med |e|':>8}")
    for path in [fit, *score]:
        rows = long_rows(path)
        (h0, m0), (h1, m1) = scored(rows, base, other, plain), scored(rows, base, other, how)
        print(f"{path[-40:]:<40} {len(rows):>5} {h0:>12} {m0:>8.2f} {h1:>13} {m1:>8.2f}")


def _parser() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--budgets", default=BUDGETS)
    ap.add_argument(
        "--slice",
        default="2017-11-02..2017-11-03",
        help="forecasts for the submissions in this slice (week 44's Thursday)",
    )
    ap.add_argument("--warmup-d", type=float, default=2.0, help="days of submissions simulated before the slice")
    ap.add_argument("--after-d", type=float, default=1.0, help="days of submissions simulated after the slice")
    ap.add_argument("--sample", type=int, default=200, help="forecasts, evenly spread over the submissions")
    ap.add_argument(
        "--every", type=int, default=0, metavar="K", help="instead of --sample: every K-th submission of the slice"
    )
    ap.add_argument(
        "--estimates",
        default=";".join(ESTIMATES),
        help=f"which estimates to make, separated by ';' (default all: {'; '.join(ESTIMATES)})",
    )
    ap.add_argument(
        "--dump",
        metavar="FILE",
        help="write each sample as a JSON line to FILE as it is made (--timing: each forecast, whole)",
    )
    ap.add_argument(
        "--long-only",
        action="store_true",
        help="of the sampled jobs, forecast only those that waited more than 1 h in the simulation",
    )
    ap.add_argument(
        "--skip", type=int, default=0, metavar="N", help="leave out the first N sampled jobs (a second run's share)"
    )
    ap.add_argument("--limit", type=int, default=0, metavar="N", help="forecast at most N of the sampled jobs")
    ap.add_argument(
        "--table", action="store_true", help="print a row per job that waited more than 1 h: each estimate's wait"
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--horizon-d", type=float, default=HORIZON_S / 86_400, help="how far each forecast looks, days")
    ap.add_argument(
        "--while-waiting", type=int, default=0, metavar="N", help="also forecast every hour while a job waits, N times"
    )
    ap.add_argument(
        "--while-waiting-estimate",
        default="forecast",
        choices=[n for n, (_, kind) in RUNS.items() if kind != "ahead"],
        metavar="NAME",
        help="--while-waiting: the estimate made (a forward run; default forecast, no arrivals)",
    )
    ap.add_argument(
        "--timing",
        action="store_true",
        help="only time forecast JOB and queue --start on bench_engine's 10,000-GPU snapshot (targets 2 s, 10 s)",
    )
    ap.add_argument(
        "--min-gap",
        type=float,
        default=MIN_GAP_S,
        metavar="S",
        help=f"the forward run's least gap between cycles, seconds (default {MIN_GAP_S:g}; run ends within S of the "
        "last cycle share one cycle)",
    )
    ap.add_argument(
        "--spacing",
        type=float,
        default=SPACING,
        metavar="F",
        help=f"the forward run's cycles spaced by F x how far ahead they look (default {SPACING:g}; 0: at every run end)",
    )
    ap.add_argument(
        "--skip-middle", action="store_true", help="--timing: leave out the forecast of the middle of the queue"
    )
    ap.add_argument("--skip-queue", action="store_true", help="--timing: leave out queue --start")
    ap.add_argument(
        "--burst-gap-m",
        type=float,
        default=BURST_GAP_S / 60,
        metavar="M",
        help=f"forecast + bursts: submissions of a user at most M minutes apart are one burst (default {BURST_GAP_S / 60:g})",
    )
    ap.add_argument(
        "--burst-again-h",
        type=float,
        default=0.0,
        metavar="H",
        help="forecast + bursts: a burst with too few longer ended ones goes on as long again as it has lasted, at "
        "most H hours (default 0: not at all)",
    )
    ap.add_argument(
        "--overtakers",
        action="store_true",
        help="only print, for each chosen job that waited more than 1 h, whose later submissions started before it",
    )
    ap.add_argument(
        "--calibrate",
        nargs="+",
        metavar="DUMP",
        help="only fit a correction on the first --dump file's waits over 1 h and score it on each file: a factor on "
        "the unallocated waits of --calibrate-estimate, or with --calibrate-blend NAME a point between the two",
    )
    ap.add_argument(
        "--calibrate-estimate", default="forecast", metavar="NAME", help="--calibrate: the estimate corrected"
    )
    ap.add_argument(
        "--calibrate-blend", metavar="NAME", help="--calibrate: blend --calibrate-estimate with this estimate instead"
    )
    return ap


def main() -> None:
    args = _parser().parse_args()
    if args.calibrate:
        calibrate(args.calibrate[0], args.calibrate[1:], args.calibrate_estimate, args.calibrate_blend)
        return
    if args.timing:
        timings(
            args.seed, args.min_gap, not args.skip_middle, not args.skip_queue, args.spacing, args.horizon_d, args.dump
        )
        return

    wanted = [e.strip() for e in args.estimates.split(";") if e.strip()]
    unknown = sorted(set(wanted) - set(ESTIMATES))
    if unknown or not wanted:
        raise SystemExit(f"--estimates: unknown {unknown}; choose from {'; '.join(ESTIMATES)}")
    bf = load_budget_file(args.budgets)
    itp = trace_format(args.trace) == "itp"  # its slices count trace days from t = 0 (ITP_T0), not dates
    lo, hi = (parse_itp_slice if itp else parse_slice)(args.slice)
    if lo is None or hi is None:
        raise SystemExit("--slice: a bounded slice (week44+1d, YYYY-MM-DD..YYYY-MM-DD; ITP: week5, days35-38)")
    first, last = lo - s_to_us(args.warmup_d * 86_400), hi + s_to_us(args.after_d * 86_400)
    day = 86_400_000_000
    if itp:
        span = f"days{max(0, (first - ITP_T0) // day)}-{-(-(last - ITP_T0) // day)}"
    else:
        span = f"{from_us(first // day * day):%Y-%m-%d}..{from_us(-(-last // day) * day):%Y-%m-%d}"
    jobs = [j for j in load_trace(args.trace, bf, args.seed, span) if first <= j.submit_us < last]
    dcfg = DispatchConfig(engine=EngineConfig(window_s=bf.window_s), heartbeat_timeout_s=None)
    cfg = SimConfig(seed=args.seed, dispatch=dcfg, until_us=default_horizon_us(jobs, bf.nodes))
    t0 = time.perf_counter()
    res = Simulator(bf.tree, bf.nodes, jobs, cfg, window_s=bf.window_s).run()
    t_sim = time.perf_counter() - t0
    log: list[Event] = res.log
    first_start: dict[str, Micros] = {}
    queued_at: dict[str, int] = {}  # job -> index of its first JobQueued in the log
    for i, e in enumerate(log):
        if type(e) is JobStarted:
            first_start.setdefault(e.job_id, to_us(e.ts))
        elif type(e) is JobQueued and e.attempt == 1:
            queued_at.setdefault(e.job_id, i)
    candidates = sorted((i, j) for j, i in queued_at.items() if j in first_start and lo <= to_us(log[i].ts) < hi)
    if args.every > 0:
        chosen = candidates[:: args.every]
    else:
        n = min(args.sample, len(candidates))
        chosen = [candidates[i * len(candidates) // n] for i in range(n)]  # evenly spread over the slice
    if args.long_only:
        sampled = len(chosen)
        chosen = [(i, j) for i, j in chosen if first_start[j] - to_us(log[i].ts) > s_to_us(3600)]
        print(f"--long-only: {len(chosen)} of the {sampled} sampled jobs waited more than 1 h")
    chosen = chosen[args.skip : args.skip + args.limit if args.limit > 0 else None]
    if args.overtakers:
        print(overtakers(chosen, log, queued_at, first_start, args.burst_gap_m * 60))
        return
    print(
        f"trace {args.trace}: {len(jobs)} jobs submitted {from_us(first):%Y-%m-%d %H:%M} .. {from_us(last):%Y-%m-%d %H:%M}"
        f" simulated ({len(log):,} events, {t_sim:.1f} s, seed {args.seed}); {len(chosen)} forecasts at submission "
        f"in slice {args.slice} (of {len(candidates)} jobs queued there, "
        f"{f'every {args.every}th' if args.every > 0 else 'evenly spread'})"
    )
    dump = open(args.dump, "w", encoding="utf-8") if args.dump else None

    state = DispatchState(bf.tree, bf.window_s)
    done = 0
    samples: list[Sample] = []
    times = dict.fromkeys(wanted, 0.0)
    hist_events: list[Event] = []
    ranges: dict[str, tuple[Micros | None, Micros | None]] = {}
    t0 = time.perf_counter()
    for idx, job_id in chosen:
        while done <= idx:
            evolve(state, log[done])
            hist_events.append(log[done])
            done += 1
        now = to_us(log[idx].ts)
        est: dict[str, Micros | None] = {}
        history = user_history(hist_events)
        basis = ""
        for name, (declared, arriving) in RUNS.items():
            waiting = name == "forecast" and "forecast + recent waits" in times
            if name not in times and not waiting:
                continue
            t1 = time.perf_counter()
            fc = forecast(
                state,
                now,
                dcfg,
                job_ids=[job_id],
                history=history,
                horizon_s=args.horizon_d * 86_400,
                declared_durations=declared,
                arrivals=arrivals_of(
                    arriving,
                    log,
                    idx,
                    hist_events,
                    state,
                    now,
                    args.horizon_d,
                    args.burst_gap_m * 60,
                    args.burst_again_h * 3600,
                ),
                arrival_period_s=PERIODS.get(arriving, 0.0),
                waits=recent_waits(hist_events, now) if waiting else None,
                spacing=0.0 if name == "forecast, unspaced" else args.spacing,
                min_gap_s=args.min_gap,
            )
            times[name if name in times else "forecast + recent waits"] += time.perf_counter() - t1
            est[name] = fc.jobs[0].forward_start_us  # the forward run's start
            if waiting:
                est["forecast + recent waits"] = fc.jobs[0].start_us
            basis = basis or fc.jobs[0].forward_basis
        name = "forecast + arrivals, median of days"
        if name in times:
            t1 = time.perf_counter()
            est[name], ranges[job_id] = median_of_days(state, now, dcfg, job_id, history, hist_events, args)
            times[name] += time.perf_counter() - t1
        if "slurm-style" in times:
            t1 = time.perf_counter()
            est["slurm-style"] = slurm_estimate(state, now, job_id)
            times["slurm-style"] += time.perf_counter() - t1
        actual = first_start[job_id]
        overtaken = sum(1 for j, i in queued_at.items() if i > idx and first_start.get(j, actual) < actual)
        allocated = log[idx].min_runtime_s > 0  # type: ignore[attr-defined]
        samples.append(Sample(job_id, now, actual, est, basis, overtaken, allocated, ranges.get(job_id)))
        if dump is not None:
            dump.write(json.dumps(samples[-1].row()) + "\n")
            dump.flush()
        if len(samples) % 20 == 0:
            print(f"  {len(samples)}/{len(chosen)} forecasts, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if dump is not None:
        dump.close()
    wall = time.perf_counter() - t0
    waits = sorted(us_to_s(s.actual - s.submitted) / 3600 for s in samples)
    print(
        f"actual waits of the sampled jobs (h): median {_quantile(waits, 0.5):.2f}, p90 {_quantile(waits, 0.9):.2f}, "
        f"max {waits[-1] if waits else 0:.2f}; {sum(1 for w in waits if w > 1)} waited more than 1 h"
    )
    print(f"replay and forecasts: {wall:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()) + ")")
    print()
    print(
        f"{'estimate':<24} {'with est':>9} {'med |e|':>7} {'p90 |e|':>7} {'bias':>7} {'<=1h':>6} {'<=25%':>6}   "
        f"{'>1h':>4} {'<=1h':>6} {'<=25%':>6}"
    )
    for name in times:
        print(summary(samples, name))
    for label, alloc in (("allocated", True), ("unallocated", False)):
        part = [s for s in samples if s.allocated == alloc]
        print(f"{label} jobs only ({len(part)}):")
        for name in times:
            print(summary(part, name))
    for lo_h, hi_h in WAIT_BUCKETS:
        part = [s for s in samples if lo_h * 3600 < us_to_s(s.actual - s.submitted) <= hi_h * 3600]
        span = f"{lo_h:g}-{hi_h:g} h" if hi_h < 1e9 else f"more than {lo_h:g} h"
        print(f"jobs that waited {span} ({len(part)}):")
        for name in times:
            print(summary(part, name))
    print("errors in hours; '>1h': the jobs that waited more than 1 h, and their shares")
    for name in times:
        print(misses(samples, name))
    if args.table:
        print()
        print(long_table(samples, list(times), log, queued_at, first_start))
    if args.while_waiting:
        converge(log, bf, dcfg, samples, args)


def scale_state(seed: int) -> tuple[DispatchState, Micros]:
    """``bench_engine``'s steady snapshot (10,000 GPUs ~97% busy, 20,000 pending over 200 leaves) as a dispatcher
    state folded from events: each node registered, each run queued, placed and started (running 1 to 8 h in all
    from its start), each pending job queued; the time of the question is the snapshot's."""
    import random

    from bench_engine import NOW, build  # bench/ is on the path when this file runs as a script

    from apportion.events import JobPlaced, NodeRegistered

    snap = build(seed, "steady")
    rng = random.Random(seed)
    state = DispatchState(snap.tree, 7 * 86_400.0)
    t0 = from_us(NOW - s_to_us(86_400))
    for nid in sorted(snap.cluster.nodes):
        evolve(state, NodeRegistered(node_id=nid, gpu_count=snap.cluster.nodes[nid].gpu_count, ts=t0))
    for key, run in sorted(snap.cluster.runs.items()):
        at = from_us(run.started_at_us if run.started_at_us is not None else NOW)
        g, k = run.gpus_per_replica, run.replicas
        common: dict[str, Any] = {"job_id": key[0], "budget": run.budget, "allocated": run.allocated}
        common |= {"gpus_per_replica": g}
        common |= {"replicas": k, "min_runtime_s": us_to_s(run.min_runtime_us), "submitted_at": at, "ts": at}
        evolve(state, JobQueued(**common, user="u", duration_s=rng.uniform(3600, 8 * 3600)))
        evolve(state, JobPlaced(**common, attempt=1, placements=run.placements, decision=_DECISION))
        for r, p in enumerate(run.placements):
            evolve(state, JobStarted(job_id=key[0], attempt=1, replica=r, node_id=p.node_id, ts=at))
    for leaf in sorted(snap.pending):
        for j in snap.pending[leaf]:
            at = from_us(j.submitted_at_us)
            evolve(
                state,
                JobQueued(
                    job_id=j.job_id,
                    budget=leaf,
                    user=j.user,
                    allocated=j.min_runtime_s > 0,
                    gpus_per_replica=j.gpus_per_replica,
                    replicas=j.replicas,
                    min_runtime_s=j.min_runtime_s,
                    duration_s=j.duration_s,
                    submitted_at=at,
                    ts=at,
                ),
            )
    return state, NOW


def timings(
    seed: int,
    min_gap_s: float = MIN_GAP_S,
    middle: bool = True,
    whole: bool = True,
    spacing: float = SPACING,
    horizon_d: float = HORIZON_S / 86_400,
    dump: str | None = None,
) -> None:
    """``--timing``: wall time of ``forecast JOB`` (the job at the head of the fair-share order, and the median
    job of the queue unless ``middle`` is false) and of ``queue --start`` (every pending job, unless ``whole`` is
    false) on :func:`scale_state`, the forward run debounced by ``min_gap_s``; targets 2 s and 10 s. ``dump``: a
    file that gets each forecast whole, a JSON line each (``{"label": ..., "forecast": Forecast.to_dict()}``)."""
    from apportion.forecast import forecast as run_forecast
    from apportion.heap import settle_heap

    t0 = time.perf_counter()
    state, now = scale_state(seed)
    built = time.perf_counter() - t0
    settle_heap()  # as the forecast commands do once the log is folded (apportion.cli.jobs._forecast_input)
    dcfg = DispatchConfig(heartbeat_timeout_s=None)
    snap = state.cycle_snapshot(now)
    rank = {leaf: i for i, leaf in enumerate(budget_order(snap.tree, snap.occupancy, snap.capacity_gpu_s))}
    queue = sorted(
        (j for jobs in state.pending.values() for j in jobs),
        key=lambda j: (rank.get(j.budget, len(rank)), j.min_runtime_s == 0, j.submitted_at_us, j.job_id),
    )
    gpus = sum(n.gpu_count for n in state.cluster.nodes.values())
    print(
        f"scale: {gpus:,} GPUs, {len(state.cluster.runs):,} runs, {len(queue):,} pending "
        f"(state folded from events in {built:.1f} s)"
    )
    asked = [("head of the queue", queue[0])] + ([("middle of the queue", queue[len(queue) // 2])] if middle else [])
    print(
        f"  debounce: {min_gap_s:g} s, spacing {spacing:g}, horizon {horizon_d:g} d; "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    kw: dict[str, Any] = {"min_gap_s": min_gap_s, "spacing": spacing, "horizon_s": horizon_d * 86_400}
    out = open(dump, "w", encoding="utf-8") if dump else None  # (closed below, after every forecast)

    def dumped(label: str, fc: Any) -> None:
        if out is not None:
            out.write(json.dumps({"label": label, "forecast": fc.to_dict()}, sort_keys=True, default=str) + "\n")

    for label, job in asked:
        t1, c1 = time.perf_counter(), time.process_time()
        fc = run_forecast(state, now, dcfg, job_ids=[job.job_id], **kw)
        took, cpu = time.perf_counter() - t1, time.process_time() - c1
        dumped(label, fc)
        j = fc.jobs[0]
        wait = "no start" if j.wait_s is None else f"starts in {j.wait_s / 3600:.2f} h"
        verdict = "met" if took < 2.0 else "MISSED"
        print(
            f"  forecast {job.job_id} ({label}): {took:.2f} s ({cpu:.2f} s CPU), {fc.cycles} cycles, {wait} (target < 2 s: {verdict})",
            flush=True,
        )
    if whole:
        t1, c1 = time.perf_counter(), time.process_time()
        fc = run_forecast(state, now, dcfg, chains_out=False, **kw)  # as queue --start runs it: no chains shown
        took, cpu = time.perf_counter() - t1, time.process_time() - c1
        dumped("queue --start", fc)
        _queue_line(fc, took, cpu)
    if out is not None:
        out.close()


def _queue_line(fc: Any, took: float, cpu: float) -> None:
    """The line of ``queue --start``'s timing: ``took`` s wall, ``cpu`` s CPU."""
    started = sum(1 for j in fc.jobs if j.start_us is not None)
    print(
        f"  queue --start ({len(fc.jobs):,} jobs): {took:.2f} s ({cpu:.2f} s CPU), {fc.cycles} cycles, {started:,} with a start "
        f"(target < 10 s: {'met' if took < 10.0 else 'MISSED'})"
    )


#: ``--while-waiting`` buckets: hours before the job's start (lower bound, label)
BUCKETS: tuple[tuple[float, str], ...] = ((24.0, ">= 24 h"), (6.0, "6-24 h"), (1.0, "1-6 h"), (0.0, "< 1 h"))


def converge(log: list[Event], bf: Any, dcfg: DispatchConfig, samples: list[Sample], args: Any) -> None:
    """The forecast again every hour while each sampled job waits (at most ``--while-waiting`` times a job),
    from the log up to that time, made as the estimate ``--while-waiting-estimate`` (a forward run, :data:`RUNS`);
    median absolute error by how long before its start it was made."""
    declared, arriving = RUNS[args.while_waiting_estimate]
    points = sorted(
        (s.submitted + s_to_us(3600 * k), s.job_id, s.actual)
        for s in samples
        for k in range(1, args.while_waiting + 1)
        if s.submitted + s_to_us(3600 * k) < s.actual
    )
    state = DispatchState(bf.tree, bf.window_s)
    done = 0
    errs: dict[str, list[float]] = {label: [] for _, label in BUCKETS}
    after = 0
    t0 = time.perf_counter()
    for at, job_id, actual in points:
        while done < len(log) and to_us(log[done].ts) <= at:
            evolve(state, log[done])
            done += 1
        if job_id not in {j.job_id for jobs in state.pending.values() for j in jobs}:
            continue  # placed, waiting for its victims' stop: started in all but the report
        hist = log[:done]
        start = (
            forecast(
                state,
                at,
                dcfg,
                job_ids=[job_id],
                history=user_history(hist),
                horizon_s=args.horizon_d * 86_400,
                declared_durations=declared,
                arrivals=arrivals_of(arriving, log, done - 1, hist, state, at, args.horizon_d),
                arrival_period_s=PERIODS.get(arriving, 0.0),
            )
            .jobs[0]
            .forward_start_us
        )
        if start is None:
            after += 1
            continue
        ahead = us_to_s(actual - at) / 3600
        label = next(lb for lo, lb in BUCKETS if ahead >= lo)
        errs[label].append(abs(us_to_s(start - actual)) / 3600)
    print(
        f"\n{args.while_waiting_estimate} while waiting: {len(points)} forecasts, every hour up to "
        f"{args.while_waiting} h after submission ({time.perf_counter() - t0:.1f} s; {after} with no start within the "
        "horizon, left out); median |e| (h) by time before the start:"
    )
    for _, label in BUCKETS:
        xs = errs[label]
        print(
            f"  {label:>8}: {len(xs):>5} forecasts, median |e| {_quantile(xs, 0.5):6.2f}, p90 {_quantile(xs, 0.9):6.2f}"
        )


if __name__ == "__main__":
    main()
