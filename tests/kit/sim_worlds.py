"""Random clusters and job streams for the simulator's property tests (rule D3.invariants): ``worlds`` draws
nodes, jobs of the ``LEAVES`` of ``TREE``, node drains and a seed; ``check_log`` walks a decision log and fails on a
GPU given to two runs (unless to the decision's own stopping victims), two workloads on one GPU, or an allocated
run preempted before its minimum runtime.

``TREE``::

    org (1.0)
    ├── x  0.6
    │   ├── p  0.5
    │   └── q  0.5
    └── y  0.4
"""

from __future__ import annotations

from hypothesis import strategies as st

from apportion.events import (
    JobCompleted,
    JobFailed,
    JobPlaced,
    JobPreempted,
    JobStarted,
    StartWorkload,
    is_allocated,
)
from apportion.sim.core import SimJob, SimNode
from apportion.timeutil import s_to_us, to_us
from tests.kit.simkit import at

TREE = {"org": 1.0, "org/x": 0.6, "org/x/p": 0.5, "org/x/q": 0.5, "org/y": 0.4}
LEAVES = ["org/x/p", "org/x/q", "org/y"]


@st.composite
def worlds(draw):
    n_nodes = draw(st.integers(1, 4))
    nodes = [SimNode(f"n{i}", draw(st.sampled_from([1, 2, 4, 8]))) for i in range(n_nodes)]
    biggest = max(n.gpus for n in nodes)
    jobs = []
    for i in range(draw(st.integers(1, 25))):
        g = draw(st.integers(1, biggest))
        fitting = sum(1 for n in nodes if n.gpus >= g)
        k = draw(st.integers(1, fitting))
        jobs.append(
            SimJob(
                job_id=f"j{i:02d}",
                budget=draw(st.sampled_from(LEAVES)),
                user="u",
                submit_us=at(0, draw(st.integers(0, 180))),
                gpus_per_replica=g,
                replicas=k,
                min_runtime_s=draw(st.sampled_from([0.0, 0.0, 600.0, 1800.0, 3600.0])),
                duration_s=float(draw(st.integers(60, 3 * 3600))),
            )
        )
    drains = tuple(
        (f"n{i}", at(0, draw(st.integers(0, 240))))
        for i in range(n_nodes)
        if draw(st.booleans()) and draw(st.booleans())
    )
    seed = draw(st.integers(0, 2**16))
    return nodes, jobs, drains, seed


def check_log(log, specs):
    held: dict[tuple[str, int], tuple[str, int]] = {}  # (node, gpu) -> run holding it
    stopping: set[tuple[str, int]] = set()
    running: dict[tuple[str, int], tuple[str, int, int]] = {}  # (node, gpu) -> workload replica
    started: dict[tuple[str, int], int] = {}
    for e in log:
        if isinstance(e, JobPreempted):
            key = (e.job_id, e.attempt)
            stopping.add(key)
            spec = specs[e.job_id]
            if is_allocated(spec.min_runtime_s) and key in started:
                assert to_us(e.ts) >= started[key] + s_to_us(spec.min_runtime_s), f"protected {key} preempted"
        elif isinstance(e, JobPlaced):
            key = (e.job_id, e.attempt)
            victims = {(v.job_id, v.attempt) for v in e.decision.victims}
            for p in e.placements:
                for g in p.gpus:
                    holder = held.get((p.node_id, g))
                    assert holder is None or (holder in victims and holder in stopping), (
                        f"{key} placed on {p.node_id}:{g} held by {holder}"
                    )
                    held[(p.node_id, g)] = key
        elif isinstance(e, StartWorkload):
            for g in e.gpus:
                assert (e.node_id, g) not in running, f"two workloads on {e.node_id}:{g}"
                running[(e.node_id, g)] = (e.job_id, e.attempt, e.replica)
        elif isinstance(e, JobStarted):
            started[(e.job_id, e.attempt)] = to_us(e.ts)
        elif isinstance(e, (JobCompleted, JobFailed)) and e.producer.startswith("sim"):
            for slot, w in list(running.items()):
                if w == (e.job_id, e.attempt, e.replica):
                    del running[slot]
        if e.type in ("JobCompleted", "JobFailed", "JobRequeued", "JobCancelled", "JobLost"):
            attempt = e.attempt - 1 if e.type == "JobRequeued" else e.attempt
            key = (e.job_id, attempt)
            if e.type in ("JobCompleted", "JobFailed") and key in stopping:
                continue
            for slot, k in list(held.items()):
                if k == key and (getattr(e, "replica", None) is None or e.node_id == slot[0]):
                    del held[slot]
