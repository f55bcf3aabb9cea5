"""``apportion simulate`` end to end on a tiny trace: table, JSON and PNG."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from apportion.cli.simulate import app

TRACE = """submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s
2024-01-01T00:00:00,a1,lab/a,u,4,1,3600,7200
2024-01-01T00:01:00,a2,lab/a,u,4,1,3600,3600
2024-01-01T00:02:00,b1,lab/b,u,4,1,3600,3600
2024-01-01T00:03:00,u1,lab/b,u,2,1,0,600
"""
BUDGETS = "cluster: [{count: 1, gpus: 8}]\nbudgets: {lab: 1.0, lab/a: 0.5, lab/b: 0.5}\n"


def test_simulate_all_policies_json_and_plot(tmp_path):
    (tmp_path / "t.csv").write_text(TRACE)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    args = [
        "--trace",
        str(tmp_path / "t.csv"),
        "--budgets",
        str(tmp_path / "b.yaml"),
        "--seed",
        "1",
        "--policy",
        "all",
        "--json",
        "--plot",
        str(tmp_path / "p.png"),
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    names = ["fairshare", "fifo", "static", "priority", "slurm", "kueue", "kai"]
    assert [p["policy"] for p in doc["policies"]] == names
    assert all(p["jobs"] == 4 for p in doc["policies"])
    # Kueue has no minimum runtime: b1 (within b's nominal quota) reclaims a2 from a (borrowing) at once
    assert {p["policy"]: p["violations"] for p in doc["policies"]} == {
        **{p: 0 for p in ("fairshare", "fifo", "static", "priority", "slurm", "kai")},
        "kueue": 1,
    }
    assert doc["bursting"]["baseline"] == "static"
    assert sorted(doc["bursting"]["policies"]) == sorted(p["policy"] for p in doc["policies"])
    assert (tmp_path / "p.png").stat().st_size > 1000
    table = CliRunner().invoke(app, args[:-3] + ["--policy", "fairshare,fifo"])
    assert table.exit_code == 0 and "fairshare" in table.output


def test_seed_is_required(tmp_path):
    (tmp_path / "t.csv").write_text(TRACE)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    res = CliRunner().invoke(app, ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml")])
    assert res.exit_code != 0


def test_tail_h_stops_the_clock_after_the_last_submission(tmp_path):
    # 8 GPUs: a1 and a2 (4 GPUs each) start at once; b1 (4 GPUs, 00:02) and u1 (00:03) find the
    # node full and both runs protected for an hour. With --tail-h 0 the clock stops at 00:03,
    # so they are never placed and the waits cover a1 and a2 only (0 s); without it, all run.
    (tmp_path / "t.csv").write_text(TRACE)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    args = [
        "--trace",
        str(tmp_path / "t.csv"),
        "--budgets",
        str(tmp_path / "b.yaml"),
        "--seed",
        "1",
        "--policy",
        "fairshare,fifo",
        "--json",
    ]
    cut = json.loads(CliRunner().invoke(app, args + ["--tail-h", "0"]).output)
    assert cut["tail_h"] == 0.0
    assert [(p["never"], p["wait_p50_s"], p["wait_p95_s"]) for p in cut["policies"]] == [(2, 0.0, 0.0)] * 2
    full = json.loads(CliRunner().invoke(app, args).output)
    assert full["tail_h"] is None and [p["never"] for p in full["policies"]] == [0, 0]


# ------------------------------------------------------------------ bad input: one line, exit 2

HEADER = "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s\n"
OK_ROW = "2024-01-01T00:00:00,a1,lab/a,u,4,1,3600,7200\n"
B2 = "cluster: [{count: 2, gpus: 8}]\nbudgets: {lab: 1.0, lab/a: 0.6, lab/b: 0.4}\n"


def _run(tmp_path, *extra, trace=TRACE, budgets=B2, raw_trace=None):
    t = tmp_path / "t.csv"
    if raw_trace is not None:
        t.write_bytes(raw_trace)
    else:
        t.write_text(trace)
    (tmp_path / "b.yaml").write_text(budgets)
    args = ["--trace", str(t), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1", *extra]
    return CliRunner().invoke(app, args)


def _error(res) -> str:
    """The one error line (exit 2, no traceback)."""
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize(
    "opts, message",
    [
        (["--cycle-s", "-5"], "error: --cycle-s -5: use 0 (no periodic cycles) or at least 1 second"),
        (["--cycle-s", "0.000001"], "error: --cycle-s 1e-06: use 0 (no periodic cycles) or at least 1 second"),
        (["--cycle-s", "nan"], "error: --cycle-s nan: use 0 (no periodic cycles) or at least 1 second"),
        (["--tail-h", "inf"], "error: --tail-h inf: use a finite number of hours from 0 to 1e+06"),
        (
            ["--plot", "/nonexistent-dir/p.png"],
            "error: --plot /nonexistent-dir/p.png: directory /nonexistent-dir does not exist",
        ),
        (
            ["--policy", "fifo,bogus"],
            "error: --policy 'fifo,bogus': unknown policy 'bogus'; use fairshare, fifo, "
            "static, priority, slurm, kueue, kai, a comma list or all",
        ),
        (
            ["--slice", "weeks45-39"],
            "error: --slice 'weeks45-39': end before start (2024-11-04 .. 2024-09-30, end "
            "exclusive): the slice is empty",
        ),
        (
            ["--slice", "2017-11-01..2017-10-01"],
            "error: --slice '2017-11-01..2017-10-01': end before start "
            "(2017-11-01 .. 2017-10-01, end exclusive): the slice is empty",
        ),
        (
            ["--slice", "week44+0d"],
            "error: --slice 'week44+0d': end before start (2024-10-28 .. 2024-10-28, end "
            "exclusive): the slice is empty",
        ),
    ],
)
def test_bad_options_are_one_line_exit_2(tmp_path, opts, message):
    assert _error(_run(tmp_path, *opts)) == message


def test_plot_extension_checked_before_the_run(tmp_path):
    res = _run(tmp_path, "--plot", str(tmp_path / "p.jpg"))
    assert _error(res) == f"error: --plot {tmp_path / 'p.jpg'}: the plot is a PNG; name it *.png"
    assert res.stdout == ""  # nothing simulated


@pytest.mark.parametrize(
    "row, message",
    [
        ("2024-01-01T00:00:00,a1,lab/a,u,0,1,3600,7200", "t.csv:2: gpus_per_replica: 0 is out of range (1..1024)"),
        ("2024-01-01T00:00:00,a1,lab/a,u,-4,1,3600,7200", "t.csv:2: gpus_per_replica: -4 is out of range (1..1024)"),
        ("2024-01-01T00:00:00,a1,lab/a,u,4,0,3600,7200", "t.csv:2: replicas: 0 is out of range (1..4096)"),
        (
            "2024-01-01T00:00:00,a1,lab/a,u,4,1,3600,-1",
            "t.csv:2: duration_s: '-1' must be a finite number of seconds > 0 and <= 1e+09",
        ),
        (
            "2024-01-01T00:00:00,a1,lab/a,u,4,1,nan,7200",
            "t.csv:2: min_runtime_s: 'nan' must be a finite number of seconds >= 0 and <= 1e+09",
        ),
        (
            "2024-01-01T00:00:00,a1,lab/a,u,4,1,3600,inf",
            "t.csv:2: duration_s: 'inf' must be a finite number of seconds > 0 and <= 1e+09",
        ),
        ("2024-01-01T00:00:00,,lab/a,u,4,1,3600,7200", "t.csv:2: job_id: empty"),
        (
            "2024-01-01T00:00:00,a1,lab/a",
            "t.csv:2: expected 8 fields (submit,job_id,budget,user,gpus_per_replica,"
            "replicas,min_runtime_s,duration_s), got 3",
        ),
        (
            "-99999999999999,a1,lab/a,u,4,1,3600,7200",
            "t.csv:2: submit: '-99999999999999' is out of range (years 1..8999)",
        ),
        ("2024-01-01T00:00:00,a1,lab/a,u,four,1,3600,7200", "t.csv:2: gpus_per_replica: 'four' is not a whole number"),
        (
            "yesterday,a1,lab/a,u,4,1,3600,7200",
            "t.csv:2: submit: 'yesterday' is not ISO 8601 or seconds since the epoch",
        ),
        (OK_ROW + OK_ROW.strip(), "t.csv:3: job_id: 'a1' is also on line 2; job ids must be unique"),
    ],
)
def test_bad_trace_rows_name_file_line_and_column(tmp_path, row, message):
    line = _error(_run(tmp_path, trace=HEADER + row + "\n"))
    assert line == f"error: {tmp_path / message}"


@pytest.mark.parametrize(
    "row, message",
    [
        ("2017-10-31 10:00:00,100.0,-8,1200.0,aaa", "p.csv:2: num_gpus: -8 is out of range (1..32768)"),
        ("2017-10-31 10:00:00,100.0,0,0,aaa", "p.csv:2: num_gpus: 0 is out of range (1..32768)"),
        (
            "2017-10-31 10:00:00,-100.0,8,1200.0,aaa",
            "p.csv:2: duration: '-100.0' must be a finite number of seconds > 0 and <= 1e+09",
        ),
        ("2017-10-31 10:00:00,100.0,8,800.0,", "p.csv:2: cluster: empty"),
        (
            "2017-10-31 10:00:00,100.0,8",
            "p.csv:2: expected 5 fields (timestamp,duration,num_gpus,gpu_time,cluster), got 3",
        ),
        (
            "2017-10-31 10:00:00,100.0,9,900.0,aaa",
            "p.csv:2: num_gpus: 9 GPUs do not split into ceil(9/8) = 2 equal "
            "replicas (reference gang rule: docs/simulation.md)",
        ),
        ("yesterday,100.0,8,800.0,aaa", "p.csv:2: timestamp: 'yesterday' is not a date-time YYYY-MM-DD HH:MM:SS"),
    ],
)
def test_bad_philly_rows(tmp_path, row, message):
    (tmp_path / "p.csv").write_text("timestamp,duration,num_gpus,gpu_time,cluster\n" + row + "\n")
    (tmp_path / "b.yaml").write_text(B2)
    res = CliRunner().invoke(
        app, ["--trace", str(tmp_path / "p.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1"]
    )
    assert _error(res) == f"error: {tmp_path / message}"


def test_encoding_and_headers(tmp_path):
    assert _error(_run(tmp_path, raw_trace=HEADER.encode() + b"2024,\xff,x\n")) == (
        f"error: {tmp_path / 't.csv'}:2: not UTF-8 text (byte 0xff); save the file as UTF-8"
    )
    assert _error(_run(tmp_path, trace="foo,bar\n1,2\n")).startswith(
        f"error: {tmp_path / 't.csv'}:1: unknown trace header 'foo,bar'; expected a Philly trace "
        "(timestamp,duration,num_gpus,gpu_time,cluster), an ITP trace "
        "(job_id,cluster,submit_time,duration,num_gpus,gpu_time) or an apportion CSV (submit,job_id,budget,user,"
    )
    assert _error(_run(tmp_path, trace=HEADER.replace(",duration_s", "") + "x\n")) == (
        f"error: {tmp_path / 't.csv'}:1: missing column duration_s; expected submit,job_id,budget,user,"
        "gpus_per_replica,replicas,min_runtime_s,duration_s[,gpu_model][,checkpoint_interval_s] (user, replicas, "
        "gpu_model, checkpoint_interval_s optional)"
    )
    bom = _run(tmp_path, "--json", raw_trace=b"\xef\xbb\xbf" + TRACE.encode())  # a BOM is fine
    assert bom.exit_code == 0 and json.loads(bom.stdout)["policies"][0]["jobs"] == 4


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        (
            "cluster: [{count: 2, gpus: 8}\n",
            "b.yaml:2:1: YAML syntax error: expected ',' or ']', but got '<stream end>'",
        ),
        ("cluster: 32\nbudgets: {lab: 1.0}\n", "b.yaml: cluster: expected a list, got 32"),
        (
            "cluster: [n]\nbudgets: {lab: 1.0}\n",
            "b.yaml: cluster[0]: expected a mapping (prefix, count, gpus, model, racks, blocks), got 'n'",
        ),
        (B2 + "min_runtime: 2h\n", "b.yaml: min_runtime: expected a mapping (unallocated_fraction, cap_s), got '2h'"),
        (
            "cluster: [{count: 2, gpus: 8}]\nbudgets: [lab, lab/a]\n",
            "b.yaml: budgets: expected a mapping (key: value), got ['lab', 'lab/a']",
        ),
        (B2 + "window_s: 0\n", "b.yaml: window_s: input should be greater than or equal to 1, got 0"),
        (
            B2.replace("gpus: 8", "gpus: -8"),
            "b.yaml: cluster[0].gpus: input should be greater than or equal to 1, got -8",
        ),
        (
            B2.replace("count: 2", "count: -2"),
            "b.yaml: cluster[0].count: input should be greater than or equal to 1, got -2",
        ),
        (
            B2.replace("[{count: 2, gpus: 8}]", "[{count: 2, gpus: 8}, {count: 1, gpus: 4}]"),
            "b.yaml: cluster[1]: node id 'n000' is also in cluster[0] (give each group its own prefix)",
        ),
        (
            B2 + "min_runtime: {cap_s: -7200}\n",
            "b.yaml: min_runtime.cap_s: input should be greater than or equal to 0, got -7200",
        ),
        (
            B2 + "min_runtime: {unallocated_fraction: 1.5}\n",
            "b.yaml: min_runtime.unallocated_fraction: input should be less than or equal to 1, got 1.5",
        ),
        (
            B2.replace("[{count: 2, gpus: 8}]", "[{count: 60000, gpus: 8}, {prefix: m, count: 60000, gpus: 8}]"),
            "b.yaml: cluster: 120,000 nodes in all; at most 100,000",
        ),
        (
            B2 + "windw_s: 5\n",
            "b.yaml: (top level): unknown key 'windw_s'; allowed keys: window_s, cluster, budgets, "
            "groups, default_budget, min_runtime, gpu_models",
        ),
        (
            B2 + "min_runtime: {cap: 5}\n",
            "b.yaml: min_runtime: unknown key 'cap'; allowed keys: unallocated_fraction, cap_s",
        ),
        (
            B2.replace("gpus", "gpu"),
            "b.yaml: cluster[0]: unknown key 'gpu'; allowed keys: prefix, count, gpus, model, racks, blocks",
        ),
        (
            B2.replace("lab/a: 0.6", "lab/a: {share: 0.6, bogus: 1}"),
            "b.yaml: budgets.lab/a: unknown key 'bogus'; allowed keys: share, members, max_min_runtime_s, max_min_runtime, "
            "default_time_limit_s, default_time_limit, max_time_limit_s, max_time_limit, preempt_idle_after_s, "
            "preempt_idle_after",
        ),
        (B2 + "default_budget: lab\n", "b.yaml: default_budget: 'lab' has children; it must name a leaf budget"),
        # the second lab/a starts at column 33 of line 2 ("budgets: {" 10 + "lab: 1.0, " 10 + "lab/a: 0.6, " 12, 1-based)
        (
            B2.replace("lab/a: 0.6", "lab/a: 0.6, lab/a: 0.4"),
            "b.yaml:2:33: YAML syntax error: found duplicate key 'lab/a'",
        ),
    ],
)
def test_bad_budget_files(tmp_path, yaml_text, message):
    assert _error(_run(tmp_path, budgets=yaml_text)) == f"error: {tmp_path / message}"


def test_rejected_jobs_are_reported(tmp_path):
    trace = (
        HEADER
        + OK_ROW
        + "2024-01-01T00:01:00,x1,lab/zzz,u,4,1,3600,60\n"
        + "2024-01-01T00:02:00,x2,lab,u,4,1,3600,60\n2024-01-01T00:03:00,x3,lab/b,u,16,1,0,60\n"
    )
    res = _run(tmp_path, "--policy", "fifo", "--json", trace=trace)
    assert res.exit_code == 0, res.output
    (doc,) = json.loads(res.stdout)["policies"]
    assert doc["rejected"] == {"not_a_leaf": 1, "shape_impossible": 1, "unknown_budget": 1} and doc["never"] == 3
    assert "3 of 4 jobs rejected at admission" in res.stderr
    table = _run(tmp_path, "--policy", "fifo", trace=trace)
    assert (
        "fifo: 3 jobs rejected at admission (1 not_a_leaf, 1 shape_impossible, 1 unknown_budget); "
        "counted in never placed"
    ) in table.stdout


def test_policies_deduplicated_case_insensitive_and_rule_only_for_philly(tmp_path):
    res = _run(tmp_path, "--policy", "FIFO,fifo, Fairshare", "--json")
    doc = json.loads(res.stdout)
    assert [p["policy"] for p in doc["policies"]] == ["fifo", "fairshare"]
    assert doc["rule"] is None and doc["format"] == "csv"
    table = _run(tmp_path, "--policy", "fifo")
    assert "min_runtime as given in the trace" in table.stdout and "unallocated" not in table.stdout.splitlines()[0]
    assert "│ fifo " in table.stdout  # a 200-column console off a terminal: names are not cut


def test_philly_without_groups_warns(tmp_path):
    (tmp_path / "p.csv").write_text(
        "timestamp,duration,num_gpus,gpu_time,cluster\n2017-10-31 10:00:00,100.0,8,800.0,aaa\n"
    )
    (tmp_path / "b.yaml").write_text(B2)
    res = CliRunner().invoke(
        app, ["--trace", str(tmp_path / "p.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1", "--json"]
    )
    assert res.exit_code == 0
    assert "has no 'groups' and no 'default_budget'" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["rule"] == "unallocated_fraction=0.25, min_runtime=min(duration, 7200s)"
    assert doc["policies"][0]["rejected"] == {"unknown_budget": 1}


TWO_JOBS = """submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s
2024-01-01T00:00:00,a1,lab/a,u,8,1,60,86400
2024-01-01T00:00:00,b1,lab/b,u,8,1,60,86400
"""
GOODPUT_KEYS = (
    "utilisation",
    "mean_deficit_pp",
    "goodput",
    "lost_gpu_h",
    "lost_pct",
    "completed",
    "jct_p50_s",
    "jct_p95_s",
    "preemptions_per_job_hour",
    "max_preemptions_per_job",
)


@pytest.mark.parametrize(
    "flags", [[], ["--no-checkpoints"], ["--checkpoint-on-stop", "all"], ["--checkpoint-on-stop", "none"]]
)
def test_two_job_swap_case_returns_by_the_default_horizon(tmp_path, flags):
    # one node of 8 GPUs, lab/a and lab/b at 0.5, one 8-GPU 24 h job each, minimum runtime 60 s (issue 12):
    # without --tail-h the run ends when both are done or at the default horizon, the last submission +
    # 2 x (2 x 8 x 24 GPU-h / 8 GPUs + 24 h) = 144 h, whichever comes first
    (tmp_path / "t.csv").write_text(TWO_JOBS)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    args = ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1", "--json"]
    res = CliRunner().invoke(app, args + flags)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    for p in doc["policies"]:
        assert p["horizon"] == "2024-01-07T00:00:00+00:00"
        assert p["end"] <= p["horizon"]
        assert p["completed"] + p["unfinished"] == 2
        assert all(k in p for k in GOODPUT_KEYS)
        assert all(all(k in b for k in GOODPUT_KEYS[2:]) for b in p["budgets"])
        assert p["violations"] == 0
    fifo = next(p for p in doc["policies"] if p["policy"] == "fifo")
    # FIFO runs a1 then b1: completion times 24 h and 48 h, nothing lost
    assert (fifo["completed"], fifo["jct_p50_s"], fifo["jct_p95_s"], fifo["lost_gpu_h"]) == (2, 86400.0, 172800.0, 0.0)


RAW_SWAP = ["--no-checkpoints", "--patience-s", "0", "--checkpoint-wait-s", "0"]


def _swap_args(tmp_path) -> list[str]:
    """``apportion simulate`` arguments for the two-job swap (TWO_JOBS, BUDGETS), seed 1, JSON output."""
    (tmp_path / "t.csv").write_text(TWO_JOBS)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    return ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1", "--json"]


def _most_preemptions(args: list[str], *options: str) -> int:
    """``max_preemptions_per_job`` of fair share on the raw swap (RAW_SWAP) with ``options``."""
    res = CliRunner().invoke(app, args + ["--policy", "fairshare", *RAW_SWAP, *options])
    assert res.exit_code == 0, res.output
    (p,) = json.loads(res.output)["policies"]
    return int(p["max_preemptions_per_job"])


def test_protection_cap_w_reaches_the_engine(tmp_path):
    # the two-job swap under fair share with the goodput rules that stop it early turned off (RAW_SWAP):
    # protection 60 s x 2**p (--protection-doublings -1: fairtree-4's doubling all the way to the cap). With the
    # cap W (--protection-cap-w 1) 60 s x 2**11 = 34 h covers the 24 h a job needs, so neither job is preempted
    # more than 11 times (see test_goodput_rules_sim). With --protection-cap-w 0.001 the cap is 604.8 s of the
    # 7-day window: from the fourth preemption on every attempt is protected 604.8 s only, so the swaps go on past
    # 11. --churn-bound 0: without it the default bound (5) would stop both at 5.
    args = _swap_args(tmp_path)
    most = {
        cap: _most_preemptions(args, "--protection-doublings", "-1", "--churn-bound", "0", "--protection-cap-w", cap)
        for cap in ("1", "0.001")
    }
    assert most["1"] <= 11 < most["0.001"], most
    res = CliRunner().invoke(app, args + ["--protection-cap-w", "0"])
    assert res.exit_code != 0 and "0.001" in res.output


# the raw two-job swap. fairtree-6's defaults, 3 doublings: attempts are protected 60, 120, 240, 480 s, and from the
# fourth preemption on for the cap (W / 4 = 42 h, more than the 24 h a job needs), so no job is preempted more than
# 4 times and the churn bound (5) is not reached; fairtree-5 (cap W, no bound) gives the same 4. Doubling all the
# way (-1) needs 11 doublings (60 s x 2**11 = 34 h) to cover 24 h: 11 without a bound (fairtree-4), and with the
# default bound 5 the job preempted five times is protected until it completes, so 5. With --churn-bound 2 the job
# preempted twice is protected until it completes and the other waits for it: no third preemption; 0 is no bound.
# Each job is preempted at the end of each short protection while the other waits, so the counts are exact.
PROTECTION_OPTIONS = [
    pytest.param((), 4, id="fairtree-6, the defaults: 3 doublings, then W / 4"),
    pytest.param(("--churn-bound", "0", "--protection-cap-w", "1"), 4, id="fairtree-5: 3 doublings, then W, no bound"),
    pytest.param(("--protection-doublings", "-1"), 5, id="doubling to the cap, churn bound 5: until done after 5"),
    pytest.param(
        ("--protection-doublings", "-1", "--churn-bound", "0", "--protection-cap-w", "1"),
        11,
        id="fairtree-4: doubling to the cap W, no bound",
    ),
    pytest.param(("--churn-bound", "2"), 2, id="churn bound 2: protected until done after 2"),
    pytest.param(("--churn-bound", "0"), 4, id="churn bound 0: no bound"),
]


@pytest.mark.parametrize("options, most", PROTECTION_OPTIONS)
def test_protection_options_reach_the_engine(tmp_path, options, most):
    assert _most_preemptions(_swap_args(tmp_path), *options) == most


@pytest.mark.parametrize("option, value", [("--protection-doublings", "-2"), ("--churn-bound", "-1")])
def test_protection_options_refuse_values_below_their_range(tmp_path, option, value):
    assert CliRunner().invoke(app, _swap_args(tmp_path) + [option, value]).exit_code != 0


def test_table_shows_goodput_and_says_why_jobs_are_unfinished(tmp_path):
    (tmp_path / "t.csv").write_text(TWO_JOBS)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    args = ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1"]
    res = CliRunner().invoke(app, args + ["--policy", "static", "--no-per-budget"])
    assert res.exit_code == 0, res.output
    assert "goodput" in res.output and "lost GPU-h" in res.output
    # static slices of 4 GPUs never fit an 8-GPU job: the run ends early, not at the horizon
    assert "static: 2 admitted jobs not completed at the end" in res.output
    assert "nothing left could run them" in res.output
    res = CliRunner().invoke(app, args + ["--policy", "fifo", "--tail-h", "1", "--no-per-budget"])
    assert "fifo: 2 admitted jobs not completed" in res.output and "(--tail-h)" in res.output


def test_apportion_csv_declares_a_checkpoint_interval(tmp_path):
    # u1 is unallocated: with no interval it never checkpoints; declared 600 s, it checkpoints at 600 s of
    # progress (its 1,200 s of work end before the second)
    trace = (
        "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s,checkpoint_interval_s\n"
        "2024-01-01T00:00:00,u1,lab/a,u,2,1,0,1200,600\n"
        "2024-01-01T00:00:00,u2,lab/b,u,2,1,0,1200,\n"
    )
    (tmp_path / "t.csv").write_text(trace)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    args = ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1", "--json"]
    res = CliRunner().invoke(app, args + ["--policy", "fifo"])
    assert res.exit_code == 0, res.output
    (p,) = json.loads(res.output)["policies"]
    assert (p["checkpoints"], p["completed"]) == (1, 2)
    bad = trace.replace(",600\n", ",-5\n")
    (tmp_path / "t.csv").write_text(bad)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "checkpoint_interval_s" in res.output


def test_an_itp_trace_with_a_heterogeneous_cluster(tmp_path):
    (tmp_path / "itp.csv").write_text(
        "job_id,cluster,submit_time,duration,num_gpus,gpu_time\n"
        "x,cluster01,0,600,16,9600\ny,cluster02,60,1200,8,9600\nz,cluster02,86400,600,1,600\n"
    )
    (tmp_path / "b.yaml").write_text(
        "cluster: [{prefix: a, count: 2, gpus: 8, model: a100}, {prefix: v, count: 2, gpus: 8, model: v100}]\n"
        "budgets: {itp: 1.0, itp/cluster01: 0.5, itp/cluster02: 0.5}\n"
        "groups: {cluster01: itp/cluster01, cluster02: itp/cluster02}\n"
        "gpu_models: {constrained_fraction: 0.5}\n"
    )
    args = ["--trace", str(tmp_path / "itp.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1"]
    res = CliRunner().invoke(app, [*args, "--slice", "days0-1", "--policy", "fairshare", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "itp"
    assert doc["rule"] == "unallocated_fraction=0.25, min_runtime=min(duration, 7200s), gpu_model_fraction=0.5"
    (p,) = doc["policies"]
    assert p["jobs"] == 2 and p["completed"] == 2 and p["start"] == "2021-03-04T00:00:00+00:00"
    assert p["idle_waiting_alloc_gpu_h"] == 0.0 and p["idle_waiting_unalloc_gpu_h"] == 0.0
    table = CliRunner().invoke(app, [*args, "--policy", "fifo"])
    assert "ITP, synthetic tenancy" in table.stdout and "50% of jobs constrained to one GPU model" in table.stdout
