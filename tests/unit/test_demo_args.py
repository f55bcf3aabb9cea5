"""The main job refuses bad input before it starts anything: one error line, exit 2."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import demo


@pytest.fixture(autouse=True)
def _keep_sigterm() -> Iterator[None]:
    """demo.main installs its SIGTERM handler in the calling process: put pytest's back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    """A one-row apportion CSV (the demo only needs the file to load)."""
    p = tmp_path / "t.csv"
    p.write_text(
        "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s\n"
        "2017-10-30T00:00:00Z,j1,lab/a,u,1,1,600,600\n"
    )
    return p


def test_unknown_budget_file_key_is_one_error_line_and_exit_2(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "b.yaml"
    bad.write_text("budgets: {lab: 1.0, lab/a: 1.0}\ncluster: [{prefix: n, count: 1, gpus: 8}]\nbogus: 1\n")
    assert demo.main(["--trace", str(trace), "--budgets", str(bad), "--dir", str(tmp_path / "d")]) == 2
    out = capsys.readouterr().out
    assert f"error: {bad}: (top level): unknown key 'bogus'" in out
    assert "Traceback" not in out
    assert not (tmp_path / "d").exists()  # nothing was started


def test_reversed_slice_is_refused_with_exit_2(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ok = tmp_path / "b.yaml"
    ok.write_text("budgets: {lab: 1.0, lab/a: 1.0}\ncluster: [{prefix: n, count: 1, gpus: 8}]\n")
    assert (
        demo.main(["--trace", str(trace), "--budgets", str(ok), "--slice", "weeks45-39", "--dir", str(tmp_path / "d")])
        == 2
    )
    assert "error: --slice 'weeks45-39': end before start" in capsys.readouterr().out
