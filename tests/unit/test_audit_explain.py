"""audit explain on a hand-built log: the preempted job's timeline names the preemptor,
the rule, the LCA and both r values, and every decision re-runs identically.

Same history as test_audit_verify.py (delta 0.01, two 1-GPU nodes)::

    lab (1.0)
    ├── a  0.5     a1, a2 at 0:00 (1 h protection)
    └── b  0.5     b1 at 0:01, b2 at 2:00

At 1:00 a1's protection has ended: O_a = 7200, O_b = 0, K = 7200 -> r_a = 2.0 >=
r_b = 0 + 0.01, and after the move r_b = 3600 / 3600 = 1.0 <= 2.0, so b1 preempts a1
(rule expired_behind, LCA lab). a1's second attempt never takes the GPU back (a stays
ahead of b); before the after-move test of rule D3.consistent-view the history ended in that
swap.
"""

from __future__ import annotations

from apportion import events
from apportion.audit.explain import explain
from apportion.audit.verify import records_from_events
from tests.kit.audit_history import CFG, history


def test_preempted_job_names_preemptor_rule_and_ratios() -> None:
    ex = explain(records_from_events(history()), "a1", CFG)
    assert ex.found and ex.decisions_match
    kinds = [e.kind for e in ex.timeline]
    assert kinds[:2] == ["JobSubmitted", "JobQueued"]
    pre = next(e for e in ex.timeline if e.kind == "JobPreempted")
    assert pre.details["by_job_id"] == "b1" and pre.details["by_budget"] == "lab/b"
    v = pre.details["victim"]
    assert (v["rule"], v["lca"], v["victim_ratio"], v["preemptor_ratio"]) == ("expired_behind", "lab", 2.0, 0.0)
    assert "preempted by b1 (lab/b): rule expired_behind at LCA lab" in pre.summary
    assert pre.summary.endswith("; grace 30s; work lost 0.00 GPU-h since its last checkpoint")
    assert pre.check is not None
    assert pre.check == {
        "match": True,
        "basis": "log-order",
        "diffs": [],
        "tick_match": True,
        "tick_offset": pre.check["tick_offset"],
    }
    assert kinds.index("JobPreempted") < kinds.index("JobRequeued")
    assert "Preempts" not in kinds  # a1 (attempt 2) does not take its GPU back: no swap
    placed = [e for e in ex.timeline if e.kind == "JobPlaced"]
    assert [p.attempt for p in placed] == [1] and all(p.check is not None and p.check["match"] for p in placed)


def test_the_preemptor_names_its_victim() -> None:
    ex = explain(records_from_events(history()), "b1", CFG)
    assert ex.found and ex.decisions_match
    mine = next(e for e in ex.timeline if e.kind == "Preempts")
    assert mine.details["victim_job"] == "a1" and mine.check is not None and mine.check["match"]


def test_a_tampered_placement_is_a_mismatch_in_the_explanation() -> None:
    log = history()
    i = next(i for i, e in enumerate(log) if isinstance(e, events.JobPlaced) and e.job_id == "a1")
    p = log[i]
    log[i] = p.model_copy(update={"placements": (events.Placement(node_id="n1", gpus=(0,)),)})
    ex = explain(records_from_events(log), "a1", CFG)
    first = next(e for e in ex.timeline if e.kind == "JobPlaced")
    assert first.check is not None
    assert not first.check["match"] and any("placements" in d for d in first.check["diffs"])
    assert not ex.decisions_match


def test_unknown_job() -> None:
    ex = explain(records_from_events(history()), "nope", CFG)
    assert not ex.found and ex.timeline == []


def test_every_job_event_gets_a_sentence_not_its_type_name() -> None:
    """Checkpoints, losses, refused starts and cancels read as what happened (they were rows of bare type names)."""
    from datetime import UTC, datetime

    ts = datetime(2026, 1, 1, 3, tzinfo=UTC)
    extra = [
        events.JobCheckpointed(job_id="a1", attempt=2, progress_s=5400, replica=0, node_id="n0", ts=ts),
        events.WorkloadRefused(node_id="n0", job_id="a1", attempt=2, reason="gpus_busy", ts=ts),
        events.JobLost(job_id="a1", attempt=2, node_id="n0", charged_until=ts, lost_gpu_s=1800.0, ts=ts),
        events.JobCancelRequested(job_id="a1", user="alice", reason="wrong data", ts=ts),
        events.JobCancelled(job_id="a1", attempt=2, reason="wrong data", ts=ts),
    ]
    ex = explain(records_from_events([*history(), *extra]), "a1", CFG, check=False)
    said = {e.kind: e.summary for e in ex.timeline if e.at == ts.isoformat()}
    assert said == {
        "JobCheckpointed": "checkpoint by replica 0 on n0: 1h30m of progress saved",
        "WorkloadRefused": "n0 refused the start: gpus_busy",
        "JobLost": "lost on n0 (charged until 2026-01-01T03:00:00+00:00); work lost 0.50 GPU-h",
        "JobCancelRequested": "cancel requested by alice (wrong data)",
        "JobCancelled": "cancelled (wrong data)",
    }
    assert all(e.summary != e.kind for e in ex.timeline)


def test_a_checkpoint_reported_beyond_the_run_time_reads_as_the_run_time() -> None:
    """Rule D3.checkpoints: a1's attempt 1 was placed at 0:00; a report of 1e300 s of progress at 0:30 counts as
    the 30 minutes it has run (1,800 s), as the dispatcher's fold counts it, not as a 300-digit duration."""
    from datetime import UTC, datetime

    log = history()
    at = datetime(2024, 1, 1, 0, 30, tzinfo=UTC)
    i = next(k for k, e in enumerate(log) if e.ts > at)
    log.insert(i, events.JobCheckpointed(job_id="a1", attempt=1, progress_s=1e300, replica=0, node_id="n0", ts=at))
    ex = explain(records_from_events(log), "a1", CFG, check=False)
    (cp,) = [e for e in ex.timeline if e.at == at.isoformat()]
    assert cp.summary == (
        "checkpoint by replica 0 on n0: 30m of progress saved "
        "(reported 1e+300 s, more than the job has run: counted as its run time)"
    )
    assert cp.details == {"progress_s": 1800.0, "reported_progress_s": 1e300}
