"""Replayed arrivals (``D12.job-forecast``, ``forecast --with-arrivals``): once by default, and at the exact resolution.

Hand-built states (:class:`tests.kit.forecast_history.History`: tree ``lab`` with ``a`` and ``b`` at 0.5 each);
every expected time is worked out in the case's comment.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.forecast import burst_arrivals, forecast, recent_arrivals, week_before_arrivals
from apportion.timeutil import from_us, to_us
from tests.kit.builders import T0, d, h, m
from tests.kit.forecast_history import CFG, History

SEC = 1_000_000  # µs


def _arrival(job_id: str, at: int, hours: float = 1 / 6) -> tuple[int, ev.JobQueued]:
    """A 1-GPU job of lab/b, ``hours`` of work (10 minutes), submitted at ``at``: the dispatcher's ``JobQueued`` of
    it, as an ``arrivals`` entry."""
    log = History().submit(job_id, at, budget="lab/b", duration_s=hours * 3600.0, tick=False).log
    return at, next(e for e in log if isinstance(e, ev.JobQueued))


def test_a_forward_run_with_arrivals_is_exact() -> None:
    # one 2-GPU node; r1 (1 h of work) and r2 (1 h 1 min) run from T0; p1 and p2 (1 GPU each, lab/a) wait; now
    # T0 + 20 min, no periodic cycle. Spaced 5%, the cycle at r1's end (T0 + 1 h, 40 min after now) leaves a gap of
    # 5% of 2,400 s = 120 s, so p2, waiting for r2's end at T0 + 1 h 1 min, starts at T0 + 1 h 2 min; with a least
    # gap of 300 s on top, at T0 + 1 h 5 min. With an arrival (x1 at T0 + 5 h, after both have started, so it
    # moves no decision) the run is exact whatever is asked: p2 starts at r2's end, T0 + 1 h 1 min, and the
    # forecast says its spacing and least gap are 0.
    hist = History().node("n0", 2).submit("r1", T0, duration_s=3600.0).submit("r2", T0, duration_s=3660.0)
    hist.submit("p1", m(10)).submit("p2", m(11))
    for spacing, gap, p2 in ((0.05, 0.0, h(1) + 120 * SEC), (0.05, 300.0, h(1) + 300 * SEC)):
        fc = forecast(hist.state, m(20), CFG, cycle_s=None, spacing=spacing, min_gap_s=gap)
        assert ({j.job_id: j.start_us for j in fc.jobs}, fc.spacing, fc.min_gap_s) == (
            {"p1": h(1), "p2": p2},
            spacing,
            gap,
        )
        fc = forecast(
            hist.state, m(20), CFG, cycle_s=None, spacing=spacing, min_gap_s=gap, arrivals=[_arrival("x1", h(5))]
        )
        assert {j.job_id: j.start_us for j in fc.jobs} == {"p1": h(1), "p2": h(1) + 60 * SEC}
        assert (fc.spacing, fc.min_gap_s, fc.to_dict()["spacing"], fc.to_dict()["min_gap_s"]) == (0.0, 0.0, 0.0, 0.0)


def test_the_last_days_arrivals_come_again_once_unless_a_period_is_given() -> None:
    # one 2-GPU node; r1 (lab/a, 1 GPU, 30 h of work) runs from T0; p1 (lab/a, 2 GPUs) waits from T0 + 10 min
    # for r1's end (it cannot preempt its own budget). A copy of x (lab/b, 1 GPU, 6 h of work) arrives at
    # T0 + 1 h and runs on the free GPU until T0 + 7 h. Once (the default), nothing holds the GPU at T0 + 30 h:
    # p1 starts then. Replayed every day, the second copy arrives at T0 + 25 h and runs until T0 + 31 h (lab/a,
    # with 30 GPU-hours against lab/b's 11, is not behind it, so p1 does not preempt it): p1 starts at T0 + 31 h.
    hist = History().node("n0", 2).submit("r1", T0, duration_s=30 * 3600.0)
    hist.submit("p1", m(10), gpus=2, duration_s=3600.0)
    x = _arrival("x", h(1), hours=6.0)
    once = forecast(hist.state, m(10), CFG, job_ids=["p1"], arrivals=[x])
    assert (once.jobs[0].start_us, once.runs[("x~1", 1)].end_us, ("x~2", 1) in once.runs) == (h(30), h(7), False)
    daily = forecast(hist.state, m(10), CFG, job_ids=["p1"], arrivals=[x], arrival_period_s=86_400.0)
    assert (daily.jobs[0].start_us, daily.runs[("x~2", 1)].end_us) == (h(31), h(31))


def _queued(job_id: str, at: int, budget: str = "lab/a", attempt: int = 1) -> ev.JobQueued:
    return ev.JobQueued(
        job_id=job_id, budget=budget, user="u", allocated=True, gpus_per_replica=1, replicas=1, min_runtime_s=60.0,
        duration_s=60.0, submitted_at=from_us(at), ts=from_us(at), attempt=attempt,
    )  # fmt: skip


def test_recent_arrivals_shifted_are_the_same_hours_of_an_earlier_day() -> None:
    # shift 2 days, lookback 1 day: the jobs queued from T0 + 1 d 6 h to T0 + 2 d 6 h (b0, b1 and a0 at
    # T0 + 2 d 5 h), 2 days later; the day before (a1 at T0 + 2 d 7 h) is not in it
    log = [_queued("b0", d(1) + h(7) - T0), _queued("b1", d(1) + h(8) - T0)]
    log += [_queued("a0", d(2) + h(5) - T0), _queued("a1", d(2) + h(7) - T0)]
    got = recent_arrivals(log, d(3) + h(6) - T0, 86_400.0, 2 * 86_400.0)
    assert [(t, j.job_id) for t, j in got] == [
        (d(3) + h(7) - T0, "b0"),
        (d(3) + h(8) - T0, "b1"),
        (d(4) + h(5) - T0, "a0"),
    ]


def test_with_the_week_before_an_unallocated_job_waits_for_the_allocated_arrivals_it_brings() -> None:
    # one 1-GPU node. lab/b ran w0 (T0 + 10 h) on the first day and y0 (T0 + 6 d 10 h), y1 (T0 + 6 d 11 h) on the
    # day before now, 1 h each (allocated). Now, T0 + 7 d 9 h: r1 (lab/a, 3 h of work from T0 + 7 d 8 h) runs; p1
    # (lab/a, unallocated, 1 h) waits for it. The log reaches back a week (it begins at T0): the next day is the
    # day from T0 + 9 h a week later, w0 at T0 + 7 d 10 h.
    # - no arrivals: p1 starts at r1's end, T0 + 7 d 11 h;
    # - the week before: w0's copy (allocated, waiting since 10 h) goes first when r1 ends, 11 h to 12 h; p1, which
    #   runs only on idle GPUs, starts at T0 + 7 d 12 h;
    # - the last day replayed: y0's copy 11 h to 12 h, then y1's (queued at 11 h) 12 h to 13 h: p1 at 13 h.
    hist = History().node("n0", 1)
    for job_id, at in (("w0", h(10)), ("y0", d(6) + h(10) - T0), ("y1", d(6) + h(11) - T0)):
        hist.submit(job_id, at, budget="lab/b").complete(job_id, at + h(1) - T0)
    day7 = d(7) - T0
    hist.submit("r1", day7 + h(8), duration_s=3 * 3600.0).submit("p1", day7 + h(9), min_runtime_s=0.0)
    now = day7 + h(9)
    week = week_before_arrivals(hist.log, now)
    assert [(t, j.job_id) for t, j in week] == [(day7 + h(10), "w0")]
    starts = [
        forecast(hist.state, now, CFG, job_ids=["p1"], arrivals=arr).jobs[0].start_us
        for arr in ((), week, recent_arrivals(hist.log, now))
    ]
    assert starts == [day7 + h(11), day7 + h(12), day7 + h(13)]
    # the whole week before (span a week; a longer span is cut to the period): every job queued from T0 + 9 h to
    # now, a week later: w0, y0 (T0 + 13 d 10 h), y1 (T0 + 13 d 11 h) and r1 (T0 + 14 d 8 h); p1, queued at now, not
    whole = [(day7 + h(10), "w0"), (d(13) + h(10) - T0, "y0"), (d(13) + h(11) - T0, "y1"), (d(14) + h(8) - T0, "r1")]
    for span in (7 * 86_400.0, 30 * 86_400.0):
        assert [(t, j.job_id) for t, j in week_before_arrivals(hist.log, now, span_s=span)] == whole
    # a log that begins later than a week before now (here T0 + 1 d): the last day's submissions, a day later
    short = [e for e in hist.log if to_us(e.ts) >= d(1)]
    assert [j.job_id for _, j in week_before_arrivals(short, now)] == ["y0", "y1", "r1"]


def _t(hours: int, minutes: int = 0) -> int:
    """T0 plus hours and minutes."""
    return h(hours) + m(minutes) - T0


def _by(job_id: str, at: int, user: str) -> ev.JobQueued:
    return _queued(job_id, at).model_copy(update={"user": user})


def test_a_burst_in_progress_goes_on_to_the_median_count_of_the_users_longer_bursts() -> None:
    # bursts cut by gaps over 30 min; now T0 + 10 h.
    # alice: ended bursts of 3 (T0, +10, +20 min), 5 (3 h, every 10 min) and 1 (6 h); in progress: 2 (9 h 40 min,
    #   9 h 46 min). Her ended bursts longer than 2: 3 and 5, median 4: 2 more at its own gap, 6 min, from its last
    #   one on (9 h 52 min, 9 h 58 min), copies of its jobs in turn (e1, e2).
    # bob: his last submission 2 h before now: no burst in progress.
    # carol: in progress 1 (9 h 55 min); ended bursts of 3 (gaps 4 and 8 min) and 2 (gap 6 min), both longer:
    #   median 2.5, so 2 in all, 1 more, at the median gap within them, 6 min: 10 h 1 min.
    # dave: in progress 3 (9 h 50, 52, 54 min); his ended burst of 2 is not longer: none.
    log = [_by(j, at, "alice") for j, at in (("a0", T0), ("a1", m(10)), ("a2", m(20)))]
    log += [_by(f"b{i}", _t(3, 10 * i), "alice") for i in range(5)] + [_by("c0", h(6), "alice")]
    log += [_by("old", h(8), "bob"), _by("k0", h(1), "carol"), _by("k1", _t(1, 4), "carol")]
    log += [_by("k2", _t(1, 12), "carol"), _by("k3", h(4), "carol"), _by("k4", _t(4, 6), "carol")]
    log += [_by("x0", h(2), "dave"), _by("x1", _t(2, 5), "dave")]
    log += [_by(j, _t(9, at), "dave") for j, at in (("y0", 50), ("y1", 52), ("y2", 54))]
    log += [_by("e1", _t(9, 40), "alice"), _by("e2", _t(9, 46), "alice"), _by("k5", _t(9, 55), "carol")]
    # erin: in progress 2 (9 h 50, 55 min); one ended burst longer (3: 1 h, 1 h 5, 1 h 10 min), too few to say
    #   (2 by default): none; with one enough, 1 more at 10 h, a copy of r3.
    # fay: in progress 12: f0, f1 at 9 h 20, 9 h 38 min, then f2 .. f11 every 2 min to 9 h 58 min; ended bursts of
    #   14 and 16 (at 2, 3 h: 1 min apart), median 15: 3 more at the mean gap of its last 10 (18 min / 9 = 2 min),
    #   10 h, 10 h 2 min, 10 h 4 min, copies of the last 10 in turn: f2, f3, f4.
    log += [_by(f"r{i}", _t(1, 5 * i), "erin") for i in range(3)]
    log += [_by("r3", _t(9, 50), "erin"), _by("r4", _t(9, 55), "erin")]
    log += [_by(f"g{i}", _t(2, i), "fay") for i in range(14)] + [_by(f"i{i}", _t(3, i), "fay") for i in range(16)]
    log += [_by("f0", _t(9, 20), "fay"), _by("f1", _t(9, 38), "fay")]
    log += [_by(f"f{i}", _t(9, 38 + 2 * (i - 1)), "fay") for i in range(2, 12)]
    now = h(10)
    every = [(_t(9, 52), "e1"), (_t(9, 58), "e2"), (_t(10), "f2"), (_t(10, 1), "k5"), (_t(10, 2), "f3")]
    every.append((_t(10, 4), "f4"))
    assert [(t, j.job_id) for t, j in burst_arrivals(log, now)] == every
    assert [(t, j.job_id) for t, j in burst_arrivals(log, now, {"erin"}, min_longer=1)] == [(_t(10), "r3")]
    # with again_s, a burst with too few longer ones goes on at its rate as long again as it has lasted, at most
    # again_s: dave's (4 min so far, every 2 min) 2 more at 9 h 56, 9 h 58 min (y0, y1); at most 3 min: 1 (y0)
    for again_s, more in ((3600.0, [(_t(9, 56), "y0"), (_t(9, 58), "y1")]), (180.0, [(_t(9, 56), "y0")])):
        assert [(t, j.job_id) for t, j in burst_arrivals(log, now, {"dave"}, again_s=again_s)] == more
    assert [(t, j.job_id) for t, j in burst_arrivals(log, now, {"alice"})] == every[:2]
    # a shorter gap (5 min) cuts alice's bursts of 10-min steps into ones: her burst in progress (e2 alone: 6 min
    # after e1) has no longer burst behind it
    assert burst_arrivals(log, now, {"alice"}, gap_s=300.0) == []


def test_the_rest_of_its_users_burst_goes_before_an_unallocated_job() -> None:
    # one 1-GPU node. alice's earlier bursts: b0, b1, b2 at 1 h, 1 h 10 min, 1 h 20 min and b3, b4, b5 an hour
    # later, 5 minutes each, done.
    # r1 (bob, lab/b) runs from 3 h to 4 h. alice submits a1 (allocated, 10 min) at 3 h 10 min and p1
    # (unallocated, 10 min) at 3 h 20 min, now: her burst in progress has 2 of the 3 of each earlier one, so one
    # more (the median of 3 and 3) comes 10 min after p1, a copy of a1 (allocated). Without it a1 runs at 4 h, p1 at 4 h 10 min; with it
    # a1~1 (allocated, before every unallocated job) runs from 4 h 10 min, and p1 starts at 4 h 20 min.
    hist = History().node("n0", 1)
    for i in range(6):
        at = _t(1 + i // 3, 10 * (i % 3))
        job_id = f"b{i}"
        hist.submit(job_id, at, duration_s=300.0).complete(job_id, at + m(5) - T0)
    hist.submit("r1", h(3), budget="lab/b", user="bob", duration_s=3600.0)
    hist.submit("a1", _t(3, 10), duration_s=600.0)
    hist.submit("p1", _t(3, 20), duration_s=600.0, min_runtime_s=0.0)
    now = _t(3, 20)
    burst = burst_arrivals(hist.log, now)
    assert [(t, j.job_id) for t, j in burst] == [(_t(3, 30), "a1")]
    starts = [forecast(hist.state, now, CFG, job_ids=["p1"], arrivals=a).jobs[0].start_us for a in ((), burst)]
    assert starts == [_t(4, 10), _t(4, 20)]
