"""The engine's incremental indices kept across cycles (``engine.VictimIndex``, ``engine.FreeIndex``).

* after any sequence of placements, starts, completions, preemptions,
  requeues, cancels and node state changes, indices kept up to date with
  ``sync`` equal ones built from scratch from the same runs and nodes;
* its order key sorts candidates exactly as the cost of rule D3.victims
  (allocated GPUs, unallocated GPUs, GPU-seconds of work lost at ``now``,
  job id, attempt) for any ``now`` after the starts.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from apportion.domain.cluster import ClusterState, Run
from apportion.domain.engine import CycleVictims, FreeIndex, VictimIndex, order_key, order_lost_gpu_s
from apportion.domain.nodes import NodeState
from tests.kit.builders import (
    T0,
    cancelled,
    completed,
    cordoned,
    drain,
    node,
    placed,
    preempted,
    requeued,
    s,
    started,
    uncordoned,
)

NODES = ["n0", "n1", "n2", "n3"]
BUDGETS = ["lab/a", "lab/b", "lab/c"]

ops = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "place",
                "place",
                "start",
                "complete",
                "complete_replica",
                "preempt",
                "requeue",
                "cancel",
                "cordon",
                "uncordon",
                "drain",
                "register",
                "sync",
                "sync",
            ]
        ),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=60,
)


def _fresh(cs: ClusterState) -> tuple:
    return VictimIndex.build(cs.runs).as_lists()


def _fresh_free(cs: ClusterState) -> tuple:
    return FreeIndex().sync(cs).as_tuple()  # a new index always rebuilds


def _copy(cs: ClusterState) -> ClusterState:
    c = ClusterState()
    c.nodes, c.runs, c.node_runs, c._owner = dict(cs.nodes), dict(cs.runs), dict(cs.node_runs), dict(cs._owner)
    return c


@settings(max_examples=200, deadline=None)
@given(ops)
def test_incremental_index_equals_a_rebuild(script):
    cs = ClusterState()
    for n in NODES:
        cs.apply(node(n, gpus=8))
    idx = VictimIndex()
    assert idx.sync(cs).as_lists() == _fresh(cs) == ({}, {})
    assert cs.changed == set()
    fidx = FreeIndex()
    assert fidx.sync(cs).as_tuple() == _fresh_free(_copy(cs))
    assert fidx.maxc == 8 and fidx.buckets[None][8] == NODES
    t = 0
    seq = 0
    for op, a, b in script:
        t += 1 + a % 900
        runs = sorted(cs.runs)
        pick = runs[a % len(runs)] if runs else None
        if op == "place":
            seq += 1
            k = 1 + b % 3
            first = a % len(NODES)
            cs.apply(
                placed(
                    f"j{seq:03d}",
                    budget=BUDGETS[b % 3],
                    gpus=1 + a % 4,
                    replicas=k,
                    allocated=b % 4 != 0,
                    min_runtime_s=None if b % 4 == 0 else float(60 * (1 + b % 7)),
                    nodes=[NODES[(first + i) % len(NODES)] for i in range(k)],
                    at=s(t),
                )
            )
        elif op in ("cordon", "uncordon", "drain", "register"):
            nid = NODES[a % len(NODES)]
            cs.apply(
                {"cordon": cordoned, "uncordon": uncordoned, "drain": drain}[op](nid, at=s(t))
                if op != "register"
                else node(nid, gpus=4 + 4 * (b % 2), at=s(t))
            )
        elif pick is None:
            continue
        elif op == "start":
            run = cs.runs[pick]
            r = b % run.replicas
            cs.apply(started(pick[0], attempt=pick[1], replica=r, node=run.placements[r].node_id, at=s(t)))
        elif op == "complete":
            cs.apply(completed(pick[0], attempt=pick[1], at=s(t)))
        elif op == "complete_replica":
            run = cs.runs[pick]
            cs.apply(completed(pick[0], attempt=pick[1], replica=b % run.replicas, at=s(t)))
        elif op == "preempt":
            cs.apply(preempted(pick[0], attempt=pick[1], at=s(t)))
        elif op == "requeue":
            cs.apply(requeued(pick[0], attempt=pick[1] + 1, at=s(t)))
        elif op == "cancel":
            cs.apply(cancelled(pick[0], attempt=pick[1], at=s(t)))
        if op == "sync":
            assert idx.sync(cs).as_lists() == _fresh(cs)
            assert cs.changed == set()
            assert fidx.sync(cs).as_tuple() == _fresh_free(_copy(cs))
            assert cs.changed_nodes == set()
    assert idx.sync(cs).as_lists() == _fresh(cs)
    assert fidx.sync(cs).as_tuple() == _fresh_free(_copy(cs))


def test_index_of_a_small_cluster_by_hand():
    cs = ClusterState()
    cs.apply(node("n0", gpus=8))
    cs.apply(node("n1", gpus=8))
    idx = VictimIndex()
    idx.sync(cs)
    cs.apply(placed("u1", budget="lab/a", gpus=2, allocated=False, nodes=["n0"], at=s(10)))
    cs.apply(placed("u2", budget="lab/b", gpus=2, replicas=2, allocated=False, nodes=["n0", "n1"], at=s(20)))
    cs.apply(placed("a1", budget="lab/a", gpus=4, min_runtime_s=600.0, nodes=["n1"], at=s(30)))
    cs.apply(started("a1", node="n1", at=s(40)))
    u, a = idx.sync(cs).as_lists()
    # unallocated u2 (4 GPUs in all) costs more than u1 (2 GPUs); key (0, gpus, -start, id, attempt)
    assert u == {
        "n0": [((0, 2, -s(10), "u1", 1), ("u1", 1), (0, 1)), ((0, 4, -s(20), "u2", 1), ("u2", 1), (0, 1))],
        "n1": [((0, 4, -s(20), "u2", 1), ("u2", 1), (0, 1))],
    }
    # allocated a1 protected until its start + 600 s
    assert a == {"lab/a": [(s(40) + 600_000_000, ("a1", 1))]}
    cs.apply(preempted("u2", at=s(50)))  # stopping runs are no candidates
    cs.apply(completed("u1", at=s(60)))
    u, a = idx.sync(cs).as_lists()
    assert u == {} and a == {"lab/a": [(s(40) + 600_000_000, ("a1", 1))]}


def test_a_cycle_reads_only_the_runs_expired_at_its_time_and_leaves_the_index_as_it_was():
    cs = ClusterState()
    cs.apply(node("n0", gpus=8))
    cs.apply(node("n1", gpus=8))
    # lab/a: a1 protected until s(100) + 600 s, a2 until s(200) + 600 s; lab/b: b1 until s(300) + 600 s
    for job, budget, n, at in [("a1", "lab/a", "n0", 100), ("a2", "lab/a", "n1", 200), ("b1", "lab/b", "n0", 300)]:
        cs.apply(placed(job, budget=budget, gpus=2, min_runtime_s=600.0, nodes=[n], at=s(at - 1)))
        cs.apply(started(job, node=n, at=s(at)))
    idx = VictimIndex().sync(cs)
    before = idx.as_lists()
    # at s(750): a1's protection ended (s(700)), a2's not yet (s(800)), b1's not (s(900))
    vic = CycleVictims(cs.view(), s(750), idx)
    assert sorted(vic.expired) == ["lab/a"]  # lab/b has nothing expired at s(750)
    a1 = cs.runs[("a1", 1)]
    assert vic.expired_on("lab/a") == {"n0": [(order_key(a1), a1, (0, 1))]}  # a2 (until s(800)) left out
    assert vic.expired_on("lab/a") == {"n0": [(order_key(a1), a1, (0, 1))]}  # asked again: the same
    later = CycleVictims(cs.view(), s(800), idx)  # a2's protection ends at s(800): expired then
    assert sorted(later.expired_on("lab/a")) == ["n0", "n1"]
    assert idx.as_lists() == before  # the index's lists are read, never cut


runs = st.builds(
    lambda alloc, g, k, start, i, att: Run(
        job_id=f"j{i}",
        attempt=att,
        budget="lab/a",
        user="u",
        allocated=alloc,
        gpus_per_replica=g,
        replicas=k,
        min_runtime_us=1 if alloc else 0,
        placements=(),
        placed_at_us=T0 + start,
        submitted_at_us=T0,
        started_at_us=T0 + start,
    ),
    st.booleans(),
    st.integers(1, 8),
    st.integers(1, 16),
    st.integers(0, 60 * 86400 * 10**6),
    st.integers(0, 50),
    st.integers(1, 3),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(runs, min_size=2, max_size=30, unique_by=lambda r: (r.job_id, r.attempt)), st.integers(0, 10**6))
def test_order_key_sorts_as_the_cost_at_any_later_now(rs, after_us):
    now = T0 + 60 * 86400 * 10**6 + after_us

    def cost(r: Run) -> tuple:
        gpus = r.gpus_per_replica * r.replicas
        lost = gpus * (now - r.started_at_us) / 1e6  # the rule D3.victims cost, computed at now
        return (gpus, 0, lost, r.job_id, r.attempt) if r.allocated else (0, gpus, lost, r.job_id, r.attempt)

    assert sorted(rs, key=order_key) == sorted(rs, key=cost)
    for r in rs:
        assert order_lost_gpu_s(order_key(r), now) == cost(r)[2]


def test_reservation_nodes_walk_the_buckets_as_the_sort_rule():
    # rule D3.scheduling-cycle reservation: eligible nodes (not reserved, model, >= g GPUs) by most free
    # GPUs, ties by id. The engine walks its free buckets; check it against the plain sort.
    import random

    from apportion.domain.cluster import ClusterSnapshot, Node
    from apportion.domain.engine import CycleFree, reservation_nodes

    def by_sort(free, g, k, model):
        elig = [
            n
            for n, m in free.model.items()
            if n not in free.reserved and (model is None or m == model) and free.count[n] >= g
        ]
        return [n for _, n in sorted((-len(free.free[n]), n) for n in elig)[:k]]

    MOSTLY_READY: list[NodeState] = ["ready", "ready", "ready", "ready", "cordoned"]
    rng = random.Random(5)
    for _ in range(1500):
        nodes = {}
        for _ in range(rng.randint(1, 12)):
            c, nid = rng.choice([2, 4, 8]), f"n{rng.randint(0, 99):02d}"
            nodes[nid] = Node(
                nid,
                c,
                "a" if rng.random() < 0.3 else None,
                rng.choice(MOSTLY_READY),
                frozenset(x for x in range(c) if rng.random() < 0.4),
            )
        free = CycleFree(ClusterSnapshot(nodes, {}, {}, tuple(sorted(nodes))))
        for n in list(free.model):
            r = rng.random()
            if r < 0.2:
                free.reserve(n)
            elif r < 0.4 and free.free[n]:
                free.take(n, rng.randint(1, len(free.free[n])))
        for _ in range(5):
            g, k, model = rng.randint(1, 8), rng.randint(1, 4), rng.choice([None, None, "a"])
            assert reservation_nodes(free, g, k, model) == by_sort(free, g, k, model)
