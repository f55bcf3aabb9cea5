"""Decisions proven by the dispatcher's key, and reports tied to the run's placement (rule D10.authentication).

The rule is :func:`apportion.domain.admission.authorize_report`: a decision or
command counts only when signed by ``service:dispatcher``; a node's report of
a run only when its node holds that run. The signer's side is
:class:`apportion.identity.keys.BatchSigner` (one signature per batch, a hash tree
over the batch); the readers' :class:`apportion.identity.gates.ReportGate` through
:meth:`apportion.bus.intake.Intake.authenticate`; the audit's
:func:`apportion.audit.signatures.check_reports`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from apportion import events
from apportion.audit.verify import records_from_events, verify
from apportion.bus.intake import Intake
from apportion.domain.admission import (
    DISPATCHER,
    UNAUTHENTICATED,
    UNAUTHENTICATED_NODE,
    Principal,
    authorize_report,
)
from apportion.identity.canonical import BATCH_MAX, signer_of
from apportion.identity.gates import ReportGate
from apportion.identity.keys import BatchSigner
from apportion.identity.registry import KeyRegistry
from apportion.logrecord import LogRecord, log_order
from tests.kit.fakes import Rec
from tests.kit.signing import dispatcher_identity, dispatcher_signer, node_identity, registered

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
D = dispatcher_identity()
N0, N1 = node_identity("n0"), node_identity("n1")
DEC = events.Decision(rank=0, budget_rank=0, ratio=0.0)


def placed(job: str = "j", nodes: tuple[str, ...] = ("n0",), at: datetime = T0) -> events.JobPlaced:
    return events.JobPlaced(
        event_id=events.det_id("placed", job, nodes),
        job_id=job,
        attempt=1,
        budget="lab/a",
        allocated=True,
        gpus_per_replica=1,
        replicas=len(nodes),
        min_runtime_s=60,
        placements=tuple(events.Placement(node_id=n, gpus=(0,)) for n in nodes),
        submitted_at=at,
        decision=DEC,
        ts=at,
        producer="dispatcher",
    )


def completed(node: str, replica: int | None = 0, job: str = "j", at: datetime = T0) -> events.JobCompleted:
    return events.JobCompleted(
        event_id=events.det_id("done", job, node, replica),
        job_id=job,
        attempt=1,
        replica=replica,
        node_id=node,
        ts=at + timedelta(seconds=60),
        producer="node-agent",
    )


def lost(producer: str = "dispatcher") -> events.JobLost:
    return events.JobLost(
        event_id=events.det_id("lost", producer),
        job_id="j",
        attempt=1,
        node_id="n0",
        charged_until=T0,
        ts=T0 + timedelta(seconds=30),
        producer=producer,
    )


# --------------------------------------------------------------------------- the batch signature


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, BATCH_MAX, BATCH_MAX + 1, 3 * BATCH_MAX - 1])
def test_every_record_of_a_batch_proves_the_dispatchers_key_and_decodes_as_before(n: int) -> None:
    evs = [placed(f"j{i}") for i in range(n)]
    values = BatchSigner(D).values([events.encode(e) for e in evs])
    assert len(values) == n
    for e, v in zip(evs, values, strict=True):
        assert events.decode(v) == e
        assert signer_of(v, appended=True) == D.public_key
    # one signature per batch of BATCH_MAX: the batch's records share it, the next batch has its own
    texts = [json.loads(v)["signature"] for v in values]
    sigs = {t.split(".")[3] if t.startswith("m.") else t for t in texts}
    assert len(sigs) == -(-n // BATCH_MAX)


def test_an_altered_byte_a_moved_signature_or_a_reserialised_record_proves_nothing() -> None:
    # fresh bytes: a reader that proved these bytes before (another test) would take them whatever follows them
    values = BatchSigner(D).values([events.encode(placed(f"alt{i}")) for i in range(5)])
    v = values[2]
    assert signer_of(v.replace(b'"lab/a"', b'"lab/b"'), appended=True) is None  # altered payload
    sig1 = json.loads(values[1])["signature"]
    swapped = v[: v.rfind(b',"signature":"')] + b',"signature":"' + sig1.encode() + b'"}'
    assert signer_of(swapped, appended=True) is None  # record 2 with record 1's path
    as_one = sig1.replace("m.1.5.", "m.1.4.", 1)  # the same path claimed for a batch of another size
    assert signer_of(values[1][: values[1].rfind(b',"signature":"')] + b',"signature":"' + as_one.encode() + b'"}',
                     appended=True) is None  # fmt: skip
    reser = json.dumps(json.loads(v), sort_keys=True).encode()  # the same members, other bytes
    assert signer_of(reser, appended=True) is None
    assert signer_of(v) is None  # a batch signature is not a request's canonical signature
    assert [signer_of(x, appended=True) for x in values] == [D.public_key] * 5  # the untouched records prove it


def test_the_verified_hash_caches_stay_bounded_and_a_record_past_a_clear_still_proves_its_key(monkeypatch) -> None:
    from apportion.identity import canonical

    monkeypatch.setattr(canonical, "_GOOD", {})
    monkeypatch.setattr(canonical, "_ROOTS", {})
    monkeypatch.setattr(canonical, "_GOOD_CAP", 64)
    monkeypatch.setattr(canonical, "_ROOTS_CAP", 4)
    values = BatchSigner(D).values([events.encode(placed(f"cap{i}")) for i in range(20 * BATCH_MAX)])
    for v in values:
        assert signer_of(v, appended=True) == D.public_key
        assert len(canonical._GOOD) <= 64 + 2 * 5 + 1 and len(canonical._ROOTS) <= 4  # a path adds at most 11
    # the first batch was forgotten long ago: its records are proven again from their signature, not taken
    assert signer_of(values[0], appended=True) == D.public_key
    assert signer_of(values[0].replace(b'"lab/a"', b'"lab/b"'), appended=True) is None


def test_a_bad_signature_or_key_proves_nothing() -> None:
    report = completed("n0")
    v = N0.signed_value(report)
    assert signer_of(v, appended=True) == N0.public_key
    bad = v[:-10] + (b"A" if v[-10:-9] != b"A" else b"B") + v[-9:]  # one character of the signature changed
    assert signer_of(bad, appended=True) is None
    zero_key = json.loads(v)
    zero_key["signer_key"] = "A" * 43 + "="  # 32 zero bytes: a small-order point, refused whatever the signature
    assert signer_of(json.dumps(zero_key).encode()) is None


def test_a_node_report_signed_alone_verifies_in_the_appended_form_and_the_canonical_one() -> None:
    v = N0.signed_value(completed("n0"))
    assert signer_of(v, appended=True) == N0.public_key
    assert signer_of(v) == N0.public_key


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "event, signer, placement, expected",
    [
        pytest.param(placed(), Principal(DISPATCHER), None, None, id="a decision signed by the dispatcher"),
        pytest.param(placed(), None, None, UNAUTHENTICATED + ": JobPlaced", id="an unsigned decision"),
        pytest.param(
            placed(), Principal("node:n0"), None, "carries the key of 'node:n0'", id="a decision a node signed"
        ),
        pytest.param(
            events.StartWorkload(node_id="n0", job_id="j", attempt=1, gpus=(0,), ts=T0),
            Principal("alice"),
            None,
            UNAUTHENTICATED + ": StartWorkload",
            id="a command a user signed",
        ),
        pytest.param(lost(), Principal(DISPATCHER), None, None, id="the dispatcher's JobLost, signed"),
        pytest.param(lost(), None, None, UNAUTHENTICATED_NODE, id="an unsigned JobLost claiming the dispatcher"),
        pytest.param(lost("node-agent"), Principal("node:n0"), ("n0",), None, id="its node's JobLost"),
        pytest.param(completed("n0"), Principal("node:n0"), ("n0",), None, id="a report of its own run"),
        pytest.param(
            completed("n1"), Principal("node:n1"), ("n0",), "but the run is placed on n0", id="another node's run"
        ),
        pytest.param(
            completed("n1", replica=0), Principal("node:n1"), ("n0", "n1"), "replica 0", id="another replica's node"
        ),
        pytest.param(completed("n1", replica=1), Principal("node:n1"), ("n0", "n1"), None, id="its own replica"),
        pytest.param(
            completed("n1", replica=2), Principal("node:n1"), ("n0", "n1"), "replica 2", id="a replica out of range"
        ),
        pytest.param(completed("n1", replica=None), Principal("node:n1"), ("n0", "n1"), None, id="a gang node"),
        pytest.param(completed("n1"), Principal("node:n1"), None, None, id="a run the reader never saw placed"),
    ],
)
def test_who_may_write_what(event, signer, placement, expected) -> None:
    got = authorize_report(event, signer, placement)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


def test_a_log_from_before_the_dispatcher_signed_keeps_its_decisions() -> None:
    assert authorize_report(placed(), None, dispatcher_keyed=False) is None
    assert authorize_report(lost(), None, dispatcher_keyed=False) is None
    assert authorize_report(lost("node-agent"), None, dispatcher_keyed=False) is not None  # a node's, unsigned


# --------------------------------------------------------------------------- the readers' edge


def _edge(batch: list[Rec], gate: ReportGate | None = None):
    dead: list[events.DeadLetter] = []
    intake = Intake("test", lambda: T0, on_dead=dead.append, gate=gate or ReportGate())
    pairs = [(r, ev) for r in batch if (ev := intake.admit(r)) is not None]
    kept = intake.authenticate(pairs, lambda p: p)
    return intake, [ev for _, ev in kept], dead


def _rec(ev: events.Event, offset: int, value: bytes) -> Rec:
    return Rec(events.topic_of(ev, ""), 0, offset, events.key_of(ev).encode(), value)


def test_the_edge_dead_letters_a_forged_decision_and_another_nodes_report_and_counts_them() -> None:
    p = placed()
    forged_lost = lost()
    other = completed("n1")
    own = completed("n0", job="j")
    batch = [
        Rec("apportion.budgets", 0, i, f"user:{x.user}".encode(), events.encode(registered(x, T0)))
        for i, x in enumerate((D, N0, N1))
    ] + [
        _rec(p, 0, dispatcher_signer().values([events.encode(p)])[0]),
        _rec(forged_lost, 1, events.encode(forged_lost)),  # a node agent's principal may write apportion.jobs
        _rec(other, 2, N1.signed_value(other)),  # n1's key, its own node id, but n0's run
        _rec(own, 3, N0.signed_value(own)),
    ]
    intake, kept, dead = _edge(batch)
    assert [type(e).__name__ for e in kept if not isinstance(e, events.UserKeyRegistered)] == [
        "JobPlaced",
        "JobCompleted",
    ]
    assert kept[-1] == own
    assert [d.source_offset for d in dead] == [1, 2]
    assert dead[0].error.startswith(UNAUTHENTICATED_NODE + ": JobLost")  # neither the dispatcher's nor n0's
    assert dead[1].error.startswith(UNAUTHENTICATED_NODE) and "placed on n0" in dead[1].error
    assert (intake.stats.unauthenticated, intake.stats.unauthenticated_node) == (0, 2)


def test_a_forged_decision_is_counted_apart_from_node_reports() -> None:
    p = placed()
    batch = [
        Rec("apportion.budgets", 0, 0, b"user:service:dispatcher", events.encode(registered(D, T0))),
        _rec(p, 0, N0.signed_value(p)),  # a node's key on a decision
    ]
    intake, kept, dead = _edge(batch)
    assert not [e for e in kept if isinstance(e, events.JobPlaced)]
    assert dead[0].error.startswith(UNAUTHENTICATED + ": JobPlaced")
    assert (intake.stats.unauthenticated, intake.stats.unauthenticated_node) == (1, 0)


def test_the_placement_is_remembered_across_batches_and_in_the_registry() -> None:
    keys = KeyRegistry()
    gate = ReportGate(keys)
    p = placed()
    _edge(
        [
            Rec("apportion.budgets", 0, 0, b"user:service:dispatcher", events.encode(registered(D, T0))),
            Rec("apportion.budgets", 0, 1, b"user:node:n1", events.encode(registered(N1, T0))),
            _rec(p, 0, dispatcher_signer().values([events.encode(p)])[0]),
        ],
        gate,
    )
    assert keys.placement(completed("n1")) == ("n0",)
    _, kept, dead = _edge([_rec(completed("n1"), 1, N1.signed_value(completed("n1")))], gate)
    assert not kept and "placed on n0" in dead[0].error


def test_a_reader_notes_the_placements_it_wrote_itself() -> None:
    gate = ReportGate()
    gate.emitted(placed(nodes=("n0", "n1")))
    assert gate.keys.placement(completed("n1", replica=1)) == ("n0", "n1")


# --------------------------------------------------------------------------- the audit


def _signed_log(evs: list[events.Event], values: dict[int, bytes]) -> list[LogRecord]:
    """``records_from_events(evs)`` with the value of ``evs[i]`` replaced by ``values[i]``."""
    import dataclasses

    index = {id(e): i for i, e in enumerate(evs)}
    out = [dataclasses.replace(r, raw=values.get(index[id(r.event)], r.raw)) for r in records_from_events(evs)]
    out.sort(key=log_order)
    return out


def test_audit_verify_flags_a_forged_decision_no_service_dead_lettered() -> None:
    from tests.kit.signing import node_value, with_node_keys

    p, forged = placed(), lost()
    evs = with_node_keys([p, completed("n0")])
    values = {i: node_value(e) for i, e in enumerate(evs)}
    evs.append(forged)  # unsigned, claiming the dispatcher
    rep = verify(_signed_log(evs, values))
    sig = [m for m in rep.mismatches if m.check == "signature"]
    assert len(sig) == 1 and "JobLost" in sig[0].detail and "no service dead-lettered it" in sig[0].detail
