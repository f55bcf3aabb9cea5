"""The hero scenario generator and its per-hero figures (docs/hero.md)."""

from __future__ import annotations

import dataclasses

import pytest

from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig
from apportion.domain.engine import CycleSnapshot, EngineConfig, run_cycle
from apportion.domain.occupancy import OccupancyLedger
from apportion.events import Event
from apportion.sim.core import SimConfig, SimJob, SimResult
from apportion.sim.hero import (
    HeroJob,
    HeroScenario,
    HeroSimulator,
    OrderHeads,
    backlogged_pairs,
    deficit_by_budget,
    hero_nodes,
    hero_rows,
    hero_scenario,
)
from apportion.timeutil import Micros, s_to_us
from tests.kit import builders as b

H = 3600
T0 = s_to_us(1_700_000_000)


def _bg(job_id: str, at_h: float, gpus: int, budget: str = "philly/x") -> SimJob:
    return SimJob(job_id, budget, "u", T0 + s_to_us(at_h * H), gpus, 1, 2 * H, 3 * H)


def test_scenario_is_seeded_scaled_and_tiled() -> None:
    src = [_bg("j1", 0, 1), _bg("j2", 10, 4, "philly/y"), _bg("j3", 24, 8)]
    tree = BudgetTree.from_mapping({"philly": 1.0, "philly/x": 0.75, "philly/y": 0.25})
    heroes = (HeroJob("a", 1024, 14, 1, 0.1), HeroJob("c", 8192, 60, 2, 0.1))
    sc = hero_scenario(src, tree, 7, days=3, size=4, heroes=heroes)
    assert sc == hero_scenario(src, tree, 7, days=3, size=4, heroes=heroes)  # same seed, same scenario
    assert len(sc.nodes) == 2048 and sum(n.gpus for n in sc.nodes) == 16_384
    assert {n.block for n in sc.nodes} == {"b0", "b1", "b2", "b3"} and len({n.rack for n in sc.nodes}) == 32
    # shares: background 0.8 split 3:1, heroes 0.1 each of the cluster
    assert sc.tree.abs_share("bg/x") == pytest.approx(0.6) and sc.tree.abs_share("bg/y") == pytest.approx(0.2)
    assert sc.tree.abs_share("hero/a") == pytest.approx(0.1)
    # span 24 h, 3 days: copies 0, 1, 2 (copy 2's j3 falls at 72 h + offset >= the end), shapes x4
    bg = [j for j in sc.jobs if j.budget.startswith("bg/")]
    assert sorted(j.job_id for j in bg) == ["j1~0", "j1~1", "j1~2", "j2~0", "j2~1", "j2~2", "j3~0", "j3~1"]
    shapes = {j.job_id.split("~")[0]: (j.gpus_per_replica, j.replicas) for j in bg}
    assert shapes == {"j1": (4, 1), "j2": (8, 2), "j3": (8, 4)}
    assert all(
        0 <= j.submit_us - s.submit_us - c * s_to_us(24 * H) <= s_to_us(H)
        for s in src
        for c in range(3)
        for j in bg
        if j.job_id == f"{s.job_id}~{c}"
    )
    a = next(j for j in sc.jobs if j.job_id == "hero-a")
    assert (a.gpus_per_replica, a.replicas, a.duration_s, a.checkpoint_interval_s) == (8, 128, 14 * 86400, 3600)
    assert a.submit_us == T0 + s_to_us(86400)


