"""`apportion cancel|hold|release ARRAY` says how many elements the dispatcher applied the request to,
``(array: N elements)``, read from the end of the reason of its answer of the array id
(:func:`apportion.cli.jobs.array_elements`); the answers here are the real dispatcher's, so a change of its wording
fails this test rather than the CLI's line."""

from __future__ import annotations

import pytest

from apportion import events as ev
from apportion.cli.jobs import array_elements
from apportion.domain.dispatch import Tick
from apportion.timeutil import from_us
from tests.kit.builders import T0, m, submitted
from tests.unit.test_job_arrays import feed, queued_array

Request = type[ev.JobHoldRequested] | type[ev.JobReleaseRequested] | type[ev.JobCancelRequested]


def request(cls: Request, job_id: str, reason: str, at: int) -> ev.JobRequest:
    return cls(
        event_id=ev.det_id(cls.__name__, job_id, reason, at), job_id=job_id, user="bob", reason=reason, ts=from_us(at)
    )


@pytest.mark.parametrize(
    "reason",
    ["", "waiting for data", "x (array: 9 elements)"],
    ids=["no reason", "a reason", "a reason that looks like a count"],
)
def test_the_count_of_an_arrays_hold_release_and_cancel_and_none_for_a_job(reason: str) -> None:
    """Four elements, %2: s_0 and s_1 run, s_2 and s_3 wait. A hold of ``s`` holds 2, its release releases 2, a
    cancel cancels all 4 still active; a plain job's answers carry no count, whatever its reason says."""
    state, log, _ = queued_array("0-3%2")
    feed(state, log, Tick(T0), T0)
    feed(state, log, submitted("j", budget="lab/b", user="bob", gpus=8, at=T0), T0)  # pending: no room
    answers = {}
    for verb, cls, at in (
        ("hold", ev.JobHoldRequested, m(1)),
        ("release", ev.JobReleaseRequested, m(2)),
        ("cancel", ev.JobCancelRequested, m(3)),
    ):
        for job_id in ("s", "j"):
            out = feed(state, log, request(cls, job_id, reason, at), at)
            [answer] = [e for e in out if getattr(e, "job_id", None) == job_id]
            answers[verb, job_id] = array_elements(reason, answer)
    assert answers == {
        ("hold", "s"): 2,
        ("hold", "j"): None,
        ("release", "s"): 2,
        ("release", "j"): None,
        ("cancel", "s"): 4,
        ("cancel", "j"): None,
    }


def test_one_element_and_no_answer() -> None:
    held = ev.JobHeld(job_id="s", by="bob", reason="no reason given (array: 1 element)", ts=from_us(T0))
    assert array_elements("", held) == 1
    assert array_elements("", None) is None
    refused = "array 's' has no pending element to hold"
    rejected = ev.JobRejected(
        job_id="s", user="bob", budget="lab/b", reason=ev.RejectReason.INVALID, message=refused, ts=from_us(T0)
    )
    assert array_elements("", rejected) is None  # a refusal's reason is its code: no count
