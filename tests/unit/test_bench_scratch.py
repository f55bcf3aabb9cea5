"""Benchmarks leave no data folder in the system temp directory unless asked to (`--keep`)."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_arrays
import bench_rss
from scratch import scratch_dir


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_the_folder_is_removed_on_leaving_and_on_an_exception(temp: Path) -> None:
    with scratch_dir("x-", keep=False) as d:
        (d / "f").write_text("data")
        assert d.parent == temp and d.name.startswith("x-")
    with pytest.raises(KeyboardInterrupt), scratch_dir("x-", keep=False) as d:
        raise KeyboardInterrupt
    assert list(temp.iterdir()) == []


def test_keep_keeps_it_and_says_where(temp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with scratch_dir("x-", keep=True) as d:
        pass
    assert d.is_dir()
    assert capsys.readouterr().err == f"data kept in {d}\n"


@pytest.mark.parametrize("bench", [bench_rss, bench_arrays], ids=["bench_rss", "bench_arrays"])
@pytest.mark.parametrize(("argv", "left"), [([], 0), (["--keep"], 1)], ids=["removed", "kept"])
def test_a_failed_run_leaves_its_folder_only_with_keep(
    bench: object, argv: list[str], left: int, temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []

    def measure(args: object, root: Path) -> int:
        seen.append(root)
        (root / "logs").mkdir()
        raise RuntimeError("the broker did not start")

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    with pytest.raises(RuntimeError):
        bench.main()  # type: ignore[attr-defined]
    assert seen and seen[0].parent == temp
    assert len(list(temp.iterdir())) == left


def test_the_chaos_stacks_policy_keeps_its_data_in_the_campaigns_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed policy leaves its `apportion-policy-*` folder behind: in the campaign's root, removed with it."""
    import chaos

    from apportion.bus import provision, stack

    class Local:
        bootstrap, redis_url, kafka_port, redis_port = "127.0.0.1:1", "redis://127.0.0.1:2/0", 1, 2

        def __init__(self, datadir: Path) -> None:
            pass

        def start(self) -> Local:
            return self

    for v in ("APPORTION_TOPIC_PREFIX", "APPORTION_TIME_SCALE", "APPORTION_CLOCK_EPOCH_WALL"):
        monkeypatch.setenv(v, "")  # restored afterwards: open_stack sets them for the campaign
    monkeypatch.setenv("APPORTION_CLOCK_EPOCH_EVENT", "")
    monkeypatch.setattr(stack, "LocalStack", Local)
    monkeypatch.setattr(provision, "provision", lambda bootstrap: None)
    _, st, _ = chaos.open_stack(tmp_path, "chaos1.", 30.0)
    assert st.env["APPORTION_FAUST_DIR"] == str(tmp_path / "policy")
    assert (tmp_path / "policy").is_dir()


def test_the_services_state_is_kept_in_the_runs_folder(tmp_path: Path) -> None:
    from scratch import state_env

    assert state_env(tmp_path) == {
        "APPORTION_STATE_DIR": str(tmp_path / "node_agent"),
        "APPORTION_FAUST_DIR": str(tmp_path / "policy"),
    }
    assert (tmp_path / "policy").is_dir()  # the policy makes its own folder in it: it must exist


def test_the_live_benchmarks_services_write_only_in_the_runs_folder(tmp_path: Path) -> None:
    """Without these a node agent and the policy keep their data in fixed-name folders of the system temp
    directory, where it outlives the run."""
    import bench_live

    run = bench_live.LiveRun("127.0.0.1:1", "redis://127.0.0.1:2/0", tmp_path / "run", 8, None, None)
    env = run.service_env()
    assert env["APPORTION_STATE_DIR"] == str(tmp_path / "run" / "node_agent")
    assert env["APPORTION_FAUST_DIR"] == str(tmp_path / "run" / "policy")
    assert env["APPORTION_KEYRING"] == str(tmp_path / "run" / "keyring")
    assert env["APPORTION_TOPIC_PREFIX"] == run.ns


class FakeStack:
    """A ``LocalStack`` that starts nothing and remembers being stopped."""

    stopped: list[Path] = []

    def __init__(self, datadir: Path, **_: object) -> None:
        self.datadir = datadir
        self.bootstrap, self.redis_url = "127.0.0.1:1", "redis://127.0.0.1:2/0"

    def start(self) -> FakeStack:
        self.datadir.mkdir(parents=True)
        return self

    def stop(self) -> None:
        FakeStack.stopped.append(self.datadir)

    def node_pid(self, node: int) -> None:
        return None


