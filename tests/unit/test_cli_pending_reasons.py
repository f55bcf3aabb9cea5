"""The pending reasons `apportion queue` shows (services.dispatcher.logic.read_model): the engine's own cycle
names what blocks each job (apportion.domain.engine.reasons), as text and as fields."""

from __future__ import annotations

from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.events import Event, JobPlaced
from services.dispatcher.logic import read_model
from tests.kit.builders import budget_set, cordoned, node, s, started, submitted

CFG = DispatchConfig(heartbeat_timeout_s=None)


def _state(*evts: Event | Tick, at: int) -> DispatchState:
    st = DispatchState()
    for e in evts:
        for out in step(st, e, at, CFG):
            if isinstance(out, JobPlaced):
                for i, p in enumerate(out.placements):
                    step(st, started(out.job_id, replica=i, node=p.node_id, at=at), at, CFG)
    return st


def _reason(st: DispatchState, job_id: str, at: int) -> str:
    jobs, _ = read_model(st, at, CFG)
    return jobs[job_id]["reason"]


def _detail(st: DispatchState, job_id: str, at: int) -> dict[str, object]:
    jobs, _ = read_model(st, at, CFG)
    return jobs[job_id]["reason_detail"]


def test_a_job_waiting_behind_its_own_budget_is_no_free_gpus() -> None:
    #   one 4-GPU node, lab/a holds all 4 for 1 h from s(1); a second lab/a job (same leaf: no victim) waits
    st = _state(
        budget_set("lab"),
        budget_set("lab/a"),
        node("n0", 4),
        submitted("j1", gpus=4, min_runtime_s=3600, at=s(1)),
        Tick(s(1)),
        submitted("j2", gpus=2, min_runtime_s=600, at=s(2)),
        Tick(s(2)),
        at=s(2),
    )
    assert st.jobs["j2"].status == "pending"
    assert _reason(st, "j2", s(3)) == (
        "no_free_gpus: needs 1 node(s) with 2 GPU(s) free, 0 node(s) have them now; "
        "no run there may be preempted for it (its own budget's, or too few GPUs)"
    )
    assert _detail(st, "j2", s(3)) == {
        "kind": "no_free_gpus",
        "text": _reason(st, "j2", s(3)),
        "gpus_per_replica": 2,
        "replicas": 1,
        "gpu_model": None,
        "free_nodes": 0,
        "allocated": True,
        "preemption": True,
    }


def test_a_job_blocked_by_another_budgets_protected_run_says_when_protection_ends() -> None:
    #   lab/b's j1 holds the node's 4 GPUs, protected for 1 h from its start at s(1)
    st = _state(
        budget_set("lab"),
        budget_set("lab/a", 0.5),
        budget_set("lab/b", 0.5),
        node("n0", 4),
        submitted("j1", budget="lab/b", gpus=4, min_runtime_s=3600, at=s(1)),
        Tick(s(1)),
        submitted("j2", gpus=2, min_runtime_s=600, at=s(2)),
        Tick(s(2)),
        at=s(2),
    )
    assert (st.jobs["j1"].status, st.jobs["j2"].status) == ("running", "pending")
    assert _reason(st, "j2", s(3)) == (
        "protected_until: the runs it could preempt are protected; the first protection ends "
        "2024-01-01 01:00:02 UTC (j1 of lab/b)"
    )


def test_a_job_no_cycle_has_seen_yet_is_placeable() -> None:
    st = _state(budget_set("lab"), budget_set("lab/a"), node("n0", 4), submitted("j1", gpus=2, at=s(1)), at=s(1))
    assert st.jobs["j1"].status == "pending"
    assert _reason(st, "j1", s(2)) == "placeable: a cycle now places it (the dispatcher's next one)"


def test_a_gang_larger_than_the_cluster_says_how_many_nodes_of_its_shape_exist() -> None:
    st = _state(
        budget_set("lab"),
        budget_set("lab/a"),
        node("n0", 8),
        node("n1", 8),
        cordoned("n1", at=s(1)),
        submitted("g", gpus=8, replicas=2, at=s(2)),
        Tick(s(2)),
        at=s(2),
    )
    assert _reason(st, "g", s(3)) == (
        "no_node_shape: needs 2 node(s) with 8 GPU(s); the cluster has 1 ready node(s) of this shape "
        "(2 in all, the rest cordoned, draining, drained or lost)"
    )
