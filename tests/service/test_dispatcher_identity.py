"""The dispatcher's intake check of requests (rule D10.proven-user), on an in-memory log.

Each threat of docs/security.md that the signature stops, fed to the real
:class:`~services.dispatcher.service.DispatcherService`: the forbidden request is
answered by ``JobRejected`` (``unauthenticated`` / ``not_owner``) and the
dispatcher's jobs are unchanged; the allowed ones work.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import timedelta

import pytest

from apportion import events
from apportion.events import NodeRegistered, UserKeyRevoked
from apportion.settings import topic_name
from apportion.topics import JOBS, NODES
from services.dispatcher.service import DispatcherService
from tests.kit.dispatcher import INPUTS, T0, ListLog, drive, service
from tests.kit.dispatcher_identity import CAROL, EVE, OPS, cancel, setup, sub
from tests.kit.fakes import log_record
from tests.kit.signing import identity, node_identity, registered


def run(*rounds: Sequence[events.Event | tuple[str, bytes]]) -> tuple[DispatcherService, list[events.Event]]:
    """A dispatcher fed the setup, then each round (events, or raw ``(topic, bytes)`` records)."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())
    drive(svc, log)
    for r in rounds:
        for item in r:
            if isinstance(item, tuple):
                obj = json.loads(item[1])
                log.append(item[0], item[1], str(obj.get("job_id") or obj["node_id"]).encode())
            else:
                log.put(item)
        drive(svc, log)
    return svc, [events.decode(v) for _, v in log.published]


def rejections(out: list[events.Event]) -> list[tuple[str, str, str]]:
    return [(e.job_id, e.reason.value, e.request) for e in out if isinstance(e, events.JobRejected)]


def test_a_signed_submission_is_queued_and_placed() -> None:
    svc, out = run([CAROL.sign(sub("j1"))])
    assert [e.type for e in out] == ["JobQueued", "JobPlaced", "StartWorkload"]
    assert svc.state.jobs["j1"].spec.user == "carol"


def test_an_unsigned_submission_is_unauthenticated() -> None:
    svc, out = run([sub("j1")])
    assert rejections(out) == [("j1", "unauthenticated", "JobSubmitted")]
    assert "j1" not in svc.state.jobs


def test_eve_cannot_submit_in_carols_name_with_her_own_key() -> None:
    """Charging another budget by claiming a member's name: signed, but by the wrong user's key."""
    svc, out = run([EVE.sign(sub("j1", user="carol"))])
    assert rejections(out) == [("j1", "unauthenticated", "JobSubmitted")]
    assert svc.state.jobs == {}


def test_a_key_nobody_registered_is_unauthenticated() -> None:
    svc, out = run([identity("mallory").sign(sub("j1", user="mallory"))])
    assert rejections(out) == [("j1", "unauthenticated", "JobSubmitted")]


def test_a_revoked_key_signs_nothing_after_the_revocation() -> None:
    revoke = UserKeyRevoked(user="carol", public_key=CAROL.public_key, ts=T0 + timedelta(minutes=1), producer="ops")
    svc, out = run([revoke], [CAROL.sign(sub("j1", minutes=2))])
    assert rejections(out) == [("j1", "unauthenticated", "JobSubmitted")]


def test_a_request_is_judged_by_the_keys_as_of_its_record_as_the_audit_judges_it() -> None:
    """In one poll: carol's j1 appended before her key's revocation (ts before it), the revocation, then j2 she
    signed after it, backdated before it. The edge folds the poll's key events first, yet j1 stands: its record
    precedes the revocation (the broker's time, ``logrecord.log_position``), as ``audit verify`` counts it."""
    from apportion.audit.verify import verify
    from apportion.logrecord import log_order

    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())
    drive(svc, log)
    revoke = UserKeyRevoked(user="carol", public_key=CAROL.public_key, ts=T0 + timedelta(minutes=5), producer="ops")
    log.put(CAROL.sign(sub("j1", minutes=2)), revoke, CAROL.sign(sub("j2", minutes=3)))
    drive(svc, log)
    out = [events.decode(v) for _, v in log.published]
    assert rejections(out) == [("j2", "unauthenticated", "JobSubmitted")]
    assert set(svc.state.jobs) == {"j1"}
    recs = [log_record(r) for r in log.records]
    assert [m for m in verify(sorted(recs, key=log_order)).mismatches if m.check == "signature"] == []