def test_load_multiplies_the_background_arrivals() -> None:
    # load 3: every job of every copy three times (ids ~c, ~c.1, ~c.2), the first as without load (same
    # offsets), the others each with its own offset of at most an hour; load 2.5: two or three times
    src = [_bg("j1", 0, 1), _bg("j2", 10, 4, "philly/y"), _bg("j3", 24, 8)]
    tree = BudgetTree.from_mapping({"philly": 1.0, "philly/x": 0.75, "philly/y": 0.25})
    one = hero_scenario(src, tree, 7, days=3, size=4, heroes=())
    three = hero_scenario(src, tree, 7, days=3, size=4, heroes=(), load=3)
    assert hero_scenario(src, tree, 7, days=3, size=4, heroes=(), load=1) == one
    base = {j.job_id: j for j in one.jobs}
    by_id = {j.job_id: j for j in three.jobs}
    assert len(base) == 8 and len(by_id) == 24
    assert all(by_id[i] == j for i, j in base.items())
    for i, j in base.items():
        for extra in (by_id[f"{i}.1"], by_id[f"{i}.2"]):
            assert (extra.budget, extra.gpus_per_replica, extra.replicas) == (j.budget, j.gpus_per_replica, j.replicas)
            c = int(i.split("~")[1])
            s0 = next(s for s in src if s.job_id == i.split("~")[0])
            assert 0 <= extra.submit_us - s0.submit_us - c * s_to_us(24 * H) <= s_to_us(H)
    half = {j.job_id for j in hero_scenario(src, tree, 7, days=3, size=4, heroes=(), load=2.5).jobs}
    assert set(base) | {f"{i}.1" for i in base} <= half <= set(by_id)
    with pytest.raises(ValueError, match="load"):
        hero_scenario(src, tree, 7, days=3, size=4, load=0.5)


def test_background_minimum_runtime_cap() -> None:
    # _bg jobs: minimum runtime 2 h, duration 3 h; a cap of 12 h makes it min(3 h, 12 h) = 3 h, a cap of
    # 1 h makes it 1 h; an unallocated job (minimum runtime 0) stays unallocated; heroes keep their 24 h
    src = [_bg("j1", 0, 1), dataclasses.replace(_bg("j2", 1, 1), min_runtime_s=0.0)]
    tree = BudgetTree.from_mapping({"philly": 1.0, "philly/x": 1.0})
    heroes = (HeroJob("a", 1024, 14, 1, 0.1),)
    base = hero_scenario(src, tree, 7, days=1, size=4, heroes=heroes)
    assert hero_scenario(src, tree, 7, days=1, size=4, heroes=heroes, bg_min_runtime_cap_s=None) == base
    for cap, want in ((12 * H, 3 * H), (H, H)):
        sc = hero_scenario(src, tree, 7, days=1, size=4, heroes=heroes, bg_min_runtime_cap_s=cap)
        got = {j.job_id.split("~")[0]: j.min_runtime_s for j in sc.jobs}  # (every copy of the span tiled)
        assert got == {"j1": want, "j2": 0.0, "hero-a": 24 * H}
        # nothing else changes: the same jobs, offsets and shapes
        assert [dataclasses.replace(j, min_runtime_s=0.0) for j in sc.jobs] == [
            dataclasses.replace(j, min_runtime_s=0.0) for j in base.jobs
        ]
    with pytest.raises(ValueError, match="minimum runtime cap"):
        hero_scenario(src, tree, 7, days=1, size=4, bg_min_runtime_cap_s=-1.0)


def test_scenario_refuses_bad_heroes() -> None:
    tree = BudgetTree.from_mapping({"philly": 1.0, "philly/x": 1.0})
    with pytest.raises(ValueError, match="multiple of 8"):
        hero_scenario([_bg("j", 0, 1)], tree, 1, heroes=(HeroJob("z", 12, 1, 0, 0.1),))
    with pytest.raises(ValueError, match="no background"):
        hero_scenario([], tree, 1)


def _hiding(job_id: str):  # a cycle that never places one job: a fitting job left waiting (the fault)
    def cycle(snap: CycleSnapshot, now_us: Micros, cfg: EngineConfig) -> list[Event]:
        pending = {leaf: [j for j in jobs if j.job_id != job_id] for leaf, jobs in snap.pending.items()}
        return run_cycle(dataclasses.replace(snap, pending=pending, memo=None), now_us, cfg).events

    return cycle


