"""Replayed arrivals (``D12.job-forecast``, ``forecast --with-arrivals``): once by default, and at the exact resolution.

Hand-built states (:class:`tests.kit.forecast_history.History`: tree ``lab`` with ``a`` and ``b`` at 0.5 each);
every expected time is worked out in the case's comment.
"""

from __future__ import annotations

from apportion import events as ev
from apportion.forecast import forecast, mean_day_arrivals, recent_arrivals
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


def test_the_mean_day_is_every_nth_submission_of_each_of_the_last_n_days_at_the_same_hours() -> None:
    # now is T0 + 3 d 6 h; the log begins at T0 + 5 h, so it covers 3 whole days: n = 3. Each day k days back
    # (from T0 + (3 - k) d 6 h) gives its jobs in time order whose index i has i mod 3 = k - 1, k days later:
    #   k = 1 (a0..a3, T0 + 2 d 7..10 h): i = 0 and 3: a0 and a3 at T0 + 3 d 7 h and 3 d 10 h;
    #   k = 2 (b0, b1, T0 + 1 d 7..8 h): i = 1: b1 at T0 + 3 d 8 h;
    #   k = 3 (c0..c3, T0 + 7..10 h): i = 2: c2 at T0 + 3 d 9 h.
    # "early" (T0 + 5 h) is more than 3 days before now, a0's requeue (attempt 2) is not a submission: neither
    # counts (nor shifts an index). 4 of the 10 submissions: the mean day of the 3.
    log = [_queued("early", h(5))]
    log += [_queued(f"c{i}", h(7 + i)) for i in range(4)]
    log += [_queued(f"b{i}", d(1) + h(7 + i) - T0) for i in range(2)]
    log += [_queued(f"a{i}", d(2) + h(7 + i) - T0) for i in range(4)]
    log.append(_queued("a0", d(2) + h(7.5) - T0, attempt=2))
    now = d(3) + h(6) - T0
    got = mean_day_arrivals(log, now, days=3)
    assert [(t, j.job_id) for t, j in got] == [
        (d(3) + h(7) - T0, "a0"),
        (d(3) + h(8) - T0, "b1"),
        (d(3) + h(9) - T0, "c2"),
        (d(3) + h(10) - T0, "a3"),
    ]
    # a log of one day and a half covers one whole day: n = 1, the last day's submissions a day on, as the
    # replay of the day before (recent_arrivals) gives them
    short = [e for e in log if to_us(e.ts) >= d(1) + h(18) - T0]
    assert [j.job_id for _, j in mean_day_arrivals(short, now, days=3)] == ["a0", "a1", "a2", "a3"]
    assert mean_day_arrivals(short, now, days=3) == recent_arrivals(short, now)


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


def test_with_the_mean_day_an_unallocated_job_waits_for_the_allocated_arrivals_it_brings() -> None:
    # one 1-GPU node. lab/b ran x0 (T0 + 10 h), x1 (T0 + 12 h 30 min) on the first day and y0 (T0 + 1 d 10 h),
    # y1 (T0 + 1 d 11 h) on the second, 1 h each (allocated). Now, T0 + 2 d 9 h: r1 (lab/a, 3 h of work from
    # T0 + 2 d 8 h) runs; p1 (lab/a, unallocated, 1 h) waits for it. The log covers 2 whole days: the mean day
    # is y0 and r1 (the day before: y0, y1, r1, indices 0 and 2) at T0 + 2 d 10 h and T0 + 3 d 8 h, and x1 (the
    # day before that, index 1) at T0 + 2 d 12 h 30 min.
    # - no arrivals: p1 starts at r1's end, T0 + 2 d 11 h;
    # - the mean day: y0's copy (allocated, waiting since 10 h) goes first when r1 ends, 11 h to 12 h; p1, which
    #   runs only on idle GPUs, starts at T0 + 2 d 12 h (x1's copy comes after it has started);
    # - the last day replayed: y0's copy 11 h to 12 h, then y1's (queued at 11 h) 12 h to 13 h: p1 at 13 h.
    hist = History().node("n0", 1)
    for job_id, at in (("x0", h(10)), ("x1", h(12.5)), ("y0", d(1) + h(10) - T0), ("y1", d(1) + h(11) - T0)):
        hist.submit(job_id, at, budget="lab/b").complete(job_id, at + h(1) - T0)
    day2 = d(2) - T0
    hist.submit("r1", day2 + h(8), duration_s=3 * 3600.0).submit("p1", day2 + h(9), min_runtime_s=0.0)
    now = day2 + h(9)
    mean = mean_day_arrivals(hist.log, now)
    assert [(t, j.job_id) for t, j in mean] == [(day2 + h(10), "y0"), (day2 + h(12.5), "x1"), (d(3) + h(8) - T0, "r1")]
    starts = [
        forecast(hist.state, now, CFG, job_ids=["p1"], arrivals=arr).jobs[0].start_us
        for arr in ((), mean, recent_arrivals(hist.log, now))
    ]
    assert starts == [day2 + h(11), day2 + h(12), day2 + h(13)]
