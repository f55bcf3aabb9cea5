"""The forward run's spacing, its horizon, and the recent-waits estimate of unallocated jobs (``D12.job-forecast``).

Hand-built states (:class:`tests.kit.forecast_history.History`: tree ``lab`` with ``a`` and ``b`` at 0.5 each)
and made-up logs; every expected time is worked out in the case's comment.
"""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.forecast import forecast, median_wait, recent_waits, waits_for
from apportion.sim.core import Debounce
from apportion.timeutil import from_us
from tests.kit.builders import T0, cancelled, d, h, m, s, started
from tests.kit.forecast_history import CFG, History

SEC = 1_000_000  # µs

# --------------------------------------------------------------------------- the debounce and its spacing


@pytest.mark.parametrize(
    ("debounce", "last", "wanted", "expected"),
    [
        pytest.param(Debounce(), s(1000), s(1000), (True, None), id="no gap: every cycle when wanted"),
        pytest.param(Debounce(300 * SEC), s(1000), s(1299), (False, s(1300)), id="min gap: 1 s before its end waits"),
        pytest.param(Debounce(300 * SEC), s(1000), s(1300), (True, None), id="min gap: at its end runs"),
        # spacing 5% from origin T0: after a cycle at 1,000 s the gap is 50 s
        pytest.param(Debounce(0, 0.05, T0), s(1000), s(1049), (False, s(1050)), id="spacing: inside 5% of 1,000 s"),
        pytest.param(Debounce(0, 0.05, T0), s(1000), s(1050), (True, None), id="spacing: at the gap's end"),
        # the gap is the larger of the two: max(60 s, 5% of 1,000 s = 50 s) = 60 s
        pytest.param(Debounce(60 * SEC, 0.05, T0), s(1000), s(1055), (False, s(1060)), id="min gap above the spacing"),
        # max(60 s, 5% of 10,000 s = 500 s) = 500 s
        pytest.param(
            Debounce(60 * SEC, 0.05, T0), s(10_000), s(10_499), (False, s(10_500)), id="spacing above the min gap"
        ),
        # the spacing counts from the origin (the forecast's time): 5% of (1,000 - 400) s = 30 s
        pytest.param(Debounce(0, 0.05, s(400)), s(1000), s(1029), (False, s(1030)), id="counted from the origin"),
    ],
)
def test_a_cycle_runs_when_wanted_or_at_the_end_of_the_gap_after_the_last(
    debounce: Debounce, last: int, wanted: int, expected: tuple[bool, int | None]
) -> None:
    assert debounce.want(last) == (True, None)  # the first cycle runs at once
    assert debounce.want(wanted) == expected


def test_cycles_wanted_inside_a_gap_share_its_end_and_a_forced_cycle_moves_it_on() -> None:
    # spacing 5% from origin 0, the last cycle at 1,000 s: gap 50 s, so the cycles wanted at 1,010 s and 1,040 s
    # share one at 1,050 s (one wake-up). A forced cycle at 1,020 s (a stop's end) runs at once; the wake-up set
    # for 1,050 s then comes inside the new gap, 5% of 1,020 s = 51 s, and is moved to 1,071 s.
    deb = Debounce(0, 0.05, T0)
    assert deb.want(s(1000)) == (True, None)
    assert deb.want(s(1010)) == (False, s(1050))
    assert deb.want(s(1040)) == (False, None)
    assert deb.want(s(1020), force=True) == (True, None)
    assert deb.want(s(1050)) == (False, s(1071))
    assert deb.want(s(1071)) == (True, None)


# --------------------------------------------------------------------------- the spaced forward run


@pytest.mark.parametrize(
    ("min_gap_s", "spacing", "p2_start"),
    [
        pytest.param(0.0, 0.0, h(1) + 60 * SEC, id="not spaced: a cycle at each run end"),
        # the cycle at r1's end (T0 + 1 h) is 40 min after now (T0 + 20 min): 5% of 2,400 s = 120 s of gap;
        # r2's end 60 s later waits for it. p2's error, 60 s, is within 5% of its wait (2,460 s: 123 s).
        pytest.param(0.0, 0.05, h(1) + 120 * SEC, id="spaced 5%: r2's end waits for 120 s after r1's cycle"),
        # 1% of 2,400 s = 24 s < 60 s: r2's end comes after the gap, its cycle is not moved
        pytest.param(0.0, 0.01, h(1) + 60 * SEC, id="spaced 1%: the gap ends before r2's end"),
        pytest.param(300.0, 0.05, h(1) + 300 * SEC, id="min gap 300 s above 5% of 2,400 s"),
    ],
)
def test_a_spaced_forward_run_moves_a_start_by_at_most_its_gap(min_gap_s: float, spacing: float, p2_start: int) -> None:
    # one 2-GPU node; r1 (1 h of work) and r2 (1 h 1 min) run from T0; p1 and p2 (1 GPU each, lab/a) wait.
    # No periodic cycle: r1's end at T0 + 1 h starts p1 (the last cycle, at now, leaves no gap: elapsed 0).
    hist = History().node("n0", 2).submit("r1", T0, duration_s=3600.0).submit("r2", T0, duration_s=3660.0)
    hist.submit("p1", m(10)).submit("p2", m(11))
    fc = forecast(hist.state, m(20), CFG, cycle_s=None, min_gap_s=min_gap_s, spacing=spacing)
    assert {j.job_id: j.start_us for j in fc.jobs} == {"p1": h(1), "p2": p2_start}


