"""Trace loaders and the budget file (reference rules of /work/shared/data/README.md)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from apportion.sim.traces import TraceError, load_budget_file, load_trace, parse_slice
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
        ("p000002", 16, 8, "p/aaa"),
        ("p000001", 1, 1, "p/bbb"),
        ("p000000", 2, 6, "p/aaa"),
        ("p000003", 1, 8, "p/other"),
    ]
    rng = random.Random(1)  # one draw per job of the whole file, in sorted order
    expect = []
    for j in jobs:
        u = rng.random() < 0.25
        expect.append(0.0 if u else min(j.duration_s, 7200.0))
    assert [j.min_runtime_s for j in jobs] == expect
    assert jobs[0].submit_us == to_us(datetime(2017, 10, 29, 23, 59, 59, tzinfo=UTC))


def test_slice_keeps_whole_file_draws(files):
    bf = load_budget_file(files / "b.yaml")
    everything = {j.job_id: j for j in load_trace(files / "philly.csv", bf, seed=1)}
    week44 = load_trace(files / "philly.csv", bf, seed=1, slice_spec="week44")
    assert [j.job_id for j in week44] == ["p000001", "p000000"]
    assert all(j == everything[j.job_id] for j in week44)


def test_slices():
    lo, hi = parse_slice("week44")
    assert (lo, hi) == (to_us(datetime(2017, 10, 30, tzinfo=UTC)), to_us(datetime(2017, 11, 6, tzinfo=UTC)))
    lo3, hi3 = parse_slice("week44+3d")
    assert lo3 == lo and hi3 == to_us(datetime(2017, 11, 2, tzinfo=UTC))
    assert parse_slice("weeks39-45")[1] == to_us(datetime(2017, 11, 13, tzinfo=UTC))
    with pytest.raises(ValueError):
        parse_slice("yesterday")


def test_own_csv(tmp_path):
    (tmp_path / "t.csv").write_text(
        "submit,job_id,budget,user,gpus_per_replica,replicas,min_runtime_s,duration_s\n"
        "2024-01-01T00:00:00,j1,lab/a,alice,2,1,600,3600\n"
    )
    bf = load_budget_file(_write(tmp_path))
    (j,) = load_trace(tmp_path / "t.csv", bf, seed=1)
    assert (j.job_id, j.gpus_per_replica, j.min_runtime_s, j.duration_s) == ("j1", 2, 600.0, 3600.0)


def _write(tmp_path):
    p = tmp_path / "lab.yaml"
    p.write_text("cluster: [{count: 1, gpus: 8}]\nbudgets: {lab: 1.0, lab/a: 1.0}\n")
    return p


def test_reference_budget_file_loads():
    from pathlib import Path

    bf = load_budget_file(Path(__file__).resolve().parents[2] / "infra/budgets/philly.yaml")
    assert len(bf.nodes) == 32 and {n.gpus for n in bf.nodes} == {8}
    assert bf.groups["103959"] == "philly/103959" and bf.default_budget == "philly/other"
    assert (bf.unallocated_fraction, bf.min_runtime_cap_s, bf.window_s) == (0.25, 7200.0, 604800.0)


def test_unquoted_numeric_group_keys_are_vc_ids(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_text(BUDGETS.replace("groups: {aaa: p/aaa, bbb: p/bbb}", "groups: {103959: p/aaa, bbb: p/bbb}"))
    assert load_budget_file(p).groups == {"103959": "p/aaa", "bbb": "p/bbb"}


def test_slice_errors_name_the_option():
    with pytest.raises(TraceError, match=r"^--slice 'weeks45-39': end before start"):
        parse_slice("weeks45-39")
    with pytest.raises(TraceError, match=r"^--slice 'week60': Invalid week: 60"):
        parse_slice("week60")
    assert parse_slice("Week44") == parse_slice("week44")


def test_blank_lines_keep_philly_row_ids(files):
    (files / "gaps.csv").write_text(PHILLY.replace("\n2017-10-30", "\n\n2017-10-30"))
    bf = load_budget_file(files / "b.yaml")
    assert load_trace(files / "gaps.csv", bf, seed=1) == load_trace(files / "philly.csv", bf, seed=1)


def test_trace_errors_are_value_errors(files):
    (files / "bad.csv").write_text(PHILLY.replace("100.0,12", "100.0,twelve"))
    with pytest.raises(ValueError, match=r"bad.csv:2: num_gpus: 'twelve' is not a whole number$"):
        load_trace(files / "bad.csv", load_budget_file(files / "b.yaml"), seed=1)
