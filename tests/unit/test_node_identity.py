"""Node reports proven by their node's key, and revocations by log position (rule D10.authentication).

The rule is :func:`apportion.domain.admission.authorize_report`; the signer's
side :meth:`apportion.identity.keys.Identity.signed_value`; the readers' side
:class:`apportion.identity.gates.ReportGate` through
:meth:`apportion.bus.intake.Intake.authenticate`; the audit's
:func:`apportion.audit.signatures.check_reports` in ``audit verify``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from apportion import events
from apportion.audit.signatures import check_requests
from apportion.audit.verify import verify
from apportion.bus.intake import Intake
from apportion.domain.admission import UNAUTHENTICATED_NODE, Principal, authorize, authorize_report
from apportion.events import JobLost, JobSubmitted, NodeHeartbeat, RejectReason, UserKeyRevoked
from apportion.identity.canonical import signer_of
from apportion.identity.gates import ReportGate
from apportion.identity.keys import ReportSigner
from tests.kit import builders
from tests.kit.fakes import Rec
from tests.kit.node_reports import log_of, reg_node
from tests.kit.signing import identity, node_identity, registered

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
N0, N1 = node_identity("n0"), node_identity("n1")
ALICE = identity("alice")


def beat(node: str = "n0", at: datetime = T0, tag: str = "") -> NodeHeartbeat:
    return NodeHeartbeat(event_id=events.det_id("hb", node, at, tag), node_id=node, ts=at, producer="node-agent")


def revoked(ident, at: datetime) -> UserKeyRevoked:
    return UserKeyRevoked(
        event_id=events.det_id("rev", ident.user, at), user=ident.user, public_key=ident.public_key, ts=at
    )


# --------------------------------------------------------------------------- signing


def test_a_signed_report_decodes_as_before_and_its_signature_names_its_key() -> None:
    ev = beat()
    value = N0.signed_value(ev)
    assert events.decode(value) == ev
    assert signer_of(value) == N0.public_key
    assert N0.signed_value(ev) == value  # deterministic: a report sent again is a duplicate, not a reused id
    obj = json.loads(value)
    obj["node_id"] = "n1"  # the signature does not carry over to another node's report
    assert signer_of(json.dumps(obj)) is None


def test_the_agent_signs_each_report_with_its_node_key_and_nothing_else() -> None:
    signer = ReportSigner({"n0": N0, "n1": N1})
    assert signer_of(signer.value(beat("n1")), appended=True) == N1.public_key
    assert signer_of(signer.value(reg_node("n0")), appended=True) == N0.public_key
    dead = events.DeadLetter(source_topic="t", original="", error="x", ts=T0)
    assert signer.value(dead) == events.encode(dead)  # not a report: published as is
    assert signer.value(beat("n7")) == events.encode(beat("n7"))  # not its node: unsigned, so readers ignore it


def test_a_group_of_reports_is_signed_once_per_node_and_every_record_still_proves_its_node() -> None:
    signer = ReportSigner({"n0": N0, "n1": N1})
    dead = events.DeadLetter(source_topic="t", original="", error="x", ts=T0)
    evs = [beat("n0", tag="a"), beat("n1"), reg_node("n0"), dead, beat("n7"), beat("n0", tag="b")]
    values = signer.values(evs)
    assert [events.decode(v) for v in values] == evs
    assert [signer_of(v, appended=True) for v in values] == [N0.public_key, N1.public_key, N0.public_key, None, None,
                                                              N0.public_key]  # fmt: skip
    assert values[3] == events.encode(dead) and values[4] == events.encode(beat("n7"))
    # n0's three reports: one batch, one root signature (the 4th dot-separated part of the signature string)
    sigs = [json.loads(values[i])["signature"].split(".") for i in (0, 2, 5)]
    assert [s[:3] for s in sigs] == [["m", "0", "3"], ["m", "1", "3"], ["m", "2", "3"]]
    assert len({s[3] for s in sigs}) == 1
    assert json.loads(values[1])["signature"].count(".") == 0  # n1's one report: a plain signature


def test_a_batched_report_altered_or_given_another_records_proof_does_not_verify() -> None:
    signer = ReportSigner({"n0": N0})
    a, b = signer.values([beat("n0", tag="x"), beat("n0", tag="y")])
    altered = a.replace(b'"node_id":"n0"', b'"node_id":"n1"')
    assert altered != a and signer_of(altered, appended=True) is None
    proof_of_b = b[b.rfind(b',"signature"') :]
    swapped = a[: a.rfind(b',"signature"')] + proof_of_b  # a's bytes with b's path: not what the root commits
    assert signer_of(swapped, appended=True) is None
    forged = ReportSigner({"n0": N1}).values([beat("n0", tag="x"), beat("n0", tag="y")])
    assert {signer_of(v, appended=True) for v in forged} == {N1.public_key}  # n1's key: the gate refuses it


def test_audit_verify_rechecks_each_record_of_a_batch_and_names_the_one_altered() -> None:
    ok, bad = beat("n0", T0 + timedelta(seconds=5), "ok"), beat("n0", T0 + timedelta(seconds=6), "bad")
    v_ok, v_bad = ReportSigner({"n0": N0}).values([ok, bad])
    tampered = bad.model_copy(update={"producer": "someone"})
    v_tampered = v_bad.replace(b'"producer":"node-agent"', b'"producer":"someone"')
    recs = log_of((registered(N0, T0), None, 0), (ok, v_ok, 1), (tampered, v_tampered, 2))
    rep = verify(recs)
    assert rep.signed_reports == 2
    assert [(m.check, m.subject) for m in rep.mismatches] == [("signature", "n0")]
    assert verify(log_of((registered(N0, T0), None, 0), (ok, v_ok, 1), (bad, v_bad, 2))).ok


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "event, signer, expected",
    [
        pytest.param(beat("n0"), Principal("node:n0"), None, id="its node's key"),
        pytest.param(beat("n0"), None, "is not signed by a key registered for it", id="unsigned or unknown key"),
        pytest.param(beat("n0"), Principal("node:n1"), "signed by the key of 'node:n1'", id="another node's key"),
        pytest.param(beat("n0"), Principal("alice"), "signed by the key of 'alice'", id="a user's key"),
        pytest.param(
            events.JobCompleted(job_id="j", attempt=1, ts=T0, producer="node-agent"),
            Principal("node:n0"),
            "names no node",
            id="a completion that names no node",
        ),
        pytest.param(
            JobLost(job_id="j", attempt=1, node_id="n0", charged_until=T0, ts=T0, producer="dispatcher"),
            None,
            "is not signed",
            id="an unsigned JobLost claiming the dispatcher is a forged report",
        ),
        pytest.param(
            JobLost(job_id="j", attempt=1, node_id="n0", charged_until=T0, ts=T0, producer="node-agent"),
            None,
            "is not signed",
            id="an agent's JobLost is",
        ),
        pytest.param(
            events.NodeDrainRequested(node_id="n0", ts=T0), Principal("root", "ops"), None, id="an ops request by ops"
        ),
    ],
)
def test_a_node_report_counts_only_when_its_node_signed_it(event, signer, expected) -> None:
    got = authorize_report(event, signer)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.startswith(UNAUTHENTICATED_NODE) and expected in got


def test_a_node_key_cannot_sign_a_request() -> None:
    sub = JobSubmitted(
        job_id="j", budget="lab/a", user="node:n0", gpus_per_replica=1, min_runtime_s=60, duration_s=1,
        submitted_at=T0, ts=T0,
    )  # fmt: skip
    got = authorize(sub, Principal("node:n0"))
    assert got is not None and got.reason is RejectReason.UNAUTHENTICATED


# --------------------------------------------------------------------------- the readers' edge


def _rec(ev: events.Event, offset: int, value: bytes | None = None) -> Rec:
    return Rec(events.topic_of(ev, ""), 0, offset, events.key_of(ev).encode(), value or events.encode(ev))


def _edge(batch: list[Rec]) -> tuple[Intake, list[events.Event], list[events.DeadLetter]]:
    dead: list[events.DeadLetter] = []
    intake = Intake("test", lambda: T0, on_dead=dead.append, gate=ReportGate())
    pairs = [(r, ev) for r in batch if (ev := intake.admit(r)) is not None]
    kept = intake.authenticate(pairs, lambda p: p)
    return intake, [ev for _, ev in kept], dead


def test_the_edge_keeps_signed_reports_and_dead_letters_forged_ones_with_the_reason() -> None:
    forged = beat("n0", T0 + timedelta(seconds=1), "forged")
    batch = [
        _rec(beat("n0"), 0, N0.signed_value(beat("n0"))),  # before its key's registration in the batch: still fine
        _rec(registered(N0, T0), 0),
        _rec(forged, 1, N1.signed_value(forged)),  # n1's key, n0's report
        _rec(beat("n1", tag="unsigned"), 2),
    ]
    intake, kept, dead = _edge(batch)
    assert [type(e).__name__ for e in kept] == ["NodeHeartbeat", "UserKeyRegistered"]
    assert intake.stats.unauthenticated_node == 2 and intake.stats.dead_lettered == 2
    assert [(d.source_offset, d.error.split(":")[0]) for d in dead] == [
        (1, UNAUTHENTICATED_NODE),
        (2, UNAUTHENTICATED_NODE),
    ]


def test_a_revoked_node_key_signs_nothing_read_after_the_revocation_even_backdated() -> None:
    """Backdating: the report's ts is before the revocation, but it is read after it (order by log position)."""
    gate = ReportGate()
    gate.observe(registered(N0, T0))
    early = beat("n0", T0 + timedelta(minutes=1), "early")
    assert gate.report_refusal(N0.signed_value(early), early) is None
    gate.observe(revoked(N0, T0 + timedelta(hours=1)))
    backdated = beat("n0", T0 + timedelta(minutes=2), "backdated")
    why = gate.report_refusal(N0.signed_value(backdated), backdated)
    assert why is not None and why.startswith(UNAUTHENTICATED_NODE)


