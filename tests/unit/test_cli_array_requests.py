"""`apportion cancel|hold|release ARRAY` says how many elements the dispatcher applied the request to,
``(array: N elements)``, from the ``array_elements`` field of its answer of the array id
(:func:`apportion.events.array_elements_of`, also the ``--json`` object's ``array_elements``); the answers here are
the real dispatcher's. A record written before the field still reads: its count is the end of its reason."""

from __future__ import annotations

import pytest

from apportion import client
from apportion import events as ev
from apportion.cli.jobs import array_phrase
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
    cancel cancels all 4 still active; a plain job's answers carry no count, whatever its reason says. The
    answer's reason is the request's alone (``no reason given``, ``cancelled`` without one): no count in it."""
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
            answers[verb, job_id] = ev.array_elements_of(answer, reason)
            assert ev.to_dict(answer)["reason"] == (reason or ("cancelled" if verb == "cancel" else "no reason given"))
    assert answers == {
        ("hold", "s"): 2,
        ("hold", "j"): None,
        ("release", "s"): 2,
        ("release", "j"): None,
        ("cancel", "s"): 4,
        ("cancel", "j"): None,
    }


def test_a_three_element_array_held_and_one_element_released() -> None:
    """``held s (array: 3 elements)`` and ``--json`` ``array_elements`` 3 (read back from the encoded record, as the
    CLI and the client read it off Kafka); one element left to release (counted by
    :func:`apportion.client.array_elements`): ``(array: 1 element)``, singular."""
    state, log, _ = queued_array("0-2", hold=False)
    feed(state, log, submitted("big", budget="lab/b", user="bob", gpus=8, at=T0), T0)  # takes the node first
    feed(state, log, Tick(T0), T0)
    held = feed(state, log, request(ev.JobHoldRequested, "s", "", m(1)), m(1))
    answer = ev.decode(ev.encode(held[-1]))
    assert isinstance(answer, ev.JobHeld) and (answer.job_id, ev.array_elements_of(answer, "")) == ("s", 3)
    assert ev.to_dict(answer)["array_elements"] == 3
    assert f"held s{array_phrase(3)}" == "held s (array: 3 elements)"
    feed(state, log, request(ev.JobReleaseRequested, "s_0", "", m(2)), m(2))
    feed(state, log, request(ev.JobReleaseRequested, "s_1", "", m(2)), m(2))
    released = feed(state, log, request(ev.JobReleaseRequested, "s", "", m(3)), m(3))
    assert [e.job_id for e in released] == ["s_2", "s"]  # type: ignore[attr-defined]
    n = client.array_elements(released[-1], request(ev.JobReleaseRequested, "s", "", m(3)))
    assert (n, f"released s{array_phrase(n)}") == (1, "released s (array: 1 element)")
    assert array_phrase(None) == ""


@pytest.mark.parametrize(
    ("reason", "asked", "count"),
    [
        ("no reason given (array: 1 element)", "", 1),
        ("no reason given (array: 12 elements)", "", 12),
        ("data late (array: 2 elements)", "data late", 2),
        ("cancelled (array of 6 active elements)", "", 6),
        ("x (array: 9 elements)", "x (array: 9 elements)", None),  # a job's answer whose reason looks like one
        ("no reason given", "", None),
    ],
)
def test_a_record_written_before_the_field_reads_its_count_from_its_reason(
    reason: str, asked: str, count: int | None
) -> None:
    """An answer of a dispatcher from before ``array_elements`` (the golden v1 JobHeld has none): decoded with the
    field ``None``, its count the end of its reason after the request's own."""
    raw = ev.encode(ev.JobHeld(job_id="s", by="bob", reason=reason, ts=from_us(T0)))
    old = raw.replace(b',"array_elements":null', b"")
    assert b"array_elements" not in old
    answer = ev.decode(old)
    assert isinstance(answer, ev.JobHeld) and answer.array_elements is None
    assert ev.array_elements_of(answer, asked) == count


def test_no_answer_and_a_refusal_carry_no_count() -> None:
    assert ev.array_elements_of(None, "") is None
    refused = "array 's' has no pending element to hold"
    rejected = ev.JobRejected(
        job_id="s", user="bob", budget="lab/b", reason=ev.RejectReason.INVALID, message=refused, ts=from_us(T0)
    )
    assert ev.array_elements_of(rejected, "") is None  # a refusal's reason is its code: no count
