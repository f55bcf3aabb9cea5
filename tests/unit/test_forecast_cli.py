"""`apportion forecast` on an export of a hand-built history (the one of ``test_forecast``'s first case).

One 1-GPU node; r1 (lab/a, 3 h of simulated work) runs from T0; p1 (lab/a) is queued at T0 + 10 min.
The log's latest event is p1's queueing, so the forecast is made at T0 + 10 min: p1 starts at T0 + 3 h,
2 h 50 min later.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion.cli.jobs import forecast as cli_forecast
from apportion.cli.main import app
from apportion.forecast import MIN_GAP_S
from apportion.timeutil import from_us
from tests.kit.audit_history import export
from tests.kit.builders import T0, h, m
from tests.kit.forecast_history import History


@pytest.fixture(autouse=True)
def _no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    # a Kafka address: no running stack's stack.env brings its namespace; the prefix is restored after each test
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")


@pytest.fixture
def log_file(tmp_path: Path) -> str:
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0).submit("p1", m(10))
    return export(tmp_path / "log.jsonl.gz", hist.log, "")


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, ["forecast", *args], terminal_width=80)
    return res.exit_code, res.stdout, res.stderr


def test_json_gives_the_start_the_wait_and_the_chain(log_file: str) -> None:
    code, stdout, _ = run("p1", "--json", "--from-file", log_file)
    assert code == 0
    got = json.loads(stdout)
    assert got["now"] == from_us(m(10)).isoformat()
    (job,) = got["jobs"]
    assert job["start"] == from_us(h(3)).isoformat() and job["wait_s"] == 3 * 3600 - 600  # 10,200 s
    assert job["basis"] == "simulated"
    assert [(c["kind"], c["job_id"]) for c in job["chain"]] == [("run_ends", "r1")]
    # the end taken for every run the forward run met: r1, and p1 itself (1 h of work from T0 + 3 h)
    assert [(r["job_id"], r["end"], r["basis"], r["note"]) for r in got["runs"]] == [
        ("p1", from_us(h(4)).isoformat(), "simulated", "simulated duration: 3600 s of work in this attempt"),
        ("r1", from_us(h(3)).isoformat(), "simulated", "simulated duration: 10800 s of work in this attempt"),
    ]


def test_the_table_fits_80_columns_with_the_chain_for_one_job(log_file: str) -> None:
    code, stdout, _ = run("p1", "--from-file", log_file)
    assert code == 0
    assert max(len(line) for line in stdout.splitlines()) <= 80
    row = next(line for line in stdout.splitlines() if line.startswith("p1"))
    assert row.split() == ["p1", "lab/a", "01-01", "03:00", "2h50m", "simulated", "no_free_gpus"]
    chain = " ".join(stdout.split())  # wrapped at 80 columns, uncut
    assert (
        "2024-01-01 03:00:00 r1 (attempt 1, lab/a) ends: simulated duration: 10800 s of work in this attempt" in chain
    )


def test_a_running_job_is_refused_with_its_start(log_file: str) -> None:
    code, _, stderr = run("r1", "--from-file", log_file)
    assert code == 1
    assert "job 'r1' is running (attempt 1, since 2024-01-01T00:00:00+00:00)" in stderr


def test_a_running_job_under_json_gives_the_reason_and_its_start_and_time_limit(tmp_path: Path) -> None:
    # r1 runs from T0 with a 4 h limit (the node agent stops it at T0 + 4 h); the JSON error object says so
    # as the stderr line does, exit 1 (docs/operations.md: a job not pending)
    hist = History().node("n0", 1).submit("r1", T0, duration_s=3 * 3600.0, time_limit_s=4 * 3600.0)
    path = export(tmp_path / "log.jsonl.gz", hist.submit("p1", m(10)).log, "")
    code, stdout, stderr = run("r1", "--json", "--from-file", path)
    assert code == 1
    got = json.loads(stdout)
    message = (
        "job 'r1' is running (attempt 1, since 2024-01-01T00:00:00+00:00, time limit at "
        "2024-01-01T04:00:00+00:00): only pending jobs have a forecast"
    )
    assert got == {
        "ok": False,
        "verdict": "refused",
        "reason": "running",
        "message": message,
        "exit_code": 1,
        "job_id": "r1",
        "state": "running",
        "attempt": 1,
        "since": "2024-01-01T00:00:00+00:00",
        "time_limit_at": "2024-01-01T04:00:00+00:00",
    }
    assert message in " ".join(stderr.split())


def test_a_running_job_without_a_time_limit_has_none_and_an_unknown_job_is_not_found(log_file: str) -> None:
    code, stdout, _ = run("r1", "--json", "--from-file", log_file)
    got = json.loads(stdout)
    assert code == 1 and (got["reason"], got["since"], got["time_limit_at"]) == (
        "running",
        "2024-01-01T00:00:00+00:00",
        None,
    )
    code, stdout, _ = run("nope", "--json", "--from-file", log_file)
    got = json.loads(stdout)
    assert code == 1 and (got["verdict"], got["reason"], got["job_id"]) == ("not_found", "no_job", "nope")


def test_the_text_prints_times_at_seconds_and_the_json_keeps_the_microseconds(log_file: str) -> None:
    at = "2024-01-01T00:20:00.123456Z"
    code, stdout, _ = run("p1", "--at", at, "--from-file", log_file)
    assert code == 0
    assert stdout.splitlines()[0].strip() == "forecast at 2024-01-01T00:20:00+00:00 (1 pending job(s))"
    code, stdout, _ = run("p1", "--json", "--at", at, "--from-file", log_file)
    assert code == 0 and json.loads(stdout)["now"] == "2024-01-01T00:20:00.123456+00:00"


def test_a_job_not_in_the_log_is_refused(log_file: str) -> None:
    code, _, stderr = run("nope", "--from-file", log_file)
    assert code == 1 and "job 'nope' is not in the log" in stderr


def test_filters_keep_the_budgets_jobs_and_an_at_before_the_log_is_bad_input(log_file: str) -> None:
    code, stdout, _ = run("--json", "-b", "lab/b", "--from-file", log_file)
    assert code == 0 and json.loads(stdout)["jobs"] == []
    code, _, stderr = run("--at", "2023-12-31T00:00:00Z", "--from-file", log_file)
    assert code == 2 and "before the log's latest event" in stderr


def test_submit_forecasts_a_job_before_it_is_submitted_and_says_when_it_would_be_rejected(log_file: str) -> None:
    # at T0 + 20 min, "s" (lab/a, 1 GPU, 30 min of work) would queue behind p1 (same budget, submitted at
    # T0 + 10 min): r1 ends at T0 + 3 h, p1 runs its 1 h of work to T0 + 4 h, then s starts.
    at = from_us(m(20)).isoformat()
    args = ["--submit", "-b", "lab/a", "-u", "alice", "-g", "1", "-m", "30m", "--duration", "30m", "--at", at]
    code, stdout, _ = run(*args, "--json", "--from-file", log_file)
    assert code == 0
    (job,) = json.loads(stdout)["jobs"]
    assert job["start"] == from_us(h(4)).isoformat() and job["budget"] == "lab/a"
    code, _, stderr = run("--submit", "-b", "lab/a", "-u", "alice", "-g", "2", "-m", "1h", "--from-file", log_file)
    assert code == 1 and "it would be rejected: shape_impossible" in stderr
    code, _, stderr = run("--submit", "-b", "lab/a", "--from-file", log_file)
    assert code == 2 and "--submit needs" in stderr
    code, _, stderr = run("--submit", "-b", "lab/a", "-g", "1", "-m", "1h", "-t", "soon", "--from-file", log_file)
    assert code == 2 and "--time" in stderr


def test_a_job_not_started_within_the_horizon_starts_after_it(log_file: str) -> None:
    # now T0 + 10 min, horizon 1 h: r1 ends at T0 + 3 h, beyond it; p1 starts after T0 + 1 h 10 min
    code, stdout, _ = run("p1", "--json", "--horizon", "1h", "--from-file", log_file)
    assert code == 0
    got = json.loads(stdout)
    (job,) = got["jobs"]
    assert (job["start"], job["after"]) == (None, from_us(h(1) + 600_000_000).isoformat())
    assert got["horizon"] == job["after"] and (got["spacing"], got["min_gap_s"]) == (0.02, 30.0)
    code, stdout, _ = run("p1", "--horizon", "1h", "--from-file", log_file)
    row = next(line for line in stdout.splitlines() if line.startswith("p1"))
    assert row.split() == ["p1", "lab/a", ">01-01", "01:10", ">1h", "-", "no_free_gpus"]


@pytest.mark.parametrize("spacing", ["-0.1", "1.5"])
def test_a_spacing_outside_0_to_1_is_bad_input(log_file: str, spacing: str) -> None:
    code, stdout, _ = run("p1", "--json", "--spacing", spacing, "--from-file", log_file)
    got = json.loads(stdout)
    assert code == 2 and got["exit_code"] == 2 and "a fraction from 0 to 1" in got["message"]


def test_a_negative_min_gap_is_bad_input_and_json_names_the_one_used(log_file: str) -> None:
    code, stdout, _ = run("p1", "--json", "--min-gap", "-1", "--from-file", log_file)
    got = json.loads(stdout)
    assert code == 2 and got["exit_code"] == 2 and "--min-gap -1: seconds, not negative" in got["message"]
    code, stdout, _ = run("p1", "--json", "--min-gap", "0", "--from-file", log_file)
    assert code == 0 and json.loads(stdout)["min_gap_s"] == 0.0


def test_the_clis_least_gap_is_the_forecasts_default() -> None:
    assert inspect.signature(cli_forecast).parameters["min_gap"].default == MIN_GAP_S == 30.0


def test_the_exact_forward_run_with_recent_waits_keeps_an_allocated_jobs_start(log_file: str) -> None:
    # p1 is allocated: the recent-waits estimate does not apply; unspaced, its start is r1's end, T0 + 3 h
    code, stdout, _ = run("p1", "--json", "--spacing", "0", "--recent-waits", "--from-file", log_file)
    (job,) = json.loads(stdout)["jobs"]
    assert code == 0 and (job["start"], job["forward_start"], job["forward_basis"]) == (
        from_us(h(3)).isoformat(),
        from_us(h(3)).isoformat(),
        "simulated",
    )


def test_recent_waits_put_an_unallocated_job_no_earlier_than_its_sizes_median_wait(tmp_path: Path) -> None:
    # one 1-GPU node. r0 (allocated, 2 h) runs from T0; u1..u5 (unallocated, 1 min each) queue at T0 + 1..5 min
    # and run one after another from r0's end: each waited 2 h - 1 min = 7,140 s. r6 (allocated, 1 h) starts at
    # T0 + 2 h 6 min; q (unallocated) queues at T0 + 2 h 7 min, the log's end. The forward run starts q at r6's
    # end, T0 + 3 h 6 min; the median of the 5 recent waits puts it at T0 + 2 h 7 min + 7,140 s = T0 + 4 h 6 min.
    hist = History().node("n0", 1).submit("r0", T0, duration_s=7200.0)
    for i in range(1, 6):
        hist.submit(f"u{i}", m(i), min_runtime_s=0.0, duration_s=60.0)
    hist.complete("r0", h(2))
    for i in range(1, 6):
        hist.complete(f"u{i}", h(2) + m(i) - T0)
    hist.submit("r6", h(2) + m(6) - T0, duration_s=3600.0).submit("q", h(2) + m(7) - T0, min_runtime_s=0.0)
    log = export(tmp_path / "log.jsonl.gz", hist.log, "")
    code, stdout, _ = run("q", "--json", "--spacing", "0", "--recent-waits", "--from-file", log)
    (job,) = json.loads(stdout)["jobs"]
    assert code == 0 and (job["start"], job["basis"]) == (from_us(h(4) + m(6) - T0).isoformat(), "recent_waits")
    assert (job["forward_start"], job["forward_basis"]) == (from_us(h(3) + m(6) - T0).isoformat(), "simulated")
    assert (
        "the median wait of 5 recent unallocated job(s) of its size that waited longer than 0 s is 1.98 h"
        in (job["note"])
    )
    code, stdout, _ = run("q", "--json", "--spacing", "0", "--from-file", log)  # without: the forward run's start
    (job,) = json.loads(stdout)["jobs"]
    assert (job["start"], job["basis"]) == (from_us(h(3) + m(6) - T0).isoformat(), "simulated")


def test_the_folded_log_is_frozen_out_of_the_forward_runs_collections(log_file: str) -> None:
    """rule D9.scale: once the log is folded the command settles the heap (apportion.heap.settle_heap), so the
    forward run's collections never walk the folded state again; the conftest puts the collector back after."""
    import gc

    from apportion.heap import THRESHOLDS

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    code, out, _ = run("--from-file", log_file, "--json")
    assert code == 0, out
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == THRESHOLDS