def test_a_revocation_in_the_same_batch_refuses_a_backdated_report_sorted_before_it() -> None:
    later = beat("n0", T0 + timedelta(minutes=2), "backdated")
    batch = [
        _rec(registered(N0, T0), 0),
        _rec(later, 0, N0.signed_value(later)),
        _rec(revoked(N0, T0 + timedelta(hours=1)), 1),
    ]
    _, kept, dead = _edge(batch)
    assert [type(e).__name__ for e in kept] == ["UserKeyRegistered", "UserKeyRevoked"]
    assert [d.source_topic for d in dead] == [events.topic_of(later, "")]


# --------------------------------------------------------------------------- audit verify


def test_audit_verify_checks_node_signatures_and_names_a_forged_report_no_service_ignored() -> None:
    ok = beat("n0", T0 + timedelta(seconds=5), "ok")
    forged = beat("n0", T0 + timedelta(seconds=6), "forged")
    recs = log_of((registered(N0, T0), None, 0), (ok, N0.signed_value(ok), 1), (forged, N1.signed_value(forged), 2))
    rep = verify(recs)
    assert rep.signed_reports == 2
    bad = next(r for r in recs if r.event == forged)
    assert [(m.check, m.offset, m.subject) for m in rep.mismatches] == [
        ("signature", f"{bad.topic}:0@{bad.offset}", "n0")
    ]
    assert (
        UNAUTHENTICATED_NODE in rep.mismatches[0].detail and "no service dead-lettered it" in rep.mismatches[0].detail
    )


