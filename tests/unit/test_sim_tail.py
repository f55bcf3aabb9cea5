"""``bench/sim_tail.py``'s per-run records and the GPU-hours they add up to, on a hand-made history.

Job ``a`` (allocated, 1 x 2 GPUs): run 1 placed at 0 h, preempted at 2 h losing 3,600 GPU-s, requeued as attempt 2
30 s later; run 2 placed at 3 h, completed at 5 h. Job ``u`` (unallocated, 1 GPU): placed at 1 h, still running
when the run ends at 6 h.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from apportion import events as ev
from apportion.timeutil import from_us
from tests.kit.builders import T0, h, placed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from sim_tail import _held, _mean_held, _recorder, _run_budget, _run_class


def _placed(job: str, attempt: int, gpus: int, at: int, allocated: bool = True) -> ev.JobPlaced:
    decision = ev.Decision(rank=0, budget_rank=0, ratio=0.5, protection_s=3600.0 if allocated else None)
    return placed(job, attempt=attempt, gpus=gpus, at=at, allocated=allocated, submitted_at=T0, decision=decision)


@pytest.fixture
def runs() -> list[dict[str, Any]]:
    kept: dict[tuple[str, int], dict[str, Any]] = {}
    seen: list[Any] = []
    apply = _recorder(lambda self, e: seen.append(e), kept)
    history = [
        _placed("a", 1, 2, h(0)),
        _placed("u", 1, 1, h(1), allocated=False),
        ev.JobPreempted(job_id="a", attempt=1, budget="lab/a", allocated=True, lost_gpu_s=3600.0, ts=from_us(h(2))),
        ev.JobRequeued(
            job_id="a", attempt=2, submitted_at=from_us(T0), reason="preempted", ts=from_us(h(2) + 30_000_000)
        ),
        _placed("a", 2, 2, h(3)),
        ev.JobCompleted(job_id="a", attempt=2, ts=from_us(h(5))),
    ]
    for e in history:
        apply(None, e)
    assert seen == history  # the ledger still gets every event
    return list(kept.values())


def test_a_requeue_ends_the_attempt_before_the_one_it_names(runs: list[dict[str, Any]]) -> None:
    spans = [(r["id"], r["att"], r["placed"], r["end"], r["how"]) for r in runs]
    assert spans == [
        ("a", 1, h(0), h(2) + 30_000_000, "preempted"),
        ("u", 1, h(1), None, None),
        ("a", 2, h(3), h(5), "done"),
    ]


def test_gpu_hours_by_class(runs: list[dict[str, Any]]) -> None:
    held = _held(runs, h(6))
    # a's run 1: 2 GPUs x (2 h + 30 s); run 2: 2 x 2 h; u: 1 x (6 h - 1 h), open at the end
    assert held["alloc preempted"] == pytest.approx(2 * (2 + 30 / 3600))
    assert held["alloc done"] == pytest.approx(4.0)
    assert held["alloc re-runs"] == pytest.approx(4.0)
    assert held["alloc lost"] == pytest.approx(1.0)
    assert held["alloc protected"] == pytest.approx(4.0)  # each run's 1 h of protection x 2 GPUs
    assert held["unalloc open"] == pytest.approx(5.0)


def test_holders_at_given_times(runs: list[dict[str, Any]]) -> None:
    # at 1.5 h: a's first run (2 GPUs, r = 0.5 <= 1) and u; at 4 h: a's re-run and u
    at = [h(1.5), h(4)]
    assert _mean_held(runs, at, h(6), _run_class) == {"alloc r<=1": 1.0, "alloc r<=1 re-run": 1.0, "unalloc": 1.0}
    # by budget: a's 2 GPUs at both times (first run, then re-run), u's 1 at both
    assert _mean_held(runs, at, h(6), _run_budget) == {"a": 2.0, "(unallocated)": 1.0}
