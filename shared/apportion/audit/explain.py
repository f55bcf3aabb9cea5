"""``audit explain JOB``: a job's whole timeline from the log, each decision re-run.

The timeline lists, in log order, every record about the job: its
submission, queueing (or rejection with the reason), each placement (nodes
and GPUs, rank, budget rank, r, victims), each preemption (by which job and
budget, the rule, the lowest common ancestor, both r values and the
victim's protection end), requeues, starts, stops and the end. It also lists
the runs the job itself preempted.

Every placement of the job and every preemption of it is cross-checked by
re-running the pure decision (:func:`apportion.audit.verify.rerun_decisions`:
the state folded up to the decision's input position, then
``step(fork, Tick(decision.ts))``); the entry says whether the re-run gives
the same decision (same ``event_id`` from :func:`apportion.events.det_id`
and the same content). The re-run folds what the services folded
(:func:`apportion.audit.verify.services_input`): a forged node report or
decision they dead-lettered is left out, as they left it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from apportion import events
from apportion.arrays import split_element_id
from apportion.audit.signatures import check_reports
from apportion.audit.verify import DecisionCheck, position, rerun_decisions, services_input
from apportion.domain.cluster import ClusterState
from apportion.domain.dispatch import DispatchConfig
from apportion.durations import format_duration
from apportion.logrecord import LogRecord
from apportion.timeutil import to_us

__all__ = ["TimelineEntry", "Explanation", "explain"]


@dataclass
class TimelineEntry:
    """One step of a job's life.

    Attributes:
        at: event time (ISO).
        offset: ``topic:partition@offset`` of the record.
        kind: the event type (``JobPlaced``...), or ``Preempts`` for a run
            this job preempted.
        attempt: the run's attempt, when the event has one.
        summary: one human line.
        details: the facts (ranks, r values, victims, rule...), JSON-friendly.
        check: for decisions, the re-run verdict: ``{"match", "basis", "diffs"}``.
        refused: why the services' gate refuses the record (a decision or node report no key of its author
            signed: :func:`~apportion.audit.signatures.check_reports`); it is shown for what it claims and
            changes nothing, in the timeline or the re-runs. ``None``: the services folded it.
    """

    at: str
    offset: str
    kind: str
    attempt: int | None
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] | None = None
    refused: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "at": self.at,
            "offset": self.offset,
            "kind": self.kind,
            "attempt": self.attempt,
            "summary": self.summary,
            "details": self.details,
            "check": self.check,
            "refused": self.refused,
        }


@dataclass
class Explanation:
    """A job's timeline and the verdict of every re-run decision.

    Attributes:
        job_id: the job.
        found: False when the log never mentions it.
        timeline: entries in log order.
        protection: what the protection of its current run promises as of the log's end
            (:func:`apportion.forecast.protection_notice`; empty when it is not running).
    """

    job_id: str
    found: bool
    timeline: list[TimelineEntry]
    protection: str = ""

    @property
    def decisions_match(self) -> bool:
        """True when every re-run decision matched (vacuously true without decisions)."""
        return all(e.check["match"] for e in self.timeline if e.check is not None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {
            "job_id": self.job_id,
            "found": self.found,
            "decisions_match": self.decisions_match,
            "timeline": [e.to_dict() for e in self.timeline],
            "protection": self.protection,
        }


_STORY = {
    "JobSubmitted": 0,
    "JobQueued": 1,
    "JobRejected": 1,
    "JobRequeued": 1,
    "Preempts": 2,
    "JobPreempted": 2,
    "StopWorkload": 3,
    "JobPlaced": 4,
    "StartWorkload": 6,
    "JobStarted": 7,
}


def _r(x: float | None) -> str:
    return "-" if x is None else ("inf" if x == float("inf") else f"{x:.4f}")


def _victim_facts(v: events.Victim) -> dict[str, Any]:
    return {
        "job_id": v.job_id,
        "attempt": v.attempt,
        "budget": v.budget,
        "allocated": v.allocated,
        "gpus": v.gpus,
        "rule": v.rule,
        "lca": v.lca,
        "victim_ratio": v.victim_ratio,
        "preemptor_ratio": v.preemptor_ratio,
        "protected_until": v.protected_until.isoformat() if v.protected_until else None,
        "idle_s": v.idle_s,
    }


def _why(v: events.Victim) -> str:
    if v.rule == "unallocated":
        return "rule unallocated (min runtime 0: preemptible at any time)"
    prot = f", protection ended {v.protected_until.isoformat()}" if v.protected_until else ""
    if v.rule == "idle":
        idle = "?" if v.idle_s is None else format_duration(v.idle_s)
        return f"rule idle: its GPUs idle for {idle}, at least its budget's preempt_idle_after{prot}"
    return (
        f"rule expired_behind at LCA {v.lca or '?'}: r(victim branch) {_r(v.victim_ratio)} >= "
        f"r(preemptor branch) {_r(v.preemptor_ratio)} + delta{prot}"
    )


def _array_of(ev: events.Event, job_id: str) -> bool:
    """Whether ``ev`` is the submission of the job array ``job_id`` is an element of (one record, N jobs)."""
    if not isinstance(ev, events.JobSubmitted) or ev.array is None:
        return False
    parts = split_element_id(job_id)
    return parts is not None and parts[0] == ev.job_id and job_id in ev.job_ids


def _entry(rec: LogRecord, job_id: str) -> TimelineEntry | None:
    """The timeline entry of ``rec`` for ``job_id``: its own event, or a preemption it caused; else None."""
    ev = rec.event
    if ev is None:
        return None
    at, where = ev.ts.isoformat(), position(rec)
    if getattr(ev, "job_id", None) != job_id and not _array_of(ev, job_id):
        if isinstance(ev, events.JobPreempted) and ev.by_job_id == job_id:
            return _preempts(ev, at, where)
        return None
    if isinstance(ev, events.JobSubmitted) and ev.job_id != job_id:  # the array's one record, for an element
        entry = _submitted(ev, at, where)
        return replace(entry, summary=f"{entry.summary}, an element of array {ev.job_id} ({ev.array})")
    for kinds, describe in _DESCRIBE:
        if isinstance(ev, kinds):
            return describe(ev, at, where)
    return TimelineEntry(at, where, ev.type, _attempt(ev), ev.type)


def _attempt(ev: events.Event) -> int | None:
    """The run's attempt, when the event has one."""
    return getattr(ev, "attempt", None)


