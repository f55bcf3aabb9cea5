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
