"""Property tests on random clusters and job streams (rule D3.invariants).

* no GPU is held by two runs, and no two workloads run on one GPU at once;
* no protected run is preempted;
* work conservation: right after a cycle, nothing more fits on free GPUs
  (unless a reservation holds nodes back);
* the same seed gives a byte-identical decision log.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from dataclasses import replace
from types import FunctionType
from typing import TypeVar
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apportion.domain.budgets import BudgetTree
from apportion.domain.cluster import ClusterState
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import CycleSnapshot, EngineConfig, run_cycle
from apportion.events import (
    JobCompleted,
    JobPlaced,
    StartWorkload,
)
from apportion.sim.baselines import POLICIES
from apportion.sim.core import SimConfig, SimJob, SimNode, simulate
from apportion.timeutil import to_us
from tests.kit.sim_worlds import LEAVES, TREE, check_log, worlds
from tests.kit.simkit import at

T = TypeVar("T")


def _work_conserving(snapshot: CycleSnapshot, now_us: int, cfg: EngineConfig):
    """The real cycle, then check that a second cycle on its outcome places nothing more on free GPUs."""
    first = run_cycle(snapshot, now_us, cfg)
    cs = ClusterState()
    c = snapshot.cluster
    cs.nodes, cs.runs, cs.node_runs = dict(c.nodes), dict(c.runs), dict(c.node_runs)
    cs._owner = {(p.node_id, g): key for key, r in c.runs.items() for p in r.placements for g in p.gpus}
    placed = set()
    for e in first.events:
        cs.apply(e)
        if isinstance(e, JobPlaced):
            placed.add(e.job_id)
    pending = {leaf: [j for j in jobs if j.job_id not in placed] for leaf, jobs in snapshot.pending.items()}
    again = run_cycle(replace(snapshot, cluster=cs.snapshot(), pending=pending), now_us, replace(cfg, preemption=False))
    if first.reservation is None:
        assert not [e for e in again.events if isinstance(e, JobPlaced)], "a placeable job was left waiting"
    return first.events


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_invariants_on_random_clusters_and_streams(world):
    nodes, jobs, drains, seed = world
    dcfg = DispatchConfig(heartbeat_timeout_s=None, scheduler=_work_conserving)
    cfg = SimConfig(seed=seed, dispatch=dcfg, drains=drains, sample_s=0, until_us=at(12))
    r = simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg)
    assert r.violations == []
    check_log(r.log, {j.job_id: j for j in jobs})
    # nothing is lost: every job is finished or still known to the dispatcher
    assert {j.job_id for j in jobs} <= set(r.state.jobs) | set(r.state.finished)


@settings(max_examples=15, deadline=None)
@given(worlds())
def test_same_seed_gives_byte_identical_decision_log(world):
    nodes, jobs, drains, seed = world
    cfg = SimConfig(seed=seed, drains=drains, sample_s=0, until_us=at(12))
    tree = BudgetTree.from_mapping(TREE)
    assert simulate(tree, nodes, jobs, cfg).decision_log() == simulate(tree, nodes, jobs, cfg).decision_log()


def test_run_cycle_is_the_default_cycle():
    assert DispatchConfig().scheduler is None and POLICIES["fairshare"] is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds())
def test_cycles_decide_the_same_with_and_without_the_kept_indices(world):
    # The dispatcher passes its VictimIndex and FreeIndex (kept across cycles) and its memo
    # (segment floors, shape codes) to the engine; every cycle must give the same events as
    # one that indexes the snapshot itself and scans the pending lists.
    from apportion.domain import dispatch

    nodes, jobs, drains, seed = world
    real = run_cycle
    cycles = []

    def both(snapshot, now_us, cfg):
        with_index = real(snapshot, now_us, cfg)
        assert snapshot.victims is not None and snapshot.free is not None
        without = real(replace(snapshot, victims=None, free=None, memo=None), now_us, cfg)
        assert [e.model_dump_json() for e in with_index.events] == [e.model_dump_json() for e in without.events]
        cycles.append(len(with_index.events))
        return with_index

    with mock.patch.object(dispatch, "run_cycle", both):
        cfg = SimConfig(seed=seed, drains=drains, sample_s=0, until_us=at(12))
        r = simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg)
    assert cycles and r.violations == []


#: Modules whose objects a run of the simulator never makes: a cycle holding one was made by another thread of the
#: test process (a Kafka client an earlier test of the same worker left to close, for example), not by the run.
FOREIGN_MODULES = ("kafka", "aiokafka", "redis", "socket", "ssl", "asyncio", "concurrent", "threading", "selectors")


def _module_of(o: object) -> str:
    """The module ``o`` comes from: a class's or a function's own (their type is a builtin), else its type's."""
    own = getattr(o, "__module__", None) if isinstance(o, (type, FunctionType)) else None
    return own if isinstance(own, str) else type(o).__module__


