"""``make bench``'s summary (``bench/run_all.py``): each target read from its script's output, met or missed,
and each guarded figure against its baseline (no more than 10% worse)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from run_all import GUARD_SLACK, TARGETS, Target, summary

ENGINE = "engine cycle ms (steady) over 200 reps: p50 20.1  p99 40.0  max 51.0  (target p99 <= 50)\n"
SIM = "  wall 48.0 s (target <= 60), 2083 jobs/s, 900 simulated-seconds per wall-second; process CPU 47.0 s\n"
LIVE = (
    "submit-to-StartWorkload latency over 100 jobs: p50 12.5 ms, p95 20.0 ms, p99 31.0 ms (target p50 <= 15 ms)\n"
    "sustained: 2000 submissions published in 1.00 s (2,000/s); last JobPlaced 0.80 s after the first submission"
    " -> 2,600 placements/s; last JobStarted at 1.20 s\n"
    "accounting ingest: 20,000 job events; raw kafka-python consume 3,000 events/s (6.67 s); accounting start-up"
    " rebuild (read + decode + fold + first snapshot) 1,800 events/s (11.11 s) = 60% of raw (target >= 50%)\n"
)


def by_name(name: str) -> Target:
    return next(t for t in TARGETS if t.name == name)


@pytest.mark.parametrize(
    ("name", "output", "value"),
    [
        ("engine cycle p99, steady, ms", ENGINE, 40.0),
        ("simulator, 100,000 jobs, wall s", SIM, 48.0),
        ("submit-to-StartWorkload p50, ms", LIVE, 12.5),
        ("sustained placements/s", LIVE, 2600.0),  # the comma of the thousands is read
        ("last JobStarted after the first submission, s", LIVE, 1.2),
        ("accounting rebuild, % of the raw consume", LIVE, 60.0),
        ("occupancy bulk rebuild, s", "bulk rebuild:         4.20 s     95,238 events/s (fold 1.00 s)\n", 4.2),
        (
            "dispatcher rebuild, full replay, s",
            "bench_restart: 90000 signed records (7 event-days): full replay 12.34 s, peak RSS 300 MiB\n",
            12.34,
        ),
        ("dispatcher restart from a snapshot, speed-up", "+ 50 tail records: 1.10 s (11.2x faster), peak\n", 11.2),
    ],
)
def test_each_target_is_read_from_its_scripts_output(name: str, output: str, value: float) -> None:
    assert by_name(name).read(output) == value


def test_met_and_missed_by_the_bound_and_its_direction() -> None:
    lines, figures, ok = summary({"bench_engine.py": ENGINE.replace("p99 40.0", "p99 50.5")}, {})
    assert lines == ["MISSED engine cycle p99, steady, ms: 50.50 (target <= 50); no baseline"]
    assert figures == {"engine cycle p99, steady, ms": 50.5} and not ok
    lines, _, ok = summary({"bench_live.py": LIVE}, {})
    assert ok
    assert "met    sustained placements/s: 2,600.00 (target >= 2,500); no baseline" in lines


def test_a_guarded_figure_more_than_ten_percent_worse_than_its_baseline_fails_the_run() -> None:
    # simulator wall 48.0 s against a baseline of 43.0 s: (48 - 43) / 43 = 11.6% worse > 10%
    lines, _, ok = summary({"bench_sim.py": SIM}, {"simulator, 100,000 jobs, wall s": 43.0})
    assert not ok and "GUARD EXCEEDED" in lines[0] and "+12% worse" in lines[0]
    # against 44.0 s: 9.1% worse, within the guard; the target (<= 60) is met
    lines, _, ok = summary({"bench_sim.py": SIM}, {"simulator, 100,000 jobs, wall s": 44.0})
    assert ok and lines == ["met    simulator, 100,000 jobs, wall s: 48.00 (target <= 60); baseline 44.00, +9% worse"]
    assert GUARD_SLACK == 0.10


def test_more_is_better_figures_are_worse_when_lower() -> None:
    # placements/s 2,600 against 3,000: (3000 - 2600) / 3000 = 13.3% worse
    lines, _, ok = summary({"bench_live.py": LIVE}, {"sustained placements/s": 3000.0})
    assert not ok
    assert [line for line in lines if "placements/s" in line] == [
        "met    sustained placements/s: 2,600.00 (target >= 2,500); baseline 3,000.00, +13% worse (GUARD EXCEEDED: > 10%)"
    ]


def test_a_target_its_script_did_not_print_is_missed() -> None:
    lines, _, ok = summary({"bench_sim.py": "bench_sim: crashed\n"}, {})
    assert lines == ["MISSED simulator, 100,000 jobs, wall s: not printed by bench_sim.py"] and not ok
