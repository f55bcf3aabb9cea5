"""Benchmarks leave no data folder in the system temp directory unless asked to (`--keep`)."""

from __future__ import annotations

import sys
import tempfile
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
