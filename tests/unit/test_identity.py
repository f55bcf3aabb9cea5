"""Signatures and the key registry (rule D10.proven-user; :mod:`apportion.identity`)."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from datetime import timedelta

import pytest

from apportion import events
from apportion.domain.admission import Principal, authorize
from apportion.events import JobCancelRequested, JobSubmitted, RejectReason
from apportion.identity.canonical import canonical_bytes, signer_of
from apportion.identity.keys import BatchSigner, Identity
from apportion.identity.registry import KeyRegistry
from apportion.logrecord import LogRecord
from apportion.timeutil import to_us
from tests.kit.narrowing import narrow
from tests.kit.signed_requests import ALICE, T0, queued, submission
from tests.kit.signing import identity, registered

CAROL = identity("carol")


def cancel(user: str, job_id: str = "j1") -> JobCancelRequested:
    return JobCancelRequested(event_id=events.det_id("cancel", job_id, user), job_id=job_id, user=user, ts=T0)


def test_canonical_bytes_sort_keys_drop_only_the_signature_and_keep_unicode() -> None:
    payload = {"b": 1, "a": {"z": 1.5, "y": "é"}, "signature": "x", "signer_key": "k"}
    assert canonical_bytes(payload) == '{"a":{"y":"é","z":1.5},"b":1,"signer_key":"k"}'.encode()


def test_the_signers_write_the_same_bytes_for_a_fixed_key_and_event() -> None:
    """A request, a report and a batch of decisions signed by fixed keys: the bytes never change.

    Ed25519 is deterministic, so the SHA-256 of the values is fixed; a signer that wrote other bytes (another
    canonical form, another batch layout) would leave every signature already in a log unverifiable.
    """
    dispatcher = identity("service:dispatcher", "ops")
    request = JobCancelRequested(event_id=events.det_id("cancel", "j1", "alice"), job_id="j1", user="alice", ts=T0)
    values = [events.encode(ALICE.sign(request)), ALICE.signed_value(registered(ALICE, T0))]
    values += BatchSigner(dispatcher).values([events.encode(registered(identity(f"u{i}"), T0)) for i in range(5)])
    digest = hashlib.sha256(b"\n".join(values)).hexdigest()
    assert digest == "5e75451cf085b7fb4efb3068b528d39fb4f8eb2d3dc499b9c361e06f8d652621"
    assert [signer_of(v, appended=True) for v in values] == [ALICE.public_key] * 2 + [dispatcher.public_key] * 5


def test_a_signed_request_verifies_on_its_published_bytes() -> None:
    ev = ALICE.sign(submission())
    assert ev.signer_key == ALICE.public_key and ev.signature is not None
    assert signer_of(events.encode(ev)) == ALICE.public_key
    # the decoded event re-encodes to the same bytes: the proof survives a round trip
    assert signer_of(events.encode(events.decode(events.encode(ev)))) == ALICE.public_key


@pytest.mark.parametrize(
    "update",
    [
        pytest.param({}, id="plain"),
        pytest.param({"min_runtime_s": 0.1, "duration_s": 1e-7, "time_limit_s": 123456789.125}, id="awkward floats"),
        pytest.param({"command": ("python", "-c", 'print("é\\n\\t\x01")'), "duration_s": None}, id="escapes, unicode"),
        pytest.param({"env": {"Z": "ü", "A": "1"}, "gpu_model": "H100", "replicas": 4096, "hold": True}, id="env"),
    ],
)
def test_a_request_is_signed_over_the_canonical_bytes_of_its_published_json(update) -> None:
    """What the signer signs (built from the model) is what a reader rebuilds from the record it reads."""
    ev = ALICE.sign(submission().model_copy(update=update))
    raw = events.encode(ev)
    read = json.loads(raw)
    assert canonical_bytes(read) == canonical_bytes(ev.model_dump(mode="json"))
    assert signer_of(raw) == ALICE.public_key


def test_the_signature_covers_a_producer_that_writes_integers_and_fields_this_reader_does_not_know() -> None:
    """Another language's producer: its own JSON (ints for floats, an extra field), signed as documented."""
    obj = json.loads(events.encode(submission()))
    obj["min_runtime_s"] = 60  # an integer, as JavaScript writes 60.0
    obj["x_future_field"] = [1, 2]
    obj["signer_key"] = ALICE.public_key
    obj["signature"] = base64.b64encode(ALICE.private_key.sign(canonical_bytes(obj))).decode()
    raw = json.dumps(obj, indent=1).encode()  # any whitespace and key order on the wire
    assert signer_of(raw) == ALICE.public_key
    assert narrow(JobSubmitted, events.decode(raw)).min_runtime_s == 60.0


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda o: o.update(budget="lab/b"), id="a field changed after signing"),
        pytest.param(lambda o: o.update(event_id=str(uuid.uuid4())), id="the signature copied onto a new event id"),
        pytest.param(lambda o: o.update(ts="2026-01-05T09:00:01Z"), id="the event time moved"),
        pytest.param(lambda o: o.update(signer_key=CAROL.public_key), id="another key claimed"),
        pytest.param(lambda o: o.pop("signature"), id="signature removed"),
        pytest.param(lambda o: o.update(signature="bm90IGEgc2lnbmF0dXJl"), id="signature of the wrong length"),
        pytest.param(lambda o: o.update(signature=7), id="signature not a string"),
    ],
)
def test_a_changed_request_does_not_verify(tamper) -> None:
    obj = json.loads(events.encode(ALICE.sign(submission())))
    tamper(obj)
    assert signer_of(json.dumps(obj).encode()) is None


