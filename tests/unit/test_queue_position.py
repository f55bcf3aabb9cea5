"""The queue's position is the order a cycle walks (rule D3.scheduling-cycle): allocated jobs first.

Tree::

    lab (1.0)
    ├── a  0.5
    └── b  0.5

One node of 4 GPUs, held by lab/b's ``rob-1``: lab/a ranks before lab/b in the budget order (its r is 0 and
lab/b's at least that; ties go by path).
"""

from __future__ import annotations

from dataclasses import replace

from apportion import events as ev
from apportion.domain.budgets import BudgetTree
from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.domain.engine import EngineConfig
from apportion.timeutil import from_us, to_us
from services.dispatcher.logic import read_model
from tests.kit.builders import T0, m, submitted

TREE = BudgetTree.from_mapping({"lab": 1.0, "lab/a": 0.5, "lab/b": 0.5})
CFG = DispatchConfig(heartbeat_timeout_s=None)


def test_an_unallocated_job_of_a_leaf_ranked_first_comes_after_every_allocated_job() -> None:
    state = DispatchState(TREE)
    reg = ev.NodeRegistered(node_id="n0", gpu_count=4, ts=from_us(T0), event_id=ev.det_id("reg", "n0"))
    for e in (
        reg,
        submitted("rob-1", budget="lab/b", user="rob", gpus=4, duration_s=7200.0),
        Tick(T0),  # rob-1 is placed on all 4 GPUs
        submitted("free-1", budget="lab/a", user="alice", gpus=1, min_runtime_s=0.0, at=m(1)),
        submitted("rob-3", budget="lab/b", user="rob", gpus=4, at=m(2)),
        submitted("ann-2", budget="lab/a", user="alice", gpus=4, at=m(3)),
    ):
        step(state, e, e.now_us if isinstance(e, Tick) else to_us(e.ts), CFG)
    step(state, Tick(m(4)), m(4), CFG)
    rows, _ = read_model(state, m(5), CFG)
    assert rows["rob-1"]["state"] == "running" and rows["rob-1"]["position"] is None
    # budget order: lab/a (nothing running) then lab/b; within it allocated ann-2, then lab/b's rob-3;
    # lab/a's unallocated free-1 goes last although its leaf ranks first
    assert {j: rows[j]["position"] for j in ("ann-2", "rob-3", "free-1")} == {"ann-2": 0, "rob-3": 1, "free-1": 2}


def _two_free_jobs(cfg: DispatchConfig) -> dict[str, int]:
    """free-1 (submitted first, requeued after 1 h on 1 GPU) and free-2 (not run yet), both lab/a's."""
    state = DispatchState(TREE)
    reg = ev.NodeRegistered(node_id="n0", gpu_count=4, ts=from_us(T0), event_id=ev.det_id("reg", "n0"))
    for e in (
        reg,
        submitted("rob-1", budget="lab/b", user="rob", gpus=4, duration_s=7200.0),
        Tick(T0),
        submitted("free-1", budget="lab/a", user="alice", gpus=1, min_runtime_s=0.0, at=m(1)),
        submitted("free-2", budget="lab/a", user="alice", gpus=1, min_runtime_s=0.0, at=m(2)),
    ):
        step(state, e, e.now_us if isinstance(e, Tick) else to_us(e.ts), cfg)
    jobs = state.pending["lab/a"]
    jobs[:] = [replace(j, attempt=2, attained_gpu_s=3600.0) if j.job_id == "free-1" else j for j in jobs]
    rows, _ = read_model(state, m(5), cfg)
    return {j: rows[j]["position"] for j in ("free-1", "free-2")}


def test_unallocated_jobs_that_have_not_run_come_before_requeued_ones_as_the_cycle_walks_them() -> None:
    # rule D3.free-las (on by default): the fresh free-2 first, then free-1 by its attained service
    assert _two_free_jobs(CFG) == {"free-2": 0, "free-1": 1}
    # without the rule: submission order within the leaf
    off = DispatchConfig(heartbeat_timeout_s=None, engine=EngineConfig(free_las=False))
    assert _two_free_jobs(off) == {"free-1": 0, "free-2": 1}
