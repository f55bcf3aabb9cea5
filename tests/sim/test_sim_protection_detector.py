"""The simulator's protection-violation detector, fed its fault: a policy that preempts a protected run.

The detector (``SimResult.violations``) judges each ``JobPreempted`` by the one
protection window, ``Run.protected_until_us``: ``protection_s`` as the run's
``JobPlaced`` recorded it (the minimum runtime, doubled per earlier preemption of
the job), from the latest replica start. Before, it read the first start and the
minimum runtime alone, so a preemption inside a grown protection went unseen.

World: one node of 8 GPUs; ``a`` (lab/a, 4 GPUs, minimum runtime 10 min, 10 h of
work) starts at 00:00:00; ``w`` (lab/b, unallocated, 5 GPUs) never fits and keeps
the 1 s cycle ticking. The policy is the real engine plus a fault: at the listed
times it also preempts ``a``'s current run (``preempt_events``). A preempted run
exits after 5 s and is requeued; its next attempt starts at once, protected for
``protection_s(600, 1) = 1200`` s.
"""

from __future__ import annotations

import pytest

from apportion.audit.replay import preemption_report
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import CycleSnapshot, EngineConfig, preempt_events, run_cycle
from apportion.events import Event
from apportion.sim.core import SimConfig, simulate
from apportion.timeutil import Micros, from_us
from tests.kit.simkit import T0, at, job, nodes

TREE = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}


def _with_faults(faults: list[Micros]):
    """The engine's cycle, plus a preemption of ``a``'s run at each of ``faults`` (µs, ascending)."""
    due = list(faults)

    def cycle(snapshot: CycleSnapshot, now_us: Micros, cfg: EngineConfig) -> list[Event]:
        out = run_cycle(snapshot, now_us, cfg).events
        if due and now_us >= due[0]:
            due.pop(0)
            run = next(r for r in snapshot.cluster.runs.values() if r.job_id == "a" and not r.stopping)
            out = preempt_events(run, from_us(now_us), cfg.grace_s, cfg.producer, reason="fault") + out
        return out

    return cycle


def _sim(faults: list[Micros]):
    cfg = SimConfig(
        seed=1,
        dispatch=DispatchConfig(heartbeat_timeout_s=None),
        stop_delay_s=5.0,
        sample_s=0,
        cycle_s=1.0,
        until_us=at(0, 40),
    )
    jobs = [
        job("a", "lab/a", gpus=4, min_runtime_s=600.0, duration_s=36_000.0),
        job("w", "lab/b", gpus=5, min_runtime_s=0.0),
    ]
    return simulate(BudgetTree.from_mapping(TREE), nodes(("n0", 8)), jobs, cfg, scheduler=_with_faults(faults))


def _msg(attempt: int, t: Micros) -> str:
    return f"a#{attempt} preempted at {from_us(t).isoformat()} inside its protection"


@pytest.mark.parametrize(
    ("faults", "violations"),
    [
        pytest.param([at(0, 9, 59)], [_msg(1, at(0, 9, 59))], id="1 s inside the minimum runtime: named"),
        pytest.param([at(0, 10)], [], id="exactly at the end of the minimum runtime: not a violation"),
        # attempt 2 starts at 00:10:05 (the 5 s exit), protected 20 min: to 00:30:05
        pytest.param(
            [at(0, 10), at(0, 25, 5)],
            [_msg(2, at(0, 25, 5))],
            id="past the minimum runtime but inside the protection grown by one preemption: named",
        ),
        pytest.param([at(0, 10), at(0, 30, 5)], [], id="exactly at the end of the grown protection: not a violation"),
    ],
)
def test_the_detector_names_a_preemption_inside_the_protection_window(faults, violations):
    r = _sim(faults)
    starts = [(e.attempt, e.ts) for e in r.log if e.type == "JobStarted" and e.job_id == "a"]
    assert starts == [(1, from_us(T0))] + [(i + 2, from_us(t + 5_000_000)) for i, t in enumerate(faults)]
    preempted = [(e.attempt, e.ts) for e in r.log if e.type == "JobPreempted" and e.job_id == "a"]
    assert preempted == [(i + 1, from_us(t)) for i, t in enumerate(faults)]  # the fault was injected as asked
    assert r.violations == violations
    # the audit reads the same window from the same log
    assert [(v["job_id"], v["attempt"]) for v in preemption_report(r.log).violations] == [
        ("a", int(m.split("#")[1].split()[0])) for m in violations
    ]
