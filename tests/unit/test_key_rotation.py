"""A key's rotation voids nothing it signed before its revocation, live or rebuilt (rule D10.proven-user).

The reader edge (:meth:`apportion.bus.intake.Intake.authenticate`) judges each
record against the keys as of its record's place in the log, the broker's
append time (:func:`apportion.logrecord.log_position`; the signed topics are
``LogAppendTime``, :data:`apportion.topics.BROKER_TIME`), with the audit's rule
(:meth:`apportion.identity.registry.KeyRegistry.principal`). So a rebuild reading the
whole log as one batch keeps what the live reader kept one poll at a time.

The log of a node's key rotation (broker ms; event ts in minutes after T0):

====  =====================  ==========
ms    record                 ts
====  =====================  ==========
1000  register k1 (node:n0)  0
2000  heartbeat signed k1    1
3000  revoke k1              2
3001  register k2 (node:n0)  2
4000  heartbeat signed k2    3
====  =====================  ==========
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from apportion import events, topics
from apportion.audit.signatures import check_reports
from apportion.bus.intake import Intake
from apportion.domain.admission import DISPATCHER_TYPES, NODE_REQUEST_TYPES, REPORT_TYPES, UNAUTHENTICATED_NODE
from apportion.identity.gates import ReportGate
from apportion.identity.keys import Identity
from apportion.logrecord import LOG_APPEND_TIME, LogRecord, log_order, log_position
from tests.kit.fakes import Rec, log_record
from tests.kit.signing import node_identity, registered

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
M = timedelta(minutes=1)
K1 = node_identity("n0")
K2 = Identity("node:n0", "user", Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"n0, rotated").digest()))
CREATE_TIME = 0


def beat(minutes: float, tag: str) -> events.NodeHeartbeat:
    at = T0 + minutes * M
    return events.NodeHeartbeat(event_id=events.det_id("hb", tag), node_id="n0", ts=at, producer="node-agent")


def revoked(ident: Identity, at: datetime) -> events.UserKeyRevoked:
    return events.UserKeyRevoked(
        event_id=events.det_id("rev", ident.public_key), user=ident.user, public_key=ident.public_key, ts=at
    )


HB1, HB2 = beat(1, "hb1"), beat(3, "hb2")


def rec(ev: events.Event, ms: int, value: bytes | None = None, *, kind: int = LOG_APPEND_TIME) -> Rec:
    """The record of ``ev`` appended at ``ms`` (offset = ms: one partition per topic, in order)."""
    raw = value if value is not None else events.encode(ev)
    return Rec(events.topic_of(ev, ""), 0, ms, events.key_of(ev).encode(), raw, ms, kind)


def rotation() -> list[Rec]:
    """The table of the module docstring."""
    return [
        rec(registered(K1, T0), 1000),
        rec(HB1, 2000, K1.signed_value(HB1)),
        rec(revoked(K1, T0 + 2 * M), 3000),
        rec(registered(K2, T0 + 2 * M), 3001),
        rec(HB2, 4000, K2.signed_value(HB2)),
    ]


def read(*batches: list[Rec]) -> tuple[list[events.Event], list[events.DeadLetter]]:
    """One reader edge fed ``batches`` (each one poll): the heartbeats it kept and its dead letters."""
    dead: list[events.DeadLetter] = []
    intake = Intake("test", lambda: T0, on_dead=dead.append, gate=ReportGate())
    kept: list[events.Event] = []
    for batch in batches:
        pairs = [(r, ev) for r in sorted(batch, key=lambda r: r.timestamp) if (ev := intake.admit(r)) is not None]
        kept += [ev for _, ev in intake.authenticate(pairs, lambda p: p)]
    return [e for e in kept if isinstance(e, events.NodeHeartbeat)], dead


def test_a_rotation_keeps_both_keys_reports_in_one_batch_a_rebuild_from_offset_0() -> None:
    kept, dead = read(rotation())
    assert kept == [HB1, HB2] and dead == []


def test_a_rotation_keeps_both_keys_reports_read_one_poll_per_record_live() -> None:
    kept, dead = read(*([r] for r in rotation()))
    assert kept == [HB1, HB2] and dead == []


LATE = beat(1.5, "late")  # ts before the revocation's: backdated


@pytest.mark.parametrize(
    ("ms", "kind", "stands"),
    [
        pytest.param(3500, LOG_APPEND_TIME, False, id="appended after the revocation, backdated: refused"),
        pytest.param(3000, LOG_APPEND_TIME, True, id="the revocation's millisecond: stands"),
        pytest.param(2500, LOG_APPEND_TIME, True, id="appended before the revocation: stands"),
        pytest.param(3500, CREATE_TIME, False, id="producer's time, read after the revocation: refused"),
    ],
)
def test_a_report_of_the_revoked_key_is_judged_by_its_place_in_the_log_alike_live_and_rebuilt(
    ms: int, kind: int, stands: bool
) -> None:
    late = rec(LATE, ms, K1.signed_value(LATE), kind=kind)
    log = sorted([*rotation(), late], key=lambda r: r.timestamp)
    for name, (kept, dead) in {"rebuild": read(log), "live": read(*([r] for r in log))}.items():
        assert (LATE in kept) is stands, name
        assert kept == sorted([HB1, HB2, *([LATE] if stands else [])], key=lambda e: e.ts), name
        if not stands:
            assert [(d.source_offset, d.error.split(":")[0]) for d in dead] == [(ms, UNAUTHENTICATED_NODE)], name


def test_the_audit_ignores_exactly_what_the_edge_refused_on_the_same_log() -> None:
    """One rule for "key valid at position": the audit's :func:`check_reports` and the edge agree."""
    late = rec(LATE, 3500, K1.signed_value(LATE))
    tie = beat(1.7, "tie")
    log = sorted([*rotation(), late, rec(tie, 3000, K1.signed_value(tie))], key=lambda r: r.timestamp)
    _, dead = read(log)
    audit_log = sorted((log_record(r) for r in log), key=log_order)
    check = check_reports(audit_log)
    assert [audit_log[i].event for i in sorted(check.ignored)] == [LATE]
    assert [d.source_offset for d in dead] == [3500]


