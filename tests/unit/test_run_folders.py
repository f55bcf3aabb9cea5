"""The live test cluster and the main job keep their services' state (node agent journals and job files, the
policy's data, logs) in a folder of the run's own, never in fixed-name folders of the system temp directory."""

from __future__ import annotations

import signal
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.kit.live_cluster import Cluster, cluster_root


def cluster_in(root: Path) -> Cluster:
    t = datetime(2026, 1, 1, tzinfo=UTC)
    return Cluster("127.0.0.1:1", "redis://127.0.0.1:2/12", None, None, None, "abc", t, root)  # type: ignore[arg-type]


def test_a_process_the_cluster_starts_keeps_its_state_and_log_in_the_clusters_folder(tmp_path: Path) -> None:
    c = cluster_in(tmp_path)
    env = c.spawn_env({"APPORTION_GROUP_ID": "agent-abc"})
    assert env["APPORTION_STATE_DIR"] == str(tmp_path / "node_agent")
    assert env["APPORTION_FAUST_DIR"] == str(tmp_path / "policy")
    assert (tmp_path / "policy").is_dir()  # the policy makes its own folder in it
    assert env["APPORTION_GROUP_ID"] == "agent-abc"
    assert env["APPORTION_KAFKA_BOOTSTRAP"] == "127.0.0.1:1"
    assert c.log_path("services.node_agent", ("--sim-nodes", "1")) == tmp_path / "logs" / "node_agent-2.log"


def test_a_test_may_give_a_spawned_agent_a_state_folder_of_its_own(tmp_path: Path) -> None:
    env = cluster_in(tmp_path).spawn_env({"APPORTION_STATE_DIR": str(tmp_path / "other")})
    assert env["APPORTION_STATE_DIR"] == str(tmp_path / "other")


def test_a_cluster_with_no_folder_given_makes_one_and_removes_it_even_on_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with cluster_root(None) as made:
        assert made.parent == tmp_path and made.name.startswith("apportion-e2e-")
    with pytest.raises(RuntimeError), cluster_root(None) as made:
        (made / "node_agent").mkdir()
        raise RuntimeError("a service stopped during start-up")
    assert list(tmp_path.iterdir()) == []
    with cluster_root(tmp_path / "given") as given:
        assert given == tmp_path / "given"  # the test's tmp_path: pytest's to keep or remove


@pytest.fixture
def _keep_sigterm() -> Iterator[None]:
    """The main job installs its SIGTERM handler in the calling process: put pytest's back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("_keep_sigterm")
def test_the_main_jobs_services_keep_their_state_in_the_run_directory_removed_when_a_start_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from apportion import client
    from apportion.bus import producer, provision
    from tools import demo

    trace, budgets, run = tmp_path / "t.csv", tmp_path / "b.yaml", tmp_path / "run"
    trace.write_text(
        "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s\n"
        "2017-10-30T00:00:00Z,j1,lab/a,u,1,1,600,600\n"
    )
    budgets.write_text("budgets: {lab: 1.0, lab/a: 1.0}\ncluster: [{prefix: n, count: 1, gpus: 8}]\n")
    (run / "state" / "node_agent").mkdir(parents=True)
    (run / "state" / "node_agent" / "n.journal").write_text("an earlier run's")

    class Producer:
        def __init__(self, *_: Any, **__: Any) -> None:
            pass

        def send(self, *_: Any) -> None:
            pass

        def flush(self) -> None:
            pass

    seen: dict[str, str] = {}

    def start_services(env: dict[str, str], *_: Any) -> None:
        assert not (run / "state" / "node_agent").exists()  # the earlier run's journal is gone
        seen.update(env)
        raise RuntimeError("the dispatcher did not start")

    monkeypatch.setenv("KAFKA_BOOTSTRAP", "127.0.0.1:1")  # a broker and Redis of someone else's: none started
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:2/0")
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")  # restored afterwards: the main job sets its namespace
    monkeypatch.setattr(provision, "provision", lambda *_, **__: None)
    monkeypatch.setattr(producer, "EventProducer", Producer)
    monkeypatch.setattr(client, "enrol", lambda *_, **__: None)
    monkeypatch.setattr(demo, "start_services", start_services)
    assert demo.main(["--trace", str(trace), "--budgets", str(budgets), "--dir", str(run)]) == 1
    assert "the dispatcher did not start" in capsys.readouterr().out
    assert seen["APPORTION_STATE_DIR"] == str(run / "state" / "node_agent")
    assert seen["APPORTION_FAUST_DIR"] == str(run / "state" / "policy")
    assert not (run / "state").exists()
