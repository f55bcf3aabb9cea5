"""Idle while waiting (apportion.sim.conservation) measured by the simulator, hours computed by hand."""

from __future__ import annotations

from apportion.domain.budgets import BudgetTree
from apportion.sim.baselines import static_partitions
from apportion.sim.core import SimConfig, simulate
from apportion.sim.report import summarise
from tests.kit.simkit import at, job, nodes

H = 3600
AB = {"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5}
# one 8-GPU node; lab/a alone asks for 8 allocated 1-GPU 2 h jobs at 0 h and 6 unallocated 1-GPU 1 h jobs at 4 h
JOBS = [job(f"a{i}", "lab/a", min_runtime_s=H, duration_s=2 * H) for i in range(8)] + [
    job(f"u{i}", "lab/a", min_runtime_s=0, duration_s=H, submit=at(4)) for i in range(6)
]


def test_static_partitions_idle_their_neighbours_slice_and_fair_share_does_not():
    tree = BudgetTree.from_mapping(AB)
    static = simulate(tree, nodes(("n0", 8)), JOBS, SimConfig(seed=1), scheduler=static_partitions)
    # lab/a's slice is 4 GPUs. 0-2 h: 4 run, 4 allocated wait, 4 GPUs free -> min(4, 4) = 4 GPUs x 2 h = 8 GPU-h;
    # 2-4 h: the other 4 run, nothing waits. 4-5 h: 4 unallocated run, 2 wait, 4 free -> min(4, 2) = 2 x 1 h = 2
    assert static.idle_waiting_gpu_s == (8 * H, 2 * H)
    rep = summarise(static, tree, "static", 1)
    assert (rep.idle_waiting_alloc_gpu_h, rep.idle_waiting_unalloc_gpu_h) == (8.0, 2.0)
    fair = simulate(tree, nodes(("n0", 8)), JOBS, SimConfig(seed=1))
    assert fair.idle_waiting_gpu_s == (0.0, 0.0)


def test_a_gang_waiting_for_two_nodes_does_not_count_gpus_it_cannot_use():
    # n0 and n1 (8 GPUs each); b0 holds 4 GPUs of one node for 3 h; an unallocated 2x8 gang (it may not preempt)
    # waits for both nodes: 0-3 h 12 GPUs are free but the gang fits nowhere (one node has 4), so nothing idles by
    # the definition; then it starts
    jobs = [
        job("b0", "lab/b", gpus=4, min_runtime_s=H, duration_s=3 * H),
        job("g", "lab/a", gpus=8, replicas=2, min_runtime_s=0, submit=at(ss=1)),
    ]
    r = simulate(BudgetTree.from_mapping(AB), nodes(("n0", 8), ("n1", 8)), jobs, SimConfig(seed=1))
    assert r.idle_waiting_gpu_s == (0.0, 0.0)
    assert r.placed_first["g"] == at(3)