def test_replays_same_event_id_is_a_duplicate_and_a_copied_signature_on_a_new_id_is_refused() -> None:
    signed = CAROL.sign(sub("j1"))
    raw = events.encode(signed)
    copied = json.loads(raw)
    copied["event_id"] = str(uuid.uuid4())
    copied["job_id"] = "j2"
    svc, out = run(
        [signed],
        [signed],  # the same record again: de-duplicated by event id, no second decision
        [(events.topic_of(signed, ""), json.dumps(copied).encode())],
    )
    assert [e.type for e in out].count("JobQueued") == 1
    assert rejections(out) == [("j2", "unauthenticated", "JobSubmitted")]
    assert set(svc.state.jobs) == {"j1"}


def test_eve_cannot_cancel_carols_job_and_the_job_goes_on() -> None:
    svc, out = run([CAROL.sign(sub("j1"))], [EVE.sign(cancel("j1", "eve"))])
    assert rejections(out) == [("j1", "not_owner", "JobCancelRequested")]
    assert not any(isinstance(e, events.JobCancelled) for e in out)
    assert svc.state.jobs["j1"].status == "running" and "j1" not in svc.state.finished


def test_a_cancel_claiming_carols_name_with_eves_key_is_unauthenticated() -> None:
    svc, out = run([CAROL.sign(sub("j1"))], [EVE.sign(cancel("j1", "carol"))])
    assert rejections(out) == [("j1", "unauthenticated", "JobCancelRequested")]
    assert svc.state.jobs["j1"].status == "running"


def test_the_owner_and_ops_may_cancel() -> None:
    _, own = run([CAROL.sign(sub("j1"))], [CAROL.sign(cancel("j1", "carol"))])
    _, ops = run([CAROL.sign(sub("j1"))], [OPS.sign(cancel("j1", "root"))])
    for out in (own, ops):
        assert rejections(out) == []
        assert [e.type for e in out if e.type == "JobCancelled"] == ["JobCancelled"]


def test_a_new_leader_refuses_an_undecided_forgery_too() -> None:
    """Recovery (bootstrap) decides what the old leader left undecided with the same check."""
    log = ListLog()
    log.put(*setup(), EVE.sign(sub("j1", user="carol")), CAROL.sign(sub("j2")))
    svc = service(log, echoes=True)
    decided = svc.bootstrap(log.read())
    assert rejections(decided) == [("j1", "unauthenticated", "JobSubmitted")]
    assert set(svc.state.jobs) == {"j2"}


def _led_then_requests(*requests: events.Event) -> tuple[ListLog, list[events.Event]]:
    """A leader places carol's j1 and dies; ``requests`` are appended while no leader runs; the next one rebuilds.

    Returns the log and the new leader's recovery decisions.
    """
    log = ListLog()
    first = service(log, echoes=True)
    log.put(*setup(), CAROL.sign(sub("j1")))
    drive(first, log)
    log.put(*requests)
    nxt = service(log, echoes=True, token=8)
    return log, nxt.bootstrap([r for r in log.records if r.topic in INPUTS])


def test_a_cancel_sent_while_no_leader_ran_is_carried_out_by_the_next_leader() -> None:
    """Found by a new user: the cancel was in the log, the job ran on (the rebuild folded it, decided nothing)."""
    _, decided = _led_then_requests(CAROL.sign(cancel("j1", "carol")))
    assert [(e.type, e.job_id) for e in decided if isinstance(e, (events.StopWorkload, events.JobCancelled))] == [
        ("StopWorkload", "j1"),
        ("JobCancelled", "j1"),
    ]


