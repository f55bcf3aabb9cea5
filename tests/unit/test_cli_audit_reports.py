"""`apportion audit preemptions --jobs` and `audit squatting` on an export file (no Kafka; values by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apportion import events
from apportion.audit.source import write_export
from apportion.cli.main import app
from apportion.logrecord import LogRecord
from tests.kit.builders import dt, h, placed, preempted


@pytest.fixture(autouse=True)
def _no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    # a Kafka address in the environment: no stack.env of a running stack brings its namespace
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX", raising=False)


def export(tmp_path: Path, evts: list[events.Event]) -> str:
    recs = [
        LogRecord(events.topic_of(e, ""), 0, i, events.key_of(e), 1000 + i, events.encode(e), e)
        for i, e in enumerate(evts)
    ]
    path = tmp_path / "log.jsonl.gz"
    write_export(recs, path, topic_names=sorted({r.topic for r in recs}), exported_at="now")
    return str(path)


def preemption_log() -> list[events.Event]:
    # j1 (lab/a) preempted at 01:00 by k1 of lab/b, rule unallocated, 1800 GPU-s lost = 0.50 GPU-h;
    # j2 (lab/a, attempt 2) preempted at 02:00 by a drain, its loss not recorded
    return [
        preempted("j1", allocated=False, by_job_id="k1", at=h(1)).model_copy(
            update={"by_budget": "lab/b", "reason": "unallocated", "lost_gpu_s": 1800.0}
        ),
        preempted("j2", attempt=2, at=h(2)).model_copy(update={"reason": "drain"}),
    ]


def test_preemptions_jobs_json_lists_each_victim_with_its_work_lost(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app, ["audit", "preemptions", "--jobs", "--json", "--from-file", export(tmp_path, preemption_log())]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["jobs"] == [
        {
            "job_id": "j1",
            "attempt": 1,
            "budget": "lab/a",
            "by_job_id": "k1",
            "by_budget": "lab/b",
            "rule": "unallocated",
            "lost_gpu_h": 0.5,
            "at": "2024-01-01T01:00:00+00:00",
        },
        {
            "job_id": "j2",
            "attempt": 2,
            "budget": "lab/a",
            "by_job_id": None,
            "by_budget": "(drain)",
            "rule": "drain",
            "lost_gpu_h": None,
            "at": "2024-01-01T02:00:00+00:00",
        },
    ]
    assert doc["rules"] == {"drain": 1, "unallocated": 1}


def test_preemptions_jobs_table_and_a_readable_rules_line(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        ["audit", "preemptions", "--jobs", "--from-file", export(tmp_path, preemption_log())],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "preempted jobs (2; work lost 0.50 GPU-h)" in out
    [j1] = [line for line in out.splitlines() if " j1 " in line]
    assert [c.strip() for c in j1.strip("│ ").split("│")] == [
        "j1", "1", "lab/a", "k1", "lab/b", "unallocated", "0.50", "2024-01-01 01:00:00"
    ]  # fmt: skip
    assert "by rule: drain 1, unallocated 1" in out
    assert "{" not in out  # no Python dict anywhere
    assert "thrash (> 3 preemptions): none" in out


def test_preemptions_without_jobs_json_has_no_rows(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["audit", "preemptions", "--json", "--from-file", export(tmp_path, preemption_log())])
    assert res.exit_code == 0, res.output
    assert "jobs" not in json.loads(res.stdout)


def beat(util: float | None, at: int) -> events.NodeHeartbeat:
    """A heartbeat of node n0 running j (attempt 1) on GPU 0, which reports ``util`` % (None: no utilisation)."""
    return events.NodeHeartbeat(
        node_id="n0",
        gpus=(events.GpuStatus(index=0, utilization_pct=util),),
        running=(events.RunningWorkload(job_id="j", attempt=1, replica=0, gpus=(0,)),),
        ts=dt(at),
        producer="test",
    )


def test_squatting_on_heartbeats_without_utilisation_says_it_cannot_see(tmp_path: Path) -> None:
    log = export(tmp_path, [placed("j", at=h(0)), beat(None, h(0)), beat(None, h(1))])
    res = CliRunner().invoke(app, ["audit", "squatting", "--json", "--from-file", log], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {
        "runs": [],
        "heartbeats": 2,
        "heartbeats_with_utilisation": 0,
        "heartbeats_with_idle_report": 0,
        "utilisation_reported": False,
    }
    note = [ln for ln in res.stderr.splitlines() if ln.startswith("note:")]
    assert note == [
        "note: none of the 2 heartbeats in the log carries GPU utilisation (no NVML, or an agent that reports "
        "none): squatting cannot be seen"
    ]


def test_squatting_with_utilisation_finds_the_idle_run_and_says_nothing_more(tmp_path: Path) -> None:
    # GPU 0 of j at 1 % from 00:00 to 01:00: one idle stretch of 3600 s > 30 min, since 00:00
    log = export(tmp_path, [placed("j", at=h(0)), beat(1.0, h(0)), beat(1.0, h(0.5)), beat(1.0, h(1))])
    res = CliRunner().invoke(app, ["audit", "squatting", "--json", "--from-file", log], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["runs"] == [
        {
            "job_id": "j",
            "attempt": 1,
            "node_id": "n0",
            "budget": "lab/a",
            "idle_s": 3600.0,
            "since": "2024-01-01T00:00:00+00:00",
            "idle": False,
            "source": "samples",
        }
    ]
    assert (doc["heartbeats"], doc["heartbeats_with_utilisation"], doc["utilisation_reported"]) == (3, 3, True)
    assert "note:" not in res.stderr


def agent_beat(util: float | None, at: int, idle_s: float | None, idle: bool) -> events.NodeHeartbeat:
    """:func:`beat` whose running entry carries the agent's ``idle_s`` and ``idle``."""
    b = beat(util, at)
    return b.model_copy(update={"running": (b.running[0].model_copy(update={"idle_s": idle_s, "idle": idle}),)})


