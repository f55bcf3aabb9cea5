"""``share --forecast``, ``queue --start`` and the protection notice: pure functions of :mod:`apportion.forecast`.

Tree::

    lab (1.0)
    ├── a  0.5
    └── b  0.5

One node of 4 GPUs from T0; a1 (lab/a, 4 GPUs, 2 days of simulated work) runs from T0; W = 7 days.
With K(t) = 4 GPUs x t, E_a = E_b = K / 2 and O_a = 4 x min(t, 2 d): r_a = 2 while a1 runs, then
4 x 2 d / (2 x t) = 4 d / t; r_b = 0 throughout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from apportion.forecast import JobForecast, budget_forecast, protection_notice, with_starts
from apportion.timeutil import from_us
from tests.kit.builders import T0, d, h, m
from tests.kit.forecast_history import CFG, History, one_job

DAY = 86_400


def test_r_and_rank_slide_with_the_window_and_running_work_ends_at_its_declared_end() -> None:
    fc = budget_forecast(one_job().state, T0, CFG, days=3, step_s=DAY)
    assert fc.times == [T0, d(1), d(2), d(3)]
    a, b, lab = fc.points["lab/a"], fc.points["lab/b"], fc.points["lab"]
    assert [p.ratio for p in a] == [0.0, 2.0, 2.0, pytest.approx(4 / 3)]
    assert [p.ratio for p in b] == [0.0, 0.0, 0.0, 0.0]
    assert [p.ratio for p in lab[1:]] == [1.0, 1.0, pytest.approx(2 / 3)]  # O_a over all of K
    # at now K = 0: both r are 0/0 = 0 and the tie goes by path; then b (r = 0) is served before a
    assert [(p.rank, q.rank) for p, q in zip(a, b, strict=True)] == [(0, 1), (1, 0), (1, 0), (1, 0)]
    assert [p.rank for p in lab] == [None] * 4
    # b is behind enough to preempt a's expired runs while a1 runs (r_a - r_b = 2 >= delta); a1 ends at 2 d
    assert [p.can_preempt for p in b] == [(), ("lab/a",), (), ()]
    assert [p.can_preempt for p in a] == [()] * 4  # b holds nothing
    first = fc.first_preempting("lab/b")
    assert first is not None and first.at_us == d(1) and fc.first_preempting("lab/a") is None
    doc = fc.to_dict()
    assert doc["times"][1] == from_us(d(1)).isoformat()
    row_b = next(x for x in doc["budgets"] if x["path"] == "lab/b")
    assert row_b["can_preempt_from"] == from_us(d(1)).isoformat()


def test_the_callers_state_is_not_changed_and_bad_arguments_are_refused() -> None:
    hist = one_job()
    before = (dict(hist.state.jobs), hist.state.clock_us)
    budget_forecast(hist.state, T0, CFG, days=1, step_s=DAY)
    assert (dict(hist.state.jobs), hist.state.clock_us) == before
    with pytest.raises(ValueError, match="positive"):
        budget_forecast(hist.state, T0, CFG, days=0)
    with pytest.raises(ValueError, match="before the state's latest event"):
        budget_forecast(hist.state, T0 - 1, CFG)


def _job(job_id: str, start: int | None, basis: str) -> JobForecast:
    return JobForecast(job_id, "lab/a", "u", 1, 1, start, None, basis, "", None, ())


def test_queue_start_adds_each_pending_jobs_forecast() -> None:
    from apportion.forecast import Forecast

    fc = Forecast(T0, d(14), jobs=[_job("p1", h(3), "simulated"), _job("p2", None, "unknown")])
    rows = [
        {"job_id": "r1", "state": "running"},
        {"job_id": "p1", "state": "pending"},
        {"job_id": "p2", "state": "pending"},
        {"job_id": "p3", "state": "pending"},
    ]
    got = with_starts(rows, fc)
    assert [(r["job_id"], r.get("est_start"), r.get("est_basis")) for r in got] == [
        ("r1", None, None),
        ("p1", from_us(h(3)).isoformat(), "simulated"),
        ("p2", None, "unknown"),
        ("p3", None, ""),
    ]
    assert "est_start" not in got[0] and rows[1] == {"job_id": "p1", "state": "pending"}


@pytest.mark.parametrize(
    "row,now,text",
    [
        pytest.param(
            {"state": "running", "allocated": True, "protected_until": from_us(h(2)).isoformat()},
            m(30),
            "protected until 2024-01-01 02:00:00 UTC; preemptible after",
            id="protected",
        ),
        pytest.param(
            {"state": "running", "allocated": True, "protected_until": from_us(h(2)).isoformat()},
            h(2),
            "preemptible since 2024-01-01 02:00:00 UTC",
            id="ended at that instant",
        ),
        pytest.param(
            {"state": "running", "allocated": True, "protected_until": "until started"},
            T0,
            "protected until started",
            id="not started",
        ),
        pytest.param({"state": "running", "allocated": False}, T0, "unallocated: preemptible at any time", id="free"),
        pytest.param({"state": "pending", "allocated": True}, T0, "", id="pending"),
        pytest.param({"state": "running", "allocated": True}, T0, "", id="no protection recorded"),
    ],
)
def test_protection_notice(row: dict, now: int, text: str) -> None:
    assert protection_notice(row, now) == text


def test_share_forecast_and_queue_start_from_an_export(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app
    from tests.kit.audit_history import export

    path = export(tmp_path / "log.jsonl.gz", one_job().log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    res = CliRunner().invoke(app, ["share", "--forecast", "3d", "--json", "--from-file", path], env=env)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    b = next(x for x in doc["budgets"] if x["path"] == "lab/b")
    assert [p["rank"] for p in b["points"][1:]] == [0, 0, 0] and b["can_preempt_from"] == from_us(d(1)).isoformat()
    table = CliRunner().invoke(app, ["share", "--forecast", "3d", "--from-file", path], env=env, terminal_width=80)
    assert table.exit_code == 0 and max(len(x) for x in table.stdout.splitlines()) <= 80
    lines = {x.split()[0]: x.split()[1:] for x in table.stdout.splitlines()[2:] if x.strip()}
    assert lines["a"] == ["0.000/0", "2.000/1", "2.000/1", "1.333/1", "-"]
    assert lines["b"][-3:] == ["0.000/0", "01-02", "00:00"]
    bad = CliRunner().invoke(app, ["share", "--forecast", "0d", "--from-file", path], env=env)
    assert bad.exit_code == 2


def test_explain_says_what_a_running_jobs_protection_promises(tmp_path: Path) -> None:
    """a1 (min runtime 1 h, the builder's default) started at T0; the log ends at T0: protected until 01:00."""
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app
    from apportion.forecast import protection_of
    from tests.kit.audit_history import export

    hist = one_job()
    assert protection_of(hist.state, "a1", m(30)) == "protected until 2024-01-01 01:00:00 UTC; preemptible after"
    assert protection_of(hist.state, "a1", h(2)) == "preemptible since 2024-01-01 01:00:00 UTC"
    assert protection_of(hist.state, "nope", T0) == ""
    path = export(tmp_path / "log.jsonl.gz", hist.log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    res = CliRunner().invoke(app, ["audit", "explain", "a1", "--json", "--from-file", path], env=env)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["protection"] == "protected until 2024-01-01 01:00:00 UTC; preemptible after"


# --------------------------------------------------------------------------- arrivals replayed


def test_a_replayed_arrival_of_a_budget_ahead_goes_first() -> None:
    """One 1-GPU node: r1 (lab/a, 3 h, min runtime and checkpoint interval 1 h) runs from T0, p1 (lab/a) waits
    from T0 + 10 min. Without arrivals p1 starts when r1 ends (3 h). A copy of b0 (lab/b, r = 0: ahead of
    lab/a by more than delta, 2 h of work) arriving at 2 h preempts r1 (protection ended at 1 h; checkpointed
    at 2 h, so 1 h left) and starts after the 30 s grace; it ends at 4 h 30 s; then r1's second attempt
    (submitted before p1) runs its last hour: p1 starts at 5 h 30 s."""
    from apportion import events as ev
    from apportion.forecast import forecast

    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    b0 = ev.JobQueued(
        job_id="b0", budget="lab/b", user="bob", allocated=True, gpus_per_replica=1, replicas=1, min_runtime_s=3600.0,
        duration_s=7200.0, submitted_at=from_us(T0 - d(1) + h(2)), ts=from_us(T0 - d(1) + h(2)),
    )  # fmt: skip
    assert forecast(hist.state, m(10), CFG, job_ids=["p1"]).jobs[0].start_us == h(3)
    fc = forecast(hist.state, m(10), CFG, job_ids=["p1"], arrivals=[(h(2), b0)], spacing=0.0)  # the exact run
    assert fc.jobs[0].start_us == h(5) + 30_000_000
    assert fc.runs[("b0~1", 1)].end_us == h(4) + 30_000_000 and ("b0~2", 1) not in fc.runs  # next copy: a day on
    chain = [(c.kind, c.job_id, c.attempt) for c in fc.jobs[0].chain]
    assert chain == [("run_ends", "r1", 1), ("run_ends", "b0~1", 1), ("run_ends", "r1", 2)]


def test_recent_arrivals_are_the_last_days_first_queueings_a_day_on() -> None:
    from apportion import events as ev
    from apportion.forecast import recent_arrivals

    def queued(job_id: str, at: int, attempt: int = 1) -> ev.JobQueued:
        return ev.JobQueued(
            job_id=job_id, budget="lab/a", user="u", allocated=True, gpus_per_replica=1, replicas=1,
            min_runtime_s=60.0, duration_s=60.0, submitted_at=from_us(at), ts=from_us(at), attempt=attempt,
        )  # fmt: skip

    hour = h(1) - T0
    log = [queued("old", d(1) - 1), queued("x", d(1)), queued("y", d(1) + 5 * hour), queued("x", d(1) + 6 * hour, 2)]
    log.append(queued("late", d(2)))
    got = recent_arrivals(log, d(2))
    assert [(t, j.job_id) for t, j in got] == [(d(2), "x"), (d(2) + 5 * hour, "y")]


def test_forecast_with_arrivals_from_an_export(tmp_path: Path) -> None:
    """r1 and p1 were queued within the last day: their copies come a day later, after p1 starts (3 h)."""
    import json

    from typer.testing import CliRunner

    from apportion.cli.main import app
    from tests.kit.audit_history import export

    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    path = export(tmp_path / "log.jsonl.gz", hist.log, "")
    env = {"APPORTION_KAFKA_BOOTSTRAP": "127.0.0.1:1", "APPORTION_TOPIC_PREFIX": ""}
    res = CliRunner().invoke(app, ["forecast", "p1", "--with-arrivals", "--json", "--from-file", path], env=env)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["jobs"][0]["start"] == from_us(h(3)).isoformat()


@pytest.mark.parametrize(
    ("time_limit_s", "ratios_a"),
    [
        # no limit, no history: a2 runs W/4 = 42 h from 2 h; r_a = 4 x (2 h + min(t - 2 h, 42 h)) / (0.5 x 4 x t)
        (None, [0.0, 2.0, 44 / 24, pytest.approx(44 / 36)]),
        # a 1-day limit: a2 runs 2 h .. 26 h; r_a = 4 x min(t, 26 h) / (2 x t)
        (86_400.0, [0.0, 2.0, pytest.approx(26 / 24), pytest.approx(26 / 36)]),
    ],
    ids=["ends-at-w-over-4", "ends-at-its-time-limit"],
)
def test_a_plain_command_job_starts_and_is_charged_under_the_logs_heartbeat_timeout(
    time_limit_s: float | None, ratios_a: list[float]
) -> None:
    """The log's dispatcher settings carry a heartbeat timeout (the stack's) and no heartbeat comes in the forward
    run: no node is lost for want of one. a1 (lab/a, 4 GPUs, 2 h of work) runs on n0 from T0; a2, lab/a's only
    pending job, is a command with no declared work: it starts when a1 ends and runs as D12 estimates its end."""
    from apportion.domain.dispatch import DispatchConfig

    hist = History().node("n0", 4).submit("a1", T0, gpus=4, duration_s=7200.0)
    hist.submit("a2", T0, gpus=4, duration_s=None, command=["train"], time_limit_s=time_limit_s)
    fc = budget_forecast(hist.state, T0, DispatchConfig(heartbeat_timeout_s=30.0), days=3, step_s=DAY)
    assert [p.ratio for p in fc.points["lab/a"]] == ratios_a
    assert [p.ratio for p in fc.points["lab/b"]] == [0.0] * 4