def test_a_stops_end_is_not_spaced() -> None:
    # one 1-GPU node; b1 (lab/b, protected 1 h) runs from T0; a1 (lab/a, behind by more than delta) waits from
    # T0 + 10 min. No periodic cycle. With spacing 50% the cycle at b1's protection end (T0 + 1 h, 50 min after
    # now; the last cycle, at now, left no gap) preempts b1 and leaves a gap of 25 min; the stop's end 30 s later
    # still runs its cycle when due: a1 starts at T0 + 1 h 30 s, as in the exact run.
    hist = History().node("n0", 1).submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("a1", m(10))
    (a1,) = forecast(hist.state, m(10), CFG, job_ids=["a1"], spacing=0.5, cycle_s=None).jobs
    assert (a1.start_us, a1.basis) == (h(1) + 30 * SEC, "rules")


def test_a_stops_end_starts_its_preemptor_when_due_and_the_cycle_after_it_waits_for_the_gap() -> None:
    # nodes n0 and n1 of 1 GPU; lab/b runs b1 (10 h of work) on n0 and b2 (1 h 30 s) on n1 from T0; a1 (lab/a,
    # 1 h) and c1 (lab/b, 10 min) wait from T0 + 10 min. No periodic cycle; now T0 + 10 min. At T0 + 1 h both
    # protections end and a1 preempts b1 (equal cost, the lower node id). At T0 + 1 h 30 s b1's grace ends (a1
    # starts on n0: the maintenance, folded when due, spaced or not) and b2 ends on n1. Unspaced, the cycle then
    # places b1's attempt 2 on n1 at once: resuming from its 3,600 s checkpoint, 32,400 s left, it ends at
    # 3,630 + 32,400 = 36,030 s. Spaced 50%, the cycle at T0 + 1 h, 50 min after now, leaves a gap of 25 min: the
    # cycle that places b1 again waits for T0 + 1 h 25 min (5,100 s; it ends at 37,500 s), and the next gap is
    # 50% of (5,100 - 600) s = 2,250 s, so c1, which waits for a1's end at 7,230 s, starts at 7,350 s.
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("b2", T0, budget="lab/b", duration_s=3630.0)
    hist.submit("a1", m(10)).submit("c1", m(10), budget="lab/b", duration_s=600.0)
    for spacing, b1_end, c1_start in ((0.0, s(36_030), s(7230)), (0.5, s(37_500), s(7350))):
        fc = forecast(hist.state, m(10), CFG, spacing=spacing, cycle_s=None)
        a1, c1 = fc.jobs
        assert (a1.job_id, a1.start_us, a1.basis) == ("a1", s(3630), "rules")
        assert (c1.job_id, c1.start_us) == ("c1", c1_start)
        assert fc.runs[("b1", 2)].end_us == b1_end


def test_a_job_not_started_before_the_horizon_starts_after_it() -> None:
    # r1 (3 h of work) holds the only GPU from T0; p1 waits. Now T0 + 20 min, horizon 1 h: the forward run stops
    # at T0 + 1 h 20 min with r1's end still ahead, so p1 has no start and starts after the horizon.
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    fc = forecast(hist.state, m(20), CFG, horizon_s=3600.0)
    (p1,) = fc.jobs
    assert (p1.start_us, p1.wait_s, p1.after_us) == (None, None, h(1) + 1200 * SEC)
    assert p1.note == f"not started before {from_us(h(1) + 1200 * SEC).isoformat()} (the forecast's horizon)"
    assert p1.to_dict()["after"] == from_us(h(1) + 1200 * SEC).isoformat()
    # with the default horizon it starts at r1's end, and has no "after"
    (p1,) = forecast(hist.state, m(20), CFG).jobs
    assert (p1.start_us, p1.after_us) == (h(3), None)


