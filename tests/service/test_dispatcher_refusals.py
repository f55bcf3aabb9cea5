"""The dispatcher service cordons a node that refuses starts in a row, and every reader takes that cordon
(rule D3.refused-starts; rule D10.authentication: the dispatcher's key may sign a cordon, nothing else may but ops').

The real ``DispatcherService`` on an in-memory log, signing what it publishes with the dispatcher's key, as
``services/dispatcher/app.py`` makes it do; node n1 (8 GPUs) refuses every start.
"""

from __future__ import annotations

from datetime import timedelta

from apportion import events
from apportion.clock import ManualClock
from apportion.identity.gates import ReportGate
from apportion.settings import topic_name
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import DispatcherService
from tests.kit.dispatcher import INPUTS, T0, ListLog, drive
from tests.kit.dispatcher_identity import CAROL, setup, sub
from tests.kit.signing import dispatcher_identity, dispatcher_signer, registered


class SignedLog(ListLog):
    """A log whose dispatcher signs what it publishes (its values are not the plain encoding)."""

    def publish(self, sent: list[tuple[events.Event, bytes]]) -> None:
        for e, value in sent:
            topic = topic_name(events.TOPIC_OF[e.type])
            self.published.append((topic, value))
            self.append(topic, value, events.key_of(e).encode())


def leader(log: SignedLog) -> DispatcherService:
    settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
    svc = DispatcherService(settings, ManualClock(T0), log.publish, consumed=INPUTS, signer=dispatcher_signer())
    svc.token = 7
    return svc


def refusal(job_id: str, minute: int) -> events.WorkloadRefused:
    return events.WorkloadRefused(
        event_id=events.det_id("refused", job_id),
        node_id="n1",
        job_id=job_id,
        attempt=1,
        reason="gpus_busy: GPUs [0, 1] are held by another process",
        ts=T0 + timedelta(minutes=minute),
        producer="node-agent",
    )


def test_three_refused_starts_cordon_the_node_and_a_new_leader_folds_the_cordon() -> None:
    log = SignedLog()
    svc = leader(log)
    log.put(*setup(), registered(dispatcher_identity(), T0))
    drive(svc, log)
    for i, job in enumerate(("j1", "j2", "j3"), start=1):
        log.put(CAROL.sign(sub(job, minutes=i)))
        drive(svc, log)
        assert svc.state.jobs[job].status == "running"  # placed by the tick of its poll
        log.put(refusal(job, i))
        drive(svc, log)
    published = [(topic, events.decode(v), v) for topic, v in log.published]
    cordons = [(e, v) for _, e, v in published if isinstance(e, events.NodeCordoned)]
    assert len(cordons) == 1
    cordon, value = cordons[0]
    assert (cordon.node_id, cordon.by) == ("n1", "dispatcher")
    assert cordon.reason.startswith("refused 3 starts in a row, the last j3#1: gpus_busy")
    assert svc.state.cluster.nodes["n1"].state == "cordoned"
    assert [e.job_id for _, e, _ in published if isinstance(e, events.JobRequeued)] == ["j1", "j2", "j3"]
    # the accounting's and the audit's reader edge take it: signed by the dispatcher, whose key may cordon
    gate = ReportGate()
    for rec in log.records:
        if rec.value is not None:
            gate.observe(events.decode(rec.value))
    assert gate.report_refusal(value, cordon) is None
    # a new leader's rebuild folds it, and answers it with no NodeRequestRefused
    again = leader(log)
    log.read_upto = 0
    decided = again.bootstrap(log.read())
    assert not [e for e in decided if isinstance(e, events.NodeRequestRefused)]
    assert again.state.cluster.nodes["n1"].state == "cordoned"
