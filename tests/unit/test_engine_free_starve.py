"""Rule D3.free-starve: a requeued free job starved past its limit goes back to rule D3.free-las's first queue
(``EngineConfig.free_starve_x``, ``free_starve_s``), and the other requeued ones by level of attained service
(``EngineConfig.free_las_levels_gpu_s``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from apportion.domain.engine.cycle import free_level, free_starved
from tests.kit.engine_world import NOW, World, h, placed

STARVED_CASES = [
    pytest.param(3600.0, 14400.0, 4.0, None, False, id="K = 4: waited exactly 4 x 3,600 s, not promoted"),
    pytest.param(3600.0, 14400.000001, 4.0, None, True, id="K = 4: a microsecond more, promoted"),
    pytest.param(7200.0, 14400.000001, 4.0, None, False, id="K = 4, twice the service: not yet"),
    pytest.param(3600.0, 1e9, None, None, False, id="both off: never"),
    pytest.param(3600.0, 7200.0, None, 7200.0, False, id="T = 2 h: waited exactly T, not promoted"),
    pytest.param(3600.0, 7201.0, None, 7200.0, True, id="T = 2 h: a second more, promoted"),
    pytest.param(1e9, 7201.0, None, 7200.0, True, id="T does not depend on the service"),
    pytest.param(3600.0, 101.0, 4.0, 100.0, True, id="both set: T promotes before K"),
    pytest.param(10.0, 41.0, 4.0, 100.0, True, id="both set: K promotes before T"),
    pytest.param(3600.0, 0.0, 0.0, None, False, id="K = 0: not at the moment it is requeued"),
    pytest.param(3600.0, 1.0, 0.0, None, True, id="K = 0: any wait"),
]


@pytest.mark.parametrize(("held", "waited", "starve_x", "starve_s", "expected"), STARVED_CASES)
def test_free_starved_at_its_boundaries(held, waited, starve_x, starve_s, expected):
    assert free_starved(held, waited, starve_x, starve_s) is expected


LEVEL_CASES = [
    pytest.param(1.0, (3600.0, 14400.0), 0, id="below the first threshold: level 0"),
    pytest.param(3599.0, (3600.0, 14400.0), 0, id="a second short of it: level 0"),
    pytest.param(3600.0, (3600.0, 14400.0), 1, id="at the first threshold: level 1"),
    pytest.param(14399.0, (3600.0, 14400.0), 1, id="short of the second: level 1"),
    pytest.param(14400.0, (3600.0, 14400.0), 2, id="at the last threshold: the last level"),
    pytest.param(1e12, (3600.0, 14400.0), 2, id="past every threshold: the last level"),
    pytest.param(1e12, (), 0, id="no threshold: one level"),
]


@pytest.mark.parametrize(("held", "levels", "expected"), LEVEL_CASES)
def test_free_level_at_its_thresholds(held, levels, expected):
    assert free_level(held, levels) == expected


def _starved_world(gpus: int = 3) -> World:
    # n0 (``gpus`` GPUs free, 3 unless given), now 10:00, budget order a, b (occupancy 0); pending, all unallocated, 1 GPU each:
    #   lab/a: a1 submitted 1:00, a2 2:00, never run
    #   lab/b: b1 submitted 0:30, requeued at 6:00 after 3,600 GPU-s (waited 4 h = 14,400 s); b2 3:00, never run
    w = World().node("n0", gpus)
    w.job("a1", "lab/a", min_runtime_s=0, submitted=h(1)).job("a2", "lab/a", min_runtime_s=0, submitted=h(2))
    w.job("b1", "lab/b", min_runtime_s=0, submitted=h(0.5), queued=h(6))
    w.job("b2", "lab/b", min_runtime_s=0, submitted=h(3))
    w.pending["lab/b"][0] = replace(w.pending["lab/b"][0], attempt=2, attained_gpu_s=3600.0)
    return w


PROMOTION_CASES = [
    pytest.param({}, NOW, ["a1", "a2", "b2"], id="off: the jobs never run take the 3 GPUs; requeued b1 waits"),
    pytest.param({"free_starve_x": 4.0}, NOW, ["a1", "a2", "b2"], id="K = 4: waited exactly 4 x its service"),
    pytest.param(
        {"free_starve_x": 4.0}, NOW + 1, ["a1", "a2", "b1"], id="K = 4, 1 us later: b1 first of lab/b by submission"
    ),
    pytest.param({"free_starve_x": 3.0}, NOW, ["a1", "a2", "b1"], id="K = 3: promoted, lab/b still after lab/a"),
    pytest.param({"free_starve_s": 4 * 3600.0}, NOW, ["a1", "a2", "b2"], id="T = 4 h: waited exactly T"),
    pytest.param({"free_starve_s": 4 * 3600.0 - 1}, NOW, ["a1", "a2", "b1"], id="T = 4 h less 1 s: promoted"),
    pytest.param({"free_las_levels_gpu_s": (3600.0,)}, NOW, ["a1", "a2", "b2"], id="levels alone promote nothing"),
]


@pytest.mark.parametrize(("cfg", "now", "expected"), PROMOTION_CASES)
def test_a_starved_requeued_free_job_goes_back_in_its_leafs_submission_order(cfg, now, expected):
    assert [p.split("@")[0] for p in placed(_starved_world().cycle(now, **cfg))] == expected


def test_a_promoted_job_is_placed_once_and_the_rest_keep_least_attained_service():
    # 4 GPUs: with K = 3 the walk places a1, a2, b1 (promoted), b2; nothing left for the second queue. Without it the
    # walk places a1, a2, b2, then b1 (least attained service), the same jobs in another order
    w = _starved_world(4)
    assert [p.split("@")[0] for p in placed(w.cycle(free_starve_x=3.0))] == ["a1", "a2", "b1", "b2"]
    assert [p.split("@")[0] for p in placed(w.cycle())] == ["a1", "a2", "b2", "b1"]


def _requeued_world() -> World:
    # n0 (2 GPUs free), budget order a, b; pending, all unallocated and requeued (none never run), 1 GPU each:
    #   lab/a: a1 submitted 3:00, 1,800 GPU-s held
    #   lab/b: b1 submitted 1:00, 3,000 GPU-s; b2 submitted 2:00, 7,200 GPU-s
    w = World().node("n0", 2)
    w.job("a1", "lab/a", min_runtime_s=0, submitted=h(3))
    w.job("b1", "lab/b", min_runtime_s=0, submitted=h(1)).job("b2", "lab/b", min_runtime_s=0, submitted=h(2))
    held = {"a1": 1800.0, "b1": 3000.0, "b2": 7200.0}
    w.pending = {
        leaf: [replace(j, attempt=2, attained_gpu_s=held[j.job_id]) for j in jobs] for leaf, jobs in w.pending.items()
    }
    return w


LEVELS_CASES = [
    pytest.param(None, ["a1", "b1"], id="off: fewest GPU-seconds first, a1 (1,800) then b1 (3,000)"),
    pytest.param((3600.0,), ["b1", "a1"], id="1 GPU-h: a1 and b1 level 0, b1 submitted first"),
    pytest.param((1801.0,), ["a1", "b1"], id="1,801 GPU-s: a1 alone in level 0"),
    pytest.param((1800.0,), ["b1", "b2"], id="1,800 GPU-s: a1 at the threshold joins level 1, by submission"),
    pytest.param((1000.0,), ["b1", "b2"], id="all in level 1: first submission across leaves"),
]


@pytest.mark.parametrize(("levels", "expected"), LEVELS_CASES)
def test_free_las_levels_order_the_requeued_jobs_by_level_then_first_submission(levels, expected):
    assert [p.split("@")[0] for p in placed(_requeued_world().cycle(free_las_levels_gpu_s=levels))] == expected


def test_a_starved_job_goes_before_the_levels():
    # the requeued world, every job queued at 10:00 less 1 h: with T = 1 h less 1 s all three are promoted and walked
    # leaf by leaf (a1, then b1 before b2), whatever the levels say
    w = _requeued_world()
    w.pending = {leaf: [replace(j, queued_at_us=h(9)) for j in jobs] for leaf, jobs in w.pending.items()}
    cycle = w.cycle(free_starve_s=3599.0, free_las_levels_gpu_s=(1000.0,))
    assert [p.split("@")[0] for p in placed(cycle)] == ["a1", "b1"]
