"""Property tests of loop-free preemption in one cycle (rule D3.consistent-view).

Random clusters, runs, queues and window occupancy on the tree::

    lab (1.0)
    ├── x  0.5
    │   ├── p  0.5
    │   └── q  0.5
    └── y  0.5
        ├── r  0.6
        └── s  0.4

For every cycle, checked against an independent replay of its provisional
charges (not the engine's own ratios):

* no cycle preempts V's allocated work for B and B's for V (leaves, and
  branches at their lowest common ancestor);
* every expired-behind preemption had, at its moment in the cycle, the
  victim's branch behind by delta and, after the move, the preemptor's
  branch (with the job charged) at most at the victim's: the pair is never
  inverted by the move;
* no victim was protected.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion import events as ev
from apportion.domain.budgets import BudgetTree, ancestors_of
from apportion.domain.cluster import ClusterState
from apportion.domain.engine import CycleSnapshot, EngineConfig, PendingJob, pending_order, run_cycle
from apportion.domain.fairshare import branches_at_lca, effective_capacity
from apportion.timeutil import WEEK_S, from_us, to_us
from tests.kit.builders import T0, h

TREE = BudgetTree.from_mapping(
    {"lab": 1.0, "lab/x": 0.5, "lab/x/p": 0.5, "lab/x/q": 0.5, "lab/y": 0.5, "lab/y/r": 0.6, "lab/y/s": 0.4}
)
LEAVES = ["lab/x/p", "lab/x/q", "lab/y/r", "lab/y/s"]
NOW = h(10)
DELTA = 0.05

runs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([0, 1, 2, 4]),  # GPUs per replica wanted (0: unallocated 1-GPU run)
        st.sampled_from([60.0, 3600.0, 12 * 3600.0]),  # min runtime
        st.integers(0, 9),  # start hour
    ),
    max_size=12,
)
jobs_st = st.lists(
    st.tuples(
        st.sampled_from(LEAVES),
        st.sampled_from([1, 2, 4]),
        st.sampled_from([1, 1, 2]),
        st.sampled_from([0.0, 60.0, 60.0, 3600.0, 20 * 3600.0, 100 * 3600.0]),  # long ones charge a lot
    ),
    min_size=1,
    max_size=12,
)
occ_st = st.fixed_dictionaries({leaf: st.floats(0, 200_000) for leaf in LEAVES})


def build(nodes: int, runs, jobs, leaf_occ, capacity):
    cs = ClusterState()
    for i in range(nodes):
        cs.apply(ev.NodeRegistered(node_id=f"n{i}", gpu_count=4, ts=from_us(T0)))
    for j, (leaf, g, min_rt, start) in enumerate(runs):
        allocated = g > 0
        g = max(g, 1)
        node = next((n for n in sorted(cs.nodes) if len(cs.nodes[n].free) >= g), None)
        if node is None:
            continue
        gpus = tuple(sorted(cs.nodes[node].free)[:g])
        cs.apply(
            ev.JobPlaced(
                job_id=f"r{j}",
                attempt=1,
                budget=leaf,
                allocated=allocated,
                gpus_per_replica=g,
                replicas=1,
                min_runtime_s=min_rt if allocated else 0.0,
                placements=(ev.Placement(node_id=node, gpus=gpus),),
                submitted_at=from_us(T0),
                decision=ev.Decision(rank=0, budget_rank=0, ratio=0.0),
                ts=from_us(h(start)),
            )
        )
        cs.apply(ev.JobStarted(job_id=f"r{j}", attempt=1, node_id=node, ts=from_us(h(start))))
    pending: dict[str, list[PendingJob]] = {}
    for j, (leaf, g, k, min_rt) in enumerate(jobs):
        pending.setdefault(leaf, []).append(
            PendingJob(
                job_id=f"j{j}",
                attempt=1,
                budget=leaf,
                user="u",
                gpus_per_replica=g,
                replicas=k,
                min_runtime_s=min_rt,
                submitted_at_us=h(1) + j,
                queued_at_us=NOW,
                duration_s=60.0,
            )
        )
    for lst in pending.values():
        lst.sort(key=pending_order)
    occ: dict[str, float] = {}
    for leaf, v in leaf_occ.items():
        for a in ancestors_of(leaf):
            occ[a] = occ.get(a, 0.0) + v
    return CycleSnapshot(cs.snapshot(), pending, TREE, occ, capacity), occ


def ratio(occ: dict[str, float], path: str, k: float) -> float:
    return occ.get(path, 0.0) / (TREE.abs_share(path) * effective_capacity(k))


@settings(max_examples=500, deadline=None)
@given(
    st.integers(1, 5),
    runs_st,
    jobs_st,
    occ_st,
    st.sampled_from([0.0, 50_000.0, 400_000.0, 2_000_000.0]),
)
def test_no_cycle_reverses_or_inverts_a_preemption(nodes, runs, jobs, leaf_occ, capacity):
    snap, occ = build(nodes, runs, jobs, leaf_occ, capacity)
    res = run_cycle(snap, NOW, EngineConfig(delta=DELTA))
    occ = dict(occ)
    leaf_pairs: set[tuple[str, str]] = set()
    branch_pairs: set[tuple[str, str, str]] = set()
    for e in res.events:
        if not isinstance(e, ev.JobPlaced) or not e.allocated:
            continue
        charge = e.gpus_per_replica * e.replicas * min(e.min_runtime_s, float(WEEK_S))
        for v in e.decision.victims:
            assert v.protected_until is None or to_us(v.protected_until) <= NOW, "a protected victim"
            if v.rule != "expired_behind":
                continue
            lca, vb, bb = branches_at_lca(v.budget, e.budget)
            r_v, r_b = ratio(occ, vb, capacity), ratio(occ, bb, capacity)
            r_b_after = (occ.get(bb, 0.0) + charge) / (TREE.abs_share(bb) * effective_capacity(capacity))
            assert r_v >= r_b + DELTA - 1e-9, (v, r_v, r_b)
            assert r_b_after <= r_v + 1e-9, ("the move inverts the pair", v, r_b_after, r_v)
            assert (e.budget, v.budget) not in leaf_pairs, "V->B and B->V in one cycle"
            assert (lca, bb, vb) not in branch_pairs, "branch reversal in one cycle"
            leaf_pairs.add((v.budget, e.budget))
            branch_pairs.add((lca, vb, bb))
        for a in ancestors_of(e.budget):
            occ[a] = occ.get(a, 0.0) + charge