def test_a_record_has_a_place_only_where_the_broker_stamped_it_except_ops_key_events() -> None:
    assert log_position(rec(HB1, 2000)) == 2000
    assert log_position(rec(HB1, 2000, kind=CREATE_TIME), HB1) is None  # the signer's own clock
    assert log_position(rec(revoked(K1, T0), 7, kind=CREATE_TIME), revoked(K1, T0)) == 7  # only ops write keys
    assert log_position(Rec("t", 0, 0, None, b"", -1, LOG_APPEND_TIME)) is None  # no timestamp at all
    assert log_position(LogRecord("t", 0, 0, None, 42, b"", None)) == 42  # the audit's records


def test_every_topic_of_a_signed_record_or_a_key_event_has_the_brokers_time() -> None:
    signed = {*REPORT_TYPES, *DISPATCHER_TYPES, *NODE_REQUEST_TYPES}
    signed |= {events.JobSubmitted, events.JobCancelRequested, events.UserKeyRegistered, events.UserKeyRevoked}
    names = {events.TOPIC_OF[cls.__name__].base for cls in signed}
    assert names == {"apportion.submissions", "apportion.jobs", "apportion.nodes", "apportion.commands"} | {
        "apportion.budgets"
    }
    for t in topics.ALL_TOPICS:
        want = "LogAppendTime" if t.base in names else None
        assert t.configs().get("message.timestamp.type") == want, t.base


def test_a_revocation_without_a_place_counts_for_every_record_and_folding_it_again_keeps_its_earliest_place() -> None:
    """A registry restored from a snapshot older than the places holds revocations without one: conservative."""
    from apportion.identity.registry import KeyRegistry
    from apportion.timeutil import to_us

    rev, before = revoked(K1, T0 + 2 * M), to_us(T0 + M)  # a report with ts before the revocation's

    def proves(*folds: int | None, at_ms: int) -> bool:
        reg = KeyRegistry()
        reg.apply(registered(K1, T0), 1000)
        for place in folds:
            reg.apply(rev, place)
        return reg.principal(K1.public_key, before, at_ms) is not None

    assert not proves(None, at_ms=2000)  # placeless: revokes even a record appended before it
    assert proves(3000, at_ms=2000) and not proves(3000, at_ms=3500)
    assert proves(None, 3000, at_ms=2000) and proves(3000, None, at_ms=2000)  # again: its place is kept
    assert proves(3000, 4000, at_ms=3500) is False  # the earliest of two places
