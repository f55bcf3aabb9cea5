"""audit verify on hand-built logs: a clean simulated log passes; a tampered snapshot,
decision or read-model row is reported at the offset where it appears.

History: :mod:`tests.kit.audit_history` (two 1-GPU nodes, b preempting a twice).

(Before the after-move test of rule D3.consistent-view this history was a1 alone on one GPU,
b1 on the other and b2 preempting a1 at 1:00: b taking both GPUs from an even split,
the swap the rule now refuses.)
"""

from __future__ import annotations

import pytest

from apportion import events, topics
from apportion.audit.replay import occupancy_at
from apportion.audit.verify import (
    check_read_models,
    check_snapshots,
    position,
    records_from_events,
    rerun_decisions,
    verify,
)
from apportion.timeutil import from_us
from tests.kit.audit_history import AB, CFG, history
from tests.kit.narrowing import narrow
from tests.kit.simkit import T0, at


def test_clean_log_every_decision_reruns_identically() -> None:
    recs = records_from_events(history())
    checks = rerun_decisions(recs, CFG)
    assert len(checks) == 3 and all(c.match for c in checks), [c.diffs for c in checks if not c.match]
    assert {c.basis for c in checks} == {"log-order"}  # the simulator records no input position


def test_clean_log_verifies() -> None:
    rep = verify(records_from_events(history((at(0, 30), at(1, 30), at(2, 30)))), config=CFG)
    assert rep.ok, rep.to_dict()
    assert rep.snapshots == 3 and rep.decisions == 3


def test_a_log_whose_tree_came_as_one_budget_batch_verifies() -> None:
    """`budget apply` writes one BudgetBatch: the audit folds it as the services did (fold_budget_log)."""
    log = history((at(0, 30), at(1, 30), at(2, 30)))
    batch = events.BudgetBatch(
        sets=tuple(events.BudgetSpec(path=p, share=s) for p, s in AB.items()), ts=from_us(T0 - 1), producer="cli"
    )
    log = [batch, *[e for e in log if not isinstance(e, events.BudgetSet)]]
    rep = verify(records_from_events(log), config=CFG)
    assert rep.ok, rep.to_dict()
    assert rep.snapshots == 3 and rep.decisions == 3


def test_tampered_snapshot_is_named_by_its_offset() -> None:
    log = history((at(0, 30), at(1, 30), at(2, 30)))
    snap = narrow(events.OccupancySnapshot, log[-2])  # the 1:30 snapshot
    rows = list(snap.budgets)
    rows[1] = rows[1].model_copy(update={"occupancy_gpu_s": rows[1].occupancy_gpu_s + 5.0})
    log[-2] = snap.model_copy(update={"budgets": tuple(rows)})
    recs = records_from_events(log)
    bad = next(r for r in recs if r.event is log[-2])
    (m,) = check_snapshots(recs)
    assert m.offset == position(bad) == "apportion.usage:0@1"
    assert f"{rows[1].path}.occupancy_gpu_s" in m.detail
    rep = verify(recs, config=CFG)
    assert not rep.ok and rep.first is not None and rep.first.offset == "apportion.usage:0@1"


def test_snapshot_within_a_gpu_second_passes_beyond_fails() -> None:
    # 1e-6 relative of ~3600 GPU-s is 0.0036: a 0.5 GPU-s error fails the relative bound
    log = history((at(0, 30),))
    rows = list(narrow(events.OccupancySnapshot, log[-1]).budgets)
    rows[1] = rows[1].model_copy(update={"occupancy_gpu_s": rows[1].occupancy_gpu_s * (1 + 1e-8)})
    log[-1] = log[-1].model_copy(update={"budgets": tuple(rows)})
    assert check_snapshots(records_from_events(log)) == []