def test_hero_figures_on_a_two_node_cluster() -> None:
    # n0 runs bg's 8-GPU job for 2 h, protected to its end; the 2-node hero arrives at 0.5 h and starts at
    # 2 h when n0 is free (every protection honoured). A 1-GPU job that fits n0's neighbour waits
    # unplaced all along (the cycle hides it): 8 GPUs of n1 idle, min(8, 1) = 1 counted, for 1.5 h of
    # gathering -> 1.5 GPU-h, 1.5 / (16 x 24) = 0.390625% of the hero's first day.
    tree = BudgetTree.from_mapping({"bg": 0.5, "bg/x": 1.0, "hero": 0.5, "hero/a": 1.0})
    nodes = tuple(hero_nodes(2, 8, 1, 1))
    big = SimJob("bg-big", "bg/x", "u", T0, 8, 1, 2 * H, 2 * H)
    small = SimJob("bg-small", "bg/x", "u", T0, 1, 1, 2 * H, H)
    hero = SimJob("hero-a", "hero/a", "h", T0 + s_to_us(H / 2), 8, 2, H, 4 * H, None, 3600.0)
    sc = HeroScenario(tree, nodes, (big, small, hero), ("hero-a",), T0, T0 + s_to_us(10 * H))
    dcfg = DispatchConfig(heartbeat_timeout_s=None, scheduler=_hiding("bg-small"))
    cfg = SimConfig(seed=1, dispatch=dcfg, stop_delay_s=0.0, until_us=sc.until_us, keep_log=False)
    sim = HeroSimulator(tree, nodes, sc.jobs, cfg, heroes=sc.heroes)
    res = sim.run()
    (row,) = hero_rows(res, sc, sim.gathering_idle_gpu_s, 16, sim._saved)
    assert row.start_h == pytest.approx(1.5)
    assert row.gathering_idle_gpu_h == pytest.approx(1.5)
    assert row.gathering_idle_pct_first_day == pytest.approx(100 * 1.5 / (16 * 24))
    assert (row.preemptions, row.lost_gpu_h, row.budget_covers) == (0, 0.0, False)  # 0.5 x 16 GPUs < 16
    assert row.completion_d == pytest.approx((1.5 + 4) / 24)
    assert row.progress_pct == 100


def test_backlogged_pairs_and_the_deficit_by_budget() -> None:
    # bg/x (abs share 0.5 x 0.75 = 0.375) and bg/y (0.125); a sample row: leaf -> (O_b/K, running, pending,
    # allocated pending). Before start: ignored; a leaf without allocated work waiting: not a pair; hero/
    # leaves: not background. Deficits: max(0, share - O_b/K) x 100.
    tree = BudgetTree.from_mapping({"bg": 0.5, "bg/x": 0.75, "bg/y": 0.25, "hero": 0.5, "hero/a": 1.0})
    samples = [
        (T0 - 1, {"bg/x": (0.0, 0, 1, 1)}),
        (T0, {"bg/x": (0.125, 8, 2, 1), "bg/y": (0.5, 8, 1, 0), "hero/a": (0.0, 0, 1, 1)}),
        (T0 + 1, {"bg/y": (0.0625, 8, 1, 1), "bg/x": (0.5, 8, 1, 1)}),
    ]
    pairs = backlogged_pairs(samples, T0, tree)
    assert pairs == [(T0, "bg/x", pytest.approx(25.0)), (T0 + 1, "bg/x", 0.0), (T0 + 1, "bg/y", pytest.approx(6.25))]
    assert deficit_by_budget(pairs) == {
        "bg/x": {"pairs": 2, "behind": 1, "sum_pp": 25.0, "mean_pp": 12.5},
        "bg/y": {"pairs": 1, "behind": 1, "sum_pp": 6.2, "mean_pp": 6.25},
    }


def test_on_day_reports_the_figures_so_far_once_a_day() -> None:
    # one 8-GPU node, hourly samples from T0: the first sample of day 1 is T0 + 24 h, of day 2 T0 + 48 h; the
    # 8-GPU job of 30 h is running at the first and has completed by the second (a later job of 20 h from
    # 40 h keeps the run going past it)
    tree = BudgetTree.from_mapping({"bg": 1.0, "bg/x": 1.0})
    nodes = tuple(hero_nodes(1, 8, 1, 1))
    jobs = (
        SimJob("j", "bg/x", "u", T0, 8, 1, H, 30 * H),
        SimJob("k", "bg/x", "u", T0 + s_to_us(40 * H), 8, 1, H, 20 * H),
    )
    told: list[tuple[float, bool]] = []

    def on_day(sim: HeroSimulator, t: Micros) -> None:
        told.append(((t - T0) / s_to_us(H), "j" in sim.jobs_ledger.completed))

    cfg = SimConfig(seed=1, dispatch=DispatchConfig(heartbeat_timeout_s=None), until_us=T0 + s_to_us(50 * H))
    HeroSimulator(tree, nodes, jobs, dataclasses.replace(cfg, sample_s=3600.0), on_day=on_day).run()
    assert told == [(24.0, False), (48.0, True)]


