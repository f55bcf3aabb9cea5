"""The CPU budget of the live and Slurm benchmarks (``bench/bench_live.py``): process trees, per-1,000 figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_live
from bench_live import CpuBudget, _proc_times, descendants, tree_cpu_seconds

TICK = bench_live.CLK_TCK

# pid -> (ppid, own CPU s, reaped children's CPU s)
#
#   1 (init)
#   ├── 10 root ── 11 ── 12
#   │              └──── 13 (a zombie not yet reaped: still in the table)
#   └── 20 elsewhere
TABLE = {
    1: (0, 0.0, 0.0),
    10: (1, 1.0, 0.5),
    11: (10, 2.0, 0.25),
    12: (11, 4.0, 0.0),
    13: (11, 0.125, 0.0),
    20: (1, 8.0, 16.0),
}


def test_proc_times_reads_a_stat_line_whose_name_holds_parentheses_and_spaces() -> None:
    # fields after the name: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    # cutime cstime ...
    line = f"42 (a) b (c)) S 7 42 42 0 -1 4194560 1 2 3 4 {3 * TICK} {TICK} {2 * TICK} {TICK} 20 0 1 0"
    assert _proc_times(line) == (7, 4.0, 3.0)


@pytest.mark.parametrize(
    ("roots", "expected"),
    [
        ([10], 1.0 + 0.5 + 2.0 + 0.25 + 4.0 + 0.125),  # the whole tree, each one's own and reaped children's
        ([11], 2.0 + 0.25 + 4.0 + 0.125),  # a subtree
        ([20], 24.0),  # a leaf: own and reaped children
        ([10, 20], 7.875 + 24.0),
        ([99], 0.0),  # gone
    ],
    ids=["tree", "subtree", "leaf", "two roots", "gone root"],
)
def test_tree_cpu_seconds_sums_a_root_and_its_descendants(roots: list[int], expected: float) -> None:
    assert tree_cpu_seconds(roots, TABLE) == expected


def test_descendants_leave_out_other_trees() -> None:
    assert sorted(descendants([10], TABLE)) == [10, 11, 12, 13]


def test_per_1000_scales_each_component_and_totals_without_measurement() -> None:
    cpu = CpuBudget({}, measurement=("watcher",))
    before = {"dispatcher": 1.0, "broker": 2.0, "watcher": 0.5}
    after = {"dispatcher": 3.0, "broker": 2.5, "watcher": 1.5}
    got = cpu.per_1000(before, after, jobs=500)
    # (3 - 1) * 1000 / 500 = 4; (2.5 - 2) * 2 = 1; the watcher (1.5 - 0.5) * 2 = 2 is not in the total
    assert got == {"dispatcher": 4.0, "broker": 1.0, "watcher": 2.0, "total": 5.0}


def test_a_budget_samples_this_process_tree() -> None:
    import os

    cpu = CpuBudget({"me": [os.getpid()]}, own={"fixed": lambda: 0.25})
    first = cpu.sample()
    sum(i * i for i in range(200_000))  # some CPU, so the second sample is not below the first
    second = cpu.sample()
    assert second["fixed"] == 0.25
    assert second["me"] >= first["me"] > 0


def test_side_by_side_medians_and_ratios() -> None:
    from slurm_side_by_side import medians

    def rnd(system: str, rate: float, start_s: float, cpu: float) -> dict[str, object]:
        col = {"a": cpu, "total": cpu}
        return {
            "system": system,
            "placements_per_s": rate,
            "last_placed_s": 1000 / rate,
            "last_started_s": start_s,
            "cpu_per_1000_to_last_placed": col,
            "cpu_per_1000_to_last_started": col,
        }

    rounds = [rnd("slurm", 800, 2.0, 10.0), rnd("slurm", 1000, 1.5, 12.0), rnd("slurm", 900, 3.0, 11.0)]
    rounds += [rnd("apportion", 2000, 1.0, 2.0), rnd("apportion", 2700, 0.75, 3.0), rnd("apportion", 3000, 2.0, 1.0)]
    got = medians(rounds)
    assert got["slurm"]["placements_per_s"] == 900
    assert got["apportion"]["cpu_per_1000_to_last_started"] == {"a": 2.0, "total": 2.0}
    # 2700 / 900, 1.0 / 2.0, 2.0 / 11.0
    assert got["apportion_over_slurm"]["placements_per_s"] == 3.0
    assert got["apportion_over_slurm"]["last_started_s"] == 0.5
    assert got["apportion_over_slurm"]["cpu_to_last_started"] == pytest.approx(2 / 11)
    assert "apportion_array_over_slurm" not in got  # no array rounds


def test_side_by_side_ratio_of_the_array_rounds_stands_apart() -> None:
    from slurm_side_by_side import medians, report

    def rnd(system: str, rate: float) -> dict[str, object]:
        col = {"a": 1.0, "total": 1.0}
        return {"system": system, "round": 1, "placements_per_s": rate, "last_placed_s": 1000 / rate,
                "last_started_s": 2.0, "cpu_per_1000_to_last_placed": col, "cpu_per_1000_to_last_started": col}  # fmt: skip

    got = medians([rnd("slurm", 500), rnd("apportion", 1000), rnd("apportion-array", 1600)])
    assert got["apportion_over_slurm"]["placements_per_s"] == 2.0  # 1000 / 500
    assert got["apportion_array_over_slurm"]["placements_per_s"] == 3.2  # 1600 / 500
    text = report({"jobs": 1000, "nodes": 126, "gpus_per_node": 8, "rounds": [], "medians": got})
    assert "apportion-array / Slurm (medians): placements/s 3.20x" in text
    assert "apportion / Slurm (medians): placements/s 2.00x" in text
