"""The forward run of a forecast runs the dispatcher's cycle on its own state (design D12, D12.job-forecast).

Hand-built histories (:mod:`tests.kit.forecast_history`: tree ``lab`` with ``a`` and ``b`` at 0.5 each, engine
defaults: grace 30 s, minimum runtime and checkpoint interval 1 h). Starts are computed by hand.
"""

from __future__ import annotations

import uuid
from typing import Any

from apportion import events as ev
from apportion.domain.dispatch import Tick
from apportion.domain.engine import CycleSnapshot, EngineConfig, run_cycle
from apportion.forecast import _ID_BASE, _Forward, forecast
from apportion.timeutil import from_us, s_to_us
from tests.kit.builders import T0, h, m
from tests.kit.forecast_history import CFG, History

GRACE_US = s_to_us(30.0)


def test_the_cycle_at_a_stops_end_sees_the_victim_requeued_and_places_it_on_gpus_freed_at_that_instant() -> None:
    # nodes n0 and n1 of 1 GPU. lab/b runs b1 (10 h of work) on n0 and b2 (1 h 30 s) on n1 from T0; lab/a runs
    # nothing, so lab/b is behind it. a1 (lab/a) is queued at T0 + 10 min. At T0 + 1 h both protections end and
    # both runs have just checkpointed (1 h): equal cost, the tie goes to the lower node id, n0: a1 preempts b1.
    # At T0 + 1 h 30 s b1's grace ends and b2 ends on n1: one cycle, in which the dispatcher's maintenance
    # requeues b1 and starts a1 on n0, and the cycle (on the state with b1 requeued) places b1's attempt 2 on
    # n1 at once; it resumes from its 3,600 s checkpoint: 32,400 s left, ending at T0 + 10 h 30 s.
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("b2", T0, budget="lab/b", duration_s=3630.0)
    hist.submit("a1", m(10))
    fc = forecast(hist.state, m(10), CFG, spacing=0.0)
    (a1,) = fc.jobs
    assert a1.start_us == h(1) + GRACE_US
    assert [(c.kind, c.job_id) for c in a1.chain] == [("protection_ends", "b1"), ("preempts", "b1")]
    again = fc.runs[("b1", 2)]
    assert again.end_us == h(10) + GRACE_US
    assert again.note == "simulated duration: 32400 s of work in this attempt"


def test_the_pending_reasons_are_those_of_a_cycle_now_on_the_callers_state() -> None:
    # one 1-GPU node running r1 (lab/a, 3 h); p1 (lab/a) and q1 (lab/b) wait. lab/b has used nothing, so it is
    # ahead of lab/a; r1 is protected until T0 + 1 h: q1 waits for that protection, p1 for free GPUs (its own
    # budget's run). The reasons come from the forward run's first cycle, the cycle at now on the caller's
    # state: the engine's explanation of that cycle, run apart, says the same.
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    hist.submit("q1", m(15), budget="lab/b")
    now = m(20)
    fc = forecast(hist.state, now, CFG)
    reasons = {j.job_id: j.reason for j in fc.jobs}
    assert reasons["p1"].startswith("no_free_gpus") and reasons["q1"].startswith("protected_until")
    apart = run_cycle(hist.state.cycle_snapshot(now), now, CFG.engine, explain=True).reasons
    assert reasons == {job: why.text() for job, why in apart.items()}


def test_a_stop_due_at_now_is_folded_first_and_the_reasons_still_come_from_the_callers_state() -> None:
    # the preemption scenario above, asked at T0 + 1 h 30 s, when b1's stop is due but not yet ended: the forward
    # run's first cycle follows the maintenance that ends it (a1 starts at once, on n0), so it is not the cycle
    # on the caller's state; the reasons are then taken from a cycle on the caller's state, run apart (a1 waits
    # for b1's stop there: placed, so no reason)
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("b2", T0, budget="lab/b", duration_s=3630.0)
    hist.submit("a1", m(10)).feed(Tick(h(1)), h(1))  # a1 preempts b1: its stop ends at T0 + 1 h 30 s
    hist.submit("p2", h(1) + s_to_us(10.0), budget="lab/b")  # behind b1's requeue in lab/b's queue
    now = h(1) + GRACE_US
    fc = forecast(hist.state, now, CFG, job_ids=["p2"], spacing=0.0)
    (p2,) = fc.jobs
    apart = run_cycle(hist.state.cycle_snapshot(now), now, CFG.engine, explain=True).reasons
    assert p2.reason == apart["p2"].text()