def _preempts(ev: events.JobPreempted, at: str, where: str) -> TimelineEntry:
    why = _why(ev.victim) if ev.victim else ev.reason
    return TimelineEntry(
        at,
        where,
        "Preempts",
        _attempt(ev),
        f"preempted {ev.job_id}#{ev.attempt} ({ev.budget}): {why}",
        {
            "victim": _victim_facts(ev.victim) if ev.victim else None,
            "victim_job": ev.job_id,
            "victim_budget": ev.budget,
        },
    )


def _submitted(ev: events.JobSubmitted, at: str, where: str) -> TimelineEntry:
    s = (
        f"submitted to {ev.budget} by {ev.user}: {ev.replicas} x {ev.gpus_per_replica} GPU, "
        f"min runtime {format_duration(ev.min_runtime_s)} ({'allocated' if ev.allocated else 'unallocated'})"
    )
    return TimelineEntry(
        at,
        where,
        ev.type,
        None,
        s,
        {
            "budget": ev.budget,
            "user": ev.user,
            "gpus_per_replica": ev.gpus_per_replica,
            "replicas": ev.replicas,
            "min_runtime_s": ev.min_runtime_s,
            "duration_s": ev.duration_s,
            "submitted_at": ev.submitted_at.isoformat(),
        },
    )


def _queued(ev: events.JobQueued, at: str, where: str) -> TimelineEntry:
    return TimelineEntry(at, where, ev.type, _attempt(ev), f"queued (attempt {ev.attempt}) in {ev.budget}")


def _rejected(ev: events.JobRejected, at: str, where: str) -> TimelineEntry:
    return TimelineEntry(
        at,
        where,
        ev.type,
        None,
        f"rejected: {ev.reason.value}: {ev.message}",
        {"reason": ev.reason.value, "message": ev.message},
    )


def _placed(ev: events.JobPlaced, at: str, where: str) -> TimelineEntry:
    d = ev.decision
    where_s = ", ".join(f"{p.node_id}{list(p.gpus)}" for p in ev.placements)
    s = (
        f"placed (attempt {ev.attempt}) on {where_s} at rank {d.rank}, budget rank {d.budget_rank}, "
        f"r {_r(d.ratio)}"
        + (f", preempting {', '.join(v.job_id for v in d.victims)}" if d.victims else "")
        + (" using its reservation" if d.reservation else "")
    )
    return TimelineEntry(
        at,
        where,
        ev.type,
        _attempt(ev),
        s,
        {
            "placements": [p.model_dump(mode="json") for p in ev.placements],
            "rank": d.rank,
            "budget_rank": d.budget_rank,
            "ratio": d.ratio,
            "reservation": d.reservation,
            "policy_version": d.policy_version,
            "victims": [_victim_facts(v) for v in d.victims],
            "fencing_token": ev.fencing_token,
            "inputs": d.inputs,
        },
    )