def test_squatting_uses_the_agents_idle_report_where_a_heartbeat_carries_one(tmp_path: Path) -> None:
    # the agent counts 2 h of idle GPUs at 02:00 (IDLE at its 2 h setting), though the samples read 50 %:
    # its report wins; 02:00 - 7200 s = 00:00
    log = export(
        tmp_path, [placed("j", at=h(0)), agent_beat(50.0, h(1), 3600.0, False), agent_beat(50.0, h(2), 7200.0, True)]
    )
    res = CliRunner().invoke(app, ["audit", "squatting", "--json", "--from-file", log], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [(r["idle_s"], r["since"], r["idle"], r["source"]) for r in doc["runs"]] == [
        (7200.0, "2024-01-01T00:00:00+00:00", True, "agent")
    ]
    assert (doc["heartbeats_with_idle_report"], doc["utilisation_reported"]) == (2, True)
    table = CliRunner().invoke(app, ["audit", "squatting", "--from-file", log], env={"COLUMNS": "300"})
    [row] = [line for line in table.stdout.splitlines() if " j " in line]
    assert [c.strip() for c in row.strip("│ ").split("│")] == [
        "j", "1", "lab/a", "n0", "IDLE 2h", "2024-01-01T00:00:00+00:00", "agent"
    ]  # fmt: skip


def test_squatting_an_agent_report_of_a_busy_run_ends_no_stretch_it_did_not_see(tmp_path: Path) -> None:
    # the agent says busy (idle_s 0) while the samples read 1 %: no stretch, nothing from the samples either
    log = export(tmp_path, [placed("j", at=h(0)), agent_beat(1.0, h(0), 0.0, False), agent_beat(1.0, h(1), 0.0, False)])
    res = CliRunner().invoke(app, ["audit", "squatting", "--json", "--from-file", log], env={"COLUMNS": "300"})
    assert json.loads(res.stdout)["runs"] == []


def test_occupancy_at_a_future_time_answers_as_of_the_logs_end_and_says_so(tmp_path: Path) -> None:
    log = export(tmp_path, preemption_log())  # its last event is at 02:00
    res = CliRunner().invoke(app, ["audit", "occupancy", "--at", "9999-12-31T00:00:00Z", "--json", "--from-file", log])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["at"], doc["requested_at"]) == ("2024-01-01T02:00:00+00:00", "9999-12-31T00:00:00+00:00")
    assert res.stderr.strip().splitlines()[-1] == (  # after the "read N records" line
        "note: --at 9999-12-31T00:00:00+00:00 is in the future; the log ends at 2024-01-01T02:00:00+00:00: "
        "occupancy as of then"
    )
    past = CliRunner().invoke(app, ["audit", "occupancy", "--at", "2024-01-01T01:30:00Z", "--json", "--from-file", log])
    doc = json.loads(past.stdout)
    assert (doc["at"], doc["requested_at"], "note:" in past.stderr) == ("2024-01-01T01:30:00+00:00", None, False)


def test_squatting_refuses_a_bad_threshold_before_reading_the_log(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = CliRunner().invoke(app, ["audit", "squatting", "--threshold", "soon", "--from-file", str(empty)])
    assert res.exit_code == 2  # not 1 for the export without records: the threshold is checked first
    assert "bad duration 'soon'" in res.stderr