def test_a_cancel_no_leader_answered_is_still_checked_for_its_owner() -> None:
    _, decided = _led_then_requests(EVE.sign(cancel("j1", "eve")))
    assert rejections(decided) == [("j1", "not_owner", "JobCancelRequested")]
    assert not any(isinstance(e, events.JobCancelled | events.StopWorkload) for e in decided)


def test_a_cancel_a_leader_answered_is_not_decided_again() -> None:
    """Carried out (the job ended) or refused (its JobRejected names it): a rebuild decides neither again."""
    log = ListLog()
    first = service(log, echoes=True)
    log.put(*setup(), CAROL.sign(sub("j1")), CAROL.sign(sub("j2", minutes=2)))
    drive(first, log)
    log.put(CAROL.sign(cancel("j1", "carol", minutes=3)), EVE.sign(cancel("j2", "eve", minutes=3)))
    drive(first, log)
    assert rejections([events.decode(v) for _, v in log.published]) == [("j2", "not_owner", "JobCancelRequested")]
    nxt = service(log, echoes=True, token=8)
    decided = nxt.bootstrap([r for r in log.records if r.topic in INPUTS])
    assert [e for e in decided if isinstance(e, events.JobCancelled | events.JobRejected | events.StopWorkload)] == []
    assert set(nxt.state.jobs) == {"j2"}


# --------------------------------------------------------------------------- node reports (a node reports for itself)


def test_a_node_report_signed_by_another_nodes_key_is_dead_lettered_and_changes_nothing() -> None:
    """Forged node reports: a fake node registered with n1's key, and a completion of carol's job on n1 by it."""
    from apportion.domain.admission import UNAUTHENTICATED_NODE
    from apportion.topics import JOBS, NODES
    from tests.kit.signing import node_identity

    svc, _ = run([CAROL.sign(sub("j1"))])
    nodes_before = set(svc.state.cluster.nodes)
    fake = NodeRegistered(event_id=events.det_id("t", "fake"), node_id="n9", gpu_count=64, ts=T0, producer="x")
    done = events.JobCompleted(
        event_id=events.det_id("t", "done"), job_id="j1", attempt=1, replica=0, node_id="n1",
        ts=T0 + timedelta(minutes=3), producer="node-agent",
    )  # fmt: skip
    svc2, out = run(
        [CAROL.sign(sub("j1"))],
        [
            (topic_name(NODES), node_identity("n1").signed_value(fake)),
            (topic_name(JOBS), identity("eve").signed_value(done)),
        ],
    )
    assert set(svc2.state.cluster.nodes) == nodes_before  # no n9
    assert "j1" in svc2.state.jobs and svc2.state.cluster.runs  # carol's run goes on
    letters = [e for e in out if isinstance(e, events.DeadLetter)]
    assert [e.error.split(":")[0] for e in letters] == [UNAUTHENTICATED_NODE] * 2
    assert svc2.intake.stats.unauthenticated_node == 2


def test_a_report_signed_by_its_nodes_key_counts() -> None:
    from apportion.topics import NODES
    from tests.kit.signing import node_identity

    new = NodeRegistered(event_id=events.det_id("t", "n2"), node_id="n2", gpu_count=8, ts=T0, producer="x")
    svc, out = run([registered(node_identity("n2"), T0)], [(topic_name(NODES), node_identity("n2").signed_value(new))])
    assert "n2" in svc.state.cluster.nodes and not [e for e in out if isinstance(e, events.DeadLetter)]


# --------------------------------------------------------------------------- ops' requests on nodes (only ops drain)


def drain_of(node_id: str = "n1", minutes: int = 3) -> events.NodeDrainRequested:
    return events.NodeDrainRequested(
        event_id=events.det_id("drain", node_id, minutes),
        node_id=node_id,
        reason="maintenance",
        ts=T0 + timedelta(minutes=minutes),
        producer="test",
    )


