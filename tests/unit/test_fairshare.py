"""Fair-share order: usage ratio edge cases, Fair-Tree ordering, provisional charge.

Every expected order below is worked by hand from design D2:
r_b = O_b / (abs(b) * K); at each node children sort by (r, path).
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apportion.domain.budgets import BudgetTree
from apportion.domain.fairshare import (
    FairShareQueue,
    branches_at_lca,
    budget_order,
    entitlement,
    free_order_key,
    lowest_common_ancestor,
    ratios,
    usage_ratio,
)


def occ_of(leaf_occ: dict[str, float]) -> dict[str, float]:
    """Leaf occupancy -> occupancy of every node (a node includes its descendants)."""
    out: dict[str, float] = {}
    for leaf, v in leaf_occ.items():
        parts = leaf.split("/")
        for i in range(len(parts)):
            p = "/".join(parts[: i + 1])
            out[p] = out.get(p, 0.0) + v
    return out


# --------------------------------------------------------------------------- usage ratio


@pytest.mark.parametrize(
    "o,e,expected",
    [
        pytest.param(0.0, 0.0, 0.0, id="zero usage, zero entitlement -> 0 (owed nothing)"),
        pytest.param(0.0, 100.0, 0.0, id="zero usage -> 0"),
        pytest.param(50.0, 100.0, 0.5, id="half used"),
        pytest.param(300.0, 100.0, 3.0, id="over share"),
        # math.inf, not the module's own INF: a test that compares with the constant it checks cannot fail
        pytest.param(1.0, 0.0, math.inf, id="usage without entitlement -> inf"),
    ],
)
def test_usage_ratio_edge_cases(o: float, e: float, expected: float) -> None:
    assert usage_ratio(o, e) == expected


@pytest.mark.parametrize(
    "gpus,share,expected",
    [
        pytest.param(4, 0.5, 8.0, id="4 GPUs at abs share 0.5: 8 per unit of share"),
        pytest.param(1, 0.1, 10.0, id="1 GPU at 0.1 ranks after 4 at 0.5"),
        pytest.param(0, 0.25, 0.0, id="nothing in use: first"),
        pytest.param(0, 0.0, math.inf, id="share 0: last, even with nothing in use"),
    ],
)
def test_free_order_key_is_unallocated_gpus_per_unit_of_share(gpus: int, share: float, expected: float) -> None:
    # D3.free-order
    assert free_order_key(gpus, share) == expected


@pytest.mark.parametrize(
    "path,k,expected",
    [
        pytest.param("lab", 4000.0, 2000.0, id="abs 0.5 of K 4000 GPU-s"),
        pytest.param("lab/x", 4000.0, 500.0, id="abs 0.5 * 0.25: the product of the shares on the path"),
        pytest.param("lab/x", 0.0, 0.0, id="no capacity: no entitlement"),
        pytest.param("nowhere", 4000.0, 0.0, id="unknown path: abs share 0"),
    ],
)
def test_entitlement_is_abs_share_times_capacity(path: str, k: float, expected: float) -> None:
    #   root
    #   └── lab 0.5
    #       └── x 0.25
    tree = BudgetTree.from_mapping({"lab": 0.5, "lab/x": 0.25})
    assert entitlement(tree, path, k) == expected


# --------------------------------------------------------------------------- ordering table

K = 1000.0  # capacity integral, GPU-s

ORDER_CASES = [
    pytest.param(
        # lab ── a 0.5, b 0.5
        {"a": 0.5, "b": 0.5},
        {"a": 100.0, "b": 300.0},
        # r_a = 100/500 = 0.2, r_b = 300/500 = 0.6
        ("a", "b"),
        id="flat: less used first",
    ),
    pytest.param({"a": 0.5, "b": 0.5}, {"a": 250.0, "b": 250.0}, ("a", "b"), id="flat: equal r, tie by path"),
    pytest.param(
        {"a": 0.2, "b": 0.8},
        {"a": 100.0, "b": 300.0},
        # r_a = 100/200 = 0.5, r_b = 300/800 = 0.375: the bigger user is behind its share
        ("b", "a"),
        id="flat: ratio, not raw usage, decides",
    ),
    pytest.param({"a": 0.5, "b": 0.5}, {}, ("a", "b"), id="no usage anywhere: path order"),
    pytest.param(
        # lab
        # ├── x 0.5 ── x/p 0.5, x/q 0.5
        # └── y 0.5 ── y/r 1.0
        {"x": 0.5, "x/p": 0.5, "x/q": 0.5, "y": 0.5, "y/r": 1.0},
        {"x/p": 0.0, "x/q": 400.0, "y/r": 100.0},
        # r_x = 400/500 = 0.8, r_y = 100/500 = 0.2 -> y first;
        # in x: r_p = 0, r_q = 400/250 = 1.6 -> p, q
        ("y/r", "x/p", "x/q"),
        id="two levels: parent ratio decides before leaf ratio",
    ),
    pytest.param(
        {"x": 0.5, "x/p": 0.5, "x/q": 0.5, "y": 0.5, "y/r": 1.0},
        {"x/q": 100.0, "y/r": 400.0},
        # r_x = 0.2 < r_y = 0.8: an idle x/p still comes after nothing in y
        ("x/p", "x/q", "y/r"),
        id="two levels: idle leaf of under-used branch first",
    ),
    pytest.param(
        # deep:  a ── a/b ── a/b/c ; d
        {"a": 0.5, "a/b": 1.0, "a/b/c": 1.0, "d": 0.5},
        {"a/b/c": 500.0, "d": 499.0},
        # r_a = 500/500 = 1.0, r_d = 499/500 = 0.998
        ("d", "a/b/c"),
        id="three levels: chain compared at the top",
    ),
    pytest.param(
        {"a": 0.3, "b": 0.3, "c": 0.4},
        {"a": 300.0, "b": 0.0, "c": 0.0},
        # r_a = 1.0, r_b = r_c = 0 -> b, c by path, then a
        ("b", "c", "a"),
        id="empty budgets tie at zero, by path",
    ),
    pytest.param(
        {"a": 0.5, "b": 0.25},
        {"a": 250.0, "b": 125.0},
        # unbudgeted remainder 0.25: r_a = 250/500 = 0.5, r_b = 125/250 = 0.5 -> tie by path
        ("a", "b"),
        id="unbudgeted remainder does not change ratios",
    ),
    pytest.param(
        # x ── x/p 0.001 (abs 0.0005 of K=1000 -> E = 0.5)
        {"x": 0.5, "x/p": 0.001, "x/q": 0.999, "y": 0.5},
        {"x/p": 1.0, "x/q": 0.0, "y": 250.0},
        # r_x = 1/500 = 0.002, r_y = 0.5 -> x first; r_p = 1/0.5 = 2.0 > r_q = 0 -> q, p
        ("x/q", "x/p", "y"),
        id="tiny share overused goes after its idle sibling",
    ),
    pytest.param(
        {"a": 1.0, "a/m": 0.5, "a/n": 0.5},
        {"a/m": 10.0, "a/n": 10.0},
        ("a/m", "a/n"),
        id="single top-level budget: order decided below",
    ),
    pytest.param(
        {"a": 0.5, "b": 0.5, "b/c": 1.0},
        {"a": 600.0, "b/c": 0.0},
        # a over share (r = 1.2), b's only leaf idle
        ("b/c", "a"),
        id="mixed depth leaves",
    ),
]


@pytest.mark.parametrize("spec,leaf_occ,expected", ORDER_CASES)
def test_budget_order(spec: dict[str, float], leaf_occ: dict[str, float], expected: tuple[str, ...]) -> None:
    tree = BudgetTree.from_mapping(spec)
    assert budget_order(tree, occ_of(leaf_occ), K) == expected


def test_zero_capacity_ranks_by_occupancy_per_share_not_by_path() -> None:
    """K = 0 (an empty window, cold start): K is floored at 1 GPU-s, so r = O / abs(b) and both
    used budgets stay comparable instead of both being +inf (which would order them by path).

    a: 5 GPU-s at share 0.5 -> r = 10; b: 2 GPU-s at 0.25 -> 8; c idle -> 0.
    """
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.25, "c": 0.25})
    r = ratios(tree, {"a": 5.0, "b": 2.0}, 0.0)
    assert r == {"a": 10.0, "b": 8.0, "c": 0.0}
    assert budget_order(tree, {"a": 5.0, "b": 2.0}, 0.0) == ("c", "b", "a")
    assert ratios(tree, {"a": 5.0}, 0.5) == ratios(tree, {"a": 5.0}, 0.0)  # below the floor: the same
    assert ratios(tree, {"a": 5.0}, 10.0)["a"] == 1.0  # above it: unchanged, 5 / (0.5 * 10)


def test_ratios_of_inner_nodes_include_descendants() -> None:
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 0.5, "x/q": 0.5})
    r = ratios(tree, occ_of({"x/p": 100.0, "x/q": 50.0}), K)
    # x: 150/500 = 0.3; x/p: 100/250 = 0.4; x/q: 50/250 = 0.2
    assert r == pytest.approx({"x": 0.3, "x/p": 0.4, "x/q": 0.2})


# --------------------------------------------------------------------------- LCA


@pytest.mark.parametrize(
    "a,b,expected",
    [
        pytest.param("lab/x/p", "lab/y", ("lab", "lab/x", "lab/y"), id="siblings' subtrees"),
        pytest.param("a", "b", ("", "a", "b"), id="top-level budgets meet at the root"),
        pytest.param("a/b/c", "a/b/d", ("a/b", "a/b/c", "a/b/d"), id="leaf siblings"),
        pytest.param(
            "lab/x", "lab/y/q/r", ("lab", "lab/x", "lab/y"), id="the deeper one's branch is its child of the LCA"
        ),
    ],
)
def test_branches_at_lca(a: str, b: str, expected: tuple[str, str, str]) -> None:
    assert branches_at_lca(a, b) == expected


def test_branches_at_lca_rejects_one_line() -> None:
    assert lowest_common_ancestor("a/b", "a") == "a"
    with pytest.raises(ValueError):
        branches_at_lca("a/b", "a")
    with pytest.raises(ValueError):
        branches_at_lca("a", "a")


def test_lowest_common_ancestor_stops_at_the_first_difference() -> None:
    # "a/b/c" and "a/x/c" agree again after they differ: the LCA is still "a"
    assert lowest_common_ancestor("a/b/c", "a/x/c") == "a"
    assert branches_at_lca("lab/x/p", "lab/y/p") == ("lab", "lab/x", "lab/y")


def test_branches_at_lca_rejects_an_ancestor_given_first() -> None:
    with pytest.raises(ValueError) as got:
        branches_at_lca("lab", "lab/x")
    assert str(got.value) == "'lab' and 'lab/x' are on one line of the tree: no branches to compare"


# --------------------------------------------------------------------------- queue


def test_queue_yields_leaf_order_then_item_order() -> None:
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.5})
    q = FairShareQueue(tree, {"a": 400.0}, K, {"a": ["a1", "a2"], "b": ["b1"]})
    # r_a = 0.8, r_b = 0: all of b first, then a in its own order
    assert list(q) == [("b", "b1"), ("a", "a1"), ("a", "a2")]
    assert q.initial_order == ("b", "a")


def test_provisional_charge_alternates_budgets() -> None:
    """One cycle must not hand everything to one budget (rule D2.provisional-charge).

    a, b: share 0.5 each, K = 1000 -> E = 500 each. Both idle: tie, a first.
    After a1 is placed and charged 300: r_a = 0.6 > r_b = 0 -> b1 next;
    after b1 charged 300: tie at 0.6 -> a (path) again.
    """
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.5})
    q = FairShareQueue(tree, {}, K, {"a": ["a1", "a2"], "b": ["b1", "b2"]})
    got = []
    while (nxt := q.pop()) is not None:
        got.append(nxt[1])
        q.charge(nxt[0], 300.0)
    assert got == ["a1", "b1", "a2", "b2"]
    assert q.ratio("a") == pytest.approx(1.2)
    assert q.occupancy("b") == 600.0


def test_queue_skips_leaves_without_items_and_rejects_inner_keys() -> None:
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 1.0, "y": 0.5})
    q = FairShareQueue(tree, {}, K, {"x/p": [], "y": ["y1"]})
    assert list(q) == [("y", "y1")]
    with pytest.raises(KeyError) as got:
        FairShareQueue(tree, {}, K, {"x": ["bad"]})
    assert got.value.args == ("'x' is not a leaf budget",)


def test_usage_ratio_in_the_queue_is_occupancy_over_share_times_capacity() -> None:
    """r = O / (abs * K) before any charge, and ``ratio_after`` adds the GPU-seconds to O (rule D2.usage-ratio).

    a, b: share 0.5, K = 1000 -> E = 500 each; O_a = 400 -> r_a = 0.8; r_b = 0.
    """
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.5})
    q = FairShareQueue(tree, {"a": 400.0}, K, {"a": ["a1"], "b": ["b1"]})
    assert (q.ratio("a"), q.ratio("b")) == (0.8, 0.0)
    # (400 + 100) / 500 = 1.0; (0 + 250) / 500 = 0.5; a path outside the tree is owed nothing
    assert (q.ratio_after("a", 100.0), q.ratio_after("b", 250.0), q.ratio_after("ghost", 5.0)) == (1.0, 0.5, 0.0)
    assert (q.occupancy("a"), q.occupancy("ghost")) == (400.0, 0.0)


def test_provisional_charge_of_one_gpu_second_counts() -> None:
    """A charge of exactly 1 GPU-s is added to the leaf and its ancestors: O = 1, r = 1 / (0.25 * 1000) = 0.004."""
    tree = BudgetTree.from_mapping({"x": 0.5, "x/p": 0.5, "y": 0.5})
    q = FairShareQueue(tree, {}, K, {"x/p": ["p1"], "y": ["y1"]})
    q.charge("x/p", 1.0)
    assert (q.occupancy("x/p"), q.occupancy("x"), q.occupancy("y")) == (1.0, 1.0, 0.0)
    assert (q.ratio("x/p"), q.ratio("x")) == (0.004, 0.002)
    assert list(q) == [("y", "y1"), ("x/p", "p1")]


def test_drop_leaf_returns_rest() -> None:
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.5})
    q = FairShareQueue(tree, {}, K, {"a": ["a1", "a2", "a3"], "b": ["b1"]})
    assert q.pop() == ("a", "a1")
    assert q.drop_leaf("a") == ["a2", "a3"]
    assert list(q) == [("b", "b1")]


def test_heads_and_clear() -> None:
    tree = BudgetTree.from_mapping({"a": 0.4, "b": 0.4, "c": 0.2})
    q = FairShareQueue(tree, {"b": 100.0}, K, {"a": ["a1", "a2"], "b": ["b1"], "c": []})
    assert q.pop() == ("a", "a1")
    assert sorted(q.heads()) == [("a", "a2"), ("b", "b1")]  # each leaf with items left, its next one
    before = (q.order(), q.ratio("a"), q.ratio("b"))
    q.clear()
    assert q.heads() == [] and not q and q.pop() is None and list(q) == []
    assert (q.order(), q.ratio("a"), q.ratio("b")) == before  # the ratios and the order stay


def test_skip_passes_over_items_as_pops_would() -> None:
    tree = BudgetTree.from_mapping({"a": 0.5, "b": 0.5})
    q = FairShareQueue(tree, {"b": 100.0}, K, {"a": ["a1", "a2", "a3", "a4"], "b": ["b1"]})
    assert q.pop() == ("a", "a1")
    q.skip("a", 2)  # a2, a3
    assert q.pop() == ("a", "a4")
    assert list(q) == [("b", "b1")]
    q2 = FairShareQueue(tree, {}, K, {"a": ["a1", "a2"], "b": ["b1"]})
    q3 = FairShareQueue(tree, {"b": 100.0}, K, {"a": ["a1", "a2", "a3"], "b": ["b1"]})
    assert q3.pop() == ("a", "a1")
    q3.skip("a", 2)  # exactly the two left: a is done
    assert list(q3) == [("b", "b1")]
    q2.skip("a", 5)  # more than are left: a is done
    assert list(q2) == [("b", "b1")]
    with pytest.raises(KeyError):
        q2.skip("a", 1)


@st.composite
def trees_and_loads(draw: st.DrawFn) -> tuple[BudgetTree, dict[str, float], dict[str, list[str]], int]:
    spec: dict[str, float] = {}
    for a in range(draw(st.integers(1, 3))):
        spec[f"t{a}"] = draw(st.sampled_from([0.1, 0.2, 0.25, 0.3]))
        for b in range(draw(st.integers(0, 3))):
            spec[f"t{a}/p{b}"] = draw(st.sampled_from([0.1, 0.2, 0.25, 0.3]))
    tree = BudgetTree.from_mapping(spec)
    leaf_occ = {leaf: float(draw(st.integers(0, 1000))) for leaf in tree.leaves()}
    items = {leaf: [f"{leaf}#{i}" for i in range(draw(st.integers(0, 4)))] for leaf in tree.leaves()}
    return tree, occ_of(leaf_occ), items, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(trees_and_loads())
def test_queue_matches_naive_reranking(case: tuple[BudgetTree, dict[str, float], dict[str, list[str]], int]) -> None:
    """Property: the incremental cursor equals re-running budget_order after every charge."""
    tree, occ, items, seed = case
    rnd = random.Random(seed)
    q = FairShareQueue(tree, occ, K, items)
    naive_occ = dict(occ)
    rest = {k: list(v) for k, v in items.items()}
    while True:
        order = [leaf for leaf in budget_order(tree, naive_occ, K) if rest[leaf]]
        got = q.pop()
        if not order:
            assert got is None
            break
        expected = (order[0], rest[order[0]].pop(0))
        assert got == expected
        if rnd.random() < 0.5:
            charge = float(rnd.randint(0, 500))
            q.charge(expected[0], charge)
            for anc in tree.ancestors(expected[0]):
                naive_occ[anc] = naive_occ.get(anc, 0.0) + charge


@settings(max_examples=100, deadline=None)
@given(trees_and_loads())
def test_order_is_a_deterministic_permutation(
    case: tuple[BudgetTree, dict[str, float], dict[str, list[str]], int],
) -> None:
    tree, occ, _, _ = case
    first = budget_order(tree, occ, K)
    assert sorted(first) == sorted(tree.leaves())
    assert budget_order(tree, dict(reversed(list(occ.items()))), K) == first
    assert not any(math.isnan(r) for r in ratios(tree, occ, K).values())


def test_readme_worked_example() -> None:
    """The example in README.md, "Fair share in one example"."""
    tree = BudgetTree.from_mapping({"lab": 1.0, "lab/prior": 0.6, "lab/prior/robotics": 0.5, "lab/vision": 0.4})
    week = 604_800.0
    k = 100 * week  # 60,480,000 GPU-s
    occ = occ_of({"lab/prior/robotics": 15 * week, "lab/vision": 40 * week})
    r = ratios(tree, occ, k)
    assert r["lab/prior"] == pytest.approx(0.25)
    assert r["lab/vision"] == pytest.approx(1.0)
    assert budget_order(tree, occ, k) == ("lab/prior/robotics", "lab/vision")