def _preempted(ev: events.JobPreempted, at: str, where: str) -> TimelineEntry:
    if ev.by_job_id:
        why = _why(ev.victim) if ev.victim else ev.reason
        s = f"preempted by {ev.by_job_id} ({ev.by_budget}): {why}; grace {format_duration(ev.grace_s)}"
    else:
        s = f"preempted ({ev.reason}); grace {format_duration(ev.grace_s)}"
    if ev.lost_gpu_s is not None:
        s += f"; work lost {ev.lost_gpu_s / 3600:.2f} GPU-h since its last checkpoint"
    return TimelineEntry(
        at,
        where,
        ev.type,
        _attempt(ev),
        s,
        {
            "by_job_id": ev.by_job_id,
            "by_budget": ev.by_budget,
            "reason": ev.reason,
            "victim": _victim_facts(ev.victim) if ev.victim else None,
            "grace_s": ev.grace_s,
            "lost_gpu_s": ev.lost_gpu_s,
        },
    )


def _requeued(ev: events.JobRequeued, at: str, where: str) -> TimelineEntry:
    refused = ""
    if ev.refused_by is not None:  # D3.refused-starts
        until = ev.refused_at.isoformat() if ev.refused_at is not None else at
        refused = f"; {ev.refused_by} refused attempt {ev.attempt - 1}, charged until {until}"
        if ev.not_before is not None:
            refused += f"; refusal {ev.refusals}: not placed before {ev.not_before.isoformat()}"
    return TimelineEntry(
        at,
        where,
        ev.type,
        _attempt(ev),
        f"requeued as attempt {ev.attempt} ({ev.reason}), keeping submitted_at {ev.submitted_at.isoformat()}" + refused,
    )


def _started(ev: events.JobStarted, at: str, where: str) -> TimelineEntry:
    return TimelineEntry(
        at, where, ev.type, _attempt(ev), f"replica {ev.replica} started on {ev.node_id} GPUs {list(ev.gpus)}"
    )


def _ended(ev: events.JobCompleted | events.JobFailed, at: str, where: str) -> TimelineEntry:
    rep = "" if ev.replica is None else f"replica {ev.replica} "
    extra = ""
    if isinstance(ev, events.JobFailed) and ev.reason:
        meaning = events.FAILURE_REASONS.get(ev.reason)
        extra = f": {ev.reason}" + (f" ({meaning})" if meaning else "")
    done = "completed" if ev.type == "JobCompleted" else "failed"
    return TimelineEntry(at, where, ev.type, _attempt(ev), f"{rep}{done}{extra}")


def _command(ev: events.StartWorkload | events.StopWorkload, at: str, where: str) -> TimelineEntry:
    verb = "start" if ev.type == "StartWorkload" else "stop"
    return TimelineEntry(at, where, ev.type, _attempt(ev), f"command: {verb} on {ev.node_id}")


def _checkpointed(ev: events.JobCheckpointed, at: str, where: str) -> TimelineEntry:
    rep = "" if ev.replica is None else f" by replica {ev.replica}"
    on = f" on {ev.node_id}" if ev.node_id else ""
    return TimelineEntry(
        at,
        where,
        ev.type,
        _attempt(ev),
        f"checkpoint{rep}{on}: {format_duration(ev.progress_s)} of progress saved",
        {"progress_s": ev.progress_s},
    )


def _bounded(e: TimelineEntry, ev: events.JobCheckpointed, bound: float | None) -> TimelineEntry:
    """``e``, a checkpoint's entry, with its progress bounded by the work time the job has had (``bound``,
    :func:`apportion.domain.cluster.progress_bound_s`, rule D3.checkpoints); ``e`` itself when within it."""
    if bound is None or ev.progress_s <= bound:
        return e
    rep = "" if ev.replica is None else f" by replica {ev.replica}"
    on = f" on {ev.node_id}" if ev.node_id else ""
    return replace(
        e,
        summary=f"checkpoint{rep}{on}: {format_duration(bound)} of progress saved (reported {ev.progress_s:.4g} s, "
        "more than the job has run: counted as its run time)",
        details={"progress_s": bound, "reported_progress_s": ev.progress_s},
    )


def _lost(ev: events.JobLost, at: str, where: str) -> TimelineEntry:
    charged = f" (charged until {ev.charged_until.isoformat()})" if ev.charged_until else ""
    lost = "" if ev.lost_gpu_s is None else f"; work lost {ev.lost_gpu_s / 3600:.2f} GPU-h"
    return TimelineEntry(
        at,
        where,
        ev.type,
        _attempt(ev),
        f"lost on {ev.node_id}{charged}{lost}",
        {"node_id": ev.node_id, "lost_gpu_s": ev.lost_gpu_s},
    )