def test_audit_verify_accepts_a_forged_report_the_services_dead_lettered() -> None:
    from apportion.bus.intake import dead_letter

    forged = beat("n0", T0 + timedelta(seconds=6), "forged")
    recs = log_of((registered(N0, T0), None, 0), (forged, N1.signed_value(forged), 2))
    bad = next(r for r in recs if r.event == forged)
    letter = dead_letter(
        topic=bad.topic, partition=0, offset=bad.offset, key=bad.key, value=bad.raw, reason="unauthenticated_node: x",
        ts=T0 + timedelta(seconds=7), producer="dispatcher",
    )  # fmt: skip
    rep = verify(recs + log_of((letter, None, 3)))
    assert rep.ok and rep.signed_reports == 1


def test_audit_verify_refuses_a_request_backdated_before_the_revocation_of_its_key() -> None:
    """By log position (the broker's record timestamps), not by the ts the signer wrote."""
    sub = ALICE.sign(
        JobSubmitted(
            event_id=events.det_id("sub", "j9"), job_id="j9", budget="lab/a", user="alice", gpus_per_replica=1,
            min_runtime_s=60, duration_s=1, submitted_at=T0 + timedelta(minutes=5), ts=T0 + timedelta(minutes=5),
        )
    )  # fmt: skip
    rev = revoked(ALICE, T0 + timedelta(hours=1))
    ms_rev = 1_000_000
    honest, _ = check_requests(log_of((registered(ALICE, T0), None, 0), (sub, None, ms_rev - 1), (rev, None, ms_rev)))
    assert honest == []  # appended before the revocation: fine
    late, checked = check_requests(
        log_of((registered(ALICE, T0), None, 0), (rev, None, ms_rev), (sub, None, ms_rev + 1))
    )
    assert checked == 1 and [f.job_id for f in late] == ["j9"] and "unauthenticated" in late[0].detail


