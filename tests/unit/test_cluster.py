"""Cluster state fold (design D1 and D3): free GPUs, runs, stopping victims, protection."""

from __future__ import annotations

from apportion import events as ev
from apportion.domain.cluster import UNTIL_STARTED, ClusterState
from apportion.timeutil import from_us
from tests.kit.builders import T0, completed, h, placed, preempted, requeued, started


def reg(nid: str, gpus: int = 4, at: int = T0) -> ev.NodeRegistered:
    return ev.NodeRegistered(node_id=nid, gpu_count=gpus, ts=from_us(at))


def fold(*events) -> ClusterState:
    cs = ClusterState()
    for e in events:
        cs.apply(e)
    return cs


def test_placement_takes_free_gpus_and_completion_returns_them():
    cs = fold(reg("n0"), placed("j", gpus=2, nodes=["n0"], at=h(1)))
    assert cs.nodes["n0"].free == {2, 3}
    assert cs.node_runs["n0"] == {("j", 1)}
    cs.apply(completed("j", at=h(2)))
    assert cs.nodes["n0"].free == {0, 1, 2, 3} and cs.runs == {} and cs.node_runs["n0"] == frozenset()


def test_gang_replicas_end_one_by_one():
    cs = fold(reg("n0"), reg("n1"), placed("g", gpus=4, replicas=2, nodes=["n0", "n1"], at=h(1)))
    cs.apply(completed("g", replica=1, at=h(2)))
    assert cs.nodes["n1"].free == {0, 1, 2, 3} and cs.nodes["n0"].free == frozenset()
    assert cs.runs[("g", 1)].open_replicas == {0}
    cs.apply(completed("g", replica=0, at=h(2)))
    assert ("g", 1) not in cs.runs


def test_stopping_victim_keeps_its_gpus_until_requeued_and_preemptor_takes_them_over():
    cs = fold(
        reg("n0"), placed("v", gpus=4, nodes=["n0"], allocated=False, at=h(1)), preempted("v", allocated=False, at=h(2))
    )
    assert cs.runs[("v", 1)].stopping and cs.nodes["n0"].free == frozenset()
    # the preemptor takes GPUs 0-1 of the stopping victim
    p = placed("j", gpus=2, nodes=["n0"], at=h(2))
    cs.apply(p)
    cs.apply(completed("v", at=h(2)))  # a stopping run's exit report does not free anything
    assert cs.nodes["n0"].free == frozenset()
    cs.apply(requeued("v", attempt=2, at=h(2)))
    assert cs.nodes["n0"].free == {2, 3}  # only the GPUs the preemptor did not take
    assert set(cs.runs) == {("j", 1)}


def test_protection_runs_from_the_latest_start():
    cs = fold(reg("n0"), reg("n1"), placed("g", gpus=1, replicas=2, nodes=["n0", "n1"], at=h(1)))
    run = cs.runs[("g", 1)]
    assert run.protected_until_us == UNTIL_STARTED  # placed, not started: protected until it starts
    cs.apply(started("g", replica=0, node="n0", at=h(1.5)))
    assert cs.runs[("g", 1)].protected(h(99))  # one replica of two started: still protected
    cs.apply(started("g", replica=1, node="n1", at=h(1.75)))
    run = cs.runs[("g", 1)]
    assert run.protected_until_us == h(2.75)
    assert run.protected(h(2.74)) and not run.protected(h(2.75))


def test_unallocated_runs_are_never_protected():
    cs = fold(reg("n0"), placed("u", allocated=False, nodes=["n0"], at=h(1)))
    assert cs.runs[("u", 1)].protected_until_us is None and not cs.runs[("u", 1)].protected(h(1))


def test_node_states_and_reregistration_keep_held_gpus():
    cs = fold(reg("n0"), placed("j", gpus=3, nodes=["n0"], at=h(1)))
    cs.apply(ev.NodeDrainRequested(node_id="n0", ts=from_us(h(2))))
    assert cs.nodes["n0"].state == "draining" and not cs.nodes["n0"].schedulable
    cs.apply(ev.NodeUncordoned(node_id="n0", ts=from_us(h(3))))
    cs.apply(reg("n0", at=h(3)))
    assert cs.nodes["n0"].state == "ready" and cs.nodes["n0"].free == {3}


