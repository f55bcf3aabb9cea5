"""Admission checks (rule D2.rejection): a table of named cases.

The tree used by every case::

    (root)
    ├── lab            share 0.5   members {alice, bob}   max_min_runtime 86400 s
    │   ├── prior      share 0.6   (inherits members and limit)
    │   │   ├── robotics 0.5       members {carol}        max_min_runtime 3600 s
    │   │   └── nlp      0.5
    │   └── vision     share 0.4   members None -> inherits {alice, bob}
    └── open           share 0.5   (no members: anyone; no limit)

Node shapes: 4 nodes x 8 A100, 2 nodes x 4 H100, 1 node x 2 of unknown model.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from apportion.domain.admission import NodeShape, ShapeLike, admit, bound_possible, rejected_event, shape_possible
from apportion.domain.budgets import Budget, BudgetTree
from apportion.events import RejectReason
from tests.kit.builders import dt, h, submitted, tree

TREE = tree(
    {
        "lab": {"share": 0.5, "members": ["alice", "bob"], "max_min_runtime_s": 86400},
        "lab/prior": 0.6,
        "lab/prior/robotics": {"share": 0.5, "members": ["carol"], "max_min_runtime_s": 3600},
        "lab/prior/nlp": 0.5,
        "lab/vision": 0.4,
        "open": 0.5,
    }
)
SHAPES: list[ShapeLike] = [NodeShape(8, "A100", 4), NodeShape(4, "H100", 2), (2, None)]


@dataclass
class Case:
    id: str
    kwargs: dict
    want: RejectReason | None


CASES = [
    Case(
        "allocated job on a member's leaf is admitted",
        dict(budget="lab/prior/nlp", user="alice", gpus=8, replicas=4),
        None,
    ),
    Case("unknown budget", dict(budget="lab/nope"), RejectReason.UNKNOWN_BUDGET),
    Case("inner budget is not a leaf", dict(budget="lab/prior"), RejectReason.NOT_A_LEAF),
    Case(
        "unknown budget wins over everything else",
        dict(budget="ghost", user="mallory", gpus=99),
        RejectReason.UNKNOWN_BUDGET,
    ),
    Case("user outside the inherited members", dict(budget="lab/vision", user="mallory"), RejectReason.NOT_A_MEMBER),
    Case(
        "members set on a leaf replace the inherited ones",
        dict(budget="lab/prior/robotics", user="alice", min_runtime_s=60),
        RejectReason.NOT_A_MEMBER,
    ),
    Case(
        "member of the leaf's own list is admitted",
        dict(budget="lab/prior/robotics", user="carol", min_runtime_s=3600),
        None,
    ),
    Case(
        "min runtime above the leaf's own limit",
        dict(budget="lab/prior/robotics", user="carol", min_runtime_s=3601),
        RejectReason.MIN_RUNTIME_TOO_LONG,
    ),
    Case(
        "min runtime above the inherited limit",
        dict(budget="lab/prior/nlp", user="bob", min_runtime_s=86401),
        RejectReason.MIN_RUNTIME_TOO_LONG,
    ),
    Case(
        "no limit anywhere on the path: a week of protection is fine",
        dict(budget="open", user="anyone", min_runtime_s=7 * 86400),
        None,
    ),
    Case(
        "unallocated job skips membership and limits",
        dict(budget="lab/prior/robotics", user="mallory", min_runtime_s=0),
        None,
    ),
    Case(
        "unallocated job still needs a leaf", dict(budget="lab", user="alice", min_runtime_s=0), RejectReason.NOT_A_LEAF
    ),
    Case("more GPUs per replica than any node has", dict(budget="open", gpus=9), RejectReason.SHAPE_IMPOSSIBLE),
    Case(
        "gang wider than the nodes that fit (5 x 8 GPUs, 4 such nodes)",
        dict(budget="open", gpus=8, replicas=5),
        RejectReason.SHAPE_IMPOSSIBLE,
    ),
    Case("gang of 6 x 4 GPUs fits across A100 and H100 nodes (4 + 2)", dict(budget="open", gpus=4, replicas=6), None),
    Case(
        "named model restricts the fitting nodes (3 x 4 H100, only 2 nodes)",
        dict(budget="open", gpus=4, replicas=3, gpu_model="H100"),
        RejectReason.SHAPE_IMPOSSIBLE,
    ),
    Case("named model that no node has", dict(budget="open", gpus=1, gpu_model="V100"), RejectReason.SHAPE_IMPOSSIBLE),
    Case(
        "unknown-model node serves a job with no model (7 x 2 GPUs: 4+2+1)",
        dict(budget="open", gpus=2, replicas=7),
        None,
    ),
    Case(
        "unallocated job with an impossible shape is still rejected",
        dict(budget="open", gpus=16, min_runtime_s=0),
        RejectReason.SHAPE_IMPOSSIBLE,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_admission(case: Case) -> None:
    kwargs = {"user": "alice", **case.kwargs}
    got = admit(TREE, submitted("j1", **kwargs), SHAPES)
    if case.want is None:
        assert got is None
    else:
        assert got is not None and got.reason is case.want
        assert got.message


def test_zero_share_is_rejected_for_allocated_only() -> None:
    """Shares are in (0, 1], so abs share 0 needs a tree that says so; a subclass does."""

    class ZeroTree(BudgetTree):
        __slots__ = ()

        def abs_share(self, path: str) -> float:
            return 0.0

    zero = ZeroTree({"x": Budget("x", 1.0)})
    got = admit(zero, submitted("j1", budget="x"), SHAPES)
    assert got is not None and got.reason is RejectReason.ZERO_SHARE
    assert admit(zero, submitted("j1", budget="x", min_runtime_s=0), SHAPES) is None


def test_no_nodes_registered_yet_queues_instead_of_rejecting() -> None:
    """Cold start: before any node registers, the shape check cannot judge; the job waits."""
    assert admit(TREE, submitted("j1", budget="open", gpus=64, replicas=9), []) is None
    # the other checks still apply
    got = admit(TREE, submitted("j2", budget="nope"), [])
    assert got is not None and got.reason is RejectReason.UNKNOWN_BUDGET


def test_shape_possible_counts_fitting_nodes() -> None:
    # 8-GPU A100 x 4 and 4-GPU H100 x 2 fit 4 GPUs; the 2-GPU node does not
    assert shape_possible(4, 1, None, SHAPES) == (True, 6)
    assert shape_possible(1, 8, "A100", SHAPES) == (False, 4)


def test_rejected_event_carries_reason_and_deterministic_id() -> None:
    job = submitted("j1", budget="lab/prior")
    rej = admit(TREE, job, SHAPES)
    assert rej is not None
    a = rejected_event(job, rej, ts=dt(h(1)))
    b = rejected_event(job, rej, ts=dt(h(1)))
    assert a.reason is RejectReason.NOT_A_LEAF and a.job_id == "j1" and a.budget == "lab/prior"
    assert a.event_id == b.event_id


def test_without_a_budget_limit_the_window_caps_a_minimum_runtime() -> None:
    # "open" sets no max_min_runtime and nothing above it does: W (7 d = 604800 s) is the ceiling
    week = 7 * 86400
    assert admit(TREE, submitted("j1", budget="open", min_runtime_s=week), SHAPES) is None
    got = admit(TREE, submitted("j1", budget="open", min_runtime_s=week + 1), SHAPES)
    assert got is not None and got.reason is RejectReason.MIN_RUNTIME_TOO_LONG
    assert got.message == (
        "min_runtime 7d1s is above the occupancy window 7d, the limit where no budget above 'open' sets max_min_runtime"
    )
    # another window, another ceiling; a budget's own limit is the one that applies (lab: 1 d, under a 1 h window)
    capped = admit(TREE, submitted("j1", budget="open", min_runtime_s=7200), SHAPES, window_s=3600)
    assert capped is not None and capped.reason is (RejectReason.MIN_RUNTIME_TOO_LONG)
    assert admit(TREE, submitted("j1", budget="lab/vision", min_runtime_s=7200), SHAPES, window_s=3600) is None
    # unallocated jobs have no protection to cap
    assert admit(TREE, submitted("j1", budget="open", min_runtime_s=0), SHAPES, window_s=3600) is None


# The labelled inventory of the topology cases (rule D1.topology), 11 nodes::
#
#     block b0                          block b1                           no labels
#     ├── rack r0: 3 nodes x 8 GPUs     ├── rack r0: 2 nodes x 8 GPUs      2 nodes x 8 GPUs
#     └── rack r1: 2 nodes x 8 GPUs     └── rack r1: 2 nodes x 4 GPUs
TOPO: list[ShapeLike] = [
    NodeShape(8, None, 3, "b0", "r0"),
    NodeShape(8, None, 2, "b0", "r1"),
    NodeShape(8, None, 2, "b1", "r0"),
    NodeShape(4, None, 2, "b1", "r1"),
    NodeShape(8, None, 2),
]

TOPO_CASES = [
    # (case id, g, k, bound, expected reason, the most fitting nodes one domain holds)
    ("within one block: b0 holds 5 x 8", 8, 5, "block", None, 5),
    ("within one block: 6 x 8, b0 holds 5, b1 2, each unlabelled node 1", 8, 6, "block", "unsatisfiable_topology", 5),
    ("within one block: the 4-GPU nodes count for 4 x 4 (b0 5, b1 4)", 4, 6, "block", "unsatisfiable_topology", 5),
    ("within one rack: b0/r0 holds 3 x 8", 8, 3, "rack", None, 3),
    (
        "within one rack: racks are named within their block (r0: 3 + 2 is not one rack)",
        4,
        4,
        "rack",
        "unsatisfiable_topology",
        3,
    ),
    ("one replica: any node is within one rack", 8, 1, "rack", None, 3),
    ("unbound, 11 x 4: the cluster holds it across blocks", 4, 11, None, None, None),
    ("shape is judged first: 12 x 4 fits no inventory", 4, 12, "block", "shape_impossible", 5),
]


@pytest.mark.parametrize(
    ("g", "k", "bound", "want", "most"), [c[1:] for c in TOPO_CASES], ids=[c[0] for c in TOPO_CASES]
)
def test_topology_bound_at_admission(g: int, k: int, bound: str | None, want: str | None, most: int | None) -> None:
    job = submitted("j1", budget="open", gpus=g, replicas=k).model_copy(update={"topology_bound": bound})
    got = admit(TREE, job, TOPO)
    assert (got.reason.value if got is not None else None) == want
    if bound is not None:
        assert bound_possible(g, k, None, bound, TOPO)[1] == most


def test_topology_refusal_says_what_the_nodes_hold() -> None:
    job = submitted("j1", budget="open", gpus=8, replicas=4).model_copy(update={"topology_bound": "rack"})
    got = admit(TREE, job, TOPO)
    assert got == (
        RejectReason.UNSATISFIABLE_TOPOLOGY,
        "needs 4 node(s) with >= 8 GPUs each within one rack (topology_bound); the most such nodes any one rack "
        "of the registered nodes has is 3",
    )


def test_topology_bound_on_unlabelled_nodes_and_cold_start() -> None:
    # a node without labels is a block and a rack of its own: a bound gang of 2 never fits 4 unlabelled nodes
    job = submitted("j1", budget="open", gpus=8, replicas=2).model_copy(update={"topology_bound": "block"})
    got = admit(TREE, job, [NodeShape(8, None, 4)])
    assert got is not None and got.reason is RejectReason.UNSATISFIABLE_TOPOLOGY
    # a block without rack labels: one block holds the gang, no rack does (each node is its own rack)
    assert admit(TREE, job, [NodeShape(8, None, 2, "b0")]) is None
    rack = job.model_copy(update={"topology_bound": "rack"})
    got = admit(TREE, rack, [NodeShape(8, None, 2, "b0")])
    assert got is not None and got.reason is RejectReason.UNSATISFIABLE_TOPOLOGY
    # no node registered yet: nothing to judge, the job is queued
    assert admit(TREE, job, []) is None


def test_a_minimum_runtime_above_the_budgets_limit_is_said_in_durations() -> None:
    # lab sets max_min_runtime 1 d (86400 s); nlp inherits it: 9 d (777600 s) is above it
    got = admit(TREE, submitted("j1", budget="lab/prior/nlp", user="bob", min_runtime_s=9 * 86400), SHAPES)
    assert got is not None and got.reason is RejectReason.MIN_RUNTIME_TOO_LONG
    assert got.message == "min_runtime 9d is above the budget's limit 1d (max_min_runtime of 'lab/prior/nlp')"


def test_a_budget_whose_max_min_runtime_is_0_takes_only_unallocated_work_and_says_so() -> None:
    # lab/vision sets max_min_runtime 0: any allocated job (min_runtime > 0) is above it
    free_only = TREE.with_budget(Budget("lab/vision", 0.4, max_min_runtime_s=0.0))
    got = admit(free_only, submitted("j1", budget="lab/vision", user="bob", min_runtime_s=3600), SHAPES)
    assert got is not None and got.reason is RejectReason.MIN_RUNTIME_TOO_LONG
    assert got.message == (
        "budget 'lab/vision' takes only unallocated work (its max_min_runtime is 0s): submit with min_runtime 0 "
        "(free, preemptible at any time), not 1h"
    )
    assert admit(free_only, submitted("u1", budget="lab/vision", user="bob", min_runtime_s=0), SHAPES) is None