# --------------------------------------------------------------------------- the key ceremony of a node


def test_keys_init_node_writes_the_key_file_the_agent_loads(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from apportion.cli.main import app
    from apportion.identity.keys import Identity
    from apportion.signers import report_signer

    monkeypatch.setenv("APPORTION_NODE_KEY_DIR", str(tmp_path))
    res = CliRunner().invoke(app, ["keys", "init", "--node", "gpu-07"])
    assert res.exit_code == 0, res.output
    ident = Identity.load(tmp_path / "gpu-07.json")
    assert ident.user == "node:gpu-07" and ident.public_key in res.output
    assert "apportion keys register node:gpu-07 PUBKEY" in " ".join(res.output.split())
    signer = report_signer(["gpu-07"], key_dir=tmp_path)
    assert signer_of(signer.value(beat("gpu-07")), appended=True) == ident.public_key
    with pytest.raises(LookupError, match="keys init --node gpu-08"):
        report_signer(["gpu-08"], key_dir=tmp_path)  # a node without its key file: the agent does not start
    (tmp_path / "gpu-09.json").write_text((tmp_path / "gpu-07.json").read_text())
    with pytest.raises(ValueError, match="signs as 'node:gpu-07'"):
        report_signer(["gpu-09"], key_dir=tmp_path)  # another node's key


def test_a_reader_checks_only_the_reports_it_folds() -> None:
    """The accounting folds no heartbeat: it does not pay a signature check for one (the dispatcher does)."""
    from apportion.events import JobCompleted, NodeRegistered

    gate = ReportGate(folds=(NodeRegistered, JobCompleted))
    assert gate.report_refusal(events.encode(beat()), beat()) is None  # unsigned, but not folded: not checked
    why = gate.report_refusal(events.encode(reg_node()), reg_node())
    assert why is not None and why.startswith(UNAUTHENTICATED_NODE)


def test_a_signed_report_of_a_run_never_placed_is_passed_on_counted_and_logged(caplog) -> None:
    """Issue 17: an event naming an unknown run is never dropped silently (its folds change nothing)."""
    placed = builders.placed("j1", nodes=["n0"], at=T0)
    done = events.JobCompleted(job_id="j1", attempt=1, replica=0, node_id="n0", ts=T0 + timedelta(seconds=5))
    ghost = events.JobCompleted(job_id="ghost", attempt=1, replica=0, node_id="n0", ts=T0 + timedelta(seconds=6))
    batch = [
        _rec(registered(N0, T0), 0),
        _rec(placed, 1),  # no dispatcher key registered (an old log): decisions are taken as they are
        _rec(done, 2, N0.signed_value(done)),
        _rec(ghost, 3, N0.signed_value(ghost)),
    ]
    with caplog.at_level("WARNING", logger="apportion.bus.intake"):
        intake, kept, dead = _edge(batch)
    assert [getattr(e, "job_id", None) for e in kept] == [None, "j1", "j1", "ghost"]
    assert (intake.stats.unknown_run, intake.stats.dead_lettered, dead) == (1, 0, [])
    assert [r.getMessage() for r in caplog.records] == [
        "apportion.jobs[0]@3: JobCompleted of ghost/1 from n0 names a run this reader knows no placement of "
        "(changes nothing; 1 so far)"
    ]