def test_a_chain_lists_the_run_ends_on_the_jobs_own_nodes_only() -> None:
    # nodes n0 and n1 of 1 GPU; r0 (1 h) on n0 and r1 (2 h) on n1 from T0, both lab/a; p1 (10 h) and p2 (lab/a)
    # wait. p1 starts on n0 when r0 ends (T0 + 1 h), p2 on n1 when r1 ends (T0 + 2 h): r0's end, earlier but on
    # n0, is not in p2's chain.
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("r0", T0, duration_s=3600.0).submit("r1", T0, duration_s=7200.0)
    hist.submit("p1", m(10), duration_s=36_000.0).submit("p2", m(11))
    fc = forecast(hist.state, m(20), CFG, spacing=0.0)
    chains = {j.job_id: [(c.kind, c.job_id, c.at_us) for c in j.chain] for j in fc.jobs}
    assert {j.job_id: j.start_us for j in fc.jobs} == {"p1": h(1), "p2": h(2)}
    assert chains == {"p1": [("run_ends", "r0", h(1))], "p2": [("run_ends", "r1", h(2))]}


def test_the_forward_run_stops_at_the_cycle_that_starts_the_last_job_asked_about() -> None:
    # the chain scenario, no periodic cycle: cycles at now (T0 + 20 min), at r0's end (T0 + 1 h: p1 starts), when
    # p1 and p2 have waited the reservation age (1 h after their queueing: T0 + 1 h 10 min and 1 h 11 min) and at
    # r1's end (T0 + 2 h: p2 starts). Asked about p1 only, the run stops after its second cycle: p2 never starts
    # in it. Asked about both, it runs all five and stops at the last.
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("r0", T0, duration_s=3600.0).submit("r1", T0, duration_s=7200.0)
    hist.submit("p1", m(10), duration_s=36_000.0).submit("p2", m(11))
    one = forecast(hist.state, m(20), CFG, job_ids=["p1"], cycle_s=None, spacing=0.0)
    assert [(j.job_id, j.start_us) for j in one.jobs] == [("p1", h(1))]
    assert one.cycles == 2 and ("p2", 1) not in one.runs
    both = forecast(hist.state, m(20), CFG, job_ids=["p1", "p2"], cycle_s=None, spacing=0.0)
    assert [(j.job_id, j.start_us) for j in both.jobs] == [("p1", h(1)), ("p2", h(2))]
    assert both.cycles == 5 and ("p2", 1) in both.runs


def test_without_chains_the_starts_and_bases_are_those_with_them() -> None:
    # nodes n0, n1 and n2 of 1 GPU; lab/b runs b1 (10 h) on n0 and b2 (1 h 30 s) on n1 from T0, n2 is free; a1
    # and d1 (lab/a, 1 h) and c1 (lab/b, 10 min) are queued at T0 + 10 min, now, with no cycle since. a1 takes
    # n2 at once (basis now, no chain); d1 preempts b1 when its protection ends and starts at its grace's end,
    # T0 + 1 h 30 s (rules: a protection end and a preemption); b1's attempt 2 takes n1 at b2's end, so c1 starts
    # at a1's end, T0 + 1 h 10 min (simulated: its chain is that run end).
    hist = History().node("n0", 1).node("n1", 1).node("n2", 1)
    hist.submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("b2", T0, budget="lab/b", duration_s=3630.0)
    hist.submit("a1", m(10), tick=False).submit("c1", m(10), budget="lab/b", duration_s=600.0, tick=False)
    hist.submit("d1", m(10), tick=False)
    expected = [("a1", m(10), "now"), ("d1", h(1) + GRACE_US, "rules"), ("c1", h(1) + m(10) - T0, "simulated")]
    full = forecast(hist.state, m(10), CFG, spacing=0.0, min_gap_s=0.0, cycle_s=None)
    bare = forecast(hist.state, m(10), CFG, spacing=0.0, min_gap_s=0.0, cycle_s=None, chains_out=False)
    assert sorted((j.job_id, j.start_us, j.basis) for j in full.jobs) == sorted(expected)
    assert sorted((j.job_id, j.start_us, j.basis) for j in bare.jobs) == sorted(expected)
    assert {j.job_id: len(j.chain) for j in full.jobs} == {"a1": 0, "d1": 2, "c1": 1}
    assert [j.chain for j in bare.jobs] == [(), (), ()]


