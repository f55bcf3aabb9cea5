"""Ops' requests on nodes (cordon, drain, uncordon) are proven by an ops key (rule D10.authentication).

The rule is :func:`apportion.domain.admission.authorize_node_request` (through
``authorize_report`` for every reader edge); the dispatcher's verdict is
``NodeRequestRefused`` (tests/service/test_dispatcher_identity.py); the
accounting dead-letters what the rule refuses; ``audit verify`` re-checks every
request from the log alone and flags a forged one the dispatcher accepted.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from apportion import events
from apportion.audit.verify import verify
from apportion.domain.admission import (
    Principal,
    authorize_node_request,
    authorize_report,
    refused_node_request_event,
)
from apportion.domain.occupancy import LEDGER_EVENT_TYPES
from apportion.events import NodeCordoned, NodeDrainRequested, NodeUncordoned, RejectReason
from apportion.identity.gates import ReportGate
from tests.kit.node_reports import log_of, reg_node
from tests.kit.signing import identity, node_identity, registered

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
OPS, EVE, N1 = identity("root", "ops"), identity("eve"), node_identity("n1")


def drain(node: str = "n1", minutes: int = 1) -> NodeDrainRequested:
    return NodeDrainRequested(
        event_id=events.det_id("drain", node, minutes), node_id=node, ts=T0 + timedelta(minutes=minutes), producer="t"
    )


@pytest.mark.parametrize(
    "signer, detail",
    [
        pytest.param(None, "no valid signature by a key registered with role 'ops'", id="unsigned or forged"),
        pytest.param(Principal("eve"), "the key of 'eve' (role 'user')", id="a researcher"),
        pytest.param(Principal("node:n1"), "the key of 'node:n1' (role 'user')", id="the node's own agent"),
        pytest.param(Principal("service:dispatcher"), "'service:dispatcher'", id="a service"),
        pytest.param(Principal("service:x", "ops"), "'service:x' (role 'ops')", id="a service key with role ops"),
        pytest.param(Principal("root", "ops"), None, id="ops"),
    ],
)
@pytest.mark.parametrize("kind", [NodeCordoned, NodeDrainRequested, NodeUncordoned])
def test_only_an_ops_key_may_cordon_drain_or_uncordon(kind, signer, detail) -> None:
    if kind is NodeCordoned and signer == Principal("service:dispatcher"):
        detail = None  # the one exception: test_the_dispatcher_may_cordon_but_neither_drain_nor_uncordon
    req = kind(event_id=events.det_id("r", kind.__name__), node_id="n1", ts=T0, producer="t")
    got = authorize_node_request(req, signer)
    edge = authorize_report(req, signer)
    if detail is None:
        assert got is None and edge is None
        return
    assert got is not None and got.reason is RejectReason.UNAUTHENTICATED and detail in got.message
    assert got.message.startswith(f"{kind.__name__} of node 'n1': ")
    assert edge == f"unauthenticated: {got.message}"  # one rule: the readers' reason is the verdict's


def test_the_dispatcher_may_cordon_but_neither_drain_nor_uncordon() -> None:
    # it cordons a node that refused several starts in a row (rule D3.refused-starts)
    dispatcher = Principal("service:dispatcher")
    for kind, allowed in ((NodeCordoned, True), (NodeDrainRequested, False), (NodeUncordoned, False)):
        req = kind(event_id=events.det_id("r", kind.__name__), node_id="n1", ts=T0, producer="dispatcher")
        assert (authorize_node_request(req, dispatcher) is None) is allowed, kind.__name__
        assert (authorize_report(req, dispatcher) is None) is allowed, kind.__name__
    # another service's key may not cordon
    req = NodeCordoned(event_id=events.det_id("r", "policy"), node_id="n1", ts=T0, producer="policy")
    assert authorize_node_request(req, Principal("service:policy")) is not None


def test_the_verdict_names_the_refused_request_and_its_id_is_deterministic() -> None:
    req = drain()
    rejection = authorize_node_request(req, None)
    assert rejection is not None
    v1 = refused_node_request_event(req, rejection, ts=T0 + timedelta(minutes=2))
    v2 = refused_node_request_event(req, rejection, ts=T0 + timedelta(minutes=9))
    assert (v1.node_id, v1.request, v1.refused_event_id, v1.reason) == (
        "n1", "NodeDrainRequested", req.event_id, RejectReason.UNAUTHENTICATED
    )  # fmt: skip
    assert v1.event_id == v2.event_id and events.topic_of(v1, "") == "apportion.nodes"


def test_the_accountings_edge_refuses_a_forged_drain_and_keeps_ops_one() -> None:
    gate = ReportGate(folds=LEDGER_EVENT_TYPES)
    for e in (registered(OPS, T0), registered(EVE, T0)):
        gate.observe(e)
    ops_drain, eve_drain = OPS.sign(drain(minutes=1)), EVE.sign(drain(minutes=2))
    assert gate.report_refusal(events.encode(ops_drain), ops_drain) is None
    why = gate.report_refusal(events.encode(eve_drain), eve_drain)
    assert why is not None and why.startswith("unauthenticated: NodeDrainRequested of node 'n1'")


def _setup() -> list[tuple[events.Event, bytes | None, int]]:
    node = reg_node("n1", T0)
    return [(registered(OPS, T0), None, 0), (registered(EVE, T0), None, 0), (registered(N1, T0), None, 0),
            (node, N1.signed_value(node), 1)]  # fmt: skip


def test_audit_verify_flags_a_forged_drain_the_dispatcher_accepted() -> None:
    """The fault fed to the detector: eve's drain in the log with no NodeRequestRefused (the dispatcher folded it)."""
    forged = EVE.sign(drain())
    recs = log_of(*_setup(), (forged, None, 2))
    rep = verify(recs)
    bad = next(r for r in recs if r.event == forged)
    assert [(m.check, m.offset, m.subject) for m in rep.mismatches] == [
        ("signature", f"{bad.topic}:0@{bad.offset}", "n1")
    ]
    detail = rep.mismatches[0].detail
    assert detail.startswith("unauthenticated: NodeDrainRequested of node 'n1': signed with the key of 'eve'")
    assert detail.endswith("and the dispatcher did not refuse it")