def _refused(ev: events.WorkloadRefused, at: str, where: str) -> TimelineEntry:
    return TimelineEntry(at, where, ev.type, _attempt(ev), f"{ev.node_id} refused the start: {ev.reason}")


def _cancel_requested(ev: events.JobCancelRequested, at: str, where: str) -> TimelineEntry:
    why = f" ({ev.reason})" if ev.reason else ""
    return TimelineEntry(at, where, ev.type, None, f"cancel requested by {ev.user}{why}")


def _cancelled(ev: events.JobCancelled, at: str, where: str) -> TimelineEntry:
    why = f" ({ev.reason})" if ev.reason else ""
    return TimelineEntry(at, where, ev.type, _attempt(ev), f"cancelled{why}")


#: One describer per event type of a job's own timeline, asked in this order; other types get their name.
_DESCRIBE: tuple[tuple[type | tuple[type, ...], Callable[[Any, str, str], TimelineEntry]], ...] = (
    (events.JobSubmitted, _submitted),
    (events.JobQueued, _queued),
    (events.JobRejected, _rejected),
    (events.JobPlaced, _placed),
    (events.JobPreempted, _preempted),
    (events.JobRequeued, _requeued),
    (events.JobStarted, _started),
    ((events.JobCompleted, events.JobFailed), _ended),
    ((events.StartWorkload, events.StopWorkload), _command),
    (events.JobCheckpointed, _checkpointed),
    (events.JobLost, _lost),
    (events.WorkloadRefused, _refused),
    (events.JobCancelRequested, _cancel_requested),
    (events.JobCancelled, _cancelled),
)


def explain(
    records: Sequence[LogRecord],
    job_id: str,
    config: DispatchConfig | None = None,
    *,
    producer: str = "dispatcher",
    check: bool = True,
) -> Explanation:
    """The timeline of ``job_id`` with each of its decisions re-run.

    Args:
        records: the log in log order.
        job_id: the job to explain.
        config: the dispatcher's knobs (must match the service's).
        producer: the dispatcher's ``producer`` name.
        check: re-run the decisions (False: timeline only).
    """
    timeline: list[TimelineEntry] = []
    decision_at: dict[int, list[TimelineEntry]] = {}
    runs = ClusterState()  # the job's own runs: a reported progress is bounded as every fold bounds it
    reports = check_reports(records)
    for i, rec in enumerate(records):
        e = _entry(rec, job_id)
        if e is None:
            continue
        ev = rec.event
        why = reports.ignored.get(i)
        if why is not None:  # shown for what it claims; the services' gate refused it, so it changes nothing
            timeline.append(replace(e, summary=f"refused by the services: {e.summary} ({why})", refused=why))
            continue
        if isinstance(ev, events.JobCheckpointed) and ev.job_id == job_id:
            e = _bounded(e, ev, runs.progress_bound_s(ev.job_id, ev.attempt, to_us(ev.ts)))
        if ev is not None and getattr(ev, "job_id", None) == job_id:
            runs.apply(ev)
        timeline.append(e)
        if isinstance(ev, events.JobPlaced) or (isinstance(ev, events.JobPreempted) and ev.producer == producer):
            decision_at.setdefault(to_us(ev.ts), []).append(e)
    # same-instant records sort by topic in log order; show them in causal order instead
    timeline.sort(key=lambda e: (e.at, _STORY.get(e.kind, 5)))
    if check and decision_at:
        checks: list[DecisionCheck] = rerun_decisions(
            services_input(records, reports), config, producer=producer, only_at=decision_at, until_us=max(decision_at)
        )
        by_t = {c.at_us: c for c in checks}
        for t, entries in decision_at.items():
            c = by_t.get(t)
            for e in entries:
                if c is None:
                    e.check = {"match": False, "basis": None, "diffs": ["no decision of the dispatcher at this time"]}
                    continue
                mine = (
                    [d for d in c.diffs if f" {_subject(e, job_id)}#" in f" {d}"]
                    if e.kind != "Preempts"
                    else [d for d in c.diffs if f" {e.details.get('victim_job')}#" in f" {d}"]
                )
                e.check = {
                    "match": not mine,
                    "basis": c.basis,
                    "diffs": mine,
                    "tick_match": c.match,
                    "tick_offset": c.offset,
                }
    return Explanation(job_id, bool(timeline), timeline)


def _subject(e: TimelineEntry, job_id: str) -> str:
    return job_id