def _own_garbage(garbage: list) -> list:
    """The objects of ``garbage`` (cycles the collector found) less every cycle that holds an object of a
    :data:`FOREIGN_MODULES` type, class or function: the cycles the simulator's run could have made."""
    index = {id(o): i for i, o in enumerate(garbage)}
    parent = list(range(len(garbage)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, o in enumerate(garbage):
        for ref in gc.get_referents(o):
            j = index.get(id(ref))
            if j is not None:
                parent[root(i)] = root(j)
    foreign = {root(i) for i, o in enumerate(garbage) if _module_of(o).split(".")[0] in FOREIGN_MODULES}
    return [o for i, o in enumerate(garbage) if root(i) not in foreign]


def _cycles_made_by(run: Callable[[], T]) -> tuple[T, list[str]]:
    """``run()``'s result and the type names of the objects it left unreachable in reference cycles (its own:
    :func:`_own_garbage`). Every object the collector tracks before the run is held until the run is judged: one
    made earlier that the run (or a thread of an earlier test of the worker) lets go of, such as a class a library
    built on first use and keeps in a cache the run evicts, is not counted as the run's (a class is a cycle by
    nature: its ``__mro__`` and its attribute descriptors refer back to it)."""
    gc.collect()
    made_before = gc.get_objects()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        out = run()
        gc.collect()
        return out, sorted({type(o).__name__ for o in _own_garbage(gc.garbage)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        del made_before


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_run_leaves_no_reference_cycles(policy):
    """``SimConfig.pause_gc`` relies on this: with the cyclic GC paused, a cycle would only be freed at the end.

    A run with heartbeats, a node loss, a drain, a cancel, preemptions and
    gangs, under each policy; every object left unreachable in a reference
    cycle is saved by ``DEBUG_SAVEALL`` instead of freed, and there must be none.
    """
    rng = random.Random(5)
    nodes = [SimNode(f"n{i}", 8 if i % 2 else 4) for i in range(6)]
    jobs = sorted(
        (
            SimJob(
                job_id=f"j{i:03d}",
                budget=rng.choice(LEAVES),
                user="u",
                submit_us=at(0, rng.randrange(600)),
                gpus_per_replica=rng.choice([1, 2, 4]),
                replicas=rng.choice([1, 1, 2]),
                min_runtime_s=rng.choice([0.0, 600.0, 1800.0]),
                duration_s=float(rng.randrange(60, 7200)),
            )
            for i in range(150)
        ),
        key=lambda j: (j.submit_us, j.job_id),
    )
    cfg = SimConfig(
        seed=3,
        heartbeat_s=30.0,
        dispatch=DispatchConfig(heartbeat_timeout_s=90.0),
        drains=(("n1", at(1)),),
        node_failures=(("n2", at(2)),),
        cancels=(("j005", at(0, 30)),),
        until_us=at(12),
        pause_gc=False,
    )
    r, cyclic = _cycles_made_by(
        lambda: simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg, scheduler=POLICIES[policy])
    )
    # Kueue has no minimum runtime (apportion.sim.peers.kueue): it preempts inside ours
    assert r.placed_first and (r.violations == [] or policy == "kueue")
    assert cyclic == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.sampled_from(["unallocated", "all", "none"]))
def test_checkpoints_and_work_lost_on_random_clusters_and_streams(world, on_stop):
    """Checkpoint progress only grows and stays below the job's work; a completed attempt ran exactly what was
    left after its job's last checkpoint; work lost is within [0, GPUs x time held]; the log fold agrees
    with the simulator's live fold."""
    from apportion.events import JobCheckpointed
    from apportion.report import JobLedger

    nodes, jobs, drains, seed = world
    cfg = SimConfig(seed=seed, drains=drains, sample_s=0, until_us=at(12), checkpoint_on_stop=on_stop)
    r = simulate(BudgetTree.from_mapping(TREE), nodes, jobs, cfg)
    specs = {j.job_id: j for j in jobs}
    saved: dict[str, float] = {}
    base: dict[tuple[str | None, int | None], float] = {}
    start: dict[tuple[str | None, int | None], int] = {}
    for e in r.log:
        key = (getattr(e, "job_id", None), getattr(e, "attempt", None))
        if isinstance(e, JobCheckpointed):
            assert saved.get(e.job_id, 0.0) <= e.progress_s <= specs[e.job_id].duration_s
            saved[e.job_id] = e.progress_s
        elif isinstance(e, StartWorkload) and key not in start:
            start[key], base[key] = to_us(e.ts), saved.get(e.job_id, 0.0)
        elif isinstance(e, JobCompleted) and e.producer.startswith("sim"):
            ran = (to_us(e.ts) - start[key]) / 1e6
            assert ran == pytest.approx(specs[e.job_id].duration_s - base[key], abs=1e-5)
    placed = {(e.job_id, e.attempt): to_us(e.ts) for e in r.log if isinstance(e, JobPlaced)}
    for s in r.jobs_ledger.stops:
        assert 0 <= s.lost_gpu_s <= s.gpus * (s.at_us - placed[(s.job_id, s.attempt)]) / 1e6
    again = JobLedger().apply_all(r.log)
    assert [(s.job_id, s.attempt, s.lost_gpu_s) for s in again.stops] == [
        (s.job_id, s.attempt, s.lost_gpu_s) for s in r.jobs_ledger.stops
    ]
    assert again.completed == r.jobs_ledger.completed


def test_own_garbage_keeps_a_cycle_of_the_run_and_leaves_out_one_holding_a_foreign_object() -> None:
    import socket

    mine: dict = {}
    mine["self"] = mine  # a cycle of builtins only: the run's
    sock = socket.socket()
    try:
        theirs: list = [sock]
        theirs.append(theirs)  # a cycle holding a socket: another thread's
        kept = _own_garbage([mine, theirs, sock])
    finally:
        sock.close()
    assert [type(o).__name__ for o in kept] == ["dict"]
    assert kept[0] is mine


def test_cycles_made_by_counts_the_runs_own_and_not_an_earlier_class_the_run_lets_go_of() -> None:
    """FAULT (a worker's earlier tests): a class built before the run (by a library on first use, kept in a cache)
    whose last reference the run drops is garbage of a class (``dict``, ``function``, ``getset_descriptor``,
    ``tuple``, ``type``) when the collector runs after it, and it is not the run's; the run's own cycle is counted,
    and a class of a :data:`FOREIGN_MODULES` module made meanwhile (another thread's) is not."""
    cache: dict[str, type] = {}

    class BuiltOnFirstUse:
        def method(self) -> None:
            pass

    cache["built"] = BuiltOnFirstUse
    del BuiltOnFirstUse

    def run() -> str:
        cache.clear()  # the run evicts it: the class's last reference goes
        mine: dict = {}
        mine["self"] = mine  # a cycle of the run's own
        type("Versioned", (), {"__module__": "kafka.protocol.api_message"})  # another thread's, dropped at once
        return "done"

    assert _cycles_made_by(run) == ("done", ["dict"])
