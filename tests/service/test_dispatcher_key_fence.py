"""The proof of the keys at the commit (rule D10.proven-user), on an in-memory log.

A poll returns its records before the key topic's end offsets are known; the term judges and decides on them
and waits for the end offsets before its commit (:meth:`services.dispatcher.service.Term.prove`). Here the
budgets partition lags the way a fetch of another partition can: a key event appended before a submission is
not in the poll that returns the submission, only in what the end offsets asked after it reveal. A key event
that bears on the batch aborts the transaction and a new term, rebuilt from the committed log, decides the
batch as ``audit verify`` judges it; one that does not is folded before the next batch and the commit goes on.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from apportion import events
from apportion.audit.config import configured_event
from apportion.audit.verify import verify
from apportion.bus.producer import Unacked
from apportion.clock import ManualClock
from apportion.events import UserKeyRevoked
from apportion.logrecord import log_order
from apportion.settings import topic_name
from apportion.topics import BUDGETS
from services.dispatcher.config import DispatcherSettings
from services.dispatcher.service import DispatcherService, KeysMoved
from tests.kit.dispatcher import INPUTS, T0, FixedLease, ListLog, Producer, Rec, quiet_term
from tests.kit.dispatcher_identity import CAROL, setup, sub
from tests.kit.fakes import log_record
from tests.kit.signing import identity, registered

KEYS = topic_name(BUDGETS)
DAVE = identity("dave")


class LaggingReader:
    """The dispatcher's reader with the read-ahead overlapped (:meth:`AssignedConsumer.settle`) over a
    :class:`ListLog`: while ``lagging``, key records are not in the polls but revealed by the next settle (the
    end offsets asked after the poll), then returned at the head of the next poll."""

    def __init__(self, log: ListLog) -> None:
        self.log = log
        self.lagging = False
        self.behind: list[Rec] = []
        self.carried: list[Rec] = []
        self.asked = False
        self.settles = 0

    def poll(self) -> list[Rec]:
        batch = self.log.read()
        if self.lagging:
            self.behind += [r for r in batch if r.topic == KEYS]
            batch = [r for r in batch if r.topic != KEYS]
        batch, self.carried = self.carried + batch, []
        self.asked |= any(r.topic != KEYS for r in batch)
        return batch

    def settle(self, wait: bool = True) -> list[Rec] | None:
        if not self.asked:
            return []
        self.settles += 1
        self.asked = False
        late, self.behind = self.behind, []
        self.carried += late
        return late


class Leader:
    """One term on ``log``: a real :class:`Unacked` over :class:`TxnProducer`, reading with ``reader``."""

    def __init__(self, log: ListLog, reader: LaggingReader) -> None:
        self.log, self.reader = log, reader
        self.producer = Producer(log, at_commit=True)
        self.sends = Unacked(self.producer, transactional=True)
        settings = DispatcherSettings(heartbeat_timeout_s=0, kafka_bootstrap="unused:1", redis_url="redis://unused")
        self.svc = DispatcherService(settings, ManualClock(T0), self.sends.send_all, consumed=INPUTS)
        self.svc.token = 7
        self.wall = 0.0
        self.term = quiet_term(
            self.svc,
            settings,
            lambda: self.wall,
            flush=self.sends.flush,
            check_delivered=self.sends.check,
            pending=lambda: self.sends.open,
            settle=reader.settle,
        )

    def start(self) -> None:
        """Rebuild from the committed log (read to its end, as the start's catch-up does) and commit."""
        self.log.read_upto = 0
        cfg = configured_event(self.svc.cfg, instance="d-1", fencing_token=7, ts=T0, producer="dispatcher")
        asyncio.run(self.term.start(self.log.read(), [], cfg, FixedLease()))

    def poll(self) -> None:
        self.wall += 1.0
        asyncio.run(self.term.handle(self.reader.poll()))

    def redo(self) -> Leader:
        """What ``services.dispatcher.app`` does on :class:`KeysMoved`: abort, then a new term rebuilt from the log."""
        self.producer.abort()
        nxt = Leader(self.log, LaggingReader(self.log))
        nxt.start()
        return nxt


def started() -> tuple[ListLog, Leader]:
    log = ListLog()
    log.put(*setup())
    leader = Leader(log, LaggingReader(log))
    leader.start()
    leader.reader.lagging = True
    return log, leader


def committed(log: ListLog) -> list[events.Event]:
    return [events.decode(v) for _, v in log.published]


def decisions_on(log: ListLog, job_id: str) -> list[str]:
    return [e.type for e in committed(log) if getattr(e, "job_id", None) == job_id and e.type != "JobSubmitted"]


def audit_clean(log: ListLog) -> None:
    recs = sorted((log_record(r) for r in log.records), key=log_order)
    assert [m for m in verify(recs).mismatches if m.check == "signature"] == []


def test_a_revocation_the_poll_missed_aborts_the_placement_and_the_rebuild_refuses_the_submission() -> None:
    """Carol's key is revoked, then she submits; the poll returns the submission without the revocation and
    the term places it. The revocation comes with the end offsets: nothing is committed, and the next term
    refuses the submission ``unauthenticated``, as the audit judges it (the revocation is earlier in the log)."""
    log, leader = started()
    leader.producer.calls.clear()
    revoke = UserKeyRevoked(user="carol", public_key=CAROL.public_key, ts=T0 + timedelta(seconds=30), producer="ops")
    log.put(revoke, CAROL.sign(sub("j1")))
    with pytest.raises(KeysMoved):
        leader.poll()
    assert leader.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload"]  # judged, never committed
    assert decisions_on(log, "j1") == []
    nxt = leader.redo()
    assert decisions_on(log, "j1") == ["JobRejected"]
    [rejected] = [e for e in committed(log) if isinstance(e, events.JobRejected)]
    assert rejected.reason.value == "unauthenticated"
    assert "j1" not in nxt.svc.state.jobs
    audit_clean(log)


def test_a_registration_the_poll_missed_is_not_a_refusal_and_the_job_is_decided_once() -> None:
    """Ops register dave's first key, then dave submits; the poll returns the submission alone and the term
    refuses it (a key nobody registered). The registration comes with the end offsets: the refusal is
    aborted, and the next term queues and places the job, once."""
    log, leader = started()
    leader.producer.calls.clear()
    log.put(registered(DAVE, T0), DAVE.sign(sub("d1", user="dave")))
    with pytest.raises(KeysMoved):
        leader.poll()
    assert leader.producer.calls == ["begin", "JobRejected"]
    nxt = leader.redo()
    assert decisions_on(log, "d1") == ["JobQueued", "JobPlaced", "StartWorkload"]
    nxt.poll()  # the next term reads on: nothing decided again
    assert decisions_on(log, "d1") == ["JobQueued", "JobPlaced", "StartWorkload"]
    audit_clean(log)


def test_with_no_key_event_missed_the_batch_commits_once() -> None:
    log, leader = started()
    leader.producer.calls.clear()
    log.put(CAROL.sign(sub("j1")))
    leader.poll()
    assert leader.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload", "commit"]
    assert leader.reader.settles == 1  # the commit waited for the end offsets
    assert decisions_on(log, "j1") == ["JobQueued", "JobPlaced", "StartWorkload"]
    audit_clean(log)


def test_a_missed_key_event_of_another_key_lets_the_commit_go_on_and_is_folded_next() -> None:
    """A registration of dave's key, missed by the poll of carol's submission, bears on none of its records:
    the commit goes on, and dave's submission read afterwards is judged with his key."""
    log, leader = started()
    leader.producer.calls.clear()
    log.put(registered(DAVE, T0), CAROL.sign(sub("j1")))
    leader.poll()
    assert leader.producer.calls == ["begin", "JobQueued", "JobPlaced", "StartWorkload", "commit"]
    leader.reader.lagging = False
    log.put(DAVE.sign(sub("d1", user="dave")))
    leader.poll()
    assert decisions_on(log, "d1") == ["JobQueued", "JobPlaced", "StartWorkload"]
    audit_clean(log)


def test_a_revocation_missed_by_a_poll_that_commits_nothing_ends_the_term_before_any_commit() -> None:
    """A node report folded without a decision is proven too: its key's revocation, missed by the poll, ends
    the term at the next proof (the end of the iteration), before anything decided on it is committed."""
    from apportion.domain.admission import node_principal
    from apportion.events import NodeHeartbeat
    from tests.kit.signing import node_identity

    log, leader = started()
    leader.producer.calls.clear()
    n1 = node_identity("n1")
    revoke = UserKeyRevoked(user=node_principal("n1"), public_key=n1.public_key, ts=T0, producer="ops")
    log.put(revoke, NodeHeartbeat(node_id="n1", ts=T0 + timedelta(seconds=5), producer="agent"))
    with pytest.raises(KeysMoved):
        leader.poll()
    assert "commit" not in leader.producer.calls


def test_a_poll_that_commits_nothing_does_not_wait_for_its_proof_and_the_next_commit_does() -> None:
    from apportion.events import NodeHeartbeat

    log, leader = started()
    asked: list[bool] = []
    settle = leader.reader.settle

    def slow(wait: bool = True) -> list[Rec] | None:  # the answer is not in until someone waits for it
        asked.append(wait)
        return settle(wait) if wait else None

    leader.term.settle = slow
    log.put(NodeHeartbeat(node_id="n1", ts=T0 + timedelta(seconds=5), producer="agent"))
    leader.poll()
    assert (asked, len(leader.term.unproven)) == ([False], 1)
    log.put(CAROL.sign(sub("j1")))
    leader.poll()
    assert (asked, leader.term.unproven) == ([False, True], [])
    assert decisions_on(log, "j1") == ["JobQueued", "JobPlaced", "StartWorkload"]