def node_verdicts(out: list[events.Event]) -> list[tuple[str, str, str, uuid.UUID]]:
    return [
        (e.node_id, e.request, e.reason.value, e.refused_event_id)
        for e in out
        if isinstance(e, events.NodeRequestRefused)
    ]


def raw(ev: events.Event) -> tuple[str, bytes]:
    return (events.topic_of(ev, ""), events.encode(ev))


def test_an_ops_signed_drain_drains_the_node() -> None:
    req = OPS.sign(drain_of())
    svc, out = run([CAROL.sign(sub("j1"))], [raw(req)])
    assert node_verdicts(out) == []
    assert "n1" in svc.state.draining and svc.state.cluster.nodes["n1"].state == "draining"


def _forged_drain_bytes() -> bytes:
    """Ops' signed drain of n2, its node id changed to n1 after signing (the signature no longer verifies)."""
    obj = json.loads(events.encode(OPS.sign(drain_of("n2"))))
    obj["node_id"] = "n1"
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    "record, why",
    [
        pytest.param(lambda: raw(drain_of()), "no valid signature", id="unsigned"),
        pytest.param(
            lambda: (topic_name(NODES), _forged_drain_bytes()), "no valid signature", id="ops' signature, altered"
        ),
        pytest.param(lambda: raw(EVE.sign(drain_of())), "role 'user'", id="a researcher's key"),
        pytest.param(lambda: raw(identity("mallory", "ops").sign(drain_of())), "no valid signature", id="unregistered"),
        pytest.param(lambda: raw(node_identity("n1").sign(drain_of())), "'node:n1'", id="the node's own key"),
    ],
)
def test_a_drain_not_signed_by_ops_is_refused_with_a_verdict_and_changes_nothing(record, why) -> None:
    svc, out = run([CAROL.sign(sub("j1"))], [record()])
    req_id = uuid.UUID(json.loads(record()[1])["event_id"])
    assert node_verdicts(out) == [("n1", "NodeDrainRequested", "unauthenticated", req_id)]
    [verdict] = [e for e in out if isinstance(e, events.NodeRequestRefused)]
    assert why in verdict.message
    assert "n1" not in svc.state.draining and svc.state.cluster.nodes["n1"].state == "ready"
    assert svc.state.jobs["j1"].status == "running"  # carol's run was not moved off
    assert not [e for e in out if isinstance(e, (events.JobPreempted, events.DeadLetter))]


@pytest.mark.parametrize("kind", [events.NodeCordoned, events.NodeUncordoned])
def test_cordon_and_uncordon_are_ops_requests_too(kind) -> None:
    req = kind(event_id=events.det_id("t", kind.__name__), node_id="n1", ts=T0 + timedelta(minutes=1), producer="t")
    svc, out = run([raw(EVE.sign(req))])
    assert node_verdicts(out) == [("n1", kind.__name__, "unauthenticated", req.event_id)]
    assert svc.state.cluster.nodes["n1"].state == "ready"
    svc, out = run([raw(OPS.sign(req))])
    assert node_verdicts(out) == []


def test_a_new_leader_refuses_an_undecided_forged_drain_once_and_never_folds_it() -> None:
    """Recovery: a forged drain with no verdict yet gets one; with its verdict already in the log, none again."""
    log = ListLog()
    log.put(*setup())
    forged = EVE.sign(drain_of())
    log.append(*raw(forged), b"n1")
    svc = service(log, echoes=True)
    decided = svc.bootstrap(log.read())
    assert node_verdicts(decided) == [("n1", "NodeDrainRequested", "unauthenticated", forged.event_id)]
    assert svc.state.cluster.nodes["n1"].state == "ready" and "n1" not in svc.state.draining
    svc._emit(decided)
    again = service(log, echoes=True)
    log.read_upto = 0
    assert node_verdicts(again.bootstrap(log.read())) == []
    assert again.state.cluster.nodes["n1"].state == "ready"


