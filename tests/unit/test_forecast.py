"""Start-time forecasts (design D12, D12.job-forecast) on hand-built histories.

Each history is played through the dispatcher's own ``step`` (a node agent
answering ``StartWorkload`` with ``JobStarted`` at once), so the state the
forecast reads is the one the dispatcher would hold. Tree ``lab`` with ``a``
and ``b`` at 0.5 each; engine defaults (grace 30 s) unless said.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from apportion import events as ev
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.events import DEFAULT_GRACE_S
from apportion.forecast import forecast, run_end, user_history, with_submission
from apportion.timeutil import from_us
from tests.kit.builders import T0, h, m, submitted
from tests.kit.forecast_history import CFG, History

#: free work in the budget order (rule D3.free-las off): a requeued free job, submitted first, runs before a later one
BUDGET_ORDER = DispatchConfig(heartbeat_timeout_s=None, engine=EngineConfig(free_las=False))


def test_a_job_behind_a_simulated_run_starts_when_that_run_ends() -> None:
    # one 1-GPU node; r1 (lab/a, 1 GPU, 3 h of simulated work) starts at T0; p1 (lab/a) is queued at T0 + 10 min
    # behind its own budget's run (no preemption within a leaf). r1 ends at T0 + 3 h: p1 starts then.
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    now = m(20)
    fc = forecast(hist.state, now, CFG)
    (p1,) = fc.jobs
    assert p1.job_id == "p1" and p1.start_us == h(3)
    assert p1.wait_s == 3 * 3600 - 20 * 60  # 10,800 - 1,200 = 9,600 s after now
    assert p1.basis == "simulated"
    assert [(c.kind, c.job_id, c.at_us, c.basis) for c in p1.chain] == [("run_ends", "r1", h(3), "simulated")]
    assert fc.runs[("r1", 1)].end_us == h(3)
    assert p1.reason.startswith("no_free_gpus")


def test_a_job_that_preempts_an_expired_run_starts_at_its_protection_end_plus_the_grace() -> None:
    # one 1-GPU node; b1 (lab/b, min runtime 1 h, 10 h of work) runs from T0, so lab/b's r is far above lab/a's
    # (0): behind by more than delta. a1 (lab/a, allocated) is queued at T0 + 10 min; b1 is protected until
    # T0 + 1 h (protection = its minimum runtime, no earlier preemptions). b1's checkpoint interval is its
    # minimum runtime, so it saves at T0 + 1 h and loses nothing: no checkpoint wait. At T0 + 1 h a1 preempts
    # b1 and starts when b1's stop ends, the grace period later: T0 + 3,600 s + 30 s.
    hist = History().node("n0", 1).submit("b1", T0, budget="lab/b", duration_s=36_000.0).submit("a1", m(10))
    fc = forecast(hist.state, m(10), CFG, job_ids=["a1"])
    (a1,) = fc.jobs
    assert DEFAULT_GRACE_S == 30.0
    assert a1.start_us == h(1) + 30_000_000
    assert a1.basis == "rules"
    kinds = [(c.kind, c.job_id, c.at_us) for c in a1.chain]
    assert kinds == [("protection_ends", "b1", h(1)), ("preempts", "b1", h(1))]
    assert a1.reason.startswith("protected_until") and a1.reason_detail is not None
    assert a1.reason_detail["until"] == from_us(h(1)).isoformat()


def test_a_run_without_duration_ends_at_its_users_median_run_time() -> None:
    # alice's completed runs of real commands (no declared duration): 1 h, 2 h and 4 h -> median 2 h.
    # r4 (alice) starts at T0 + 8 h; p5 waits behind it in lab/a. At now = T0 + 8.5 h r4 has run 0.5 h,
    # shorter than all three, so its end = T0 + 8 h + 2 h = T0 + 10 h, and p5 starts then.
    hist = History().node("n0", 1)
    cmd: dict[str, Any] = {"duration_s": None, "command": ["python", "train.py"]}
    for job, start, hours in (("r1", 0.0, 1.0), ("r2", 1.0, 2.0), ("r3", 3.0, 4.0)):
        hist.submit(job, h(start), **cmd).complete(job, h(start + hours))
    hist.submit("r4", h(8), **cmd).submit("p5", h(8.25), **cmd)
    history = user_history(hist.log)
    assert history == {"alice": (3600.0, 7200.0, 14_400.0)}
    fc = forecast(hist.state, h(8.5), CFG, history=history)
    (p5,) = fc.jobs
    assert p5.start_us == h(10)
    assert p5.basis == "history"
    end = fc.runs[("r4", 1)]
    assert (end.end_us, end.basis) == (h(10), "history")
    assert end.note == "median run time of 3 completed run(s) of alice longer than 1800 s: 7200 s"


def test_a_runs_end_counts_only_the_history_longer_than_it_has_run() -> None:
    # the run started at T0 and it is T0 + 1.5 h: of 1 h, 2 h, 4 h only 2 h and 4 h are longer -> median 3 h
    spec = ev.JobQueued(
        event_id=ev.det_id("t", "q"),
        ts=from_us(T0),
        producer="t",
        job_id="r",
        budget="lab/a",
        user="alice",
        allocated=True,
        gpus_per_replica=1,
        replicas=1,
        min_runtime_s=60.0,
        submitted_at=from_us(T0),
    )
    hist = {"alice": (3600.0, 7200.0, 14_400.0)}
    assert run_end(spec, 1, T0, 0.0, h(1.5), hist, 7 * 86_400.0).end_us == h(3)
    # nothing longer, no limit: W/4 from its start (W = 7 d: 42 h), said to be unknown
    end = run_end(spec, 1, T0, 0.0, h(5), hist, 7 * 86_400.0)
    assert (end.end_us, end.basis) == (h(42), "unknown")
    # past W/4: no end (only a preemption frees it)
    assert run_end(spec, 1, T0, 0.0, h(43), hist, 7 * 86_400.0).end_us is None


def test_a_job_with_free_gpus_and_nothing_running_starts_now() -> None:
    # two idle GPUs; q1 (1 GPU) is queued at T0 + 5 min, no cycle has run yet: the first cycle, now, places it
    hist = History().node("n0", 2).submit("q1", m(5), tick=False)
    fc = forecast(hist.state, m(5), CFG)
    (q1,) = fc.jobs
    assert (q1.start_us, q1.wait_s, q1.basis, q1.chain) == (m(5), 0.0, "now", ())
    assert q1.reason == ""  # a cycle now places it


def test_the_callers_state_is_left_as_it_was_and_an_unknown_job_is_a_key_error() -> None:
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3600.0).submit("p1", m(10))
    before = pickle.dumps(hist.state)
    forecast(hist.state, m(10), CFG)
    assert pickle.dumps(hist.state) == before
    with pytest.raises(KeyError):
        forecast(hist.state, m(10), CFG, job_ids=["r1"])  # running, not pending


def test_an_unallocated_run_preempted_in_the_forward_run_resumes_from_its_progress() -> None:
    # one 1-GPU node; u1 (lab/a, unallocated, 2 h of work) runs from T0; q1 (lab/a, unallocated, 1 h) is queued at
    # T0 + 20 min; a1 (lab/b, allocated, 1 h) at T0 + 30 min, before any cycle. Now = T0 + 30 min: a1 preempts u1
    # (an unallocated run), which saves 1,800 s of progress on SIGTERM; a1 starts at the grace end, T0 + 30 min
    # 30 s, and ends 1 h later, T0 + 1 h 30 min 30 s. Then u1 (attempt 2, submitted first) runs its last 5,400 s,
    # to T0 + 3 h 0 min 30 s, and q1 starts then (in the budget order: with rule D3.free-las q1, never run, goes
    # first). (Were the progress lost, q1 would start 30 min later.)
    hist = History().node("n0", 1).submit("u1", T0, min_runtime_s=0.0, duration_s=7200.0)
    hist.submit("q1", m(20), min_runtime_s=0.0, duration_s=3600.0)
    hist.submit("a1", m(30), budget="lab/b", tick=False)
    fc = forecast(hist.state, m(30), BUDGET_ORDER, spacing=0.0)  # every cycle when due: the exact run
    starts = {j.job_id: j.start_us for j in fc.jobs}
    assert starts == {"a1": m(30) + 30_000_000, "q1": h(3) + 30_000_000}
    # with the rule (the default) q1 goes at a1's end, before the requeued u1
    assert {j.job_id: j.start_us for j in forecast(hist.state, m(30), CFG, spacing=0.0).jobs}["q1"] == m(
        90
    ) + 30_000_000
    end = fc.runs[("u1", 2)]
    assert (end.end_us, end.note) == (h(3) + 30_000_000, "simulated duration: 5400 s of work in this attempt")


def test_a_forward_run_that_preempts_requeues_and_checkpoints_leaves_the_state_byte_identical() -> None:
    # the forward run works on a copy-on-write fork with its own ledger: preemptions, requeues, checkpoints and
    # run ends in it reach neither the caller's pickled state nor its occupancy, and a second forecast of the
    # same state gives the same starts as the first (the scenario of the unallocated-run test above)
    hist = History().node("n0", 1).submit("u1", T0, min_runtime_s=0.0, duration_s=7200.0)
    hist.submit("q1", m(20), min_runtime_s=0.0, duration_s=3600.0)
    hist.submit("a1", m(30), budget="lab/b", tick=False)
    before, occupancy = pickle.dumps(hist.state), hist.state.ledger.occupancy(m(30))
    first = {j.job_id: j.start_us for j in forecast(hist.state, m(30), BUDGET_ORDER, spacing=0.0).jobs}
    assert pickle.dumps(hist.state) == before
    assert hist.state.ledger.occupancy(m(30)) == occupancy
    again = {j.job_id: j.start_us for j in forecast(hist.state, m(30), BUDGET_ORDER, spacing=0.0).jobs}
    assert first == again == {"a1": m(30) + 30_000_000, "q1": h(3) + 30_000_000}


@pytest.mark.parametrize(
    ("min_gap_s", "p2_start"),
    [
        pytest.param(0.0, h(1) + 60_000_000, id="no debounce: a cycle at each run end"),
        pytest.param(300.0, h(1) + 300_000_000, id="debounce: r2's end waits for the gap after the cycle at r1's"),
    ],
)
def test_the_debounce_answers_run_ends_within_its_gap_by_one_cycle_at_the_gaps_end(
    min_gap_s: float, p2_start: int
) -> None:
    # one 2-GPU node; r1 (1 h of work) and r2 (1 h 1 min) run from T0; p1 and p2 (1 GPU each, lab/a) wait.
    # No periodic cycle. r1 ends at T0 + 1 h: a cycle starts p1. r2 ends 60 s later: without a debounce a cycle
    # starts p2 at once; with a 300 s gap the cycle waits until 300 s after the last one, T0 + 1 h 5 min.
    hist = History().node("n0", 2).submit("r1", T0, duration_s=3600.0).submit("r2", T0, duration_s=3660.0)
    hist.submit("p1", m(10)).submit("p2", m(11))
    fc = forecast(hist.state, m(20), CFG, cycle_s=None, min_gap_s=min_gap_s)
    assert {j.job_id: j.start_us for j in fc.jobs} == {"p1": h(1), "p2": p2_start}


def test_a_job_not_yet_submitted_is_forecast_as_if_submitted_now_or_its_rejection_given() -> None:
    # r1 (lab/a, 3 h of work) runs from T0 on the only GPU; "if I submit s1 (lab/a, 1 GPU) at T0 + 1 h": it waits
    # behind its own budget's run and starts when r1 ends, T0 + 3 h. A job of 2 GPUs fits no node: rejected.
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0)
    before = pickle.dumps(hist.state)
    state, rejected = with_submission(hist.state, submitted("s1", at=h(1)), h(1), CFG)
    assert rejected is None and pickle.dumps(hist.state) == before
    (s1,) = forecast(state, h(1), CFG, job_ids=["s1"]).jobs
    assert (s1.start_us, s1.basis) == (h(3), "simulated")
    _, rejected = with_submission(hist.state, submitted("s2", gpus=2, at=h(1)), h(1), CFG)
    assert rejected is not None and rejected.reason.value == "shape_impossible"


def test_a_time_limit_ends_a_command_and_cuts_short_a_longer_simulated_run() -> None:
    # two 1-GPU nodes. c1 (a real command, time limit 2 h) runs on one from T0: it ends at its limit, T0 + 2 h.
    # s1 (5 h of simulated work, time limit 3 h) runs on the other from T0: the node agent stops it at T0 + 3 h
    # (JobFailed time_limit). p1 and p2 (lab/a) wait: p1 takes the first GPU freed (T0 + 2 h), p2 the second.
    hist = History().node("n0", 1).node("n1", 1)
    hist.submit("c1", T0, duration_s=None, command=["train"], time_limit_s=7200.0)
    hist.submit("s1", T0, duration_s=5 * 3600.0, time_limit_s=3 * 3600.0)
    hist.submit("p1", m(10)).submit("p2", m(11))
    fc = forecast(hist.state, m(11), CFG)
    starts = {j.job_id: (j.start_us, j.basis) for j in fc.jobs}
    assert starts == {"p1": (h(2), "time_limit"), "p2": (h(3), "time_limit")}
    assert fc.runs[("c1", 1)].note == "time limit 7200 s"
    assert fc.runs[("s1", 1)].note == "time limit 10800 s, before its work ends"


def test_a_held_job_has_no_start_and_says_so() -> None:
    hist = History().node("n0", 2)
    hist.feed(submitted("x", at=m(5)).model_copy(update={"hold": True}), m(5))
    (x,) = forecast(hist.state, m(5), CFG).jobs
    assert (x.start_us, x.basis, x.note) == (None, "-", "held: no start until it is released")


def test_a_held_job_waits_for_its_release_not_for_a_cycle() -> None:
    # Two free GPUs: a cycle would place it at once; the reason it waits is the hold, as `apportion queue` says.
    hist = History().node("n0", 2)
    hist.feed(submitted("x", at=m(5)).model_copy(update={"hold": True}), m(5))
    (x,) = forecast(hist.state, m(5), CFG).jobs
    assert x.reason_detail is not None and x.reason_detail["kind"] == "held"
    assert x.reason == (
        "held: held by alice at 2024-01-01 00:05:00 UTC (submitted held); "
        "never placed until released (apportion release JOB)"
    )


def test_what_the_forward_run_feeds_in_itself_asks_for_no_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # the forward run skips wakeups() for its own reports and arrivals (_NO_WAKEUPS): every one of them it feeds
    # in, in runs that start, complete, checkpoint, stop at a time limit and submit, has none
    from apportion import forecast as forecast_module
    from apportion.domain.dispatch import wakeups

    fed: list[ev.Event] = []
    real = forecast_module._Forward._feed

    def recording(self: Any, e: ev.Event, t: int) -> bool:
        fed.append(e)
        return real(self, e, t)

    monkeypatch.setattr(forecast_module._Forward, "_feed", recording)
    hist = History().node("n0", 1).submit("u1", T0, min_runtime_s=0.0, duration_s=7200.0)
    hist.submit("q1", m(20), min_runtime_s=0.0, duration_s=3600.0)
    hist.submit("a1", m(30), budget="lab/b", tick=False)
    forecast(hist.state, m(30), BUDGET_ORDER, spacing=0.0)
    limited = History().node("n0", 1).submit("s1", T0, duration_s=5 * 3600.0, time_limit_s=3 * 3600.0)
    limited.submit("p1", m(10))
    queued = next(e for e in History().submit("x1", m(5), tick=False).log if isinstance(e, ev.JobQueued))
    forecast(limited.state, m(10), CFG, arrivals=[(m(40), queued)])
    kinds = {type(e) for e in fed}
    assert kinds == {ev.JobStarted, ev.JobCompleted, ev.JobCheckpointed, ev.JobFailed, ev.JobSubmitted}
    assert kinds == forecast_module._NO_WAKEUPS
    assert all(wakeups(e, CFG) == [] for e in fed)
