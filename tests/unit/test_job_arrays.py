"""Job arrays: Slurm's index syntax, one submission expanded into N jobs, the throttle, cancel of the array.

Tree::

    lab (1.0)
    ├── a  0.5   members: alice
    └── b  0.5

One node of 8 GPUs; every element asks for 1 GPU for 10 minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion import events as ev
from apportion.arrays import ArraySpec, element_id, parse_array, split_element_id
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, fold, step, submission_decided
from apportion.timeutil import from_us, to_us
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, completed, m, submitted
from tests.kit.narrowing import narrow

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 0.5, "members": ["alice"]}, "lab/b": 0.5})
CFG = DispatchConfig(heartbeat_timeout_s=None)


@pytest.mark.parametrize(
    "text,indices,throttle",
    [
        pytest.param("7", (7,), None, id="one index"),
        pytest.param("0-4", (0, 1, 2, 3, 4), None, id="range, both ends included"),
        pytest.param("1,3,5", (1, 3, 5), None, id="list"),
        pytest.param("0-9:3", (0, 3, 6, 9), None, id="stepped range"),
        pytest.param("0-10:4", (0, 4, 8), None, id="step past the end stops before it"),
        pytest.param("0-99%8", tuple(range(100)), 8, id="range with throttle"),
        pytest.param("5,1-3,3", (1, 2, 3, 5), None, id="overlaps kept once, sorted"),
        pytest.param("1,10-16:3%2", (1, 10, 13, 16), 2, id="list, step and throttle"),
        pytest.param(" 0-1 ", (0, 1), None, id="blanks around"),
    ],
)
def test_slurm_index_expressions(text: str, indices: tuple[int, ...], throttle: int | None) -> None:
    assert parse_array(text) == ArraySpec(indices, throttle)


@pytest.mark.parametrize(
    "text,says",
    [
        pytest.param("", "no indices", id="empty"),
        pytest.param("%4", "no indices", id="only a throttle"),
        pytest.param("5-2", "ends below its start", id="backwards range"),
        pytest.param("0-9:0", "step of '0-9:0' must be >= 1", id="zero step"),
        pytest.param("0-9%0", "throttle after % must be a whole number >= 1", id="zero throttle"),
        pytest.param("0-9%x", "throttle after %", id="throttle not a number"),
        pytest.param("a-b", "'a-b' is not an index", id="letters"),
        pytest.param("1,,2", "'' is not an index", id="empty item"),
        pytest.param("-1", "'-1' is not an index", id="negative"),
        pytest.param("0-1000000", "index 1000000 is above", id="index too high"),
        pytest.param("0-100000", "more than 100000 elements", id="too many elements"),
    ],
)
def test_bad_index_expressions_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        parse_array(text)
    assert says in str(err.value)


def test_element_ids_are_slurms_form_and_split_back() -> None:
    assert element_id("sweep", 12) == "sweep_12"
    assert split_element_id("sweep_12") == ("sweep", 12)
    assert split_element_id("a_b_3") == ("a_b", 3)
    assert [split_element_id(j) for j in ("sweep", "sweep_", "_3", "sweep_x", "sweep_03")] == [None] * 5


def test_a_bad_array_field_is_a_decode_error_naming_the_field() -> None:
    raw = ev.encode(array_sub("s", "0-3")).replace(b'"0-3"', b'"3-0"')
    with pytest.raises(ev.DecodeError) as err:
        ev.decode(raw)
    assert "array" in str(err.value) and "ends below its start" in str(err.value)


def test_a_v4_submission_is_upcast_to_one_job() -> None:
    v5 = ev.JobSubmitted.model_validate(
        ev.upcast_job_submitted_v4_v5({**submitted("j").model_dump(mode="json"), "schema_version": 4})
    )
    assert (v5.array, v5.job_ids) == (None, ("j",))


# --------------------------------------------------------------------------- the dispatcher


def reg(nid: str = "n0", gpus: int = 8) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=gpus, ts=from_us(T0), event_id=ev.det_id("reg", nid))


def array_sub(job_id: str, spec: str, at: int = T0, *, hold: bool = False, user: str = "bob") -> ev.JobSubmitted:
    sub = submitted(job_id, budget="lab/b", user=user, gpus=1, duration_s=600.0, at=at)
    return sub.model_copy(update={"array": spec, "hold": hold, "event_id": ev.det_id("array", job_id, spec, at)})


def cancel(job_id: str, at: int, user: str = "bob") -> ev.JobCancelRequested:
    return ev.JobCancelRequested(event_id=ev.det_id("cancel", job_id, at), job_id=job_id, user=user, ts=from_us(at))


def kinds(out: list[ev.Event]) -> list[str]:
    return [f"{e.type}:{getattr(e, 'job_id', '')}" for e in out]


def feed(state: DispatchState, log: list[ev.Event], e: ev.Event | Tick, now: int) -> list[ev.Event]:
    out = step(state, e, now, CFG)
    log += ([] if isinstance(e, Tick) else [e]) + out
    return out


def queued_array(spec: str, *, hold: bool = False) -> tuple[DispatchState, list[ev.Event], list[ev.Event]]:
    state = DispatchState(TREE)
    log: list[ev.Event] = []
    feed(state, log, reg(), T0)
    sub = array_sub("s", spec, hold=hold)
    return state, log, feed(state, log, sub, T0)


def test_one_submission_becomes_one_queued_job_per_element() -> None:
    state, _, out = queued_array("0-6:2,9%2")
    assert kinds(out) == ["JobQueued:s_0", "JobQueued:s_2", "JobQueued:s_4", "JobQueued:s_6", "JobQueued:s_9"]
    first = narrow(ev.JobQueued, out[0])
    assert (first.array_id, first.array_index, first.array_throttle) == ("s", 0, 2)
    assert (first.budget, first.user, first.gpus_per_replica, first.duration_s) == ("lab/b", "bob", 1, 600.0)
    assert [narrow(ev.JobQueued, e).array_index for e in out] == [0, 2, 4, 6, 9]
    assert sorted(state.arrays["s"].members.values()) == [0, 2, 4, 6, 9]
    assert len({e.event_id for e in out}) == 5  # one id each, deterministic in the element
    assert out[1].event_id == ev.det_id("JobQueued", "s_2", 1)


def test_an_array_submitted_held_holds_every_element() -> None:
    state, _, out = queued_array("0-1", hold=True)
    assert kinds(out) == ["JobQueued:s_0", "JobHeld:s_0", "JobQueued:s_1", "JobHeld:s_1"]
    assert state.pending_now(m(1)) == {}


def test_the_throttle_keeps_at_most_two_of_five_running_at_every_cycle() -> None:
    """%2 with 5 elements of 10 minutes on 8 free GPUs: 0 and 1 start at once, each later element the cycle
    after one ends, lowest index first; never more than 2 running."""
    state, log, _ = queued_array("0-4%2")
    started_at: dict[str, int] = {}
    running_per_cycle = []
    for minute in range(0, 41):
        now = m(minute)
        for job_id, t in sorted(started_at.items()):
            if t + m(10) - T0 == now:
                feed(state, log, completed(job_id, at=now, node="n0"), now)
        for e in feed(state, log, Tick(now), now):
            if isinstance(e, ev.JobPlaced):
                started_at[e.job_id] = now
        running_per_cycle.append(sum(1 for r in state.jobs.values() if r.status == "running"))
    assert max(running_per_cycle) == 2
    assert {j: (t - T0) // (m(1) - T0) for j, t in started_at.items()} == {
        "s_0": 0,
        "s_1": 0,
        "s_2": 10,
        "s_3": 10,
        "s_4": 20,
    }
    assert "s" not in state.arrays and "s" in state.finished  # all done at minute 30: the array ended


def test_a_held_element_does_not_use_the_throttle_and_lowest_ready_indices_go_first() -> None:
    state, log, _ = queued_array("0-3%2")
    feed(state, log, ev.JobHoldRequested(event_id=ev.det_id("h"), job_id="s_0", user="bob", ts=from_us(T0)), T0)
    assert [j.job_id for j in state.pending_now(T0)["lab/b"]] == ["s_1", "s_2"]


def test_cancel_of_the_array_cancels_every_pending_and_running_element() -> None:
    state, log, _ = queued_array("0-3%2")
    feed(state, log, Tick(T0), T0)  # s_0 and s_1 run
    feed(state, log, completed("s_0", at=m(10), node="n0"), m(10))
    out = feed(state, log, cancel("s", m(11)), m(11))
    assert kinds(out) == [
        "StopWorkload:s_1",
        "JobCancelled:s_1",
        "JobCancelled:s_2",
        "JobCancelled:s_3",
        "JobCancelled:s",
    ]
    done = narrow(ev.JobCancelled, out[-1])
    assert (done.reason, done.array_elements) == ("cancelled", 3)
    assert [narrow(ev.JobCancelled, e).array_elements for e in out[1:-1]] == [None, None, None]
    assert [narrow(ev.JobCancelled, e).attempt for e in out[1:]] == [1, None, None, None]
    assert state.jobs == {} and state.arrays == {} and "s" in state.finished
    again = feed(state, log, cancel("s", m(12)), m(12))
    rej = narrow(ev.JobRejected, again[0])
    assert (rej.request, rej.message) == ("JobCancelRequested", "job 's' already finished: nothing to cancel")


def test_hold_of_the_array_holds_every_pending_element_and_release_lets_them_all_go() -> None:
    """Four elements, %2: s_0 and s_1 run, s_2 and s_3 wait; a hold of ``s`` holds the two pending ones (not the
    running), answered last by a JobHeld of ``s`` itself; its release releases both, and they run as before."""
    state, log, _ = queued_array("0-3%2")
    feed(state, log, Tick(T0), T0)
    held = feed(state, log, ev.JobHoldRequested(event_id=ev.det_id("h"), job_id="s", user="bob", ts=from_us(T0)), T0)
    assert kinds(held) == ["JobHeld:s_2", "JobHeld:s_3", "JobHeld:s"]
    answer = narrow(ev.JobHeld, held[-1])
    assert (answer.reason, answer.array_elements) == ("no reason given", 2)
    assert [narrow(ev.JobHeld, e).array_elements for e in held[:-1]] == [None, None]
    rows, _ = read_model(state, m(1), CFG)  # each element held as a job held without a reason is
    assert rows["s_2"]["reason"] == (
        "held: held by bob at 2024-01-01 00:00:00 UTC (no reason given); never placed until released "
        "(apportion release JOB)"
    )
    assert (sorted(state.held), state.pending_now(m(1))) == (["s_2", "s_3"], {})
    again = feed(state, log, ev.JobHoldRequested(event_id=ev.det_id("h2"), job_id="s", user="bob", ts=from_us(T0)), T0)
    assert narrow(ev.JobRejected, again[0]).message == "array 's' has no pending element to hold"
    rel = ev.JobReleaseRequested(event_id=ev.det_id("r"), job_id="s", user="bob", ts=from_us(m(1)))
    assert kinds(feed(state, log, rel, m(1))) == ["JobReleased:s_2", "JobReleased:s_3", "JobReleased:s"]
    assert state.held == {}
    feed(state, log, completed("s_0", at=m(10), node="n0"), m(10))
    assert "JobPlaced:s_2" in kinds(feed(state, log, Tick(m(10)), m(10)))  # released: next under the throttle
    rel2 = ev.JobReleaseRequested(event_id=ev.det_id("r2"), job_id="s", user="bob", ts=from_us(m(2)))
    assert narrow(ev.JobRejected, feed(state, log, rel2, m(2))[0]).message == "array 's' has no held element to release"


def test_a_cancel_of_one_element_leaves_the_others() -> None:
    state, log, _ = queued_array("0-2")
    out = feed(state, log, cancel("s_1", m(1)), m(1))
    assert kinds(out) == ["JobCancelled:s_1"]
    assert sorted(state.arrays["s"].members) == ["s_0", "s_2"]


def test_duplicates_are_refused_both_ways() -> None:
    state, log, _ = queued_array("0-2")
    cases = {
        "same array id": array_sub("s", "5-6", m(1)),
        "a job named as the array": submitted("s", budget="lab/b", user="bob", at=m(1)),
        "an array over an element's id": array_sub("s_1", "0", m(1)),
    }
    got = {}
    for name, sub in cases.items():
        out = feed(state, log, sub, m(1))
        got[name] = (narrow(ev.JobRejected, out[0]).reason.value, narrow(ev.JobRejected, out[0]).message)
    assert got == {
        "same array id": ("duplicate_job", "job 's' was already submitted"),
        "a job named as the array": ("duplicate_job", "job 's' was already submitted"),
        "an array over an element's id": ("duplicate_job", "job 's_1' was already submitted"),
    }
    assert sorted(state.arrays["s"].members) == ["s_0", "s_1", "s_2"]  # refusals changed nothing of the array


def test_an_element_clash_with_an_ended_job_rejects_the_whole_array() -> None:
    state = DispatchState(TREE)
    log: list[ev.Event] = []
    feed(state, log, reg(), T0)
    feed(state, log, submitted("r_1", budget="lab/b", user="bob"), T0)
    feed(state, log, cancel("r_1", m(1)), m(1))
    out = feed(state, log, array_sub("r", "0-2", m(2)), m(2))
    rej = narrow(ev.JobRejected, out[0])
    assert len(out) == 1 and rej.job_id == "r" and rej.message == "job 'r_1' of array 'r' was already submitted"


def test_elements_get_their_index_and_array_id_in_the_environment() -> None:
    state, log, _ = queued_array("3-4")
    starts = [e for e in feed(state, log, Tick(T0), T0) if isinstance(e, ev.StartWorkload)]
    assert [(s.job_id, s.env) for s in starts] == [
        ("s_3", {"APPORTION_ARRAY_ID": "s", "APPORTION_ARRAY_INDEX": "3"}),
        ("s_4", {"APPORTION_ARRAY_ID": "s", "APPORTION_ARRAY_INDEX": "4"}),
    ]


def test_a_rebuild_folds_the_array_and_knows_the_submission_was_decided() -> None:
    state, log, _ = queued_array("0-4%2")
    feed(state, log, Tick(T0), T0)
    rebuilt = fold(log, TREE)
    assert rebuilt.arrays == state.arrays and rebuilt.pending_now(m(1)) == state.pending_now(m(1)) == {}
    sub = next(e for e in log if isinstance(e, ev.JobSubmitted))
    assert submission_decided(rebuilt, sub)
    assert not submission_decided(rebuilt, array_sub("u", "0-1"))
    fork = state.fork()
    feed(fork, [], completed("s_0", at=m(10), node="n0"), m(10))
    assert sorted(state.arrays["s"].members) == ["s_0", "s_1", "s_2", "s_3", "s_4"]  # the fork folds its own


def test_the_request_view_gives_an_arrays_owner() -> None:
    state, _, _ = queued_array("0-1")
    view = state.requests_view()
    assert view["s"].spec.user == "bob" and view["s"].spec.job_id == "s_0"
    assert view.get("nope") is None and set(view) == {"s_0", "s_1", "s"} and len(view) == 3


def test_stepping_the_same_submission_twice_changes_nothing() -> None:
    state, log, _ = queued_array("0-2")
    sub = next(e for e in log if isinstance(e, ev.JobSubmitted))
    n = len(state.jobs)
    assert step(state, sub, to_us(sub.ts), CFG) == []  # folded once already: de-duplicated by event id
    assert len(state.jobs) == n


# --------------------------------------------------------------------------- readers of submissions


def test_history_shows_each_element_as_a_job_and_a_rejected_array_as_one_row() -> None:
    from apportion.cli.history import fold_jobs

    _, log, _ = queued_array("0-2")
    rows = fold_jobs(log)
    assert {j: (r.state, r.user, r.budget) for j, r in rows.items()} == {
        "s_0": ("pending", "bob", "lab/b"),
        "s_1": ("pending", "bob", "lab/b"),
        "s_2": ("pending", "bob", "lab/b"),
    }
    state = DispatchState(TREE)
    bad: list[ev.Event] = []
    feed(state, bad, array_sub("r", "0-9").model_copy(update={"budget": "lab/nope"}), T0)  # unknown_budget
    assert {j: r.state for j, r in fold_jobs(bad).items()} == {"r": "rejected"}


def test_the_ledger_and_whatif_count_every_element() -> None:
    from apportion.audit.whatif import jobs_from_log
    from apportion.bus.reader import LogRecord
    from apportion.report import JobLedger

    _, log, _ = queued_array("0-4:2")
    assert sorted(JobLedger().apply_all(log).submitted) == ["s_0", "s_2", "s_4"]
    recs = [LogRecord("t", 0, i, None, 0, b"", e) for i, e in enumerate(log)]
    jobs, skipped = jobs_from_log(recs)
    assert ([(j.job_id, j.budget, j.gpus_per_replica, j.duration_s) for j in jobs], skipped) == (
        [("s_0", "lab/b", 1, 600.0), ("s_2", "lab/b", 1, 600.0), ("s_4", "lab/b", 1, 600.0)],
        [],
    )


# --------------------------------------------------------------------------- forecast


def test_the_forecast_respects_the_throttle() -> None:
    """Array 0-3%2 of 1-GPU, 1 h simulated elements on an empty 4-GPU node, queued at T0 + 10 min: 0 and 1
    start at once (basis ``now``: the forecast is made at T0 + 10 min, before any cycle), 2 and 3 when they
    end, 1 h later (basis ``simulated``: their declared work), though the node has room for all four."""
    from apportion.forecast import forecast
    from tests.kit.forecast_history import CFG as FCFG
    from tests.kit.forecast_history import History

    hist = History().node("n0", 4)
    hist.feed(submitted("a", at=m(10)).model_copy(update={"array": "0-3%2"}), m(10))
    fc = forecast(hist.state, m(10), FCFG)
    assert [(j.job_id, j.start_us, j.basis) for j in fc.jobs] == [
        ("a_0", m(10), "now"),
        ("a_1", m(10), "now"),
        ("a_2", m(70), "simulated"),
        ("a_3", m(70), "simulated"),
    ]


def test_forecast_of_an_array_id_and_of_an_array_not_yet_submitted(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app
    from tests.kit.audit_history import export
    from tests.kit.forecast_history import History

    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0)
    hist.feed(submitted("a", at=m(10), duration_s=1800.0).model_copy(update={"array": "5,7"}), m(10))
    path = export(tmp_path / "log.jsonl.gz", hist.log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    res = CliRunner().invoke(app, ["forecast", "a", "--json", "--from-file", path], env=env)
    assert res.exit_code == 0, res.output
    got = [(j["job_id"], j["start"]) for j in json.loads(res.stdout)["jobs"]]
    # r1 holds the only GPU until T0 + 3 h; then a_5 (30 min), then a_7
    assert got == [("a_5", from_us(m(180)).isoformat()), ("a_7", from_us(m(210)).isoformat())]
    args = ["forecast", "--submit", "-b", "lab/b", "-u", "bob", "-g", "1", "-m", "1h", "--duration", "1h"]
    res = CliRunner().invoke(app, [*args, "--array", "0-1", "--json", "--from-file", path], env=env)
    assert res.exit_code == 0, res.output
    jobs = json.loads(res.stdout)["jobs"]
    assert [j["job_id"].rsplit("_", 1)[1] for j in jobs] == ["0", "1"] and len({j["job_id"] for j in jobs}) == 2


def test_submit_array_dry_run_says_what_it_would_ask_for_and_refuses_a_bad_expression() -> None:
    from typer.testing import CliRunner

    from apportion.cli.main import app

    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    base = ["submit", "-b", "lab/a", "-g", "1", "-m", "30m", "--duration", "1h", "--user", "bob", "--dry-run"]
    res = CliRunner().invoke(app, [*base, "--job-id", "sw", "--array", "0-9:3%2"], env=env, terminal_width=200)
    assert res.exit_code == 0
    assert " ".join(res.stdout.split()) == (
        "validated sw (1x1 GPUs, allocated; array of 4: sw_0 .. sw_9, at most 2 running, budget lab/a)"
    )
    bad = CliRunner().invoke(app, [*base, "--array", "9-0"], env=env, terminal_width=200)
    assert bad.exit_code == 2 and "array '9-0': range '9-0' ends below its start" in bad.stderr


def test_elements_beyond_the_limit_keep_their_place_and_say_why_they_wait() -> None:
    """0-3%1 on 8 free GPUs: s_0 starts, s_1..s_3 wait for the limit; each keeps its place in the order
    (positions 0, 1, 2) and the reason says the array's limit, not an empty string."""
    from services.dispatcher.logic import read_model

    state, log, _ = queued_array("0-3%1")
    assert kinds(feed(state, log, Tick(T0), T0)) == ["JobPlaced:s_0", "StartWorkload:s_0"]
    jobs, _ = read_model(state, T0, CFG)
    text = "array_limit: array s runs at most 1 element(s) at once, 1 of 1 running; lower indices start first, the rest as elements end"
    assert [(j, jobs[j]["position"], jobs[j]["reason"]) for j in ("s_1", "s_2", "s_3")] == [
        ("s_1", 0, text),
        ("s_2", 1, text),
        ("s_3", 2, text),
    ]
    assert jobs["s_1"]["reason_detail"] == {
        "kind": "array_limit",
        "text": text,
        "array_id": "s",
        "limit": 1,
        "running": 1,
    }
    assert jobs["s_0"]["position"] is None  # running


def test_the_forecast_says_the_limit_of_the_elements_it_holds_back() -> None:
    """0-3%2 before any cycle: a_0 and a_1 are let through (no reason), a_2 and a_3 wait for the limit."""
    from apportion.forecast import forecast
    from tests.kit.forecast_history import CFG as FCFG
    from tests.kit.forecast_history import History

    hist = History().node("n0", 4)
    hist.feed(submitted("a", at=m(10)).model_copy(update={"array": "0-3%2"}), m(10))
    fc = forecast(hist.state, m(10), FCFG)
    assert [(j.job_id, (j.reason_detail or {}).get("kind")) for j in fc.jobs] == [
        ("a_0", None),
        ("a_1", None),
        ("a_2", "array_limit"),
        ("a_3", "array_limit"),
    ]
