"""Trace loaders and the budget file (reference rules of /work/shared/data/README.md)."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest

from apportion.sim.traces import load_budget_file, load_trace, parse_slice
from apportion.timeutil import to_us

PHILLY = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-31 10:00:00,100.0,12,1200.0,aaa
2017-10-30 09:00:00,50.0,1,50.0,bbb
2017-10-29 23:59:59,7300.0,128,934400.0,aaa
2017-11-06 00:00:00,10.0,8,80.0,zzz
"""

BUDGETS = """
cluster: [{prefix: n, count: 2, gpus: 8}]
budgets: {p: 1.0, p/aaa: 0.5, p/bbb: 0.3, p/other: 0.2}
groups: {aaa: p/aaa, bbb: p/bbb}
default_budget: p/other
min_runtime: {unallocated_fraction: 0.25, cap_s: 7200}
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "philly.csv").write_text(PHILLY)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    return tmp_path


def test_budget_file(files):
    bf = load_budget_file(files / "b.yaml")
    assert [n.node_id for n in bf.nodes] == ["n000", "n001"] and bf.nodes[0].gpus == 8
    assert bf.tree.abs_share("p/bbb") == 0.3 and bf.default_budget == "p/other"


def test_philly_rules(files):
    bf = load_budget_file(files / "b.yaml")
    jobs = load_trace(files / "philly.csv", bf, seed=1)
    # sorted by time; ids are the file row; gangs ceil(n/8) x n/replicas; VC -> budget
    assert [(j.job_id, j.replicas, j.gpus_per_replica, j.budget) for j in jobs] == [
        ("p000002", 16, 8, "p/aaa"), ("p000001", 1, 1, "p/bbb"), ("p000000", 2, 6, "p/aaa"),
        ("p000003", 1, 8, "p/other")]
    rng = random.Random(1)  # one draw per job of the whole file, in sorted order
    expect = []
    for j in jobs:
        u = rng.random() < 0.25
        expect.append(0.0 if u else min(j.duration_s, 7200.0))
    assert [j.min_runtime_s for j in jobs] == expect
    assert jobs[0].submit_us == to_us(datetime(2017, 10, 29, 23, 59, 59, tzinfo=timezone.utc))


def test_slice_keeps_whole_file_draws(files):
    bf = load_budget_file(files / "b.yaml")
    everything = {j.job_id: j for j in load_trace(files / "philly.csv", bf, seed=1)}
    week44 = load_trace(files / "philly.csv", bf, seed=1, slice_spec="week44")
    assert [j.job_id for j in week44] == ["p000001", "p000000"]
    assert all(j == everything[j.job_id] for j in week44)


def test_slices():
    lo, hi = parse_slice("week44")
    assert (lo, hi) == (to_us(datetime(2017, 10, 30, tzinfo=timezone.utc)),
                        to_us(datetime(2017, 11, 6, tzinfo=timezone.utc)))
    lo3, hi3 = parse_slice("week44+3d")
    assert lo3 == lo and hi3 == to_us(datetime(2017, 11, 2, tzinfo=timezone.utc))
    assert parse_slice("weeks39-45")[1] == to_us(datetime(2017, 11, 13, tzinfo=timezone.utc))
    with pytest.raises(ValueError):
        parse_slice("yesterday")


def test_own_csv(tmp_path):
    (tmp_path / "t.csv").write_text(
        "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s\n"
        "2024-01-01T00:00:00,j1,lab/a,alice,2,1,600,3600\n")
    bf = load_budget_file(_write(tmp_path))
    (j,) = load_trace(tmp_path / "t.csv", bf, seed=1)
    assert (j.job_id, j.gpus_per_replica, j.min_runtime_s, j.duration_s) == ("j1", 2, 600.0, 3600.0)


def _write(tmp_path):
    p = tmp_path / "lab.yaml"
    p.write_text("cluster: [{count: 1, gpus: 8}]\nbudgets: {lab: 1.0, lab/a: 1.0}\n")
    return p