def test_tampered_decision_is_named_by_its_offset() -> None:
    log = history()
    i = next(i for i, e in enumerate(log) if isinstance(e, events.JobPlaced) and e.job_id == "b2")
    placed = narrow(events.JobPlaced, log[i])
    log[i] = placed.model_copy(update={"decision": placed.decision.model_copy(update={"rank": 7})})
    recs = records_from_events(log)
    rep = verify(recs, config=CFG)
    assert not rep.ok
    m = rep.first
    assert m is not None
    assert m.check == "decision" and "decision.rank: recorded 7, re-run 0" in m.detail
    # the first record of that tick: a2's preemption (same instant, earlier offset)
    tick = sorted(
        (
            r
            for r in recs
            if r.event is not None
            and r.event.ts == placed.ts
            and isinstance(r.event, (events.JobPlaced, events.JobPreempted))
        ),
        key=lambda r: (r.topic, r.partition, r.offset),
    )
    assert m.offset == position(tick[0])


def test_read_model_rows_compared_with_the_rebuild() -> None:
    log = history((at(2, 30),))
    recs = records_from_events(log)
    snap = narrow(events.OccupancySnapshot, log[-1])
    _, ranks = occupancy_at(recs, at(2, 30))
    budgets = {u.path: u.model_dump(mode="json") | {"rank": ranks.get(u.path)} for u in snap.budgets}
    meta = {
        "at": snap.at.isoformat(),
        "window_s": snap.window_s,
        "capacity_gpu_s": snap.capacity_gpu_s,
        "snapshot_id": str(snap.event_id),
    }
    rows = {"usage": {"meta": meta}, "budgets": budgets}
    assert check_read_models(recs, rows, CFG) == []
    budgets["lab/b"] = budgets["lab/b"] | {"occupancy_gpu_s": 1.0}
    (m,) = check_read_models(recs, rows, CFG)
    assert m.subject == "budgets[lab/b]" and m.offset == "apportion.usage:0@0"


@pytest.mark.parametrize("field,value", [("state", "pending"), ("nodes", ["n9"])])
def test_dispatcher_job_row_that_disagrees_is_reported(field: str, value: object) -> None:
    recs = records_from_events(history())
    from apportion.domain.dispatch import fold

    state = fold(r.event for r in recs if r.event is not None)
    jobs = {}
    for jid, rec in state.jobs.items():
        run_ = state.cluster.runs.get((jid, rec.attempt))
        jobs[jid] = {
            "state": rec.status,
            "attempt": rec.attempt,
            "budget": rec.spec.budget,
            "nodes": [p.node_id for p in run_.placements] if run_ else [],
        }
    assert check_read_models(recs, {"jobs": jobs}, CFG) == []
    jid = next(j for j in sorted(jobs) if jobs[j]["state"] == "running")  # b1
    jobs[jid] = jobs[jid] | {field: value}
    (m,) = check_read_models(recs, {"jobs": jobs}, CFG)
    assert m.subject == f"jobs[{jid}]" and m.offset is not None


def test_read_model_of_a_snapshot_that_had_read_a_budget_set_after_its_at_verifies() -> None:
    # accounting's snapshot time is its ledger clock, which only job and node events move: a budget set after the
    # last of them (here lab/b at T0 + 10 s, the snapshot at T0 + 5 s) is in the snapshot and its read model. The
    # check compares the rows with that recorded snapshot (check_snapshots rebuilds it from its inputs) and ranks
    # by the tree of those inputs; by event time the tree at T0 + 5 s has no lab/b: "row not in the rebuilt tree".
    from apportion.domain.budgets import BudgetTree
    from apportion.domain.occupancy import OccupancyLedger
    from apportion.domain.usage import usage_snapshot
    from apportion.settings import topic_name
    from services.accounting.logic import read_model

    sets = [
        events.BudgetSet(path="lab", share=1.0, ts=from_us(T0), producer="ops"),
        events.BudgetSet(path="lab/a", share=0.5, ts=from_us(T0), producer="ops"),
        events.BudgetSet(path="lab/b", share=0.5, ts=from_us(T0 + 10_000_000), producer="ops"),
    ]
    tree = BudgetTree.from_mapping(AB)
    ledger = OccupancyLedger()
    ledger.apply(events.NodeRegistered(node_id="n0", gpu_count=8, ts=from_us(T0 + 5_000_000)))
    offsets = {f"{topic_name(topics.BUDGETS)}:0": 3}
    snap = usage_snapshot(tree, ledger, T0 + 5_000_000, producer="accounting").model_copy(update={"inputs": offsets})
    recs = records_from_events([*sets, snap])
    meta, budgets = read_model(snap, tree, offsets)
    rows = {"usage": {"meta": meta}, "budgets": budgets}
    assert sorted(budgets) == ["lab", "lab/a", "lab/b"]
    assert check_read_models(recs, rows, CFG) == []
    budgets["lab/b"] = budgets["lab/b"] | {"rank": 0}  # lab/a and lab/b tie at 0 GPU-s: by path, lab/a first
    (m,) = check_read_models(recs, rows, CFG)
    assert m.subject == "budgets[lab/b]" and "rank" in m.detail