@pytest.mark.parametrize("bad", [{"spacing": -0.1}, {"min_gap_s": -1.0}, {"horizon_s": 0.0}])
def test_a_negative_spacing_or_gap_or_an_empty_horizon_is_refused(bad: dict[str, float]) -> None:
    hist = History().node("n0", 1).submit("p1", m(10), tick=False)
    with pytest.raises(ValueError, match="spacing and min_gap_s must not be negative"):
        forecast(hist.state, m(10), CFG, **bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- recent waits of unallocated jobs


def _queued(job_id: str, at: int, *, gpus: int = 1, replicas: int = 1, allocated: bool = False) -> ev.JobQueued:
    return ev.JobQueued(
        event_id=ev.det_id("t", "q", job_id),
        ts=from_us(at),
        producer="t",
        job_id=job_id,
        budget="lab/a",
        user="alice",
        allocated=allocated,
        gpus_per_replica=gpus,
        replicas=replicas,
        min_runtime_s=3600.0 if allocated else 0.0,
        submitted_at=from_us(at),
    )


def test_recent_waits_are_the_unallocated_jobs_that_waited_in_the_trailing_day_by_size() -> None:
    # now T0 + 10 h, a day back:
    #   u1 (1 GPU) queued 1 h, started 3 h: waited 7,200 s        u2 (1 GPU) queued 2 h, started 30 s later: no wait
    #   u3 (1 GPU) queued 4 h, not started: at least 21,600 s     u4 (2 x 1 GPU) queued 5 h, started 6 h: 3,600 s
    #   a1 (allocated), old (queued 2 days ago), c1 (cancelled while pending), u5 (started after now): left out
    #   but u5's wait so far, 10 h - 9 h = 3,600 s, counts as not ended
    log: list[ev.Event] = [
        _queued("old", T0 - d(2)),
        started("old", at=T0 - d(2) + h(5)),
        _queued("u1", h(1)),
        _queued("a1", h(1), allocated=True),
        _queued("c1", h(1)),
        _queued("u2", h(2)),
        started("u2", at=h(2) + 30 * SEC),
        cancelled("c1", attempt=None, at=h(2)),
        started("u1", at=h(3)),
        _queued("u3", h(4)),
        _queued("u4", h(5), replicas=2),
        started("a1", at=h(5)),
        started("u4", at=h(6)),
        _queued("u5", h(9)),
        started("u5", at=h(11)),
    ]
    assert recent_waits(log, h(10)) == {
        1: ((3600.0, False), (7200.0, True), (21_600.0, False)),
        2: ((3600.0, True),),
    }


@pytest.mark.parametrize(
    ("waits", "expected"),
    [
        pytest.param([(1.0, True), (2.0, True), (3.0, True)], 2.0, id="all ended: at 2 one third still waits"),
        pytest.param([(10.0, True), (20.0, True)], 10.0, id="half ended at 10: the median is 10"),
        # at 1: 3/4 still wait; 2 not ended leaves 2 at risk; at 3: 3/4 x 1/2 = 3/8 <= 1/2
        pytest.param([(1.0, True), (2.0, False), (3.0, True), (4.0, True)], 3.0, id="one not ended, counted on"),
        pytest.param([(1.0, False), (2.0, False)], None, id="none ended: no median"),
        pytest.param([(1.0, True), (5.0, False), (6.0, False)], None, id="never half ended: no median"),
        pytest.param([], None, id="no waits"),
    ],
)
def test_the_median_wait_counts_the_waits_not_ended_as_at_least_as_long(
    waits: list[tuple[float, bool]], expected: float | None
) -> None:
    assert median_wait(waits) == expected


def test_the_median_is_of_the_jobs_size_with_five_waits_else_of_every_size() -> None:
    five = tuple((float(x), True) for x in (10, 20, 30, 40, 50))  # median 30: at 30, 2 of 5 still wait
    assert waits_for({1: five, 2: ((99.0, True),)}, 1) == (30.0, 5, "of its size")
    # 2 GPUs: one wait of its size; of every size (10 20 30 40 50 99): at 30, 3 of 6 still wait
    assert waits_for({1: five, 2: ((99.0, True),)}, 2) == (30.0, 6, "of any size")
    assert waits_for({2: ((99.0, True),)}, 2) is None


def test_an_unallocated_job_gets_the_later_of_the_forward_start_and_its_recent_median_wait() -> None:
    # one 1-GPU node; r1 (lab/a, allocated, 1 h of work) runs from T0; u (lab/a, unallocated) is queued at
    # T0 + 10 min. The forward run starts u at r1's end, T0 + 1 h. Recent unallocated jobs of 1 GPU waited 2 h
    # (five of them): u's estimate is its queueing + 2 h = T0 + 2 h 10 min, basis recent_waits.
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3600.0).submit("u", m(10), min_runtime_s=0.0)
    waits = {1: ((7200.0, True),) * 5}
    (u,) = forecast(hist.state, m(20), CFG, waits=waits).jobs
    assert (u.start_us, u.basis, u.forward_start_us, u.forward_basis) == (
        h(2) + 600 * SEC,
        "recent_waits",
        h(1),
        "simulated",
    )
    assert u.note == (
        "unallocated: runs only on idle GPUs, behind later allocated work; the median wait of 5 recent unallocated "
        "job(s) of its size that waited longer than 600 s is 2.00 h, later than the forward run's start"
    )
    # recent waits of 30 min (T0 + 40 min) come before the forward start: it stands
    (u,) = forecast(hist.state, m(20), CFG, waits={1: ((1800.0, True),) * 5}).jobs
    assert (u.start_us, u.basis, u.forward_start_us) == (h(1), "simulated", h(1))
    # an allocated job keeps the forward run's start whatever the waits
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3600.0).submit("p", m(10))
    (p,) = forecast(hist.state, m(20), CFG, waits=waits).jobs
    assert (p.start_us, p.basis) == (h(1), "simulated")
