"""``audit verify``'s signature check and the reader edge's id rule (found by the chaos campaign).

A copy of an accepted submission under its id with another payload (``event_id reused``) is dead-lettered by
the dispatcher, never acted on: it is no finding when it follows the original on its partition. Across
partitions the log does not say which copy the dispatcher read first, so both are checked.
"""

from __future__ import annotations

from dataclasses import replace

from apportion import events
from apportion.audit.verify import records_from_events, verify
from apportion.events import JobSubmitted
from tests.kit.signed_requests import ALICE, T0, queued, submission
from tests.kit.signing import registered


def forged_copy(s: JobSubmitted) -> JobSubmitted:
    """``s``'s id on another payload (8 GPUs, in mallory's name), unsigned: what the campaign's reused ids are."""
    return s.model_copy(update={"gpus_per_replica": 8, "user": "mallory", "signer_key": None, "signature": None})


def test_a_reused_id_after_the_accepted_request_on_its_partition_is_not_a_finding() -> None:
    s = ALICE.sign(submission())
    recs = records_from_events([registered(ALICE, T0), s, queued(s), forged_copy(s)])
    rep = verify(recs)
    assert rep.ok, rep.mismatches
    assert rep.signed_requests == 1


def test_the_forged_copy_first_on_the_partition_is_what_was_accepted_and_is_flagged() -> None:
    s = ALICE.sign(submission())
    recs = records_from_events([registered(ALICE, T0), forged_copy(s), s, queued(s)])
    rep = verify(recs)
    assert [(m.check, m.subject) for m in rep.mismatches] == [("signature", "j1")]
    assert "of user 'mallory' accepted, but unsigned" in rep.mismatches[0].detail


def test_a_reused_id_on_another_partition_is_still_checked() -> None:
    s = ALICE.sign(submission())
    recs = records_from_events([registered(ALICE, T0), s, queued(s), forged_copy(s)])
    i = next(k for k, r in enumerate(recs) if isinstance(r.event, JobSubmitted) and r.event.user == "mallory")
    recs[i] = replace(recs[i], partition=1, offset=0)
    rep = verify(recs)
    assert [(m.check, m.subject) for m in rep.mismatches] == [("signature", "j1")]
    assert events.det_id("sub", "j1", "alice") == s.event_id
