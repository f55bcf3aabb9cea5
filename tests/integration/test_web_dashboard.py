"""The web dashboard in a real browser, and every service's metrics, on one live stack (issue 16).

One stack for the module, as ``test_cli_truth`` starts it: the four services and the dashboard as processes
(`stack up`, two simulated 4-GPU nodes, the dashboard on the port `stack up` gave it) on the session's Kafka
and Redis, a namespace and Redis db of their own. The dashboard connects as the read-only principal ``web``
(Kafka ACLs and a Redis user that may only read the read models): its writes are refused, its pages work. The
story on it: the example budget tree, two allocated jobs filling both nodes (protected for an hour), a third
that must wait (a pending reason), one node cordoned with a reason.

Pages are loaded by Debian's chromium (headless, driven by selenium through the system chromedriver, both found
on ``PATH`` by ``tests/kit/browser.py``; no browser is downloaded) and every number is read from the page's
``data-value`` attributes and compared with what the CLI's ``--json`` prints for the same stack at the same
moment. A screenshot of each page is saved under ``.run/screenshots/``. Without chromium the tests fail with
one line saying what is missing and how to install it.

Metrics: each service's endpoint (the ports `stack up` gave them) is scraped and parsed with
``prometheus_client``'s parser; names, labels and one value per service are checked against the read model.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from apportion.settings import topic_name

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / ".run" / "screenshots"
DEADLINE_S = 60.0

TRACE = """submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s
2024-01-01T00:00:00,a1,lab/a,u,4,1,3600,7200
2024-01-01T00:01:00,a2,lab/a,u,4,1,3600,3600
2024-01-01T00:02:00,b1,lab/b,u,4,1,3600,3600
2024-01-01T00:03:00,u1,lab/b,u,2,1,0,600
"""
SIM_BUDGETS = "cluster: [{count: 1, gpus: 8}]\nbudgets: {lab: 1.0, lab/a: 0.5, lab/b: 0.5}\n"


def until(fn: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    """:func:`tests.kit.livestack.until` with this module's deadline."""
    from tests.kit.livestack import until as poll

    return poll(fn, what, deadline_s)


class Stack:
    """The module's stack: a CLI runner bound to it and the dashboard's address."""

    def __init__(self, info: Any, env: dict[str, str]) -> None:
        from typer.testing import CliRunner

        self.info = info
        self.env = env
        self.runner = CliRunner()
        self.web = ""

    def run(self, *args: str) -> Any:
        from apportion.cli.main import app

        res = self.runner.invoke(app, list(args), env=self.env)
        assert res.exit_code == 0, f"exit {res.exit_code}: {res.output}"
        return res

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:  # loopback only
        return resp.read().decode()


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`stack up` on the session's Kafka and Redis, the story above, and the dashboard serving it."""
    from tests.kit.livestack import live_stack

    sim = tmp_path_factory.mktemp("web-sim")
    (sim / "t.csv").write_text(TRACE)
    (sim / "b.yaml").write_text(SIM_BUDGETS)
    _simulate(sim)
    with live_stack(
        kafka_bootstrap,
        redis_url,
        tmp_path_factory,
        name="web",
        db=12,
        sim_nodes=2,
        gpus_per_node=4,
        simulate_json=(str(sim / "sim.json"),),
    ) as (info, env, _run_dir):
        s = Stack(info, env)
        s.run("budget", "apply", str(ROOT / "infra/budgets/example.yaml"))
        for job, budget, user in (("busy-v", "lab/vision", "carol"), ("busy-r", "lab/prior/robotics", "alice")):
            s.run(*f"submit -b {budget} -g 4 --min-runtime 1h --duration 2h -u {user} --job-id {job}".split())
        until(lambda: _states(s) == {"busy-v": "running", "busy-r": "running"}, "both nodes busy")
        s.run(*"submit -b lab/prior/language -g 4 --min-runtime 30m --duration 1h -u dave --job-id wait-l".split())
        until(lambda: next((j["reason"] for j in s.json("queue") if j["job_id"] == "wait-l"), ""), "a reason")
        node = sorted(n["node_id"] for n in s.json("nodes"))[0]
        s.run("cordon", node, "--reason", "fan replacement")
        until(
            lambda: any(r["rank"] is not None and r["occupancy_gpu_s"] > 0 for r in s.json("share")["budgets"]),
            "a snapshot with occupancy",
        )
        s.web = info.web_url.rstrip("/")
        assert s.web.startswith("http://127.0.0.1:"), info.web_url
        until(lambda: _healthy(s.web), "the dashboard to answer")
        yield s


