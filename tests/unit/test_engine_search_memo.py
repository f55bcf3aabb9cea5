"""The preemption search's memo within a cycle (speed only) never changes a decision.

A cycle's searches share what the earlier ones found out (per node, its expired-behind and unallocated
options, re-evaluated only where a node was touched or the behind set changed; a bound on the largest r).
The same cycle with every search starting from an empty memo must decide byte for byte the same: events,
reservation and pending reasons. The cases are small clusters of the engine benchmark where one cycle runs
many searches with preemptions between them (so nodes are touched and the behind sets shrink).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from apportion.domain.engine import EngineConfig, run_cycle
from apportion.domain.engine import cycle as cycle_module
from apportion.domain.engine import search as search_module
from apportion.domain.engine.search import PreemptionRequest, plan_preemption

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_engine

CASES = [
    pytest.param("steady", {"nodes": 96, "heroes": 1, "hero_gpus": 256, "pending": 1500, "groups": 2}, id="hero-gang"),
    pytest.param("rebalance", {"nodes": 120, "pending": 2000, "groups": 2}, id="rebalance"),
    pytest.param("burst", {"nodes": 120, "pending": 2000, "groups": 2}, id="burst"),
]


def _decided(snap: Any) -> tuple[list[str], Any, list[tuple[str, str]], int, int]:
    res = run_cycle(snap, bench_engine.NOW, EngineConfig(), explain=True)
    preempted = sum(1 for e in res.events if e.type == "JobPreempted")
    return (
        [e.model_dump_json() for e in res.events],
        res.reservation,
        sorted((k, repr(v)) for k, v in res.reasons.items()),
        res.searches,
        preempted,
    )


@pytest.mark.parametrize(("scenario", "size"), CASES)
def test_a_cycle_decides_the_same_without_the_search_memo(
    monkeypatch: pytest.MonkeyPatch, scenario: str, size: dict[str, int]
) -> None:
    snap = bench_engine.build(7, scenario, **size, cold=False)
    kept = _decided(snap)

    def forgetful(req: PreemptionRequest) -> Any:
        req.memo.clear()
        return plan_preemption(req)

    monkeypatch.setattr(cycle_module, "plan_preemption", forgetful)
    fresh = _decided(snap)
    assert kept[3] >= 20 and kept[4] >= 5  # the memo was used: many searches, preemptions between them
    assert kept == fresh


def test_searches_of_other_sizes_read_the_kept_node_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's expired-behind candidates, listed by one job shape's search, are read by the searches of other
    GPU counts (with the same gang test) while the node is untouched: the hero-gang cycle lists fewer nodes than
    its searches evaluate, and decides as it does with every search starting from an empty memo (above)."""
    snap = bench_engine.build(7, "steady", nodes=96, heroes=1, hero_gpus=256, pending=1500, groups=2, cold=False)
    listed = evaluated = 0
    sizes: set[int] = set()
    node_list, node_option = search_module._node_list, search_module._node_option

    def counted_list(*a: Any) -> Any:
        nonlocal listed
        listed += 1
        return node_list(*a)

    def counted_option(s: Any, nid: str, *a: Any) -> Any:
        nonlocal evaluated
        if s.eligible(nid):
            evaluated += 1
            sizes.add(s.g)
        return node_option(s, nid, *a)

    monkeypatch.setattr(search_module, "_node_list", counted_list)
    monkeypatch.setattr(search_module, "_node_option", counted_option)
    _decided(snap)
    assert len(sizes) >= 2  # searches of several GPU counts evaluated nodes
    assert 0 < listed < evaluated


# The bound on the largest r and each ancestor's answer to "is anything behind it by delta" are kept with the
# request until the next charge. The tree (shares of the parent; K = 1,000 GPU-s, O in GPU-s):
#
#        root
#       /    \
#      a      b          a: 0.5, O 500, r 1.0     b: 0.5, O 500, r 1.0
#     / \    / \
#   a/x a/y b/x b/y      each 0.5 of its parent (E 250), O 250, r 1.0
#
# With every r at 1.0 the largest r is 1.0 < 1.0 + 0.05 for each ancestor of a/x: nothing is behind it.
# A charge of 100 GPU-s to b/y makes its r 1.4 (b: 1.2): now 1.4 >= 1.0 + 0.05, so something is behind a/x,
# and a kept answer must not say otherwise; with delta = inf nothing is behind it still.
_TREE = {"a": 0.5, "b": 0.5, "a/x": 0.5, "a/y": 0.5, "b/x": 0.5, "b/y": 0.5}
_OCC = {"a": 500.0, "b": 500.0, "a/x": 250.0, "a/y": 250.0, "b/x": 250.0, "b/y": 250.0}
_INF = float("inf")

BEHIND_CASES = [
    # (charges before the questions, questions (leaf, delta) -> expected answer)
    pytest.param([], [("a/x", 0.05, True), ("a/y", 0.05, True), ("a/x", 0.05, True)], id="kept-answers-reused"),
    pytest.param(
        [("b/y", 100.0)], [("a/x", 0.05, False), ("a/y", 0.05, False), ("b/x", 0.05, False)], id="after-a-charge"
    ),
    pytest.param([("b/y", 100.0)], [("a/x", 0.05, False), ("a/x", _INF, True)], id="kept-per-delta"),
]


def _behind_request() -> tuple[PreemptionRequest, Any]:
    from apportion.domain.budgets import BudgetTree
    from apportion.domain.fairshare import FairShareQueue

    tree = BudgetTree.from_mapping(_TREE)
    view: Any = FairShareQueue(tree, _OCC, 1000.0, {})
    none: Any = None
    return PreemptionRequest(none, "a/x", none, none, 0, view, 0.05, tree=tree), view


@pytest.mark.parametrize(("charges", "questions"), BEHIND_CASES)
def test_nothing_behind_keeps_answers_only_until_a_charge(
    charges: list[tuple[str, float]], questions: list[tuple[str, float, bool]]
) -> None:
    req, view = _behind_request()
    assert search_module._nothing_behind(req, "a/x", 0.05)  # answers kept before any charge
    for leaf, gpu_s in charges:  # as the cycle charges: the view, then the request's list
        view.charge(leaf, gpu_s)
        req.charged.append(leaf)
    for leaf, delta, expected in questions:
        fresh, fresh_view = _behind_request()
        for c, gpu_s in charges:
            fresh_view.charge(c, gpu_s)
        assert search_module._nothing_behind(req, leaf, delta) is expected
        assert search_module._nothing_behind(fresh, leaf, delta) is expected  # the same with nothing kept


def test_short_test_is_known_short_for_every_leaf() -> None:
    """The bulk pass's test of many leaves at once answers what known_short answers of each, and nothing
    (``None``) when the shape's search has not found too few nodes with the free index as it is now."""
    from apportion.domain.engine.search import known_short, short_test

    req, _ = _behind_request()
    free: Any = type("Free", (), {"log": ["n1", "n2"]})()
    req.free = free
    assert short_test(req, 1, 1, None, 0.05, 0) is None  # no search of the shape yet
    req.memo[(search_module._SHORT, 1, None, 1)] = 2
    test = short_test(req, 1, 1, None, 0.05, 0)
    assert test is not None
    for leaf in ("a/x", "a/y", "b/x", "b/y"):
        assert test(leaf) is known_short(req, 1, 1, None, leaf, 0.05, 0) is True
    free.log.append("n3")  # a node touched since: the first test fails for every leaf
    assert short_test(req, 1, 1, None, 0.05, 0) is None
