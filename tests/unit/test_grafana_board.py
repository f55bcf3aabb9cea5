"""The Grafana board and the Prometheus scrape config (infra/grafana, infra/prometheus), kept honest by test:
Prometheus scrapes every service container of docker-compose.yml on the port it serves metrics on, Grafana is
provisioned with the board and its datasource, and every metric the board queries is one the services export
(the families of apportion.metrics, collected from a registry holding all of them)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "infra/grafana/dashboards/apportion.json"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def exported_names() -> set[str]:
    """Every sample name the services and the dashboard export (rows given, so the row families appear)."""
    from apportion import metrics as m
    from apportion.metrics import add_process_collectors

    reg = CollectorRegistry()
    add_process_collectors(reg)
    d = m.dispatcher_metrics(reg, lambda: datetime(2026, 1, 1, tzinfo=UTC))
    a = m.accounting_metrics(reg)
    m.policy_metrics(reg)["decide"].observe(0.001)
    m.node_agent_metrics(reg)
    a["budgets"].update({"at": "2026-01-01T00:00:00+00:00", "window_s": 1.0, "capacity_gpus": 1, "capacity_gpu_s": 1.0},
                        {"b": {"share": 1.0, "rank": 0, "ratio": 0.0}})  # fmt: skip
    d["queue"].update(
        {}, {"n": {"node_id": "n", "state": "ready", "last_heartbeat": "2026-01-01T00:00:00+00:00"}}, ["b"]
    )
    d["reader"].set_lag({("t", 0): 0})
    d["preemptions"].labels("b", "drain").inc()
    d["work_lost"].labels("b").inc()
    names = set()
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        names |= {s.name for s in fam.samples}
    return names


def board_exprs() -> list[str]:
    board = json.loads(BOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def test_every_metric_the_board_queries_is_exported() -> None:
    names = exported_names()
    used = {n for e in board_exprs() for n in re.findall(r"\b((?:apportion|process)_[a-z_]+)\b", e)}
    assert used, "the board queries nothing"
    assert sorted(used - names) == []


def test_the_board_covers_budgets_nodes_and_services() -> None:
    exprs = " ".join(board_exprs())
    for family in (
        "apportion_budget_occupancy_gpu_seconds",
        "apportion_budget_abs_share",
        "apportion_budget_usage_ratio",
        "apportion_budget_pending_gpus",
        "apportion_budget_running_gpus",
        "apportion_budget_preemptions_total",
        "apportion_budget_work_lost_gpu_seconds_total",
        "apportion_node_state",
        "apportion_node_heartbeat_age_seconds",
        "apportion_consumer_lag_records",
        "apportion_dead_letters_total",
        "apportion_dispatcher_cycle_seconds_bucket",
        "process_cpu_seconds_total",
    ):
        assert family in exprs, family
    board = json.loads(BOARD.read_text())
    ds = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert ds == {"apportion-prometheus"}
    assert [v["name"] for v in board["templating"]["list"]] == ["budget"]


def test_prometheus_scrapes_every_service_container_on_its_metrics_port(compose: dict[str, Any]) -> None:
    conf = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    targets = {t for job in conf["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = compose["services"]
    for name, svc in services.items():
        build = svc.get("build")
        if not build or "apportion.bus.provision" in (svc.get("command") or []):
            continue  # not built here, or the one-shot topic provisioning
        env = svc.get("environment") or {}
        if build.get("args", {}).get("SERVICE") == "web":
            port = env["APPORTION_WEB_PORT"]
        else:
            port = env["APPORTION_METRICS_PORT"]
            assert env["APPORTION_METRICS_HOST"] == "0.0.0.0", f"{name}: metrics unreachable from prometheus"
        assert f"{name}:{port}" in targets, f"{name} is not scraped"
    assert all(t.split(":")[0] in services for t in targets), "a target names no compose service"


def test_grafana_is_provisioned_with_the_board_and_prometheus(compose: dict[str, Any]) -> None:
    g = compose["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in g["volumes"] if v.startswith("./")}
    assert mounts["./infra/grafana/dashboards"] == "/var/lib/grafana/dashboards"
    assert mounts["./infra/grafana/provisioning"] == "/etc/grafana/provisioning"
    prov = yaml.safe_load((ROOT / "infra/grafana/provisioning/dashboards/apportion.yml").read_text())
    assert prov["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    ds = yaml.safe_load((ROOT / "infra/grafana/provisioning/datasources/prometheus.yml").read_text())
    [source] = ds["datasources"]
    assert (source["uid"], source["url"]) == ("apportion-prometheus", "http://prometheus:9090")
    assert "prometheus" in compose["services"]
    assert all(p.startswith("127.0.0.1:") for s in compose["services"].values() for p in s.get("ports", []))
