"""The targets table (``bench/bench_fairness_targets.py``): each target judged met, missed or n/a at its boundary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from bench_fairness_targets import TARGETS, load, main

H = 3600.0


def pol(name: str, **kw: float) -> dict:
    """One policy's figures: every target's column, all at a passing value unless given."""
    base = {
        "policy": name,
        "seed": 1,
        "completed": 100,
        "never": 10,
        "jct_p95_s": 100 * H,
        "mean_deficit_pp": 0.4,
        "mean_attainable_deficit_pp": 0.4,
        "goodput": 0.98,
        "max_preemptions_allocated": 5,
        "violations": 0,
        "idle_waiting_alloc_gpu_h": 0.0,
        "idle_waiting_unalloc_gpu_h": 0.0,
        "wait_p95_s": 10 * H,
    }
    base.update(kw)
    return base


def verdicts(kind: str, fair: dict, *peers: dict) -> dict[str, bool | None]:
    ps = {p["policy"]: p for p in (fair, *peers)}
    return {name: judge(fair, ps)[1] for name, judge in TARGETS[kind]}


@pytest.mark.parametrize(
    ("case", "fair", "target", "expected"),
    [
        ("completed exactly 99% of Slurm's", {"completed": 99}, "completed >= 99% of Slurm's", True),
        ("completed 98", {"completed": 98}, "completed >= 99% of Slurm's", False),
        ("JCT p95 exactly 1.5 x", {"jct_p95_s": 150 * H}, "JCT p95 <= 1.5 x Slurm's (h)", True),
        ("JCT p95 above 1.5 x", {"jct_p95_s": 151 * H}, "JCT p95 <= 1.5 x Slurm's (h)", False),
        ("never placed 16 against 10", {"never": 16}, "never placed <= 1.5 x Slurm's", False),
        ("deficit 0.5 pp", {"mean_deficit_pp": 0.5}, "mean share deficit <= 0.5 pp", True),
        ("deficit 0.51 pp", {"mean_deficit_pp": 0.51}, "mean share deficit <= 0.5 pp", False),
        ("goodput 0.5 point below", {"goodput": 0.975}, "goodput >= Slurm's - 0.5 pt (%)", True),
        ("goodput 0.6 point below", {"goodput": 0.974}, "goodput >= Slurm's - 0.5 pt (%)", False),
        ("6 preemptions of one job", {"max_preemptions_allocated": 6}, "<= 5 preemptions of one allocated job", False),
        ("one protection violation", {"violations": 1}, "protection violations 0", False),
        ("idle while waiting, unallocated", {"idle_waiting_unalloc_gpu_h": 0.5}, "idle while waiting 0 GPU-h", False),
    ],
)
def test_weeks_targets_at_their_boundaries(case, fair, target, expected):
    assert verdicts("weeks", pol("fairshare", **fair), pol("slurm"))[target] is expected, case


def test_itp_deficit_must_be_strictly_below_every_peer_and_the_wait_at_most_the_best():
    peers = (pol("slurm", mean_deficit_pp=2.0, wait_p95_s=44 * H), pol("kueue", mean_deficit_pp=0.9), pol("kai"))
    got = verdicts("itp", pol("fairshare", mean_deficit_pp=0.9, wait_p95_s=10 * H), *peers)
    assert got["mean share deficit < every peer's (pp)"] is False  # a tie with Kueue is not below it
    assert got["allocated wait p95 <= best peer's (h)"] is True  # equal to KAI's and Kueue's 10 h
    got = verdicts("itp", pol("fairshare", mean_deficit_pp=0.3, wait_p95_s=11 * H), *peers)
    assert got["mean share deficit < every peer's (pp)"] is True
    assert got["allocated wait p95 <= best peer's (h)"] is False


def test_a_missing_reference_policy_is_not_judged():
    assert verdicts("week44", pol("fairshare"))["JCT p95 <= FIFO's (h)"] is None
    assert verdicts("itp", pol("fairshare"), pol("slurm"))["allocated wait p95 <= best peer's (h)"] is None


def test_files_of_one_slice_and_seed_are_merged_and_misses_counted(tmp_path, capsys):
    for name, doc in (
        ("w44s2_fairshare.json", [pol("fairshare", seed=2, jct_p95_s=105 * H)]),
        ("w44s2_fifo.json", [pol("fifo", seed=2, jct_p95_s=104 * H)]),
    ):
        (tmp_path / name).write_text(json.dumps({"policies": doc}))
    args = [f"week44={tmp_path / 'w44s2_fairshare.json'}", f"week44={tmp_path / 'w44s2_fifo.json'}"]
    assert set(load(args)[("week44", "w44s2", 2)]) == {"fairshare", "fifo"}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "105.0 vs fifo 104.0" in out and "MISSED" in out and "1 target(s) missed" in out


def test_an_unknown_kind_is_a_clear_error():
    with pytest.raises(SystemExit, match="expected KIND=FILE"):
        load(["weekly=x.json"])