@pytest.fixture
def fake_stack(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """``LocalStack`` replaced by :class:`FakeStack`, no broker or Redis named, the signal handlers and the
    settings the benchmarks change put back afterwards; the stopped stacks' folders."""
    import signal

    from apportion.bus import stack

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for v in ("KAFKA_BOOTSTRAP", "REDIS_URL", "APPORTION_NO_TLS", "APPORTION_TOPIC_PREFIX"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(stack, "LocalStack", FakeStack)
    FakeStack.stopped = []
    yield FakeStack.stopped
    for sig, h in handlers.items():
        signal.signal(sig, h)


def failing_start(self: object) -> None:
    """A service start that fails after the run wrote its first files."""
    tmp: Path = self.tmp  # type: ignore[attr-defined]
    (tmp / "logs").mkdir(parents=True)
    (tmp / "logs" / "dispatcher.log").write_text("started")
    raise RuntimeError("a service did not start")


@pytest.mark.parametrize(("argv", "left"), [([], 0), (["--keep"], 1)], ids=["removed", "kept"])
def test_a_failed_live_run_stops_its_stack_and_leaves_its_folder_only_with_keep(
    argv: list[str], left: int, temp: Path, fake_stack: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench_live

    monkeypatch.setattr(bench_live.LiveRun, "start", failing_start)
    monkeypatch.setattr(sys, "argv", ["bench_live", "--latency-only", *argv])
    with pytest.raises(RuntimeError, match="a service did not start"):
        bench_live.main()
    assert [d.name for d in fake_stack] == ["stack"] and fake_stack[0].parent.parent == temp
    assert len(list(temp.iterdir())) == left


def test_a_failed_round_against_slurm_stops_the_stack_and_removes_the_folder(
    temp: Path, fake_stack: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench_live
    import slurm_side_by_side

    def start(self: object) -> None:
        raise bench_live.BenchError("the stack did not place a probe job within 120 s")

    monkeypatch.setattr(bench_live.LiveRun, "start", start)
    monkeypatch.setattr(sys, "argv", ["slurm_side_by_side", "--systems", "apportion", "--quick"])
    assert slurm_side_by_side.main() == 1
    assert len(fake_stack) == 1
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize(("argv", "left"), [([], 0), (["--keep"], 1)], ids=["removed", "kept"])
def test_a_chaos_campaign_whose_stack_fails_to_start_leaves_its_folder_only_with_keep(
    argv: list[str], left: int, temp: Path, fake_stack: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import chaos

    def open_stack(root: Path, *_: object, **__: object) -> None:
        (root / "stack").mkdir()
        raise RuntimeError("Kafka did not start")

    monkeypatch.setattr(chaos, "open_stack", open_stack)
    with pytest.raises(RuntimeError, match="Kafka did not start"):
        chaos.main(["--quick", *argv])
    assert len(list(temp.iterdir())) == left


def test_the_chaos_stack_is_stopped_when_its_namespace_cannot_be_provisioned(
    tmp_path: Path, fake_stack: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import chaos

    from apportion.bus import provision

    for v in ("APPORTION_TOPIC_PREFIX", "APPORTION_TIME_SCALE", "APPORTION_CLOCK_EPOCH_WALL"):
        monkeypatch.setenv(v, "")  # restored afterwards: open_stack sets the campaign's namespace before provisioning

    def refuse(bootstrap: str) -> None:
        raise RuntimeError("no broker")

    monkeypatch.setattr(provision, "provision", refuse)
    with pytest.raises(RuntimeError, match="no broker"):
        chaos.open_stack(tmp_path, "chaos1.", 30.0)
    assert fake_stack == [tmp_path / "stack"]


def test_a_producer_that_fails_to_open_stops_the_rss_runs_services_broker_and_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    from types import SimpleNamespace

    import chaos

    from apportion.bus import producer
    from apportion.cli import stack as cli_stack

    stopped: list[str] = []
    local = SimpleNamespace(bootstrap="127.0.0.1:1", stop=lambda: stopped.append("kafka and redis"))
    services = SimpleNamespace(lease_ttl_wall_s=3.0, traced={}, procs={}, stop=lambda: stopped.append("services"))

    def no_producer(*_: object, **__: object) -> None:
        raise RuntimeError("no broker answered")

    monkeypatch.setattr(chaos, "open_stack", lambda *_, **__: (local, services, None))
    monkeypatch.setattr(chaos, "raise_on_sigterm", lambda: None)
    monkeypatch.setattr(cli_stack, "dev_keyring", lambda path: path)
    monkeypatch.setattr(producer, "EventProducer", no_producer)
    monkeypatch.setattr(bench_rss, "job_outcomes", lambda bootstrap: {})
    args = argparse.Namespace(seed=1, time_scale=1.0, trace="", every_s=5.0, duration_s=1.0, rate=1.0)
    with pytest.raises(RuntimeError, match="no broker answered"):
        bench_rss.measure(args, tmp_path)
    assert stopped == ["services", "kafka and redis"]


def test_a_cached_input_lives_in_one_folder_and_fresh_removes_it(temp: Path) -> None:
    from scratch import cache_file

    path = cache_file("occupancy-1-10.jsonl", fresh=False)
    assert path == temp / "apportion-bench-cache" / "occupancy-1-10.jsonl" and path.parent.is_dir()
    path.write_text("kept")
    assert cache_file("occupancy-1-10.jsonl", fresh=False).read_text() == "kept"
    assert not cache_file("occupancy-1-10.jsonl", fresh=True).exists()


@pytest.mark.parametrize(("argv", "left"), [([], 0), (["--keep"], 1)], ids=["removed", "kept"])
def test_the_audit_benchmark_leaves_no_export_in_the_temp_directory(
    argv: list[str], left: int, temp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_audit

    monkeypatch.delenv("KAFKA_BOOTSTRAP", raising=False)
    assert bench_audit.main(["--jobs", "20", *argv]) == 0
    assert "200 records from 20 simulated jobs" in capsys.readouterr().out
    assert len(list(temp.iterdir())) == left
    assert [p.name for p in temp.glob("*/*")] == ["log.jsonl.gz"] * left


class Generated(Exception):
    """Raised where a benchmark would go on to measure: its input is ready."""


def test_the_occupancy_log_is_cached_in_the_cache_folder_and_no_cache_makes_it_again(
    temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    import bench_occupancy

    assert bench_occupancy.main(["--generate-only", "--events", "300", "--seed", "7"]) == 0
    path = temp / "apportion-bench-cache" / "occupancy-7-300.jsonl"
    assert len(path.read_text().splitlines()) == 300 + bench_occupancy.NODES
    ran: list[list[str]] = []

    def run(cmd: list[str], **_: object) -> None:
        ran.append(cmd)
        raise Generated

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(Generated):
        bench_occupancy.main(["--no-cache", "--events", "300", "--seed", "7"])
    assert not path.exists() and "--generate-only" in ran[0]


def test_the_restart_log_is_cached_whole_and_no_cache_makes_it_again(
    temp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    import bench_restart

    made: list[int] = []

    def generate(*_: object) -> list[str]:
        made.append(1)
        return ["record"]

    def run(cmd: list[str], **_: object) -> None:
        raise Generated

    monkeypatch.setattr(bench_restart, "generate", generate)
    monkeypatch.setattr(subprocess, "run", run)
    for argv, times in (([], 1), ([], 1), (["--no-cache"], 2)):
        monkeypatch.setattr(sys, "argv", ["bench_restart", "--days", "0.5", *argv])
        with pytest.raises(Generated):
            bench_restart.main()
        assert len(made) == times
    assert [p.name for p in (temp / "apportion-bench-cache").iterdir()] == ["restart-signed-0.5d-32-60-1.pickle"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--latency-nodes", "64"], "--latency-nodes needs --latency-only"),
        (["--latency-only", "--latency-nodes", "0"], "--latency-nodes: at least 1"),
    ],
    ids=["without-latency-only", "no-node"],
)
def test_latency_nodes_is_refused_where_it_cannot_apply(
    argv: list[str], says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bench_live

    monkeypatch.setattr(sys, "argv", ["bench_live", *argv])
    with pytest.raises(SystemExit) as stop:
        bench_live.main()
    assert stop.value.code == 2 and says in capsys.readouterr().err