def _rebuilt(log: ListLog) -> tuple[DispatcherService, list[events.Event]]:
    """A new leader's rebuild of the whole log: the service and what it decided."""
    svc = service(log, echoes=True)
    log.read_upto = 0
    return svc, svc.bootstrap(log.read())


def test_a_drain_by_an_ops_key_revoked_later_stands_on_a_rebuild() -> None:
    """Key rotation: the revocation is later in the log than the drain, so the drain the old leader folded stands."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())
    drive(svc, log)
    log.append(*raw(OPS.sign(drain_of(minutes=3))), b"n1")
    drive(svc, log)
    log.put(UserKeyRevoked(user="root", public_key=OPS.public_key, ts=T0 + timedelta(minutes=9), producer="ops"))
    drive(svc, log)
    assert svc.state.cluster.nodes["n1"].state == "drained"  # nothing ran there: drained at once
    again, decided = _rebuilt(log)
    # folded (the test clock leaves the NodeDrained at T0, before the drain in log order: draining again)
    assert node_verdicts(decided) == [] and again.state.cluster.nodes["n1"].state in ("draining", "drained")


def test_a_backdated_drain_refused_live_stays_refused_on_a_rebuild() -> None:
    """Signed with ops' key after its revocation, backdated before it: refused live (the revocation was read);
    the rebuild, which counts that revocation by event time only, goes by the verdict in the log."""
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())
    log.put(UserKeyRevoked(user="root", public_key=OPS.public_key, ts=T0 + timedelta(minutes=5), producer="ops"))
    drive(svc, log)
    backdated = OPS.sign(drain_of(minutes=3))
    log.append(*raw(backdated), b"n1")
    drive(svc, log)
    verdicts = [events.decode(v) for _, v in log.published]
    assert node_verdicts(verdicts) == [("n1", "NodeDrainRequested", "unauthenticated", backdated.event_id)]
    again, decided = _rebuilt(log)
    assert node_verdicts(decided) == [] and again.state.cluster.nodes["n1"].state == "ready"


def test_a_dispatcher_rebuilt_from_offset_0_after_a_node_key_rotation_keeps_the_node() -> None:
    """Ops rotate n1's key (register k2, revoke k1) while carol's job runs there; a new leader reads the whole log
    as one batch: n1's registration and the start (signed by k1 before the revocation was appended) and the
    completion (k2) count, as they did live (the revocation counts from its place in the log only)."""
    import hashlib

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from apportion.identity.keys import Identity

    k1 = node_identity("n1")
    k2 = Identity(k1.user, k1.role, Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"n1, rotated").digest()))
    log = ListLog()
    svc = service(log, echoes=True)
    log.put(*setup())  # n1's NodeRegistered signed by k1, registered before it
    log.put(CAROL.sign(sub("j1")))
    drive(svc, log)
    placed = next(e for _, v in log.published if isinstance(e := events.decode(v), events.JobPlaced))
    log.put(
        events.JobStarted(
            event_id=events.det_id("t", "started"), job_id="j1", attempt=1, node_id="n1",
            gpus=placed.placements[0].gpus, ts=T0 + timedelta(minutes=2), producer="node-agent",
        )
    )  # fmt: skip
    drive(svc, log)  # live: one poll each
    log.put(
        registered(k2, T0 + timedelta(minutes=3)),
        UserKeyRevoked(user=k1.user, public_key=k1.public_key, ts=T0 + timedelta(minutes=3), producer="ops"),
    )
    done = events.JobCompleted(
        event_id=events.det_id("t", "done"), job_id="j1", attempt=1, replica=0, node_id="n1",
        ts=T0 + timedelta(minutes=4), producer="node-agent",
    )  # fmt: skip
    log.append(topic_name(JOBS), k2.signed_value(done), b"j1")
    drive(svc, log)
    assert "j1" in svc.state.finished and set(svc.state.cluster.nodes) == {"n1"}
    assert svc.intake.stats.dead_lettered == 0
    again, decided = _rebuilt(log)
    assert set(again.state.cluster.nodes) == {"n1"} and again.state.cluster.nodes["n1"].gpu_count == 8
    assert again.state.finished == svc.state.finished and "j1" not in again.state.jobs
    assert again.intake.stats.dead_lettered == 0 and not [e for e in decided if isinstance(e, events.DeadLetter)]
    # a report k1 signs after its revocation was appended is refused, live and by the next rebuild
    late = events.NodeHeartbeat(
        event_id=events.det_id("t", "late"), node_id="n1", ts=T0 + timedelta(minutes=2, seconds=30),
        producer="node-agent",
    )  # fmt: skip
    log.append(topic_name(NODES), k1.signed_value(late), b"n1")
    drive(svc, log)
    assert svc.intake.stats.unauthenticated_node == 1
    assert _rebuilt(log)[0].intake.stats.unauthenticated_node == 1


# --------------------------------------------------------------------------- the fencing-token floor from the log


def test_the_rebuild_floors_only_on_tokens_the_dispatchers_key_signed() -> None:
    """A forged decision with token 2**62 (and one in range, 2**40) in the log must not raise the floor."""
    from apportion.domain.admission import DISPATCHER
    from tests.kit.signing import dispatcher_identity, dispatcher_signer

    def configured(token: int, tag: str) -> events.DispatcherConfigured:
        return events.DispatcherConfigured(
            event_id=events.det_id("configured", tag), instance=tag, fencing_token=token, policy_version="p",
            window_s=3600.0, delta=0.0, grace_s=0.0, reservation_after_s=0.0, ts=T0, producer="dispatcher",
        )  # fmt: skip

    log = ListLog()
    log.put(*setup(), registered(dispatcher_identity(), T0))
    log.append(topic_name(JOBS), dispatcher_signer().values([events.encode(configured(5, "real"))])[0], b"cluster")
    log.append(topic_name(JOBS), events.encode(configured(2**62, "huge")), b"cluster")  # unsigned, out of range too
    log.append(topic_name(JOBS), events.encode(configured(2**40, "big")), b"cluster")  # unsigned, in range
    log.append(
        topic_name(JOBS), identity("root", "ops").signed_value(configured(2**41, "ops")), b"cluster"
    )  # not the dispatcher
    svc = service(log, echoes=True)
    assert svc.gate.keys.knows(DISPATCHER) is False  # nothing read yet
    svc.bootstrap(log.read())
    assert svc.log_token == 5


# --------------------------------------------------------------------------- hold and release (owner or ops)


def hold(job_id: str, user: str, minutes: int = 2) -> events.JobHoldRequested:
    return events.JobHoldRequested(
        event_id=events.det_id("hold", job_id, user, minutes),
        job_id=job_id,
        user=user,
        ts=T0 + timedelta(minutes=minutes),
    )


def release(job_id: str, user: str, minutes: int = 3) -> events.JobReleaseRequested:
    return events.JobReleaseRequested(
        event_id=events.det_id("release", job_id, user, minutes),
        job_id=job_id,
        user=user,
        ts=T0 + timedelta(minutes=minutes),
    )


def test_eve_cannot_hold_or_release_carols_job() -> None:
    """carol's j1 runs, her j2 was submitted held: eve may neither hold the one nor release the other."""
    svc, out = run(
        [CAROL.sign(sub("j1")), CAROL.sign(sub("j2", minutes=1).model_copy(update={"hold": True}))],
        [EVE.sign(hold("j1", "eve")), EVE.sign(release("j2", "eve"))],
    )
    assert rejections(out) == [("j1", "not_owner", "JobHoldRequested"), ("j2", "not_owner", "JobReleaseRequested")]
    assert [m.message for m in out if isinstance(m, events.JobRejected)][0] == (
        "job 'j1' belongs to 'carol'; 'eve' may hold only their own jobs"
    )
    assert set(svc.state.held) == {"j2"}


