"""`apportion top` piped (stdout not a terminal): one frame, then exit; `--iterations N`: N frames.

Redis is the in-memory fake of the accounting tests, holding read-model rows as the services write them."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from typer.testing import CliRunner

from apportion import readmodel
from apportion.cli import main, nodes
from tests.kit.fakes import FakeRedis


@pytest.fixture
def rc(monkeypatch: pytest.MonkeyPatch) -> FakeRedis:
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    r = FakeRedis()
    r.hset(readmodel.budgets_key(), {"lab": readmodel.dumps({"path": "lab", "share": 1.0, "abs_share": 1.0})})
    r.hset(
        readmodel.jobs_key(),
        {
            "j1": readmodel.dumps(
                {"job_id": "j1", "budget": "lab", "user": "ann", "state": "pending", "position": 0, "reason": "why"}
            )
        },
    )
    r.hset(
        readmodel.nodes_key(),
        {"n0": readmodel.dumps({"node_id": "n0", "state": "ready", "free_gpus": 8, "gpu_count": 8})},
    )
    r.hset(readmodel.usage_key(), {"meta": readmodel.dumps({"at": "2026-12-01T00:00:00+00:00", "capacity_gpus": 8})})
    monkeypatch.setattr(nodes, "_redis", lambda url: r)
    return r


def _invoke(args: list[str], within_s: float = 20.0) -> Any:
    got: list[Any] = []
    t = threading.Thread(
        target=lambda: got.append(CliRunner().invoke(main.app, args, env={"COLUMNS": "200"})), daemon=True
    )
    t.start()
    t.join(within_s)
    assert got, f"`apportion {' '.join(args)}` did not return within {within_s} s on a pipe"
    return got[0]


def test_top_on_a_pipe_prints_one_frame_and_exits(rc: FakeRedis) -> None:
    res = _invoke(["top"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("budgets at 2026-12-01T00:00:00+00:00") == 1
    assert "queue head (1 shown)" in res.stdout and "why" in res.stdout
    assert "nodes: ready 1; GPUs free 8/8" in res.stdout


def test_top_on_a_pipe_with_iterations_prints_that_many_frames(rc: FakeRedis) -> None:
    res = _invoke(["top", "--iterations", "3", "--interval", "0"])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("budgets at ") == 3


def test_top_lists_the_runs_their_agents_report_idle_longest_first(rc: FakeRedis) -> None:
    def running(job: str, idle_s: float, idle: bool) -> str:
        return readmodel.dumps(
            {"job_id": job, "budget": "lab", "user": "bo", "state": "running", "replicas": 1, "gpus_per_replica": 4,
             "nodes": ["n0"], "idle_s": idle_s, "idle": idle}
        )  # fmt: skip

    rc.hset(
        readmodel.jobs_key(),
        {"r1": running("r1", 7200.0, True), "r2": running("r2", 90000.0, True), "r3": running("r3", 600.0, False)},
    )
    res = _invoke(["top"])
    assert res.exit_code == 0, res.output
    assert "idle runs (2)" in res.stdout
    rows = [line.split() for line in res.stdout.splitlines() if line.split()[1:2] in (["r1"], ["r2"], ["r3"])]
    assert [(r[1], r[9]) for r in rows] == [("r2", "1d1h"), ("r1", "2h")]  # 90000 s, 7200 s; r3 not idle yet
    doc = _invoke(["top", "--json"])
    assert [j["job_id"] for j in json.loads(doc.stdout)["idle_runs"]] == ["r2", "r1"]


def test_top_in_80_columns_cuts_no_budget_job_or_time(rc: FakeRedis) -> None:
    # lab ── prior ── language, robotics; lab ── vision: the example tree's names, the deepest two levels down
    rows = {p: readmodel.dumps({"path": p, "share": 0.5, "abs_share": 0.3, "rank": 0}) for p in (
        "lab", "lab/prior", "lab/prior/language", "lab/prior/robotics", "lab/vision")}  # fmt: skip
    rc.hset(readmodel.budgets_key(), rows)
    reason = (
        "protected_until: the runs it could preempt are protected; the first protection ends "
        "2026-12-07T06:49:19.815344+00:00 (h1 of lab/vision)"
    )
    job = {"job_id": "carol-043701b01b60", "budget": "lab/prior/language", "user": "carol", "state": "pending",
           "position": 0, "replicas": 8, "gpus_per_replica": 8, "reason": reason}  # fmt: skip
    rc.hset(readmodel.jobs_key(), {"j1": readmodel.dumps(job)})
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(CliRunner().invoke(main.app, ["top"], env={"COLUMNS": "80"})))
    t.start()
    t.join(20)
    out = got[0].stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out
    words = out.split()
    for name in ("language", "robotics", "vision", "running", "carol-043701b01b60", "lab/prior/language"):
        assert name in words, name
    assert "2026-12-07T06:49:19.815344+00:00" in out.replace("\n", "")
