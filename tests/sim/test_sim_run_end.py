"""The run ends when the last job ends (rule D7.simulator): a wake-up that can decide nothing more does not
keep the clock going, whatever the policy and however far out the wake-up lies."""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import PROTECTION_UNTIL_DONE_S
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import EngineConfig
from apportion.sim.baselines import fifo
from apportion.sim.core import SimConfig, simulate
from apportion.timeutil import to_us
from tests.kit.simkit import T0, at, job, nodes, run

H = 3600
AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}


def _last_completion(r) -> int:
    return max(to_us(e.ts) for e in r.log if isinstance(e, ev.JobCompleted))


def test_a_protection_longer_than_the_job_does_not_outlive_it():
    # min_runtime 10 h, work 1 h: the protection-expiry wake-up is at 10:00, the job ends at 01:00
    r = run(AB, nodes(("n0", 8)), [job("a", "lab/a", min_runtime_s=10 * H, duration_s=H)])
    assert _last_completion(r) == at(1)
    assert r.end_us == at(1)


def test_a_job_protected_until_done_by_the_churn_bound_ends_the_run_when_it_ends():
    """Churn bound 1: the first job preempted once is placed again "until done" (100 years of protection)."""
    jobs = [
        job("a", "lab/a", gpus=8, min_runtime_s=60, duration_s=10 * H),
        job("b", "lab/b", gpus=8, min_runtime_s=60, duration_s=10 * H, submit=T0 + 1),
    ]
    eng = EngineConfig(churn_bound=1)
    cfg = SimConfig(seed=1, dispatch=DispatchConfig(engine=eng, heartbeat_timeout_s=None), stop_delay_s=5.0)
    r = simulate(BudgetTree.from_mapping(AB), nodes(("n0", 8)), jobs, cfg)
    until_done = [
        e for e in r.log if isinstance(e, ev.JobPlaced) and e.decision.protection_s == PROTECTION_UNTIL_DONE_S
    ]
    assert until_done, "the scenario must place a job protected until done"
    assert {e.job_id for e in r.log if isinstance(e, ev.JobCompleted)} == {"a", "b"}
    assert r.end_us == _last_completion(r) < at(48)


def test_a_baseline_run_ends_with_its_last_job_too():
    # FIFO records no protection: its wake-ups are the minimum runtime from placement (10 h here)
    r = simulate(
        BudgetTree.from_mapping(AB),
        nodes(("n0", 8)),
        [job("a", "lab/a", min_runtime_s=10 * H, duration_s=2 * H)],
        SimConfig(seed=1),
        scheduler=fifo,
    )
    assert r.end_us == _last_completion(r) == at(2)