def test_one_altered_byte_of_the_record_is_caught() -> None:
    raw = bytearray(events.encode(ALICE.sign(submission())))
    i = raw.index(b'"lab/a"') + 5
    raw[i] = ord("b")
    assert signer_of(bytes(raw)) is None
    assert signer_of(b"not json") is None and signer_of(None) is None


def test_identity_file_round_trip_is_private(tmp_path) -> None:
    path = tmp_path / "apportion" / "identity.json"
    ident = Identity.generate("dana")
    ident.save(path)
    assert path.stat().st_mode & 0o777 == 0o600
    back = Identity.load(path)
    assert (back.user, back.role, back.public_key) == ("dana", "user", ident.public_key)
    assert "private_key" not in repr(back)
    with pytest.raises(FileExistsError):
        Identity.generate("dana").save(path)


H = timedelta(hours=1)


@pytest.mark.parametrize(
    "history, at, position, expected",
    [
        pytest.param([], T0, None, None, id="unknown key"),
        pytest.param([("reg", 0)], T0 - H, None, None, id="before its registration"),
        pytest.param([("reg", 0)], T0, None, Principal("alice"), id="at its registration"),
        pytest.param(
            [("reg", 0), ("rev", 2)], T0 + H, 100, Principal("alice"), id="earlier in the log than the revocation"
        ),
        pytest.param([("reg", 0), ("rev", 2)], T0 + H, 300, None, id="backdated: later in the log, ts before it"),
        pytest.param(
            [("reg", 0), ("rev", 2)], T0 + H, 200, Principal("alice"), id="the revocation's millisecond: stands"
        ),
        pytest.param([("reg", 0), ("rev", 2)], T0 + H, 201, None, id="one millisecond after the revocation"),
        pytest.param([("reg", 0), ("rev", 2)], T0 + H, None, None, id="live: the revocation was read, ts before it"),
        pytest.param([("reg", 0), ("rev", 2)], T0 + 2 * H, 100, None, id="at the revocation's time"),
        pytest.param([("reg", 0), ("rev", 1), ("reg", 2)], T0 + 3 * H, None, Principal("alice"), id="registered again"),
        pytest.param([("rev", 1), ("reg", 0)], T0 + 2 * H, None, None, id="folded out of order"),
    ],
)
def test_a_key_proves_its_user_from_registration_until_revocation(history, at, position, expected) -> None:
    """Revocations count by log position (record timestamp 100 x hours; unknown: once read), not by the signer's ts.

    A record of the revocation's own millisecond stands (the broker's clock does not order them: a live reader
    that read the record first took it, and a rebuild reading both in one batch must too).
    """
    reg = KeyRegistry()
    for kind, hours in history:
        ts = T0 + hours * H
        if kind == "reg":
            reg.apply(registered(ALICE, ts).model_copy(update={"event_id": uuid.uuid4()}))
        else:
            reg.apply(events.UserKeyRevoked(user="alice", public_key=ALICE.public_key, ts=ts), 100 * hours)
    assert reg.principal(ALICE.public_key, to_us(at), position) == expected