def _preempted_by_bg() -> tuple[HeroSimulator, SimResult, HeroScenario]:
    """One 8-GPU node: hero-a (8 GPUs, minimum runtime 1 h) from T0; bg/x's 8-GPU job (minimum runtime 2 h,
    3 h of work) at 2 h; no grace, no stop delay; 8 h."""
    tree = BudgetTree.from_mapping({"bg": 0.5, "bg/x": 1.0, "hero": 0.5, "hero/a": 1.0})
    nodes = tuple(hero_nodes(1, 8, 1, 1))
    hero = SimJob("hero-a", "hero/a", "h", T0, 8, 1, H, 20 * H, None, 3600.0)
    bg = SimJob("bg-1", "bg/x", "u", T0 + s_to_us(2 * H), 8, 1, 2 * H, 3 * H)
    sc = HeroScenario(tree, nodes, (hero, bg), ("hero-a",), T0, T0 + s_to_us(8 * H))
    dcfg = DispatchConfig(engine=EngineConfig(grace_s=0.0), heartbeat_timeout_s=None)
    cfg = SimConfig(seed=1, dispatch=dcfg, stop_delay_s=0.0, until_us=sc.until_us, keep_log=False)
    sim = HeroSimulator(tree, nodes, sc.jobs, cfg, heroes=sc.heroes)
    return sim, sim.run(), sc


def test_restart_wait_and_the_protection_in_force_at_the_preemption() -> None:
    # One 8-GPU node. hero-a (8 GPUs, minimum runtime 1 h) runs from T0; bg/x's 8-GPU job (minimum runtime
    # 2 h, 3 h of work) arrives at 2 h: bg/x is behind (nothing run), hero/a far ahead, the hero's protection
    # has ended, so the same cycle preempts the hero (no grace, no stop delay) and places the job at 2 h.
    # Longest protection in force then: the job's, placed at 2 h for 2 h -> 2 h. The hero is placed again
    # when the job completes, at 2 + 3 = 5 h: a 3 h wait.
    sim, res, sc = _preempted_by_bg()
    assert sim.restarts == {"hero-a": [(3 * H, 2 * H)]}
    (row,) = hero_rows(res, sc, sim.gathering_idle_gpu_s, 8, sim._saved, sim.restarts)
    assert (row.preemptions, row.stops_d, row.restarts_h) == (1, (2 / 24,), ((3.0, 2.0),))


def test_placed_at_the_preemption_running_once_its_victims_stopped() -> None:
    # Two 8-GPU nodes: bg/x's unallocated 8-GPU job holds one, the other is free. hero-a (2 x 8 GPUs)
    # arrives at 1 h: the cycle preempts the unallocated job (grace 30 s) and places the hero at once, so
    # its start is 0 h after its submission. Its replica on the free node starts at once, the other once
    # the victim has stopped, 20 s later (stop delay 20 s): the whole gang runs 20 s after its submission.
    tree = BudgetTree.from_mapping({"bg": 0.5, "bg/x": 1.0, "hero": 0.5, "hero/a": 1.0})
    nodes = tuple(hero_nodes(2, 8, 1, 1))
    free_job = SimJob("bg-free", "bg/x", "u", T0, 8, 1, 0.0, 10 * H)
    hero = SimJob("hero-a", "hero/a", "h", T0 + s_to_us(H), 8, 2, H, 4 * H, None, 3600.0)
    sc = HeroScenario(tree, nodes, (free_job, hero), ("hero-a",), T0, T0 + s_to_us(3 * H))
    cfg = SimConfig(seed=1, stop_delay_s=20.0, until_us=sc.until_us, keep_log=False)
    sim = HeroSimulator(tree, nodes, sc.jobs, cfg, heroes=sc.heroes)
    res = sim.run()
    (row,) = hero_rows(res, sc, sim.gathering_idle_gpu_s, 16, sim._saved, sim.restarts, sim.running_us)
    assert row.start_h == 0.0
    assert row.running_h == pytest.approx(20 / 3600)
    assert sim.running_us == {"hero-a": hero.submit_us + s_to_us(20)}