def test_the_owner_and_ops_may_hold_and_release() -> None:
    sub2 = sub("j2", minutes=1).model_copy(update={"hold": True})
    _, own = run([CAROL.sign(sub2)], [CAROL.sign(release("j2", "carol"))])
    _, ops = run([CAROL.sign(sub2)], [OPS.sign(release("j2", "root"))])
    for out in (own, ops):
        assert rejections(out) == []
        assert [e.type for e in out] == ["JobQueued", "JobHeld", "JobReleased", "JobPlaced", "StartWorkload"]


def _held_log(*, leader_answers: bool) -> tuple[ListLog, DispatcherService]:
    """carol's j1 runs (2 of the 8 GPUs), her j3 (8 GPUs) waits; then carol's hold of j3 and eve's of j1, answered
    by the first leader when ``leader_answers``, else appended while no leader runs."""
    log = ListLog()
    first = service(log, echoes=True)
    big = sub("j3", minutes=1).model_copy(update={"gpus_per_replica": 8})
    log.put(*setup(), CAROL.sign(sub("j1")), CAROL.sign(big))
    drive(first, log)
    log.put(CAROL.sign(hold("j3", "carol")), EVE.sign(hold("j1", "eve")))
    if leader_answers:
        drive(first, log)
    return log, service(log, echoes=True, token=8)


