"""Topology-aware gang placement (rules ``D1.topology``, ``D3.placement``): exact node choices.

The labelled cluster of most cases, 8 nodes of 8 GPUs::

    block b0                 block b1
    ├── rack r0: n0 n1       ├── rack r2: n4 n5
    └── rack r1: n2 n3       └── rack r3: n6 n7
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from apportion.domain.cluster import ClusterSnapshot, ClusterState, Node
from apportion.domain.dispatch import DispatchState, Tick, step
from apportion.domain.engine.placement import CycleFree, FreeIndex, topology_pick
from apportion.domain.engine.reservation import reservation_nodes
from apportion.events import JobPlaced, JobQueued, JobRejected, JobSubmitted, NodeRegistered
from apportion.sim.traces import load_budget_file, topology_of
from apportion.timeutil import from_us
from tests.kit.builders import T0, m, submitted
from tests.kit.domain_dispatch import CFG, TREE

RACK = {"n0": "r0", "n1": "r0", "n2": "r1", "n3": "r1", "n4": "r2", "n5": "r2", "n6": "r3", "n7": "r3"}
BLOCK = {"r0": "b0", "r1": "b0", "r2": "b1", "r3": "b1"}


def cluster(free: dict[str, int] | None = None, labels: bool = True, model: dict[str, str] | None = None) -> CycleFree:
    """8 nodes of 8 GPUs; ``free``: node -> free GPUs (default 8); ``labels``: the tree above, else none."""
    nodes = {}
    for nid, rack in RACK.items():
        f = (free or {}).get(nid, 8)
        nodes[nid] = Node(
            nid,
            8,
            (model or {}).get(nid),
            "ready",
            frozenset(range(f)),
            None,
            BLOCK[rack] if labels else None,
            rack if labels else None,
        )
    return CycleFree(ClusterSnapshot(nodes, {}, {}, tuple(sorted(nodes))))


CASES = [
    # (case id, free GPUs per node, labels, g, k, bound, expected nodes)
    ("one node: best fit, as without topology", {"n5": 2}, True, 2, 1, None, ["n5"]),
    ("fewest blocks beat best fit across blocks", {"n0": 4, "n4": 4}, True, 4, 2, None, ["n0", "n1"]),
    ("unlabelled: best fit across the cluster", {"n0": 4, "n4": 4}, False, 4, 2, None, ["n0", "n4"]),
    ("tightest block that holds the gang", {"n0": 0, "n1": 0}, True, 8, 2, None, ["n2", "n3"]),
    ("fewest racks: a whole rack, then the rest", {}, True, 8, 3, None, ["n0", "n1", "n2"]),
    ("larger than a block: a whole block, then one rack", {}, True, 8, 5, None, ["n0", "n1", "n2", "n3", "n4"]),
    ("whole block first, the rest in the tightest rack", {"n6": 0}, True, 8, 5, None, ["n0", "n1", "n2", "n3", "n7"]),
    ("within one block: the tightest that holds it", {"n0": 0}, True, 8, 3, "block", ["n2", "n3", "n1"]),
    ("within one block: the other block", {"n0": 0, "n1": 0}, True, 8, 3, "block", ["n4", "n5", "n6"]),
    ("within one block: none holds it", {}, True, 8, 5, "block", None),
    ("within one rack", {"n0": 0}, True, 8, 2, "rack", ["n2", "n3"]),
    ("within one rack: none holds it", {}, True, 8, 3, "rack", None),
    ("a bound on unlabelled nodes: no known block", {}, False, 8, 2, "block", None),
    ("too few nodes", {"n0": 0}, True, 8, 8, None, None),
]


@pytest.mark.parametrize(
    ("free", "labels", "g", "k", "bound", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_gang_choice(
    free: dict[str, int], labels: bool, g: int, k: int, bound: str | None, want: list[str] | None
) -> None:
    assert cluster(free, labels).fit(g, k, None, bound) == want


def test_scarce_model_rule_still_first() -> None:
    # b0 holds model "a", b1 model "b"; a waiting job asks for "b": a job of any model takes "a" nodes
    free = cluster(model={n: ("a" if BLOCK[r] == "b0" else "b") for n, r in RACK.items()})
    free.prefer = ["a"]
    assert free.fit(8, 2, None) == ["n0", "n1"]
    assert free.fit(8, 2, "b") == ["n4", "n5"]


def test_reserved_nodes_join_the_topology_choice() -> None:
    free = cluster({"n0": 4, "n4": 4})
    free.reserve("n1")
    assert free.fit(4, 2, None) == ["n2", "n3"]  # n1 reserved: one rack of b0 (r1) over two
    assert free.fit_with_reserved(4, 2, None) == ["n0", "n1"]


def test_unlabelled_node_is_its_own_block() -> None:
    place = {"a": ("b0", "b0\x00r0"), "b": ("b0", "b0\x00r0")}
    assert topology_pick(["x", "a", "b"], 2, place) == ["a", "b"]
    assert topology_pick(["x", "y"], 2, {}) == ["x", "y"]


def test_registration_labels_reach_the_free_index() -> None:
    cs = ClusterState()
    cs.changed_nodes = set()
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    cs.apply(NodeRegistered(ts=ts, producer="t", node_id="n0", gpu_count=8))
    idx = FreeIndex().sync(cs)
    assert idx.place == {}
    cs.apply(NodeRegistered(ts=ts, producer="t", node_id="n0", gpu_count=8, block="b0", rack="r0"))
    assert cs.nodes["n0"].block == "b0" and cs.nodes["n0"].rack == "r0"
    assert idx.sync(cs).place == {"n0": ("b0", "b0\x00r0")}


def test_labels_and_bound_are_optional_fields() -> None:
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    assert NodeRegistered(ts=ts, producer="t", node_id="n0", gpu_count=8).block is None
    job = {"ts": ts, "producer": "t", "job_id": "j", "budget": "a", "user": "u", "gpus_per_replica": 8}
    job |= {"replicas": 2, "min_runtime_s": 60, "duration_s": 60, "submitted_at": ts}
    assert JobSubmitted.model_validate(job | {"topology_bound": "block"}).topology_bound == "block"
    assert JobSubmitted.model_validate(job).topology_bound is None
    with pytest.raises(ValueError, match="topology_bound"):
        JobSubmitted.model_validate(job | {"topology_bound": "row"})


def test_simulated_inventory_labels() -> None:
    # 2,048 nodes, 32 racks of 64, 4 blocks of 8 racks
    got = [topology_of(i, 2048, 32, 4) for i in (0, 63, 64, 511, 512, 2047)]
    assert got == [("b0", "r0"), ("b0", "r0"), ("b0", "r1"), ("b0", "r7"), ("b1", "r8"), ("b3", "r31")]
    assert topology_of(5, 10, None, None) == (None, None)


def test_budget_file_cluster_labels(tmp_path: Path) -> None:
    f = tmp_path / "b.yaml"
    f.write_text(
        "cluster:\n- {prefix: n, count: 8, gpus: 8, racks: 4, blocks: 2}\n- {prefix: m, count: 2, gpus: 8}\nbudgets:\n  a: 1.0\n"
    )
    got = [(n.node_id, n.block, n.rack) for n in load_budget_file(f).nodes]
    assert got[:4] == [("n000", "nb0", "nr0"), ("n001", "nb0", "nr0"), ("n002", "nb0", "nr1"), ("n003", "nb0", "nr1")]
    assert got[7] == ("n007", "nb1", "nr3") and got[8:] == [("m000", None, None), ("m001", None, None)]


def _labelled_dispatch() -> DispatchState:
    """The 8-node tree of the module docstring behind a dispatcher, nodes registered with their labels."""
    state = DispatchState(TREE)
    for nid, rack in RACK.items():
        reg = NodeRegistered(node_id=nid, gpu_count=8, block=BLOCK[rack], rack=rack, ts=from_us(T0))
        step(state, reg, T0, CFG)
    return state


BOUND_CASES = [
    # (case id, GPUs taken first on n0 (a one-node job), g, k, bound, expected nodes of the bound job)
    ("within one rack: r0 lacks a node, so r1", 8, 8, 2, "rack", ["n2", "n3"]),
    ("unbound, the same gang: best fit on r0's free node first", 4, 4, 2, None, ["n0", "n1"]),
    ("within one rack: n0's free half beside n1", 4, 4, 2, "rack", ["n0", "n1"]),
    ("within one block: b0 holds three, so b1", 8, 8, 4, "block", ["n4", "n5", "n6", "n7"]),
    ("unbound, five: b1 whole, then the rack of b0 that holds one", 8, 8, 5, None, ["n4", "n5", "n6", "n7", "n1"]),
    ("within one block, four: b0 lacks n0's GPUs and b1 is whole", 8, 8, 4, "block", ["n4", "n5", "n6", "n7"]),
]


@pytest.mark.parametrize(
    ("first", "g", "k", "bound", "want"), [c[1:] for c in BOUND_CASES], ids=[c[0] for c in BOUND_CASES]
)
def test_bound_from_submission_to_placement(
    first: int, g: int, k: int, bound: str | None, want: list[str] | None
) -> None:
    # the submission's bound reaches the queue (JobQueued), the pending job and the engine's placement
    state = _labelled_dispatch()
    step(state, submitted("first", budget="lab/b", gpus=first), T0, CFG)
    step(state, Tick(m(1)), m(1), CFG)
    job = submitted("j", budget="lab/b", gpus=g, replicas=k).model_copy(update={"topology_bound": bound})
    queued = [e for e in step(state, job, m(2), CFG) if isinstance(e, JobQueued)]
    assert [q.topology_bound for q in queued] == [bound]
    assert state.pending["lab/b"][0].topology_bound == bound
    out = step(state, Tick(m(3)), m(3), CFG)
    placed = [e for e in out if isinstance(e, JobPlaced) and e.job_id == "j"]
    assert [[p.node_id for p in e.placements] for e in placed] == ([want] if want is not None else [])


REFUSED_CASES = [
    # (case id, g, k, bound, expected verdict): judged on the 8 registered nodes, whatever runs on them
    ("within one block, five: no block has five nodes", 8, 5, "block", "unsatisfiable_topology"),
    ("within one rack, three: no rack has three nodes", 1, 3, "rack", "unsatisfiable_topology"),
    ("within one block, four: b0 and b1 each have four", 8, 4, "block", None),
    ("unbound, five: across the blocks", 8, 5, None, None),
]


@pytest.mark.parametrize(("g", "k", "bound", "want"), [c[1:] for c in REFUSED_CASES], ids=[c[0] for c in REFUSED_CASES])
def test_bound_no_registered_domain_holds_is_rejected(g: int, k: int, bound: str | None, want: str | None) -> None:
    state = _labelled_dispatch()
    job = submitted("j", budget="lab/b", gpus=g, replicas=k).model_copy(update={"topology_bound": bound})
    out = step(state, job, m(1), CFG)
    verdicts = [
        e.reason.value if isinstance(e, JobRejected) else "queued"
        for e in out
        if isinstance(e, (JobRejected, JobQueued))
    ]
    assert verdicts == [want or "queued"]
    if want is None:
        return
    assert "j" not in state.jobs and state.pending.get("lab/b", []) == []
    # a verdict is final: nodes that register later (a third block) do not bring the refused job back
    for i in range(5):
        reg = NodeRegistered(node_id=f"x{i}", gpu_count=8, block="b2", rack="r9", ts=from_us(m(2)))
        step(state, reg, m(2), CFG)
    assert "j" not in state.jobs
    again = submitted("j2", budget="lab/b", gpus=g, replicas=k, at=m(3)).model_copy(update={"topology_bound": bound})
    assert [type(e).__name__ for e in step(state, again, m(3), CFG) if isinstance(e, (JobRejected, JobQueued))] == [
        "JobQueued"
    ]


RESERVE_CASES = [
    # (case id, free GPUs per node (others 0), labels, unallocated GPUs per node, k, bound, expected nodes)
    ("most available, then one block over two", {"n0": 8, "n4": 8, "n5": 8}, True, {}, 2, None, ["n4", "n5"]),
    ("unlabelled: most available, ties by id", {"n0": 8, "n4": 8, "n5": 8}, False, {}, 2, None, ["n0", "n4"]),
    ("unallocated GPUs count as available", {"n0": 8}, True, {"n1": 8}, 2, None, ["n0", "n1"]),
    (
        "within one rack: none of the free ones, so the first rack",
        {"n0": 8, "n2": 8, "n4": 8},
        True,
        {},
        2,
        "rack",
        ["n0", "n1"],
    ),
    ("within one rack: the rack with most available", {"n0": 8, "n6": 8, "n7": 8}, True, {}, 2, "rack", ["n6", "n7"]),
    ("within one block: larger than a block", {}, True, {}, 5, "block", []),
]


@pytest.mark.parametrize(
    ("free", "labels", "unalloc", "k", "bound", "want"),
    [c[1:] for c in RESERVE_CASES],
    ids=[c[0] for c in RESERVE_CASES],
)
def test_reservation_prefers_fewest_blocks_then_racks(
    free: dict[str, int], labels: bool, unalloc: dict[str, int], k: int, bound: str | None, want: list[str]
) -> None:
    cf = cluster({n: free.get(n, 0) for n in RACK}, labels)
    assert reservation_nodes(cf, 8, k, None, unalloc, bound) == want


EXCLUDE_CASES = [
    # (case id, free GPUs per node (others 0), labels, unallocated GPUs per node, excluded nodes, expected nodes;
    # without the exclusion each would take the excluded node, as the case id says)
    (
        "labelled: the block of most available excluded in part",
        {"n0": 8, "n4": 8, "n5": 8},
        True,
        {},
        {"n5"},
        ["n0", "n4"],
    ),
    ("unlabelled buckets: the first of most free", {"n0": 8, "n4": 8, "n5": 8}, False, {}, {"n0"}, ["n4", "n5"]),
    ("unallocated GPUs of an excluded node", {"n0": 8}, False, {"n1": 8, "n2": 4}, {"n1"}, ["n0", "n2"]),
    ("nodes with none free, by id", {"n0": 8}, False, {}, {"n1"}, ["n0", "n2"]),
    ("labelled, fewer than k left: those left", {}, True, {}, set(RACK) - {"n3"}, ["n3"]),
]


@pytest.mark.parametrize(
    ("free", "labels", "unalloc", "exclude", "want"),
    [c[1:] for c in EXCLUDE_CASES],
    ids=[c[0] for c in EXCLUDE_CASES],
)
def test_reservation_leaves_out_the_excluded_nodes(
    free: dict[str, int], labels: bool, unalloc: dict[str, int], exclude: set[str], want: list[str]
) -> None:
    cf = cluster({n: free.get(n, 0) for n in RACK}, labels)
    assert reservation_nodes(cf, 8, 2, None, unalloc, None, exclude) == want
    assert not cf.reserved and not cf.log  # the choice reserves nothing
    assert set(reservation_nodes(cf, 8, 2, None, unalloc, None)) & exclude  # without it, an excluded node is taken
