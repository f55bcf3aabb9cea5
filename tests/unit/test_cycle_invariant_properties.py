"""The invariants of rule D3.invariants, property-tested on random cycles of the real engine with the audit's detectors.

Each example is a random cluster (nodes of 4 or 8 GPUs, models ``a`` and ``b``, some cordoned), random runs
already on it (allocated or not, started at random hours, gangs of one replica), a random queue (gangs of 1-2
replicas of 1-8 GPUs, with or without a model, allocated or not, some waiting long enough to reserve) and random
window occupancy. One :func:`run_cycle` later, the log (the set-up events, then the cycle's) must show:

* no GPU held by two runs (:func:`apportion.audit.invariants.double_bookings`);
* every placement a whole gang on distinct nodes (:func:`apportion.audit.invariants.partial_gangs`);
* no protected run preempted (:func:`apportion.audit.replay.preemption_report`, the audit's protection check);
* no GPU idle while a placeable job waits (:func:`apportion.audit.invariants.idle_while_waiting` on the nodes
  after the cycle, the cycle's reservation excepted: rule D3.scheduling-cycle lets it keep its nodes' free GPUs from
  lower-ranked allocated work).

The detectors themselves are fed their faults in ``test_invariants.py`` and ``test_replay_protection.py``; this
file feeds them the engine.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.audit.invariants import Waiting, double_bookings, idle_while_waiting, partial_gangs
from apportion.audit.replay import preemption_report
from apportion.domain.budgets import BudgetTree, ancestors_of
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, pending_order, run_cycle
from apportion.timeutil import from_us
from tests.kit.builders import T0, h

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/x": 0.5, "lab/x/p": 0.5, "lab/x/q": 0.5, "lab/y": 0.5})
LEAVES = ["lab/x/p", "lab/x/q", "lab/y"]
NOW = h(10)

nodes_st = st.lists(
    st.tuples(st.sampled_from([4, 8]), st.sampled_from(["a", "b"]), st.booleans()),  # GPUs, model, cordoned
    min_size=1,
    max_size=5,
)
runs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([1, 2, 4, 8]),
        st.sampled_from([0.0, 60.0, 3600.0, 12 * 3600.0]),  # minimum runtime (0: unallocated)
        st.integers(0, 9),  # start hour
    ),
    max_size=10,
)
jobs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([1, 2, 4, 8]),  # GPUs per replica
        st.sampled_from([1, 1, 2]),  # replicas
        st.sampled_from([0.0, 60.0, 3600.0]),  # minimum runtime
        st.sampled_from([None, None, "a", "b"]),  # model
        st.sampled_from([0, 2]),  # hours queued (2: past reservation_after)
    ),
    min_size=1,
    max_size=12,
)
occ_st = st.fixed_dictionaries({leaf: st.floats(0, 200_000) for leaf in LEAVES})


def world(nodes, runs, jobs, leaf_occ) -> tuple[list[ev.Event], CycleSnapshot, list[PendingJob]]:
    """The set-up log, the cycle's snapshot folded from it, and the queue."""
    log: list[ev.Event] = []
    cs = ClusterState()

    def put(e: ev.Event) -> None:
        log.append(e)
        cs.apply(e)

    for i, (gpus, model, cordoned) in enumerate(nodes):
        put(ev.NodeRegistered(node_id=f"n{i}", gpu_count=gpus, gpu_model=model, ts=from_us(T0)))
        if cordoned:
            put(ev.NodeCordoned(node_id=f"n{i}", ts=from_us(T0)))
    for j, (leaf, g, min_rt, start) in enumerate(runs):
        node = next((n for n in sorted(cs.nodes) if len(cs.nodes[n].free) >= g), None)
        if node is None:
            continue
        put(
            ev.JobPlaced(
                job_id=f"r{j}",
                attempt=1,
                budget=leaf,
                allocated=min_rt > 0,
                gpus_per_replica=g,
                replicas=1,
                min_runtime_s=min_rt,
                placements=(ev.Placement(node_id=node, gpus=tuple(sorted(cs.nodes[node].free)[:g])),),
                submitted_at=from_us(T0),
                decision=ev.Decision(rank=0, budget_rank=0, ratio=0.0),
                ts=from_us(h(start)),
            )
        )
        put(ev.JobStarted(job_id=f"r{j}", attempt=1, node_id=node, ts=from_us(h(start))))
    queue = [
        PendingJob(
            job_id=f"j{j}",
            attempt=1,
            budget=leaf,
            user="u",
            gpus_per_replica=g,
            replicas=k,
            min_runtime_s=min_rt,
            gpu_model=model,
            submitted_at_us=h(1) + j,
            queued_at_us=h(10 - queued),
            duration_s=60.0,
        )
        for j, (leaf, g, k, min_rt, model, queued) in enumerate(jobs)
    ]
    pending: dict[str, list[PendingJob]] = {}
    for p in queue:
        pending.setdefault(p.budget, []).append(p)
    for lst in pending.values():
        lst.sort(key=pending_order)
    occ: dict[str, float] = {}
    for leaf, v in leaf_occ.items():
        for a in ancestors_of(leaf):
            occ[a] = occ.get(a, 0.0) + v
    return log, CycleSnapshot(cs.snapshot(), pending, TREE, occ, 400_000.0), queue


@settings(max_examples=400, deadline=None)
@given(nodes_st, runs_st, jobs_st, occ_st)
def test_a_cycle_keeps_every_invariant_the_audit_checks(nodes, runs, jobs, leaf_occ):
    log, snap, queue = world(nodes, runs, jobs, leaf_occ)
    res = run_cycle(snap, NOW, EngineConfig())
    full = log + res.events
    assert double_bookings(full) == []
    assert partial_gangs(full) == []
    assert preemption_report(full).violations == []
    after = ClusterState()
    for e in full:
        after.apply(e)
    placed = {e.job_id for e in res.events if isinstance(e, ev.JobPlaced)}
    waiting = [Waiting(p.job_id, p.gpus_per_replica, p.replicas, p.gpu_model) for p in queue if p.job_id not in placed]
    reserved = res.reservation[1] if res.reservation is not None else ()
    assert idle_while_waiting(after.nodes, waiting, reserved) == []