def test_audit_verify_flags_a_drain_altered_after_ops_signed_it() -> None:
    obj = json.loads(events.encode(OPS.sign(drain("n2"))))
    obj["node_id"] = "n1"
    altered = events.decode(json.dumps(obj).encode())
    rep = verify(log_of(*_setup(), (altered, json.dumps(obj).encode(), 2)))
    assert [m.subject for m in rep.mismatches] == ["n1"] and "no valid signature" in rep.mismatches[0].detail


def test_audit_verify_accepts_a_forged_drain_the_dispatcher_refused_and_an_ops_drain() -> None:
    forged, ok = EVE.sign(drain(minutes=1)), OPS.sign(drain(minutes=2))
    rejection = authorize_node_request(forged, Principal("eve"))
    assert rejection is not None
    verdict = refused_node_request_event(forged, rejection, ts=T0 + timedelta(minutes=1, seconds=1))
    rep = verify(log_of(*_setup(), (forged, None, 2), (verdict, None, 3), (ok, None, 4)))
    assert rep.ok, rep.mismatches
    assert rep.signed_reports == 4  # the node's registration, both drains, the verdict


def test_nodes_shows_the_reason_of_the_last_request_the_dispatcher_did_not_refuse() -> None:
    """``apportion nodes`` (and the dashboard) read the reason from the log: a refused forgery's reason is not shown."""
    from collections import namedtuple

    from apportion.cli.nodes import node_notes

    rec = namedtuple("rec", "key raw")
    ops = OPS.sign(NodeCordoned(node_id="n1", reason="bios", by="root", ts=T0, producer="cli"))
    forged = EVE.sign(drain(minutes=2).model_copy(update={"reason": "eve was here", "by": "eve"}))
    rejection = authorize_node_request(forged, Principal("eve"))
    assert rejection is not None
    verdict = refused_node_request_event(forged, rejection, ts=T0 + timedelta(minutes=3))
    log = [rec("n1", events.encode(e)) for e in (ops, forged)]
    assert node_notes(log)["n1"]["reason"] == "eve was here"  # before the verdict: the request is all there is
    notes = node_notes([*log, rec("n1", events.encode(verdict))])
    assert (notes["n1"]["reason"], notes["n1"]["reason_by"]) == ("bios", "root")
