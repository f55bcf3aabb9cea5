"""A researcher's replay of another user's signed submission, its job id changed (found by the hostile job's
tour of a local stack): the copy lands on another partition, the dispatcher dead-letters it (``event_id
reused``) and never queues it, yet ``audit verify`` calls it an accepted request whose signature does not
verify, and exits 1. Any principal that may write ``apportion.submissions`` can so make every later ``audit
verify`` of the log fail, with bytes copied from the log every researcher reads (rule D10.proven-user)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from apportion.audit.verify import records_from_events, verify
from apportion.bus.intake import dead_letter
from apportion.events import JobSubmitted
from tests.kit.signed_requests import ALICE, T0, queued, submission
from tests.kit.signing import registered


@pytest.mark.xfail(
    strict=True,
    reason="audit.signatures.check_requests counts a copy on another partition as accepted even though the "
    "dispatcher dead-lettered it and no JobQueued names its job",
)
def test_a_copy_under_another_job_id_the_dispatcher_dead_lettered_is_a_refused_record_not_a_mismatch() -> None:
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
        producer="dispatcher",
    )
    recs = sorted([*recs, *records_from_events([letter])], key=lambda r: (r.timestamp_ms, r.topic))
    rep = verify(recs)
    assert [(f.reason, f.kind) for f in rep.refused] == [("event_id reused", "forgery")]
    assert rep.ok, rep.mismatches
