"""The censored job completion time of the simulator's report, by hand on a 4-job run.

One node of 1 GPU, every job of ``lab/a`` (so they run in submission order), 1 GPU each, the clock stopped
at 4:00:

    j1  submitted 0:00, 1 h of work: 0:00 -> 1:00, completed      JCT 1 h
    j2  submitted 0:00, 2 h of work: 1:00 -> 3:00, completed      JCT 3 h
    j3  submitted 0:30, 5 h of work: 3:00 -> (running at 4:00)    censored 4:00 - 0:30 = 3.5 h
    j4  submitted 1:00, 1 h of work: never placed                 censored 4:00 - 1:00 = 3 h

Plain (completed only): [1, 3] h, p50 1 h, p95 3 h. Censored: [1, 3, 3, 3.5] h, nearest rank p50 the 2nd = 3 h,
p95 the 4th = 3.5 h.
"""

from __future__ import annotations

from apportion.domain.budgets import BudgetTree
from apportion.sim.report import censored_jct_s, summarise
from apportion.timeutil import US_PER_S
from tests.kit.simkit import at, job, nodes, run

TREE = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
H = 3600.0


def _four_jobs():
    jobs = [
        job("j1", "lab/a", submit=at(0), duration_s=1 * H),
        job("j2", "lab/a", submit=at(0), duration_s=2 * H),
        job("j3", "lab/a", submit=at(0, 30), duration_s=5 * H),
        job("j4", "lab/a", submit=at(1), duration_s=1 * H),
    ]
    return run(TREE, nodes(("n0", 1)), jobs, until_us=at(4))


def test_censored_jct_counts_unfinished_and_unplaced_jobs_at_the_end_of_the_run():
    r = _four_jobs()
    rep = summarise(r, BudgetTree.from_mapping(TREE), "fairshare", 1)
    assert (rep.completed, rep.unfinished, rep.never) == (2, 2, 1)
    assert (rep.jct_p50_s, rep.jct_p95_s) == (1 * H, 3 * H)
    assert (rep.jct_censored_p50_s, rep.jct_censored_p95_s) == (3 * H, 3.5 * H)


def test_censored_jct_of_the_ledger_by_hand():
    sub = {"a": (0, "lab/a", True), "b": (0, "lab/a", False), "c": (US_PER_S, "lab/b", True)}
    done = {"a": 10 * US_PER_S}
    assert censored_jct_s(sub, done, 100 * US_PER_S) == [10.0, 100.0, 99.0]
