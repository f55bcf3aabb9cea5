"""A job array through the dispatcher service: one signed record, N jobs; its cancel, its owner, its audit.

One node of 8 GPUs; every element asks for 2 GPUs (``sub`` of the identity tests), so four fit at once.
"""

from __future__ import annotations

from apportion import events
from apportion.audit.signatures import check_requests
from apportion.audit.verify import verify
from apportion.bus.reader import log_order
from services.dispatcher.service import DispatcherService
from tests.kit.dispatcher import INPUTS, ListLog, drive, service
from tests.kit.dispatcher_identity import CAROL, EVE, cancel, setup, sub
from tests.kit.fakes import log_record


def array(job_id: str, spec: str, user: str = "carol") -> events.JobSubmitted:
    return sub(job_id, user).model_copy(update={"array": spec, "event_id": events.det_id("array", job_id, spec)})


def driven(*rounds: list[events.Event]) -> tuple[ListLog, DispatcherService]:
    """A dispatcher fed the setup, then each round, its clock 5 s on before each (the audit, without the heartbeat setting, loses a silent node at 30 s)."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())
    drive(svc, log)
    for r in rounds:
        svc.clock.advance(5)  # type: ignore[attr-defined]
        log.put(*r)
        drive(svc, log)
    return log, svc


def published(log: ListLog) -> list[events.Event]:
    return [events.decode(v) for _, v in log.published]


def test_one_signed_array_places_at_most_its_throttle_and_the_audit_passes() -> None:
    log, svc = driven([CAROL.sign(array("sw", "0-5%3"))])
    out = published(log)
    assert [(e.type, getattr(e, "job_id", "")) for e in out if isinstance(e, events.JobPlaced)] == [
        ("JobPlaced", "sw_0"),
        ("JobPlaced", "sw_1"),
        ("JobPlaced", "sw_2"),
    ]  # 4 would fit on the node: the throttle keeps it to 3
    assert sum(isinstance(e, events.JobQueued) for e in out) == 6
    findings, checked = check_requests([log_record(r) for r in log.records])
    assert (findings, checked) == ([], 1)  # one signed request covers the six jobs
    assert verify(sorted((log_record(r) for r in log.records), key=log_order)).mismatches == []


def test_only_the_owner_cancels_the_array_and_every_active_element_goes() -> None:
    log, svc = driven([CAROL.sign(array("sw", "0-5%3"))], [EVE.sign(cancel("sw", "eve"))])
    refused = [e for e in published(log) if isinstance(e, events.JobRejected)]
    assert [(e.job_id, e.reason.value, e.request) for e in refused] == [("sw", "not_owner", "JobCancelRequested")]
    n = len(log.published)
    svc.clock.advance(5)  # type: ignore[attr-defined]
    log.put(CAROL.sign(cancel("sw", "carol", minutes=3)))
    drive(svc, log)
    after = [events.decode(v) for _, v in log.published[n:]]
    assert [(e.type, e.job_id) for e in after if isinstance(e, (events.JobCancelled, events.StopWorkload))] == [
        ("StopWorkload", "sw_0"),
        ("JobCancelled", "sw_0"),
        ("StopWorkload", "sw_1"),
        ("JobCancelled", "sw_1"),
        ("StopWorkload", "sw_2"),
        ("JobCancelled", "sw_2"),
        ("JobCancelled", "sw_3"),
        ("JobCancelled", "sw_4"),
        ("JobCancelled", "sw_5"),
        ("JobCancelled", "sw"),
    ]
    assert svc.state.jobs == {} and svc.state.arrays == {}
    findings, checked = check_requests([log_record(r) for r in log.records])
    assert (findings, checked) == ([], 2)
    assert verify(sorted((log_record(r) for r in log.records), key=log_order)).mismatches == []


def test_a_new_leader_does_not_decide_an_answered_array_again() -> None:
    log, _ = driven([CAROL.sign(array("sw", "0-5%3"))])
    nxt = service(ListLog(), echoes=True)
    decided = nxt.bootstrap([r for r in log.records if r.topic in INPUTS])
    assert [e for e in decided if isinstance(e, (events.JobQueued, events.JobRejected))] == []
    assert sorted(nxt.state.arrays["sw"].members.values()) == [0, 1, 2, 3, 4, 5]