def _simulate(sim: Path) -> None:
    from typer.testing import CliRunner

    from apportion.cli.simulate import app

    args = ["--trace", str(sim / "t.csv"), "--budgets", str(sim / "b.yaml"), "--seed", "1", "--json"]
    args += ["--policy", "fairshare,fifo,static,priority"]  # (the peers add minutes and Kueue breaks our contract)
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    (sim / "sim.json").write_text(res.stdout)


def _healthy(base: str) -> bool:
    try:
        return _get(base + "/healthz") == "ok"
    except OSError:
        return False


def _states(s: Stack) -> dict[str, str]:
    return {j["job_id"]: j["state"] for j in s.json("queue")}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Debian chromium through the system chromedriver (selenium never downloads one)."""
    from tests.kit.browser import require_browser

    chromium, chromedriver = require_browser()  # fails the tests with one line when either is missing
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=opts)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def _open(browser: Any, url: str, shot: str) -> None:
    """Load ``url`` (the error page's title says "unavailable"), save a screenshot of the whole page."""
    import base64

    from selenium.webdriver.common.by import By

    browser.get(url)
    assert "unavailable" not in browser.title, browser.find_element(By.TAG_NAME, "main").text
    size = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 6000), "scale": 1}
    shot_png = browser.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip})
    (SHOTS / f"{shot}.png").write_bytes(base64.b64decode(shot_png["data"]))  # the whole page, not the window
    assert (SHOTS / f"{shot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # saved for people to look at


def _values(browser: Any, row_selector: str, key: str) -> dict[str, dict[str, str]]:
    """``data-<key>`` of each row matching ``row_selector`` -> {data-field: data-value} of its cells."""
    from selenium.webdriver.common.by import By

    out: dict[str, dict[str, str]] = {}
    for row in browser.find_elements(By.CSS_SELECTOR, row_selector):
        cells = row.find_elements(By.CSS_SELECTOR, "[data-field]")
        out[row.get_attribute(f"data-{key}")] = {
            c.get_attribute("data-field"): c.get_attribute("data-value") for c in cells
        }
    return out


def _as_value(v: Any) -> str:
    """The page's ``data-value`` for a CLI JSON value (the CLI prints +inf as "Infinity")."""
    if isinstance(v, str):
        return v
    return json.dumps(v)


def _stable(s: Stack, read: Callable[[], Any], cli: Callable[[], Any]) -> tuple[Any, Any]:
    """(page, CLI) read at one moment: the CLI before and after the page agree (a snapshot may land between)."""
    for _ in range(20):
        before = cli()
        page = read()
        if cli() == before:
            return page, before
    pytest.fail("the read model changed during every one of 20 page loads")


# ------------------------------------------------------------------ pages


def test_budget_tree_shows_the_numbers_share_prints(stack: Stack, browser: Any) -> None:
    def page() -> Any:
        _open(browser, stack.web + "/", "budgets")
        return _values(browser, "#budgets tbody tr", "budget")

    shown, cli = _stable(stack, page, lambda: stack.json("share"))
    fields = ("share", "abs_share", "occupancy_gpu_s", "unallocated_gpu_s", "entitlement_gpu_s", "ratio", "rank")
    assert shown == {b["path"]: {f: _as_value(b[f]) for f in fields} for b in cli["budgets"]}
    assert set(shown) == {"lab", "lab/prior", "lab/prior/robotics", "lab/prior/language", "lab/vision"}
    assert shown["lab/vision"]["abs_share"] == "0.4"
    assert float(shown["lab/vision"]["occupancy_gpu_s"]) > 0  # busy-v has been running


def test_budget_page_plots_occupancy_share_against_share(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    def page() -> Any:
        _open(browser, stack.web + "/budget?path=lab/vision", "budget-lab-vision")
        return _values(browser, "#budget", "budget")

    shown, cli = _stable(stack, page, lambda: stack.json("share"))
    [row] = [b for b in cli["budgets"] if b["path"] == "lab/vision"]
    assert shown["lab/vision"]["share"] == "0.4" and shown["lab/vision"]["ratio"] == _as_value(row["ratio"])
    svg = browser.find_element(By.CSS_SELECTOR, "#plot svg")
    assert svg.size["width"] > 300
    assert int(browser.find_element(By.ID, "points").get_attribute("data-points")) >= 1


def test_queue_shows_positions_and_the_pending_reason(stack: Stack, browser: Any) -> None:
    def page() -> Any:
        _open(browser, stack.web + "/queue", "queue")
        return _values(browser, "#queue tbody tr", "job")

    shown, cli = _stable(stack, page, lambda: stack.json("queue"))
    expect = {}
    for j in cli:
        row = {
            "position": _as_value(j["position"]),
            "budget": j["budget"],
            "user": j["user"],
            "gpus": f"{j['replicas']}x{j['gpus_per_replica']}",
            "min_runtime_s": _as_value(j["min_runtime_s"]),
            "state": j["state"],
            "attempt": _as_value(j["attempt"]),
            "idle_s": _as_value(j.get("idle_s") if j["state"] == "running" else None),
        }
        row.update({"reason": j["reason"]} if j["state"] == "pending" else {"nodes": ",".join(j["nodes"])})
        expect[j["job_id"]] = row
    assert shown == expect
    assert shown["wait-l"]["state"] == "pending" and shown["wait-l"]["position"] == "0"
    assert shown["wait-l"]["reason"]  # whatever the engine says (its wording is the engine's), non-empty


def test_job_page_shows_the_timeline_audit_explain_builds(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, stack.web + "/job/busy-v", "job-busy-v")
    rows = browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    shown = [
        (r.get_attribute("data-offset"), r.get_attribute("data-kind"), _values_of(r)["summary"], _values_of(r)["at"])
        for r in rows
    ]
    ex = stack.json("audit", "explain", "busy-v")
    assert shown == [(e["offset"], e["kind"], e["summary"], e["at"]) for e in ex["timeline"]]
    kinds = [k for _, k, _, _ in shown]
    assert kinds[:2] == ["JobSubmitted", "JobQueued"] and "JobPlaced" in kinds and "JobStarted" in kinds
    verdict = browser.find_element(By.ID, "verdict")
    assert verdict.get_attribute("data-value") == _as_value(ex["decisions_match"]) == "true"
    assert "all identical" in verdict.text


def _values_of(row: Any) -> dict[str, str]:
    from selenium.webdriver.common.by import By

    return {
        c.get_attribute("data-field"): c.get_attribute("data-value")
        for c in row.find_elements(By.CSS_SELECTOR, "[data-field]")
    }


def test_nodes_page_shows_state_reason_and_gpus_as_nodes_prints(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    def page() -> Any:
        _open(browser, stack.web + "/nodes", "nodes")
        return _values(browser, "#nodes tbody tr", "node")

    def cli() -> Any:  # the heartbeat moves every few seconds; everything else must be equal
        return [
            {k: v for k, v in n.items() if k not in ("last_heartbeat", "heartbeat_age_s")} for n in stack.json("nodes")
        ]

    shown, rows = _stable(stack, page, cli)
    assert {n: {k: v for k, v in f.items() if k != "last_heartbeat"} for n, f in shown.items()} == {
        n["node_id"]: {
            "state": n["state"],
            "reason": n["reason"],
            "gpu_model": n["gpu_model"] or "",
            "free_gpus": _as_value(n["free_gpus"]),
            "gpu_count": _as_value(n["gpu_count"]),
            "running": _as_value(len(n["running"])),
        }
        for n in rows
    }
    states = sorted((f["state"], f["reason"]) for f in shown.values())
    assert states == [("cordoned", "fan replacement"), ("ready", "")]
    total = browser.find_element(By.CSS_SELECTOR, '#totals [data-field="total"]').get_attribute("data-value")
    assert total == "8"


def test_simulate_page_renders_the_comparison_of_a_simulate_json(stack: Stack, browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    _open(browser, stack.web + "/simulate", "simulate")
    shown = _values(browser, "table.policies tbody tr", "policy")
    sims = browser.find_elements(By.CSS_SELECTOR, "section.sim")
    assert [s.get_attribute("data-file") for s in sims] == ["sim.json"]
    assert list(shown) == ["fairshare", "fifo", "static", "priority"]
    assert all(int(v["violations"]) == 0 for v in shown.values())
    assert len(browser.find_elements(By.CSS_SELECTOR, "section.sim .plot svg")) == 2


# ------------------------------------------------------------------ the read-only role


def _environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` (a child of this test run) was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)


def test_the_dashboard_is_the_web_principal_whose_writes_are_refused_and_whose_pages_work(stack: Stack) -> None:
    import os

    import redis
    from kafka.errors import TopicAuthorizationFailedError

    from apportion import topics
    from tests.kit.principals import as_user, end_offset, producer_as

    env = _environ(stack.info.pids["web"])
    assert (env["APPORTION_KAFKA_USER"], env["APPORTION_REDIS_USER"]) == ("web", "web")
    assert "APPORTION_KAFKA_PASSWORD" not in env and "APPORTION_REDIS_PASSWORD" not in env  # files, not values
    # its password files are web's in the servers' secrets (the ones the helpers below connect with)
    assert env["APPORTION_KAFKA_PASSWORD_FILE"] == str(Path(os.environ["APPORTION_KAFKA_SECRETS_DIR"]) / "web.password")
    assert env["APPORTION_REDIS_PASSWORD_FILE"] == str(Path(os.environ["APPORTION_REDIS_SECRETS_DIR"]) / "web.password")
    prefix = stack.env["APPORTION_TOPIC_PREFIX"]

    # Kafka: the dashboard's principal may write no topic (the ACL table grants it reads only)
    for topic in (topics.SUBMISSIONS, topics.BUDGETS):
        name = prefix + topic.base
        before = end_offset(stack.info.bootstrap, name)
        producer = producer_as("web", stack.info.bootstrap)
        try:
            with pytest.raises(TopicAuthorizationFailedError):
                producer.send(name, key=b"k", value=b'{"probe": true}').get(timeout=15)
        finally:
            producer.close(timeout=5)
        assert end_offset(stack.info.bootstrap, name) == before

    # Redis: it reads the read models and writes nothing
    r = as_user(stack.info.redis_url, "web")
    budgets_key = f"{prefix}apportion:rm:budgets"
    rows = r.hgetall(budgets_key)
    assert "lab/vision" in rows
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.hset(budgets_key, "lab/vision", "forged")
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.delete(budgets_key)
    assert r.hgetall(budgets_key)["lab/vision"] == rows["lab/vision"]
    r.close()

    # and as that principal every page answers (the browser tests above read their numbers)
    for page in ("/", "/budget?path=lab/vision", "/queue", "/job/busy-v", "/nodes", "/simulate"):
        with urllib.request.urlopen(stack.web + page, timeout=30) as resp:  # loopback only
            assert resp.status == 200, page
            assert 'id="principal" data-value="web"' in resp.read().decode(), page  # the header says as whom


# ------------------------------------------------------------------ metrics


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample on ``127.0.0.1:port/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(_get(f"http://127.0.0.1:{port}/metrics")):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _one(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    got = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(got) == 1, f"{name}{labels}: {got} of {m.get(name)}"
    return got[0]


def _common(m: dict[str, list[tuple[dict[str, str], float]]], topics: set[str]) -> None:
    """Every service: process metrics, reader-edge counters, lag per partition of the topics it reads."""
    assert _one(m, "process_cpu_seconds_total") > 0
    assert _one(m, "process_resident_memory_bytes") > 1e6
    assert _one(m, "apportion_events_handled_total") > 0
    assert _one(m, "apportion_dead_letters_total") == 0
    lagged = {lab["topic"] for lab, _ in m["apportion_consumer_lag_records"]}
    assert lagged == topics, lagged
    assert all(v >= 0 for _, v in m["apportion_consumer_lag_records"])
    labels = {k for samples in m.values() for lab, _ in samples for k in lab}
    assert not labels & {"job", "job_id"}, labels  # bounded cardinality: never a job id


def test_accounting_metrics_report_the_budget_rows_of_the_read_model(stack: Stack) -> None:
    from apportion import topics

    p = stack.env["APPORTION_TOPIC_PREFIX"]
    m, share = _stable(stack, lambda: _scrape(stack.info.metrics["accounting"]), lambda: stack.json("share"))
    _common(m, {p + topic_name(topics.JOBS), p + topic_name(topics.NODES), p + topic_name(topics.BUDGETS)})
    rows = {b["path"]: b for b in share["budgets"]}
    for path, row in rows.items():
        assert _one(m, "apportion_budget_share", budget=path) == row["share"]
        assert _one(m, "apportion_budget_abs_share", budget=path) == row["abs_share"]
        assert _one(m, "apportion_budget_occupancy_gpu_seconds", budget=path) == row["occupancy_gpu_s"]
        assert _one(m, "apportion_budget_entitlement_gpu_seconds", budget=path) == row["entitlement_gpu_s"]
        assert _one(m, "apportion_budget_usage_ratio", budget=path) == float(row["ratio"])
    assert _one(m, "apportion_budget_rank", budget="lab/vision") == rows["lab/vision"]["rank"]
    assert (
        _one(m, "apportion_cluster_capacity_gpus") == share["meta"]["capacity_gpus"] == 4
    )  # the cordoned node is out of C
    assert {lab["budget"] for lab, _ in m["apportion_budget_rank"]} == {
        "lab/prior/robotics",
        "lab/prior/language",
        "lab/vision",
    }


def test_dispatcher_metrics_report_the_queue_and_the_nodes_of_the_read_model(stack: Stack) -> None:
    from apportion import topics

    p = stack.env["APPORTION_TOPIC_PREFIX"]
    m = _scrape(stack.info.metrics["dispatcher"])
    _common(m, {t.named(p) for t in (topics.SUBMISSIONS, topics.JOBS, topics.NODES, topics.BUDGETS)})
    queue = stack.json("queue")
    assert _one(m, "apportion_budget_pending_jobs", budget="lab/prior/language") == 1
    assert _one(m, "apportion_budget_pending_gpus", budget="lab/prior/language") == 4
    assert _one(m, "apportion_budget_pending_jobs", budget="lab") == sum(j["state"] == "pending" for j in queue)
    assert _one(m, "apportion_budget_running_gpus", budget="lab/vision") == 4
    assert _one(m, "apportion_budget_running_gpus", budget="lab") == 8
    for n in stack.json("nodes"):
        node = n["node_id"]
        assert _one(m, "apportion_node_gpus", node=node) == n["gpu_count"] == 4
        assert _one(m, "apportion_node_free_gpus", node=node) == n["free_gpus"]
        assert _one(m, "apportion_node_state", node=node, state=n["state"]) == 1
        assert [lab["state"] for lab, _ in m["apportion_node_state"] if lab["node"] == node] == [n["state"]]
        assert _one(m, "apportion_node_info", node=node, model=n["gpu_model"] or "") == 1
        assert 0 <= _one(m, "apportion_node_heartbeat_age_seconds", node=node) < 60
    assert _one(m, "apportion_dispatcher_leader") == 1
    assert _one(m, "apportion_dispatcher_cycle_seconds_count") > 0


def test_policy_and_node_agent_metrics(stack: Stack) -> None:
    from apportion import topics
    from apportion.bus.reader import read_log

    p = stack.env["APPORTION_TOPIC_PREFIX"]

    def rankings() -> int:  # the FairShareRanking records on the ranking topic: what the policy published
        recs = read_log(stack.info.bootstrap, [p + topics.RANKING.base])
        return sum(1 for rec in recs if rec.event is not None and rec.event.type == "FairShareRanking")

    pol, published = _stable(stack, lambda: _scrape(stack.info.metrics["policy"]), rankings)
    _common(pol, {p + topic_name(topics.BUDGETS), p + topic_name(topics.USAGE)})
    assert _one(pol, "apportion_policy_published_total", type="FairShareRanking") == published > 0
    assert _one(pol, "apportion_policy_decide_seconds_count") > 0
    agent = _scrape(stack.info.metrics["node_agent"])
    _common(agent, {p + topic_name(topics.COMMANDS), p + topic_name(topics.NODES)})
    running = sum(len(j["nodes"]) for j in stack.json("queue") if j["state"] == "running")
    assert _one(agent, "apportion_node_agent_running") == running == 2  # busy-v and busy-r, one replica each
    assert _one(agent, "apportion_node_agent_heartbeats_total") > 0


def test_the_dashboard_serves_its_own_process_metrics(stack: Stack) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(_get(stack.web + "/metrics"))}
    assert {"process_cpu_seconds", "apportion_web_requests"} <= names
    m = _scrape(int(stack.web.rsplit(":", 1)[1]))  # `stack up` serves the dashboard's metrics on its own port
    assert _one(m, "process_resident_memory_bytes") > 1e6
    served = {(lab["page"], lab["status"]) for lab, _ in m["apportion_web_requests_total"]}
    assert ("tree", "200") in served and {page for page, _ in served} <= {
        "tree", "budget", "queue", "job", "nodes", "simulate"
    }  # fmt: skip
    assert _one(m, "apportion_web_requests_total", page="tree", status="200") >= 1
