"""A researcher's replay of another user's signed submission, its job id changed (found by the hostile job's
tour of a local stack): the copy lands on another partition, the dispatcher dead-letters it (``event_id
reused``) and never queues it, yet ``audit verify`` calls it an accepted request whose signature does not
verify, and exits 1. Any principal that may write ``apportion.submissions`` can so make every later ``audit
verify`` of the log fail, with bytes copied from the log every researcher reads (rule D10.proven-user)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from apportion.audit.verify import records_from_events, verify
from apportion.bus.intake import dead_letter
from apportion.events import JobSubmitted
from tests.kit.signed_requests import ALICE, T0, queued, submission
from tests.kit.signing import registered


def replayed(producer: str) -> list:
    """Alice's submission, queued, and its copy under job id ``j2`` on partition 1, dead-lettered by ``producer``."""
    s = ALICE.sign(submission())
    copy = s.model_copy(update={"job_id": "j2"})  # alice's signature kept over bytes it no longer covers
    recs = records_from_events([registered(ALICE, T0), s, queued(s), copy])
    i = next(k for k, r in enumerate(recs) if isinstance(r.event, JobSubmitted) and r.event.job_id == "j2")
    recs[i] = replace(recs[i], partition=1, offset=0)  # keyed by its own job id: another partition
    letter = dead_letter(
        topic=recs[i].topic,
        partition=1,
        offset=0,
        key="j2",
        value=recs[i].raw,
        reason=f"event_id reused: {s.event_id} was read before with a different payload",
        ts=T0 + timedelta(seconds=5),
        producer=producer,
    )
    return sorted([*recs, *records_from_events([letter])], key=lambda r: (r.timestamp_ms, r.topic))


def test_a_copy_under_another_job_id_the_dispatcher_dead_lettered_is_a_refused_record_not_a_mismatch() -> None:
    rep = verify(replayed("dispatcher"))
    assert [(f.reason, f.kind) for f in rep.refused] == [("event_id reused", "forgery")]
    assert rep.ok, rep.mismatches
    assert rep.signed_requests == 1  # alice's own submission; the copy was never acted on


def test_the_copy_dead_lettered_only_by_another_service_is_still_checked() -> None:
    """Only the dispatcher's refusal says it did not act on a request: another reader's dead letter does not."""
    rep = verify(replayed("accounting"))
    assert [(m.check, m.subject) for m in rep.mismatches] == [("signature", "j2")]
    assert "accepted, but its signature does not verify" in rep.mismatches[0].detail
