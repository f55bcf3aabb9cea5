"""The share deficit of a log (``audit.report.share_deficits``) is the simulator's (``apportion.sim.report``),
sample for sample: the main job compares the live log's with the simulator's, so both need one definition."""

from __future__ import annotations

from apportion.audit.report import log_report, share_deficits
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.sim.core import SimConfig, SimResult, simulate
from tests.kit.simkit import T0, at, job, nodes

H = 3600
WEEK = 7 * 24 * H


def _run() -> tuple[BudgetTree, SimResult]:
    """lab/a fills the 8-GPU node at 0 h (four 4-GPU 5 h jobs: two run, two wait); lab/b submits four 2-GPU
    3 h jobs at 2 h. Hourly samples up to 14 h."""
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})
    jobs = [job(f"a{i}", "lab/a", gpus=4, min_runtime_s=1800, duration_s=5 * H) for i in range(4)] + [
        job(f"b{i}", "lab/b", gpus=2, min_runtime_s=1800, duration_s=3 * H, submit=T0 + 2 * H * 10**6) for i in range(4)
    ]
    cfg = SimConfig(
        seed=1, dispatch=DispatchConfig(engine=EngineConfig()), stop_delay_s=5.0, sample_s=H, until_us=at(30)
    )
    return tree, simulate(tree, nodes(("n0", 8)), jobs, cfg)


def test_the_deficit_of_the_simulators_log_is_the_simulators_own_sample_for_sample() -> None:
    tree, r = _run()
    own = {
        leaf: [max(0.0, tree.abs_share(leaf) - row[leaf][0]) * 100 for _t, row in r.samples if row[leaf][3]]
        for leaf in tree.leaves()
    }
    got = share_deficits(r.log, tree, r.start_us, r.end_us, window_s=WEEK)
    assert got == own
    # by hand: at 0 h lab/a waits with nothing held yet (K = 0: deficit = its share, 50 pp); at 2 h lab/b's
    # jobs wait with O_b = 0 (50 pp); the other samples with work waiting are at or near their share
    assert got["lab/b"][0] == 50.0 and got["lab/a"][0] == 50.0
    assert len(got["lab/a"]) == 9 and len(got["lab/b"]) == 2


def test_log_report_gives_the_mean_and_max_and_each_budgets_mean() -> None:
    tree, r = _run()
    d = share_deficits(r.log, tree, r.start_us, r.end_us, window_s=WEEK)
    rep = log_report(r.log, tree, r.start_us, r.end_us, window_s=WEEK)
    every = d["lab/a"] + d["lab/b"]
    assert rep.mean_deficit_pp == sum(every) / len(every)
    assert rep.max_deficit_pp == 50.0
    by = {b.path: b.mean_deficit_pp for b in rep.budgets}
    assert by == {"lab/a": sum(d["lab/a"]) / 9, "lab/b": sum(d["lab/b"]) / 2}