@pytest.mark.parametrize(
    "request_, signer, owner, reason",
    [
        pytest.param(submission(), Principal("alice"), None, None, id="own submission"),
        pytest.param(submission(), None, None, RejectReason.UNAUTHENTICATED, id="no valid signature"),
        pytest.param(submission(), Principal("carol"), None, RejectReason.UNAUTHENTICATED, id="another user's key"),
        pytest.param(submission(), Principal("root", "ops"), None, RejectReason.UNAUTHENTICATED, id="ops as alice"),
        pytest.param(cancel("alice"), Principal("alice"), "alice", None, id="cancel own job"),
        pytest.param(cancel("eve"), Principal("eve"), "carol", RejectReason.NOT_OWNER, id="cancel another's job"),
        pytest.param(cancel("root"), Principal("root", "ops"), "carol", None, id="ops cancel any job"),
        pytest.param(cancel("eve"), Principal("eve"), None, None, id="cancel of an unknown job"),
        pytest.param(cancel("carol"), Principal("eve"), "carol", RejectReason.UNAUTHENTICATED, id="eve claims carol"),
    ],
)
def test_authorize(request_, signer, owner, reason) -> None:
    got = authorize(request_, signer, owner)
    assert (got.reason if got is not None else None) == reason


def _log(*evs: events.Event) -> list[LogRecord]:
    from apportion.audit.verify import records_from_events

    return records_from_events(evs)


def test_audit_verify_passes_a_log_of_signed_requests() -> None:
    from apportion.audit.verify import verify

    s = ALICE.sign(submission())
    rep = verify(_log(registered(ALICE, T0), s, queued(s)))
    assert rep.ok and rep.signed_requests == 1


def test_audit_verify_names_an_altered_byte_of_an_accepted_submission() -> None:
    from dataclasses import replace

    from apportion.audit.verify import verify

    s = ALICE.sign(submission())
    recs = _log(registered(ALICE, T0), s, queued(s))
    i = next(k for k, r in enumerate(recs) if isinstance(r.event, JobSubmitted))
    raw = bytearray(narrow(bytes, recs[i].raw))
    raw[raw.index(b'"gpus_per_replica":1') + len('"gpus_per_replica":')] = ord("8")  # 1 GPU -> 8 GPUs
    recs[i] = replace(recs[i], raw=bytes(raw), event=events.decode(bytes(raw)))
    rep = verify(recs)
    assert [(m.check, m.offset, m.subject) for m in rep.mismatches] == [("signature", f"{recs[i].topic}:0@0", "j1")]
    assert "does not verify" in rep.mismatches[0].detail


@pytest.mark.parametrize(
    "signer, user",
    [
        pytest.param(None, "alice", id="an unsigned submission accepted"),
        pytest.param(CAROL, "alice", id="accepted in alice's name with carol's key"),
    ],
)
def test_audit_verify_flags_an_accepted_request_the_log_does_not_prove(signer, user) -> None:
    from apportion.audit.verify import verify

    s = submission(user)
    s = signer.sign(s) if signer is not None else s
    rep = verify(_log(registered(ALICE, T0), registered(CAROL, T0), s, queued(s)))
    assert [(m.check, m.subject) for m in rep.mismatches] == [("signature", "j1")]


def test_audit_verify_does_not_blame_the_stack_for_a_forgery_it_refused() -> None:
    from apportion.audit.verify import verify
    from apportion.domain.admission import Rejection, refused_request_event

    s = CAROL.sign(submission("alice"))
    no = refused_request_event(s, Rejection(RejectReason.UNAUTHENTICATED, "x"), budget="lab/a", ts=T0)
    rep = verify(_log(registered(ALICE, T0), registered(CAROL, T0), s, no))
    assert rep.ok and rep.signed_requests == 0


def test_audit_verify_skips_logs_without_identity() -> None:
    """A simulator's log (no keys registered, unsigned submissions) verifies as before."""
    from apportion.audit.verify import verify

    s = submission()
    rep = verify(_log(s, queued(s)))
    assert rep.ok and rep.signed_requests == 0
