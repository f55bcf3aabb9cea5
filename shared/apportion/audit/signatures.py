"""The audit's identity checks (D10.proven-user): every signature of a log re-checked from the log alone.

``audit verify`` runs them: the requests the dispatcher accepted (:func:`check_requests`) and the decisions,
commands and node reports the services took (:func:`check_reports`), under the rules the services' gates apply
(:mod:`apportion.identity.gates`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apportion import events
from apportion.bus.intake import IdLedger
from apportion.domain.admission import JOB_REQUESTS, NODE_REQUEST_TYPES, authorize, is_attributed
from apportion.identity.canonical import signer_of
from apportion.identity.gates import ReportGate
from apportion.identity.registry import KeyRegistry
from apportion.logrecord import log_position
from apportion.timeutil import to_us

__all__ = ["ReportCheck", "RequestFinding", "check_reports", "check_requests"]


@dataclass(frozen=True, slots=True)
class RequestFinding:
    """A request the dispatcher acted on that the log does not prove.

    Attributes:
        index: position of its record in the sequence given to :func:`check_requests`.
        job_id: the job it names.
        detail: what is wrong (a signature that does not verify, an unknown key, not the owner).
    """

    index: int
    job_id: str
    detail: str


def check_requests(
    records: Iterable[Any], dead_lettered: Collection[tuple[str, int, int]] = frozenset()
) -> tuple[list[RequestFinding], int]:
    """Re-check, from the log alone, every request the dispatcher accepted (``audit verify``).

    A request is *accepted* when the dispatcher neither dead-lettered its record (``dead_lettered``, rule
    D4.dead-letters: it never folded it) nor holds a ``JobRejected`` refusing it
    (id ``det_id("JobRejected", job_id, request id)``) and, for a cancel, a
    ``JobCancelled`` of its job, for a hold or release the ``JobHeld`` or ``JobReleased`` answering it
    (``request_id``). Each accepted request must carry a valid
    signature (:func:`signer_of` of its stored bytes) by a key registered for
    its user at its event time, and an accepted cancel, hold or release of another user's job
    must be signed by ops (:func:`~apportion.domain.admission.authorize`).
    Refused requests are not findings: refusing a forgery is the stack working.
    Nor is a request the reader edge dead-lettered as ``event_id reused``
    (:class:`apportion.bus.intake.IdLedger`: an earlier record of its
    partition carried its id with another payload): the dispatcher never acted
    on it. Across partitions the order the dispatcher read them in is not in
    the log: there the dispatcher's dead letter says which copy it refused (a researcher's copy of another
    user's signed request under another job id, published on another partition, is refused, not a finding);
    a reuse there without one is still checked.

    A key revoked earlier in the log (the revocation's record timestamp
    before the request's: :class:`KeyRegistry`) proves nothing, whatever the
    request's ``ts`` says (a backdated request).

    Logs of a stack without identity (no ``UserKeyRegistered`` at all, e.g. a
    simulator log) are not checked: ``(findings=[], checked=0)``.

    Args:
        records: log records (``event``, ``raw``, ``topic``, ``partition``, ``offset``) in log order.
        dead_lettered: ``(topic, partition, offset)`` of the records the dispatcher dead-lettered, each
            letter holding the record's bytes (:func:`apportion.audit.verify.refused_records`).

    Returns:
        ``(findings, checked)``: what is wrong, and how many signed requests were re-checked.
    """
    recs = list(records)
    reg = KeyRegistry()
    refused: set[Any] = set()
    cancelled: set[str] = set()
    answered: set[Any] = set()  # requests a JobHeld or JobReleased carried out
    owner: dict[str, str] = {}
    for r in recs:
        ev = r.event
        if ev is None:
            continue
        reg.apply(ev, log_position(r))
        if isinstance(ev, events.JobRejected):
            refused.add(ev.event_id)
        elif isinstance(ev, events.JobCancelled):
            cancelled.add(ev.job_id)  # a job array's cancel ends with the JobCancelled of the array id
        elif isinstance(ev, (events.JobHeld, events.JobReleased)) and ev.request_id is not None:
            answered.add(ev.request_id)
    if not len(reg):
        return [], 0
    reused: set[int] = set()
    ledgers: dict[tuple[str, int], IdLedger] = {}
    for i in sorted(range(len(recs)), key=lambda i: (recs[i].topic, recs[i].partition, recs[i].offset)):
        ev = recs[i].event
        if isinstance(ev, JOB_REQUESTS):
            try:
                ledgers.setdefault((recs[i].topic, recs[i].partition), IdLedger()).check(ev)
            except events.DecodeError:
                reused.add(i)
    findings: list[RequestFinding] = []
    checked = 0
    for i, r in enumerate(recs):
        ev = r.event
        if not isinstance(ev, JOB_REQUESTS) or i in reused or (r.topic, r.partition, r.offset) in dead_lettered:
            continue
        if events.det_id("JobRejected", ev.job_id, ev.event_id) in refused:
            continue
        if isinstance(ev, events.JobSubmitted):
            for job_id in {ev.job_id, *ev.job_ids}:  # one signed record covers every element of an array
                owner.setdefault(job_id, ev.user)
        elif isinstance(ev, events.JobCancelRequested) and ev.job_id not in cancelled:
            continue  # a cancel that changed nothing proves nothing
        elif not isinstance(ev, (events.JobSubmitted, events.JobCancelRequested)) and ev.event_id not in answered:
            continue  # nor does a hold or release
        checked += 1
        key = signer_of(r.raw)
        if key is None:
            why = "unsigned" if ev.signature is None else "its signature does not verify (altered or forged bytes)"
            findings.append(RequestFinding(i, ev.job_id, f"{ev.type} of user {ev.user!r} accepted, but {why}"))
            continue
        rejection = authorize(ev, reg.principal(key, to_us(ev.ts), log_position(r)), owner.get(ev.job_id))
        if rejection is not None:
            findings.append(
                RequestFinding(i, ev.job_id, f"{ev.type} accepted, but {rejection.reason.value}: {rejection.message}")
            )
    return findings, checked


@dataclass(frozen=True, slots=True)
class ReportCheck:
    """``audit verify``'s look at the node reports of a log (:func:`check_reports`).

    Attributes:
        ignored: index -> the gate's reason (``unauthenticated...: ...``) of each event the services must
            have ignored; the audit's rebuilds leave them out, as the services did.
        findings: ignored events that no service dead-lettered (one did not ignore them).
        checked: decisions, commands and node reports whose signature was checked.
    """

    ignored: Mapping[int, str]
    findings: list[RequestFinding]
    checked: int


def check_reports(records: Sequence[Any]) -> ReportCheck:
    """Re-check, from the log alone, the signature of every decision, command and node report (``audit verify``).

    The rule is the services' (:class:`ReportGate`,
    :func:`~apportion.domain.admission.authorize_report`) with the log's
    positions for revocations (:class:`KeyRegistry`), checked in each
    partition's offset order (as the services read it: a run's placement
    precedes its reports). An event that fails it must have been ignored by
    the dispatcher and the accounting, which dead-letter it (id
    ``det_id("DeadLetter", topic, partition, offset)``); one without such a
    dead letter is a finding. An ops request on a node that fails it
    (:func:`~apportion.domain.admission.authorize_node_request`) must have
    the dispatcher's ``NodeRequestRefused`` instead (the accounting's dead
    letter does not say the dispatcher did not fold it); one without is a
    finding: the dispatcher accepted it. Logs without any ``UserKeyRegistered`` (a
    simulator's) are not checked.

    Args:
        records: log records (``event``, ``raw``, ``topic``, ``partition``, ``offset``, ``timestamp_ms``).
    """
    gate = ReportGate()
    letters: set[Any] = set()
    verdicts: set[Any] = set()  # ids of the ops requests on nodes the dispatcher refused
    for r in records:
        ev = r.event
        if ev is None:
            continue
        gate.observe(ev, log_position(r))
        if isinstance(ev, events.DeadLetter):
            letters.add(ev.event_id)
        elif isinstance(ev, events.NodeRequestRefused):
            verdicts.add(ev.refused_event_id)
    if not len(gate.keys):
        return ReportCheck({}, [], 0)
    ignored: dict[int, str] = {}
    findings: list[RequestFinding] = []
    checked = 0
    for i in sorted(range(len(records)), key=lambda i: (records[i].topic, records[i].partition, records[i].offset)):
        r = records[i]
        ev = r.event
        if ev is None or not is_attributed(ev):
            continue
        checked += 1
        why = gate.report_refusal(r.raw, ev, log_position(r))
        if why is None:
            continue
        ignored[i] = why
        if isinstance(ev, NODE_REQUEST_TYPES):
            if ev.event_id not in verdicts:
                findings.append(RequestFinding(i, ev.node_id, f"{why}, and the dispatcher did not refuse it"))
        elif events.dead_letter_id(r.topic, r.partition, r.offset) not in letters:
            subject = getattr(ev, "job_id", None) or getattr(ev, "node_id", None) or ev.type
            findings.append(RequestFinding(i, str(subject), f"{why}, and no service dead-lettered it"))
    return ReportCheck(ignored, findings, checked)
