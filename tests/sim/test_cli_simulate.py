"""``apportion simulate`` end to end on a tiny trace: table, JSON and PNG."""

from __future__ import annotations

import json

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
    args = ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1",
            "--policy", "all", "--json", "--plot", str(tmp_path / "p.png")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [p["policy"] for p in doc["policies"]] == ["fairshare", "fifo", "static", "priority"]
    assert all(p["violations"] == 0 and p["jobs"] == 4 for p in doc["policies"])
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
    args = ["--trace", str(tmp_path / "t.csv"), "--budgets", str(tmp_path / "b.yaml"), "--seed", "1",
            "--policy", "fairshare,fifo", "--json"]
    cut = json.loads(CliRunner().invoke(app, args + ["--tail-h", "0"]).output)
    assert cut["tail_h"] == 0.0
    assert [(p["never"], p["wait_p50_s"], p["wait_p95_s"]) for p in cut["policies"]] == [(2, 0.0, 0.0)] * 2
    full = json.loads(CliRunner().invoke(app, args).output)
    assert full["tail_h"] is None and [p["never"] for p in full["policies"]] == [0, 0]
