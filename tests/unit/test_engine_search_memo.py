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
