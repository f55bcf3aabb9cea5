"""`audit verify` passes on the logs the stack writes, and `audit squatting` sees simulated idle jobs (issue 13).

Three logs, all on the session's real Kafka and Redis:

* a fresh stack (`apportion stack up`, 2 simulated 8-GPU nodes) after `budget apply` and one submit: verify,
  read models included, exits 0 (it used to exit 1: a snapshot stamped before budgets it contained);
* the same stack a little later: the job submitted is one that simulated workloads leave idle (seed 0, see
  ``services.node_agent.logic.simulated_utilisation``), a second one is busy, and `audit squatting` names the
  idle one only;
* a shortened main job (``python tools/demo.py``: its own trace of 40 jobs over one day on 4 nodes, at
  2,880x), which runs verify at the end of its replay and exits non-zero when it fails.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.kit.livestack import until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 90.0
IDLE_JOB = "j21"  # simulated_utilisation(0, "j21") == 0.0 (tests/service/test_node_agent.py)
BUSY_JOB = "j7"  # 94.5%


class Cli:
    def __init__(self, env: dict[str, str]) -> None:
        from typer.testing import CliRunner

        self.env = env
        self.runner = CliRunner()

    def run(self, *args: str, code: int = 0) -> Any:
        from apportion.cli.main import app

        res = self.runner.invoke(app, list(args), env=self.env)
        assert res.exit_code == code, f"exit {res.exit_code} != {code}: {res.output}"
        return res

    def json(self, *args: str, code: int = 0) -> Any:
        return json.loads(self.run(*args, "--json", code=code).stdout)


@pytest.fixture(scope="module")
def fresh(kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    from tests.kit.livestack import live_stack

    with live_stack(
        kafka_bootstrap, redis_url, tmp_path_factory, name="verify", db=15, sim_nodes=2, gpus_per_node=8
    ) as (_, env, _):
        yield Cli(dict(env))


def _running(cli: Cli, job_id: str) -> bool:
    rows = {r["job_id"]: r for r in cli.json("queue")}
    return rows.get(job_id, {}).get("state") == "running"


def test_verify_passes_on_a_fresh_stack_after_one_submit(fresh: Cli) -> None:
    fresh.run("budget", "apply", str(ROOT / "infra/budgets/example.yaml"))
    fresh.run(
        "submit", "--job-id", IDLE_JOB, "-b", "lab/vision", "-g", "2", "-m", "2h", "--duration", "3h", "-u", "carol"
    )
    until(lambda: _running(fresh, IDLE_JOB), "the job to run", DEADLINE_S)
    # settled: accounting's read model shows a snapshot at or after the placement (it snapshots on change)
    ex = fresh.json("audit", "explain", IDLE_JOB)
    placed_at = datetime.fromisoformat(next(e["at"] for e in ex["timeline"] if e["kind"] == "JobPlaced"))

    def settled() -> bool:
        import redis as redis_lib

        from apportion.bus.security import redis_auth
        from apportion.readmodel import loads

        r = redis_lib.Redis.from_url(fresh.env["APPORTION_REDIS_URL"], **redis_auth())
        try:
            raw = r.hget(f"{fresh.env['APPORTION_TOPIC_PREFIX']}apportion:rm:usage", "meta")
        finally:
            r.close()
        return raw is not None and datetime.fromisoformat(loads(raw)["at"]) >= placed_at

    until(settled, "accounting to snapshot the placement", DEADLINE_S)
    rep = fresh.json("audit", "verify")
    assert rep["ok"], rep["mismatches"]
    assert rep["read_models"] and rep["snapshots"] >= 1 and rep["decision_ticks"] >= 1
    assert rep["signed_requests"] >= 1
    # and no reader dead-lettered anything on the way (a fresh stack used to write one `event_id reused`)
    assert fresh.json("deadletter") == []


def test_squatting_names_the_simulated_idle_job_and_not_the_busy_one(fresh: Cli) -> None:
    if not _running(fresh, IDLE_JOB):  # run alone: the first test's job
        fresh.run(
            "submit", "--job-id", IDLE_JOB, "-b", "lab/vision", "-g", "2", "-m", "2h", "--duration", "3h", "-u", "carol"
        )
    fresh.run(
        "submit", "--job-id", BUSY_JOB, "-b", "lab/vision", "-g", "1", "-m", "2h", "--duration", "3h", "-u", "carol"
    )
    until(lambda: _running(fresh, IDLE_JOB) and _running(fresh, BUSY_JOB), "both jobs to run", DEADLINE_S)

    def idle_named() -> Any:
        rep = fresh.json("audit", "squatting", "--threshold", "5s")
        return rep if any(r["job_id"] == IDLE_JOB for r in rep["runs"]) else None

    # heartbeats every 10 s on the stack's wall clock: the idle stretch passes 5 s at the second one after start
    rep = until(idle_named, "audit squatting to name the idle job", DEADLINE_S)
    assert rep["utilisation_reported"] and rep["heartbeats_with_utilisation"] >= 2
    assert [(r["job_id"], r["budget"]) for r in rep["runs"]] == [(IDLE_JOB, "lab/vision")]
    assert rep["runs"][0]["source"] == "agent" and rep["heartbeats_with_idle_report"] >= 2

    def idle_shown() -> Any:  # the dispatcher's jobs read model carries the agents' report
        rows = {r["job_id"]: r for r in fresh.json("queue")}
        idle, busy = rows[IDLE_JOB].get("idle_s"), rows[BUSY_JOB].get("idle_s")
        return (idle, busy) if idle and busy == 0.0 else None

    until(idle_shown, "queue to show the idle job's idle time and the busy job's 0", DEADLINE_S)


# --------------------------------------------------------------------------- the main job, shortened

TRACE_JOBS = 40
BUDGETS_YAML = """\
window_s: 86400
cluster:
- prefix: n
  count: 4
  gpus: 8
