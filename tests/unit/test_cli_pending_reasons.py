"""The pending reasons `apportion queue` shows (services.dispatcher.logic.read_model): they name what blocks a job."""

from __future__ import annotations

from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
from apportion.events import JobPlaced
from apportion.timeutil import from_us
from services.dispatcher.logic import read_model
from tests.unit.builders import budget_set, cordoned, node, s, started, submitted

CFG = DispatchConfig(heartbeat_timeout_s=None)


def _state(*evts: object, at: int) -> DispatchState:
    st = DispatchState()
    for e in evts:
        for out in step(st, e, at, CFG):  # type: ignore[arg-type]
            if isinstance(out, JobPlaced):
                for i, p in enumerate(out.placements):
                    step(st, started(out.job_id, replica=i, node=p.node_id, at=at), at, CFG)
    return st


def _reason(st: DispatchState, job_id: str, at: int) -> str:
    jobs, _ = read_model(st, at, CFG)
    return jobs[job_id]["reason"]


def test_a_job_blocked_by_a_protected_run_names_the_shape_and_when_protection_ends() -> None:
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
        "waiting_for_gpus: needs 1 node(s) with 2 free GPU(s), 0 of 1 ready node(s) have them now; "
        f"no preemptible victim behind this budget; the earliest protection on those nodes ends "
        f"{from_us(s(2 + 3600)).isoformat()}"
    )


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
        "nodes_unavailable: needs 2 node(s) with 8 free GPU(s); 2 node(s) of this shape, 1 ready "
        "(the rest cordoned, draining, drained or lost)"
    )