def test_the_forward_runs_reports_are_numbered_by_first_use_and_never_a_log_events_id() -> None:
    # the same parts give the same id (a report made twice is folded once); ids count 0, 1, ... after the prefix,
    # outside RFC 4122's variant, which every log event's id (version 4 or 5) has
    fwd = _Forward(History().node("n0", 1).state, T0, CFG, {}, h(1), None)
    started = fwd._id("JobStarted", "j1", 1, 0)
    completed = fwd._id("JobCompleted", "j1", 1, 0)
    assert fwd._id("JobStarted", "j1", 1, 0) is started
    assert (started.int, completed.int) == (_ID_BASE, _ID_BASE | 1)
    assert str(started) == "f07ec457-0000-0000-0000-000000000000"
    assert started.variant != uuid.RFC_4122 and ev.det_id("JobStarted", "j1", 1, 0).variant == uuid.RFC_4122


def test_the_collector_is_paused_during_a_forecast_and_enabled_after() -> None:
    # the chain scenario asked about p1, its cycles run by a scheduler that notes whether the collector is on:
    # the forward run folds with it off (as the simulator's run) and it is on again after; already off, it
    # stays off
    import gc
    from dataclasses import replace

    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("r0", T0, duration_s=3600.0).submit("r1", T0, duration_s=7200.0)
    hist.submit("p1", m(10), duration_s=36_000.0).submit("p2", m(11))
    seen: list[bool] = []

    def engine(snapshot: CycleSnapshot, now_us: int, config: EngineConfig) -> list[ev.Event]:
        seen.append(gc.isenabled())
        return run_cycle(snapshot, now_us, config).events

    cfg = replace(CFG, scheduler=engine)
    try:
        assert gc.isenabled()
        one = forecast(hist.state, m(20), cfg, job_ids=["p1"], cycle_s=None, spacing=0.0)
        assert gc.isenabled()
        gc.disable()
        forecast(hist.state, m(20), cfg, job_ids=["p1"], cycle_s=None, spacing=0.0)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert [(j.job_id, j.start_us) for j in one.jobs] == [("p1", h(1))]
    assert seen == [False] * 4


def test_the_forward_runs_reports_are_the_events_validation_builds() -> None:
    # a start and a completion report made without validating again equal the validated events, field for field
    # and in the fields set; a value validation would change (a naive time) is validated (and refused)
    from datetime import datetime

    import pytest
    from pydantic import ValidationError

    from apportion.forecast import _report

    values: dict[str, Any] = {
        "event_id": uuid.UUID(int=_ID_BASE | 7),
        "ts": from_us(T0),
        "producer": "forecast/agent",
        "job_id": "j1",
        "attempt": 2,
        "replica": 1,
        "node_id": "n0",
    }
    pairs = [
        (_report(ev.JobStarted, dict(values)), ev.JobStarted(**values)),
        (_report(ev.JobCompleted, dict(values)), ev.JobCompleted(**values)),
    ]
    for made, checked in pairs:
        assert made == checked and made.model_fields_set == checked.model_fields_set
        assert made.model_dump_json() == checked.model_dump_json()
    with pytest.raises(ValidationError):
        _report(ev.JobStarted, values | {"ts": datetime(2026, 1, 1)})