budgets:
  lab: 1.0
  lab/a: 0.6
  lab/b: 0.4
"""


def _trace(path: Path) -> Path:
    """40 jobs over 2017-10-30: 1-8 GPUs, 20 min to 6 h, one in four unallocated, alternating budgets."""
    lines = ["submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s"]
    for i in range(TRACE_JOBS):
        minute = i * 30  # every half hour from midnight
        gpus = (1, 2, 4, 8)[i % 4]
        duration = (1200, 3600, 7200, 21600)[(i // 4) % 4]
        min_rt = 0 if i % 4 == 3 else min(duration, 3600)
        lines.append(
            f"2017-10-30T{minute // 60:02d}:{minute % 60:02d}:00Z,t{i:03d},lab/{'ab'[i % 2]},u{i % 3},"
            f"{gpus},1,{min_rt},{duration}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def _demo_env(kafka_bootstrap: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The main job on the session's Kafka and Redis; its environment and SIGTERM handler put back after."""
    monkeypatch.setenv("KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("REDIS_URL", redis_url.rsplit("/", 1)[0] + "/8")
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", os.environ.get("APPORTION_TOPIC_PREFIX", ""))  # demo sets its own
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("_demo_env")
def test_a_shortened_main_job_runs_audit_verify_and_it_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tools import demo

    budgets = tmp_path / "budgets.yaml"
    budgets.write_text(BUDGETS_YAML)
    code = demo.main(
        [
            "--trace",
            str(_trace(tmp_path / "trace.csv")),
            "--budgets",
            str(budgets),
            "--slice",
            "2017-10-30..2017-10-31",
            "--time-scale",
            "2880",
            "--tolerance-pp",
            "100",  # only verify decides here: a day of 40 jobs on a loaded machine is no share comparison
            "--dir",
            str(tmp_path / "run"),
            "--json",
        ]
    )
    out = capsys.readouterr().out
    doc = json.loads(out)
    v = doc["audit_verify"]
    assert v["ok"], v["mismatches"][:5]
    assert code == 0
    assert v["read_models"] and v["snapshots"] >= 10 and v["decision_ticks"] >= 10
    assert v["signed_requests"] == TRACE_JOBS and doc["live"]["jobs"] == TRACE_JOBS
    assert Path(v["export"]).is_file()  # `apportion audit verify --from-file` re-runs it offline
