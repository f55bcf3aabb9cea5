"""The ITP trace loader, its slices and the seeded GPU-model rule (reference rules of /work/shared/data/README.md)."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from apportion.sim.traces import ITP_T0, TraceError, load_budget_file, load_trace, parse_itp_slice, trace_format
from apportion.timeutil import s_to_us, to_us

ITP = """job_id,cluster,submit_time,duration,num_gpus,gpu_time
u1,cluster02,3024000,600,16,9600
u0,cluster01,100,7300,1,7300
u2,cluster09,3628800,1200,8,9600
u3,cluster01,3024000,3600,64,230400
"""

BUDGETS = """
cluster: [{prefix: n, count: 8, gpus: 8}]
budgets: {itp: 1.0, itp/cluster01: 0.5, itp/cluster02: 0.3, itp/other: 0.2}
groups: {cluster01: itp/cluster01, cluster02: itp/cluster02}
default_budget: itp/other
"""

HETERO = """
cluster: [{prefix: a, count: 1, gpus: 8, model: a100}, {prefix: v, count: 3, gpus: 8, model: v100}]
budgets: {itp: 1.0, itp/x: 1.0}
default_budget: itp/x
gpu_models: {constrained_fraction: 0.4}
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "itp.csv").write_text(ITP)
    (tmp_path / "b.yaml").write_text(BUDGETS)
    (tmp_path / "h.yaml").write_text(HETERO)
    return tmp_path


def test_itp_rules(files):
    assert trace_format(files / "itp.csv") == "itp"
    jobs = load_trace(files / "itp.csv", load_budget_file(files / "b.yaml"), seed=1)
    # sorted by (submit_time, row); ids i<row>; gangs ceil(n / 8) x n / replicas; cluster -> budget
    assert [(j.job_id, j.replicas, j.gpus_per_replica, j.budget, j.gpu_model) for j in jobs] == [
        ("i000001", 1, 1, "itp/cluster01", None),
        ("i000000", 2, 8, "itp/cluster02", None),
        ("i000003", 8, 8, "itp/cluster01", None),
        ("i000002", 1, 8, "itp/other", None),
    ]
    assert jobs[0].submit_us == to_us(datetime(2021, 3, 4, 0, 1, 40, tzinfo=UTC))  # t = 100 s on the convention
    rng = random.Random(1)  # the Philly rule: one draw per job of the whole file, in sorted order
    assert [j.min_runtime_s for j in jobs] == [0.0 if rng.random() < 0.25 else min(j.duration_s, 7200.0) for j in jobs]


@pytest.mark.parametrize(
    ("spec", "days"),
    [("week5", (35, 42)), ("weeks0-7", (0, 56)), ("days35-38", (35, 38)), ("week5+3d", (35, 38))],
)
def test_itp_slices_are_trace_weeks_and_days(spec, days):
    day = s_to_us(86400)
    assert parse_itp_slice(spec) == (ITP_T0 + days[0] * day, ITP_T0 + days[1] * day)


def test_an_itp_slice_keeps_the_whole_files_draws(files):
    bf = load_budget_file(files / "b.yaml")
    whole = {j.job_id: j for j in load_trace(files / "itp.csv", bf, seed=1)}
    week5 = load_trace(files / "itp.csv", bf, seed=1, slice_spec="week5")  # [3,024,000 s, 3,628,800 s)
    assert [j.job_id for j in week5] == ["i000000", "i000003"]
    assert all(j == whole[j.job_id] for j in week5)


@pytest.mark.parametrize("spec", ["week", "days5-5", "2021-03-04..2021-03-05"])
def test_bad_itp_slices_name_the_option(spec):
    with pytest.raises(TraceError, match="--slice"):
        parse_itp_slice(spec)


def test_the_gpu_model_rule_draws_apart_from_the_minimum_runtime(files):
    hetero = load_budget_file(files / "h.yaml")
    jobs = load_trace(files / "itp.csv", hetero, seed=3)
    rng = random.Random("gpu-model-3")  # two draws per job: constrained?, then the model by GPUs (a100 1/4)
    expect = []
    for _ in jobs:
        constrained, pick = rng.random() < 0.4, rng.random()
        expect.append(("a100" if pick < 0.25 else "v100") if constrained else None)
    assert [j.gpu_model for j in jobs] == expect
    plain = load_trace(files / "itp.csv", load_budget_file(files / "b.yaml"), seed=3)
    assert [j.min_runtime_s for j in jobs] == [j.min_runtime_s for j in plain]


def test_the_reference_budget_files_load():
    for name, models in (("itp", {None}), ("itp-equal", {None}), ("itp-hetero", {"a100", "v100"})):
        bf = load_budget_file(f"infra/budgets/{name}.yaml")
        assert sum(n.gpus for n in bf.nodes) == 512 and {n.model for n in bf.nodes} == models
        assert len(bf.tree.leaves()) == 10 and sum(bf.tree.abs_share(p) for p in bf.tree.leaves()) == pytest.approx(1)
    assert load_budget_file("infra/budgets/itp-hetero.yaml").constrained_fraction == 0.25