@pytest.mark.parametrize(
    "change,detail",
    [
        ({"free_gpus": 99}, "free_gpus: Redis 99"),
        ({"state": "drained"}, "state: Redis 'drained'"),
        (None, "row missing in Redis"),
    ],
    ids=["free GPUs", "state", "missing row"],
)
def test_dispatcher_node_row_that_disagrees_is_reported(change: dict[str, object] | None, detail: str) -> None:
    recs = records_from_events(history())
    from apportion.domain.dispatch import fold

    state = fold(r.event for r in recs if r.event is not None)
    nodes: dict[str, dict[str, object]] = {
        nid: {
            "state": n.state,
            "gpu_count": n.gpu_count,
            "gpu_model": n.gpu_model,
            "free_gpus": len(n.free),
            "running": sorted(f"{k[0]}#{k[1]}" for k in state.cluster.node_runs.get(nid, ())),
        }
        for nid, n in state.cluster.nodes.items()
    }
    assert check_read_models(recs, {"nodes": nodes}, CFG) == []
    nid = sorted(nodes)[0]
    if change is None:
        del nodes[nid]
    else:
        nodes[nid] = nodes[nid] | change
    (m,) = check_read_models(recs, {"nodes": nodes}, CFG)
    assert m.subject == f"nodes[{nid}]" and detail in m.detail and m.offset is not None


def test_a_completion_stamped_before_a_loss_the_log_holds_no_requeue_for_is_folded_after_the_loss() -> None:
    """Rule D3.completed-before-loss: a gang's replica reports (stamped 35 s) of a run the dispatcher lost at 41 s,
    whose survivors' stop they ended (no requeue, no next placement in the log), are folded after the loss, where
    the dispatcher read them; a report stamped after the loss, and one of a run never lost, keep event time."""
    from apportion.audit.verify import emitted_order, ext_key, fold_order, loss_times
    from apportion.logrecord import LogRecord

    def sec(s: float):  # a datetime, s seconds after T0
        return from_us(T0 + int(s * 1_000_000))

    def rec(e: events.Event, topic: str, offset: int) -> LogRecord:
        return LogRecord(topic, 0, offset, None, 0, None, e)

    lost = events.JobLost(
        job_id="g", attempt=1, node_id="n1", charged_until=sec(10), ts=sec(41), producer="dispatcher",
        event_id=events.det_id("lost"),
    )  # fmt: skip

    def done(job: str, replica: int, s: float) -> events.JobCompleted:
        return events.JobCompleted(
            job_id=job, attempt=1, replica=replica, ts=sec(s), event_id=events.det_id(job, replica)
        )

    own = [rec(lost, "jobs", 0)]
    polled = [rec(done("g", 0, 35), "nodes", 0), rec(done("h", 0, 36), "nodes", 1), rec(done("g", 1, 42), "nodes", 2)]
    order = fold_order(own, polled, emitted_order, ext_key, lost_at=loss_times(own))
    assert [
        (type(r.event).__name__, getattr(r.event, "job_id", ""), narrow(events.Event, r.event).ts) for r in order
    ] == [
        ("JobCompleted", "h", sec(36)),
        ("JobLost", "g", sec(41)),
        ("JobCompleted", "g", sec(35)),
        ("JobCompleted", "g", sec(42)),
    ]
