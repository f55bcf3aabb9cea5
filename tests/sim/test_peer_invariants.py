"""Invariants every peer (slurm, kueue, kai) keeps on random clusters and streams.

* no double booking: a GPU is given to a run only when free or held by one of
  the decision's own stopping victims; one workload per GPU
  (``tests.kit.sim_worlds.check_log``);
* its own protection rule: Slurm preempts only min-runtime-0 (scavenger QOS)
  runs for a job (drains aside); KAI never reclaims an allocated run before
  its minimum runtime (reclaim-min-runtime, the simulator's violation list);
  Kueue has no minimum runtime, so only the booking is checked for it, and it
  never preempts an allocated run of the preemptor's own queue;
* determinism: the same inputs and seed give a byte-identical decision log,
  also when the registry's instance ran another simulation in between.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.events import JobPreempted
from apportion.sim.baselines import POLICIES
from apportion.sim.core import SimConfig, simulate
from tests.kit.sim_worlds import TREE, check_log, worlds
from tests.kit.simkit import at

PEERS = ("slurm", "kueue", "kai")


def _sim(world, policy):
    nodes, jobs, drains, seed = world
    cfg = SimConfig(
        seed=seed, dispatch=DispatchConfig(heartbeat_timeout_s=None), drains=drains, sample_s=0, until_us=at(12)
    )
    return simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg, scheduler=POLICIES[policy])


@pytest.mark.parametrize("policy", PEERS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds())
def test_no_double_booking_and_the_peer_keeps_its_own_protection_rule(policy, world):
    _nodes, jobs, _drains, _seed = world
    r = _sim(world, policy)
    specs = {j.job_id: j for j in jobs}
    if policy == "kueue":  # no minimum runtime in Kueue: check the booking only
        specs = {k: replace(j, min_runtime_s=0.0) for k, j in specs.items()}
    check_log(r.log, specs)
    for_a_job = [e for e in r.log if isinstance(e, JobPreempted) and e.by_job_id is not None]
    if policy == "slurm":
        assert all(not e.allocated for e in for_a_job)
    if policy == "kai":
        assert r.violations == []
    if policy == "kueue":
        assert all(not (e.allocated and e.by_budget == e.budget) for e in for_a_job)
    assert {j.job_id for j in jobs} <= set(r.state.jobs) | set(r.state.finished)


@pytest.mark.parametrize("policy", PEERS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world=worlds(), other=worlds())
def test_same_inputs_give_the_same_decision_log_even_after_another_run(policy, world, other):
    first = _sim(world, policy).decision_log()
    _sim(other, policy)  # the registry's instance serves another simulation in between
    assert _sim(world, policy).decision_log() == first