def test_a_hold_sent_while_no_leader_ran_is_decided_by_the_next_leader() -> None:
    log, nxt = _held_log(leader_answers=False)
    decided = nxt.bootstrap([r for r in log.records if r.topic in INPUTS])
    assert [(e.type, e.job_id) for e in decided if isinstance(e, events.JobHeld | events.JobRejected)] == [
        ("JobHeld", "j3"),
        ("JobRejected", "j1"),
    ]
    assert set(nxt.state.held) == {"j3"}


def test_a_hold_a_leader_answered_is_not_decided_again() -> None:
    log, nxt = _held_log(leader_answers=True)
    answered = [events.decode(v) for _, v in log.published]
    assert [(e.type, e.job_id) for e in answered if isinstance(e, events.JobHeld | events.JobRejected)] == [
        ("JobHeld", "j3"),
        ("JobRejected", "j1"),
    ]
    decided = nxt.bootstrap([r for r in log.records if r.topic in INPUTS])
    assert [e for e in decided if isinstance(e, events.JobHeld | events.JobRejected)] == []
    assert set(nxt.state.held) == {"j3"}


def test_the_audit_checks_the_signature_of_every_hold_the_dispatcher_carried_out() -> None:
    """An accepted hold of carol's job whose record is signed by eve (a dispatcher that skipped the check) is a
    finding; the holds this dispatcher carried out are not."""
    from apportion.audit.signatures import check_requests

    log = ListLog()
    svc = service(log, echoes=True)
    log.put(
        *setup(), CAROL.sign(sub("j0")), CAROL.sign(sub("j1", minutes=1).model_copy(update={"gpus_per_replica": 8}))
    )
    drive(svc, log)
    log.put(CAROL.sign(hold("j1", "carol")))
    drive(svc, log)
    log.put(CAROL.sign(release("j1", "carol", minutes=4)))
    drive(svc, log)
    assert svc.state.held == {}
    findings, checked = check_requests([log_record(r) for r in log.records])
    assert (findings, checked) == ([], 4)
    from apportion.audit.verify import verify
    from apportion.logrecord import log_order

    assert verify(sorted((log_record(r) for r in log.records), key=log_order)).mismatches == []
    forged = EVE.sign(release("j1", "carol", minutes=5))
    log.put(
        forged,
        events.JobReleased(
            event_id=events.det_id("JobReleased", "j1", forged.event_id),
            job_id="j1",
            by="carol",
            request_id=forged.event_id,
            ts=forged.ts,
            producer="dispatcher",
        ),
    )
    findings, checked = check_requests([log_record(r) for r in log.records])
    assert checked == 5
    assert [(f.job_id, f.detail) for f in findings] == [
        (
            "j1",
            "JobReleaseRequested accepted, but unauthenticated: signed with a key of 'eve', not of the user "
            "'carol' the request names",
        )
    ]
