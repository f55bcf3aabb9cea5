"""The blocked tails kept in the pending lists' memo (speed only) never change a decision or a counter.

Once a cycle's first pass can place nothing more (a reservation held that lends nothing, no free GPU for a
1 x 1 job, no node that a search could free without runs of a leaf behind), a leaf whose searches are all
known to fail is taken exactly as before, job by job, and what that added to the counters is kept in the
memo of its pending list; the next cycle on the same list adds the same numbers without taking the jobs.
The cases are small clusters of the engine benchmark in the steady state, where most leaves end that way.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from apportion.domain.engine import CycleMemo, CycleSnapshot, EngineConfig, run_cycle
from apportion.domain.engine.caches import EngineCaches
from apportion.domain.engine.shapes import memo_tail

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_engine

CASES = [
    pytest.param("steady", {"nodes": 120, "pending": 2000, "groups": 2}, id="steady"),
    pytest.param("steady", {"nodes": 96, "heroes": 1, "hero_gpus": 256, "pending": 1500, "groups": 2}, id="hero-gang"),
    # leaves behind others still preempt after most leaves ended blocked: their ranks count the jobs taken before
    pytest.param("rebalance", {"nodes": 250, "pending": 4000, "groups": 4}, id="rebalance"),
]


def _decided(snap: Any) -> tuple[Any, ...]:
    res = run_cycle(snap, bench_engine.NOW, EngineConfig(), explain=True)
    return (
        [e.model_dump_json() for e in res.events],
        res.reservation,
        sorted((k, repr(v)) for k, v in res.reasons.items()),
        res.considered,
        res.searches,
        res.passed_over,
    )


def _memo(snap: CycleSnapshot) -> CycleMemo:
    assert snap.memo is not None  # (the benchmark hands the snapshot over with its memo)
    return snap.memo


def _tails(snap: CycleSnapshot) -> dict[str, dict[int, tuple[int, int, int, int]]]:
    return {leaf: dict(memo_tail(_memo(snap), jobs)) for leaf, jobs in snap.pending.items()}


@pytest.mark.parametrize(("scenario", "size"), CASES)
def test_a_cycle_decides_and_counts_the_same_with_the_blocked_tails_kept(scenario: str, size: dict[str, int]) -> None:
    snap = bench_engine.build(7, scenario, **size, cold=False)
    without = _decided(dataclasses.replace(snap, memo=None))  # no memo: every job taken one by one
    first = _decided(snap)  # the tails found and kept
    kept = _tails(snap)
    second = _decided(snap)  # the kept tails added without taking their jobs
    assert sum(1 for t in kept.values() if t) >= 30  # most leaves end blocked
    assert without == first == second
    assert _tails(snap) == kept  # nothing new to keep
    # two leaves' lists replaced by copies (as the dispatcher does when a job joins or leaves): no tail kept for
    # them, so they are taken job by job while the others are passed over with theirs
    blocked = sorted(leaf for leaf, t in kept.items() if t)
    pending = dict(snap.pending)
    for leaf in blocked[:2]:
        pending[leaf] = list(pending[leaf])
    changed = dataclasses.replace(snap, pending=pending)
    assert _decided(changed) == without
    assert all(_tails(changed)[leaf] == kept[leaf] for leaf in blocked[:2])  # found again, kept for the copies


def test_the_kept_tail_is_what_the_cycle_adds() -> None:
    """A kept tail is read: changing it changes the counters by as much (and no decision)."""
    snap = bench_engine.build(7, "steady", nodes=120, pending=2000, groups=2)
    before = run_cycle(snap, bench_engine.NOW, EngineConfig())
    leaf, jobs = next((leaf, jobs) for leaf, jobs in sorted(snap.pending.items()) if memo_tail(_memo(snap), jobs))
    tails = memo_tail(_memo(snap), jobs)
    idx, (considered, rank, searches, passed) = next(iter(tails.items()))
    assert considered >= 1 and rank == considered and searches >= 1
    tails[idx] = (considered + 5, rank + 5, searches + 3, passed + 2)
    after = run_cycle(snap, bench_engine.NOW, EngineConfig())
    assert after.considered == before.considered + 5
    assert after.searches == before.searches + 3
    assert after.passed_over == before.passed_over + 2
    assert [e.model_dump_json() for e in after.events] == [e.model_dump_json() for e in before.events]


def test_a_replaced_pending_list_keeps_no_tail() -> None:
    """The dispatcher's copy-on-write list that replaces one carries its floors and codes, never its tails."""
    snap = bench_engine.build(7, "steady", nodes=120, pending=2000, groups=2)
    run_cycle(snap, bench_engine.NOW, EngineConfig())
    leaf, jobs = next((leaf, jobs) for leaf, jobs in sorted(snap.pending.items()) if memo_tail(_memo(snap), jobs))
    old = list(jobs)
    memo = _memo(snap)
    memo[id(old)] = [old, *memo[id(jobs)][1:]]  # the memo's entry, for a list the test owns
    new = old[:-1]
    EngineCaches(memo).carry(old, new, old[-1], False, len(old) - 1)
    assert memo_tail(_memo(snap), old)
    assert memo_tail(_memo(snap), new) == {}


def test_a_leaf_with_no_leaf_behind_it_keeps_its_tail_though_the_bound_on_r_does_not_clear_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leaf is known blocked when no leaf is behind it at charge 0 (``CycleVictims.behind_of``), not only
    when the largest r of any budget is below its ancestors' r + delta: more leaves keep a tail, and the
    cycle decides and counts as the one that takes every job (no memo). With the bound alone (the test as it
    was), fewer tails are kept."""
    from apportion.domain.engine import search

    # (the rebalance case: leaves behind others by r, so the bound on the largest r clears few leaves)
    scenario, size = "rebalance", {"nodes": 250, "pending": 4000, "groups": 4}
    snap = bench_engine.build(7, scenario, **size, cold=False)
    without = _decided(dataclasses.replace(snap, memo=None))

    def bound_only(leaf: str, top: float, clear: dict[str, bool], ratio: Any, delta: float, *_: Any, **__: Any) -> bool:
        return search._ancestors_clear(leaf, top, clear, ratio, delta)

    with monkeypatch.context() as m:
        m.setattr(search, "_clear_or_none_behind", bound_only)
        fewer = dataclasses.replace(snap, memo=bench_engine.build(7, scenario, **size, cold=False).memo)
        assert _decided(fewer) == without
        by_bound = sum(1 for t in _tails(fewer).values() if t)
    assert _decided(snap) == without
    kept = sum(1 for t in _tails(snap).values() if t)
    assert kept > by_bound
    assert _decided(snap) == without  # the kept tails read
