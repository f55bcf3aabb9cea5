"""The dashboard's pages with fake sources (no Redis, no Kafka): what each page shows, the 503 page when a
source cannot be read, and that nothing but GET is served (read-only). The real stack and browser are
tests/integration/test_web_dashboard.py."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from apportion.audit.explain import Explanation, TimelineEntry
from services.web.app import create_app
from services.web.config import WebSettings
from services.web.store import Sources, Unavailable

BUDGETS = [
    {"path": "lab", "share": 1.0, "abs_share": 1.0, "occupancy_gpu_s": 7200.0, "unallocated_gpu_s": 0.0,
     "entitlement_gpu_s": 14400.0, "ratio": 0.5, "rank": None},
    {"path": "lab/vision", "share": 0.4, "abs_share": 0.4, "occupancy_gpu_s": 7200.0, "unallocated_gpu_s": 0.0,
     "entitlement_gpu_s": 0.0, "ratio": math.inf, "rank": 0},
]  # fmt: skip


class FakeSources(Sources):
    """What Sources returns, from fixed rows; ``down`` makes every read fail as an unreachable stack does."""

    def __init__(self, down: bool = False) -> None:  # no connection (Sources.__init__ opens one): rows below
        self.down = down

    def _check(self) -> None:
        if self.down:
            raise Unavailable("Redis at redis://127.0.0.1:1/0 cannot be read: refused")

    def share(self) -> dict[str, Any]:
        self._check()
        return {"meta": {"at": "2026-01-01T00:00:00+00:00", "window_s": 604800.0, "capacity_gpus": 8,
                         "capacity_gpu_s": 14400.0}, "budgets": BUDGETS}  # fmt: skip

    def queue(self) -> list[dict[str, Any]]:
        self._check()
        return [{"job_id": "j1", "budget": "lab/vision", "user": "carol", "state": "pending", "position": 0,
                 "gpus_per_replica": 4, "replicas": 2, "min_runtime_s": 3600.0, "attempt": 1, "nodes": [],
                 "started_at": None, "reason": "waiting_for_gpus: needs 2 node(s) with 4 free GPU(s)"},
                {"job_id": "j2", "budget": "lab/vision", "user": "carol", "state": "running", "position": None,
                 "gpus_per_replica": 1, "replicas": 1, "min_runtime_s": 3600.0, "attempt": 1, "nodes": ["n1"],
                 "started_at": "2026-01-01T00:00:00+00:00", "reason": "", "idle_s": 7260.0, "idle": True}]  # fmt: skip

    def nodes(self) -> list[dict[str, Any]]:
        self._check()
        return [{"node_id": "n1", "state": "draining", "gpu_count": 8, "free_gpus": 2, "gpu_model": "a100",
                 "running": ["j0#1"], "last_heartbeat": "2026-01-01T00:00:00+00:00", "heartbeat_age_s": 3.0,
                 "reason": "fan swap", "reason_by": "cli"}]  # fmt: skip

    def explain(self, job_id: str) -> Explanation:
        self._check()
        if job_id == "j2":
            return Explanation(job_id, True, [])
        if job_id != "j1":
            return Explanation(job_id, False, [])
        e = TimelineEntry("2026-01-01T00:00:00+00:00", "apportion.jobs:0@4", "JobPlaced", 1, "placed on n1",
                          check={"match": False, "basis": None, "diffs": ["JobPlaced j1#1 differs"]})  # fmt: skip
        return Explanation(job_id, True, [e])

    def snapshots(self) -> list[Any]:
        self._check()
        return []

    def history(self) -> list[dict[str, Any]]:
        self._check()
        row = {"budget": "lab/vision", "state": "completed", "gpus_per_replica": 1, "replicas": 1,
               "min_runtime_s": 60.0, "first_start": None, "ended_at": None, "attempts": 1, "preemptions": 0,
               "wait_s": 90.0, "run_s": 3600.0, "gpu_hours": 1.0, "lost_gpu_s": None, "reason": ""}  # fmt: skip
        return [
            {**row, "job_id": "h1", "user": "carol", "submitted_at": "2026-01-01T00:00:00+00:00"},
            {**row, "job_id": "h2", "user": "dave", "submitted_at": "2026-01-02T00:00:00+00:00"},
            {**row, "job_id": "h3", "user": "carol", "budget": "lab/nlp", "submitted_at": "2026-01-03T00:00:00+00:00",
             "state": "rejected", "wait_s": None, "run_s": 0.0, "gpu_hours": 0.0, "attempts": 0,
             "reason": "unknown_budget: no budget 'lab/nlp'"},
        ]  # fmt: skip

    def close(self) -> None:
        pass


def client(tmp_path: Path, down: bool = False, sims: list[str] | None = None) -> TestClient:
    settings = WebSettings(simulate_json=sims or [])
    return TestClient(create_app(settings, FakeSources(down)), base_url="http://127.0.0.1:8080")


def test_tree_shows_each_budget_with_the_cli_values_and_an_infinite_ratio(tmp_path: Path) -> None:
    r = client(tmp_path).get("/")
    assert r.status_code == 200
    assert 'data-budget="lab/vision"' in r.text
    assert 'data-field="ratio" data-value="Infinity">inf<' in r.text
    assert 'data-field="occupancy_gpu_s" data-value="7200.0">2.00<' in r.text
    assert 'data-field="rank" data-value="null">' in r.text  # an inner budget has no rank


def test_queue_shows_the_pending_reason_and_the_job_links_to_its_timeline(tmp_path: Path) -> None:
    r = client(tmp_path).get("/queue")
    assert 'data-field="reason" data-value="waiting_for_gpus: needs 2 node(s) with 4 free GPU(s)"' in r.text
    assert 'href="/job/j1"' in r.text and 'data-value="2x4"' in r.text


def test_queue_and_job_pages_show_how_long_a_running_jobs_gpus_have_been_idle(tmp_path: Path) -> None:
    c = client(tmp_path)
    q = c.get("/queue").text
    assert 'data-field="idle_s" data-value="7260.0"><span class="pill st-idle">IDLE</span> 2h1m<' in q
    assert 'data-field="idle_s" data-value="null"><' in q  # the pending job: none
    j = c.get("/job/j2").text
    assert 'data-field="idle_s" data-value="7260.0">2h1m<' in j and 'data-field="idle">IDLE<' in j
    assert 'data-field="idle_s"' not in c.get("/job/j1").text


def test_job_page_says_when_a_rerun_decision_differs_and_when_a_job_is_unknown(tmp_path: Path) -> None:
    c = client(tmp_path)
    r = c.get("/job/j1")
    assert 'id="verdict" data-value="false"' in r.text and "DIFFERS" in r.text and "JobPlaced j1#1 differs" in r.text
    missing = c.get("/job/nope")
    assert missing.status_code == 404 and "Job nope is not in the log." in missing.text


def test_nodes_page_shows_state_reason_and_totals(tmp_path: Path) -> None:
    r = client(tmp_path).get("/nodes")
    assert 'data-field="state" data-value="draining"' in r.text and "fan swap" in r.text
    assert 'data-field="free" data-value="2"' in r.text and 'data-field="total" data-value="8"' in r.text


def test_an_unreachable_stack_gives_a_503_page_naming_it(tmp_path: Path) -> None:
    c = client(tmp_path, down=True)
    for page in ("/", "/queue", "/nodes", "/job/j1", "/budget?path=lab"):
        r = c.get(page)
        assert r.status_code == 503, page
        assert "redis://127.0.0.1:1/0 cannot be read" in r.text
    assert c.get("/healthz").text == "ok"  # reads nothing


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_the_dashboard_is_read_only(tmp_path: Path, method: str) -> None:
    assert client(tmp_path).request(method, "/queue").status_code == 405


@pytest.mark.parametrize(
    ("settings", "host", "status"),
    [
        pytest.param(WebSettings(), "127.0.0.1:8080", 200, id="loopback address"),
        pytest.param(WebSettings(), "localhost:8080", 200, id="localhost"),
        pytest.param(WebSettings(), "rebind.attacker.example:8080", 400, id="a name pointed at loopback"),
        pytest.param(WebSettings(), "10.0.0.7:8080", 400, id="another address"),
        pytest.param(WebSettings(web_host="127.0.0.2"), "127.0.0.2:8080", 200, id="the bound loopback address"),
        pytest.param(
            WebSettings(web_host="0.0.0.0", web_tls_cert="c.pem", web_tls_key="k.pem"),
            "dash.lab.example",
            200,
            id="over TLS any name: the certificate binds it",
        ),
    ],
)
def test_a_page_is_served_only_to_the_hosts_the_dashboard_answers_for(
    settings: WebSettings, host: str, status: int
) -> None:
    c = TestClient(create_app(settings, FakeSources()), base_url="http://127.0.0.1:8080")
    r = c.get("/queue", headers={"Host": host})
    assert r.status_code == status
    assert ("carol" in r.text) == (status == 200)  # a refused request reads no page


def test_simulate_page_reports_a_file_that_is_not_a_simulate_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    r = client(tmp_path, sims=[str(bad), str(tmp_path / "missing.json")]).get("/simulate")
    assert r.status_code == 200
    assert "not the output of `apportion simulate --json`" in r.text
    assert "No such file" in r.text


def test_the_server_binds_loopback_by_default() -> None:
    assert WebSettings().web_host == "127.0.0.1"
    from services.web.__main__ import parse_args

    assert parse_args(["--port", "9", "--simulate-json", "a.json"]) == {"web_port": 9, "simulate_json": ["a.json"]}


def test_metrics_count_each_page_served_by_page_and_status_and_ready_answers_json(tmp_path: Path) -> None:
    up, down = client(tmp_path), client(tmp_path, down=True)
    assert [up.get(p).status_code for p in ("/", "/", "/job/nobody")] == [200, 200, 404]
    assert down.get("/nodes").status_code == 503
    text = up.get("/metrics").text
    assert 'apportion_web_requests_total{page="tree",status="200"} 2.0' in text
    assert 'apportion_web_requests_total{page="job",status="404"} 1.0' in text
    assert 'status="503"' not in text  # each app counts its own pages
    assert 'apportion_web_requests_total{page="nodes",status="503"} 1.0' in down.get("/metrics").text
    r = up.get("/ready")  # fake sources: nothing to probe, ready from the start
    assert (r.status_code, r.json()) == (200, {"ready": True, "service": "ready"})


def test_history_page_lists_every_job_newest_first_with_the_cli_values(tmp_path: Path) -> None:
    r = client(tmp_path).get("/history")
    assert r.status_code == 200
    assert [line.split('"')[1] for line in r.text.splitlines() if "<tr data-job=" in line] == ["h3", "h2", "h1"]
    assert 'data-field="wait_s" data-value="90.0">1m30s<' in r.text
    assert 'data-field="wait_s" data-value="null">-<' in r.text  # never started
    assert 'data-field="reason" data-value="unknown_budget: no budget &#39;lab/nlp&#39;"' in r.text
    assert 'href="/history" class="on"' in r.text
    assert "pending and running ones too (<code>apportion history</code> lists the finished ones)" in r.text


def test_my_jobs_filters_history_and_queue_by_user_and_budget(tmp_path: Path) -> None:
    c = client(tmp_path)
    mine = c.get("/history?user=carol").text
    assert [x.split('"')[1] for x in mine.splitlines() if "<tr data-job=" in x] == ["h3", "h1"]
    assert "(2 jobs of carol)" in mine
    vision = c.get("/history?user=carol&budget=lab/vision").text
    assert [x.split('"')[1] for x in vision.splitlines() if "<tr data-job=" in x] == ["h1"]
    assert "(2 jobs of carol)" in c.get("/queue?user=carol").text
    nobody = c.get("/queue?user=nobody").text
    assert "(0 jobs of nobody)" in nobody and "<tr data-job=" not in nobody
    assert "(2 jobs)" in c.get("/queue").text


def test_the_history_page_of_an_unreachable_stack_is_a_503(tmp_path: Path) -> None:
    r = client(tmp_path, down=True).get("/history")
    assert r.status_code == 503 and "cannot be read" in r.text


def test_page_loads_that_come_while_the_log_is_read_wait_for_that_read_and_read_it_once() -> None:
    from apportion.settings import Connection

    src = Sources(Connection("127.0.0.1:1", "redis://127.0.0.1:1/0"), cache_s=60.0, redis_client=object())
    reads, release, seen = [], threading.Event(), threading.Condition()

    def read() -> list[str]:
        with seen:
            reads.append("log")
            seen.notify_all()
        release.wait(10)
        return ["the log"]

    got: list[Any] = []
    threads = [threading.Thread(target=lambda: got.append(src._cached("log", read))) for _ in range(8)]
    for t in threads:
        t.start()
    with seen:  # each load that read the log on its own would show here; a second read within 1 s fails below
        seen.wait_for(lambda: len(reads) == len(threads), timeout=1.0)
    release.set()
    for t in threads:
        t.join(10)
    assert reads == ["log"]
    assert got == [["the log"]] * 8