def test_order_heads_on_a_hand_made_log() -> None:
    # Abs shares: bg/x 0.5, hero/a 0.25, hero/b 0.25; r compares O / abs (one capacity integral for all).
    # From T0 bg-1 runs 32 GPUs and hero-b 16; at 2 h hero-a (16 GPUs) preempts hero-b. The hero branch is
    # ahead of bg at the root all along (16t / 0.5 against 32t / 0.5 GPU-h). In it, at 2 h hero/a has 0,
    # hero/b 32 GPU-h: hero/a ranks first. From 2 h, O(hero/a) = 16 (t - 2) passes 32 after 4 h (at 4 h the
    # tie goes to hero/a by path): the first event time after it, 5 h (bg-3 placed), is hero-b's head; it is
    # placed again at 6 h. hero-a, preempted at 7 h (O 80 against hero/b's 48), is placed again at 8 h, when
    # hero/b holds 64: never at the head.
    tree = BudgetTree.from_mapping({"bg": 0.5, "bg/x": 1.0, "hero": 0.5, "hero/a": 0.5, "hero/b": 0.5})
    ledger = OccupancyLedger(7 * 86_400.0)
    heads = OrderHeads(tree, {"hero-a": "hero/a", "hero-b": "hero/b"}, ledger)
    hb = {"budget": "hero/b", "gpus": 8, "replicas": 2, "nodes": ["n0", "n1"]}
    ha = {"budget": "hero/a", "gpus": 8, "replicas": 2, "nodes": ["n0", "n1"]}
    log: list[Event] = [
        *(b.node(f"n{i}", 8, at=b.T0) for i in range(8)),
        b.placed("bg-1", budget="bg/x", gpus=8, replicas=4, nodes=["n2", "n3", "n4", "n5"], at=b.T0),
        b.placed("hero-b", **hb, at=b.T0),  # type: ignore[arg-type]
        b.preempted("hero-b", budget="hero/b", by_job_id="hero-a", at=b.h(2)),
        b.placed("hero-a", **ha, at=b.h(2)),  # type: ignore[arg-type]
        b.placed("bg-2", budget="bg/x", gpus=8, nodes=["n6"], at=b.h(3)),
        b.placed("bg-3", budget="bg/x", gpus=8, nodes=["n7"], at=b.h(5)),
        b.placed("hero-b", **hb, attempt=2, at=b.h(6)),  # type: ignore[arg-type]
        b.preempted("hero-a", budget="hero/a", at=b.h(7)),
        b.placed("hero-a", **ha, attempt=2, at=b.h(8)),  # type: ignore[arg-type]
    ]
    reached = []
    for e in log:
        ledger.apply(e)  # the caller folds each event (the simulator: its dispatcher state), then feeds it
        reached.append((e.ts, heads.feed(e)))
    assert [(t, r) for t, r in reached if r] == [(b.dt(b.h(5)), ["hero-b"])]
    assert heads.heads == {"hero-b": [[b.h(2), b.h(5), b.h(6)]], "hero-a": [[b.h(7), None, b.h(8)]]}


def test_order_heads_at_the_preemption_and_in_the_simulator() -> None:
    # The restart scenario below: hero-a (8 GPUs of one node) runs from T0; bg-1 preempts it at 2 h and runs
    # 3 h. At 2 h hero/a holds 16 GPU-h and bg/x 0 (equal shares): bg/x first. bg/x's O = 8 (t - 2) passes 16
    # after 4 h; the next event is bg-1's completion at 5 h (its protection's end at 4 h is a timer, no event),
    # and hero-a is placed again in that cycle: 3 h to the head, 0 h from it. Longest protection in force at the
    # head: none (bg-1 completing, hero-a not yet placed) -> 0.
    sim, res, sc = _preempted_by_bg()
    assert sim.heads_s("hero-a") == [(3 * H, 0.0, 0.0)]
    (row,) = hero_rows(res, sc, sim.gathering_idle_gpu_s, 8, sim._saved, sim.restarts, None, sim.heads_s)
    assert row.heads_h == ((3.0, 0.0, 0.0),)