def test_lost_run_frees_and_duplicates_are_harmless():
    p = placed("j", gpus=2, nodes=["n0"], at=h(1))
    cs = fold(reg("n0"), p, p)
    lost = ev.JobLost(job_id="j", attempt=1, node_id="n0", charged_until=from_us(h(1.5)), ts=from_us(h(2)))
    cs.apply(lost)
    cs.apply(lost)
    assert cs.nodes["n0"].free == {0, 1, 2, 3} and cs.runs == {}


def test_snapshot_is_not_changed_by_later_events():
    cs = fold(reg("n0"), placed("j", gpus=2, nodes=["n0"], at=h(1)))
    snap = cs.snapshot()
    cs.apply(completed("j", at=h(2)))
    assert snap.nodes["n0"].free == {2, 3} and ("j", 1) in snap.runs


def checkpointed(job: str, progress: float, at: int, attempt: int = 1, replica: int | None = 0):
    return ev.JobCheckpointed(job_id=job, attempt=attempt, progress_s=progress, replica=replica, ts=from_us(at))


def test_a_reported_progress_is_bounded_by_the_work_time_the_job_has_had():
    """Rule D3.checkpoints. Attempt 1 runs 1 h (placed h(1), preempted h(1.5), requeued h(2): its run ends at
    the requeue); attempt 2 is placed at h(3). A report of 1e300 s at h(3.25) counts as 1 h + 0.25 h = 4,500 s;
    one within the bound (300 s) keeps its word; after the job ends its worked time is gone."""
    cs = fold(reg("n0"), placed("j", nodes=["n0"], at=h(1)))
    cs.apply(checkpointed("j", 1e300, at=h(1.25)))
    assert cs.runs[("j", 1)].checkpoint_progress_s == 900.0 and cs.progress["j"] == 900.0
    cs.apply(preempted("j", at=h(1.5)))
    cs.apply(requeued("j", attempt=2, at=h(2)))
    assert cs.worked_us["j"] == 3_600_000_000
    cs.apply(placed("j", attempt=2, nodes=["n0"], at=h(3)))
    assert cs.progress_bound_s("j", 2, h(3.25)) == 4500.0
    cs.apply(checkpointed("j", 1e300, attempt=2, at=h(3.25)))
    assert cs.runs[("j", 2)].checkpoints == ((0, h(3.25), 4500.0),) and cs.progress["j"] == 4500.0
    cs.apply(checkpointed("j", 300.0, attempt=2, at=h(3.5)))
    assert cs.runs[("j", 2)].checkpoint_progress_s == 300.0
    cs.apply(completed("j", attempt=2, at=h(4)))
    assert ("j" in cs.worked_us, "j" in cs.progress) == (False, False)


def test_a_run_replaced_by_the_fold_is_dataclasses_replace_of_it_field_by_field():
    from dataclasses import fields, replace
    from typing import Any

    from apportion.domain.cluster import Run, _run_with

    run = Run("j", 2, "g/a", "u", True, 4, 2, 600_000_000, (), T0, T0 - 5, None, frozenset(), frozenset({0, 1}))
    new: dict[str, Any] = {
        "job_id": "k", "attempt": 3, "budget": "g/b", "user": "v", "allocated": False, "gpus_per_replica": 8,
        "replicas": 1, "min_runtime_us": 1, "placements": (ev.Placement(node_id="n1", gpus=(0,)),),
        "placed_at_us": T0 + 1, "submitted_at_us": T0 - 9, "started_at_us": T0 + 2,
        "started_replicas": frozenset({1}), "open_replicas": frozenset({1}), "stopping": True, "protection_us": 7,
        "preemptions": 4, "resumed_from_s": 12.5, "checkpoints": ((0, T0, 3.0),), "checkpoint_interval_us": 60,
    }  # fmt: skip
    assert set(new) == {f.name for f in fields(Run)}  # every field changed once
    for name, value in new.items():
        got = _run_with(run, **{name: value})
        assert got == replace(run, **{name: value}) and getattr(got, name) == value and got != run
    both = _run_with(run, started_at_us=T0 + 3, started_replicas=frozenset({0, 1}))
    assert both == replace(run, started_at_us=T0 + 3, started_replicas=frozenset({0, 1}))
    assert run.started_at_us is None  # the run replaced is not changed
