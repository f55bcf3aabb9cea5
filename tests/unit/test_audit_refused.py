"""`audit verify` reads the dead letters: what the services refused is a refused attack, not a mismatch.

Rule D10.node-boundary. The logs are built by hand; the dead letters are made by the services' own reader edge
(:class:`apportion.bus.intake.Intake` with :class:`apportion.identity.gates.ReportGate`), the verdict on a forged
request by the dispatcher's :class:`apportion.identity.gates.RequestGate`. Check (f) of
:mod:`apportion.audit.verify` classifies them; ``apportion audit verify`` prints them and sets the exit code.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from apportion import events, topics
from apportion.audit.source import verify_topics, write_export
from apportion.audit.verify import REFUSED_LISTED, records_from_events, refusal_kind, refusal_reason, verify
from apportion.bus.intake import Intake, dead_letter
from apportion.cli.audit import refused_line, refused_table
from apportion.cli.main import app
from apportion.identity.gates import ReportGate, RequestGate
from apportion.logrecord import LogRecord, log_order
from apportion.timeutil import from_us, to_us
from tests.kit.audit_history import CFG, history
from tests.kit.fakes import Rec
from tests.kit.signing import identity, node_identity, registered
from tests.kit.simkit import at

T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
N0, N1 = node_identity("n0"), node_identity("n1")
ALICE, EVE = identity("alice"), identity("eve")
LETTERS = topics.DEADLETTER.base


@pytest.fixture(autouse=True)
def _default_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    # no running stack's namespace, and no Kafka: the CLI reads the export file only
    monkeypatch.setenv("APPORTION_KAFKA_BOOTSTRAP", "127.0.0.1:1")
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "")


class Log:
    """A hand-built log: each record at the next offset of its topic (partition 0), broker time = event time."""

    def __init__(self) -> None:
        self.recs: list[LogRecord] = []

    def _next(self, topic: str) -> int:
        return sum(1 for r in self.recs if r.topic == topic)

    def add(self, ev: events.Event, value: bytes | None = None) -> LogRecord:
        """``ev`` as published (``value``: its signed bytes; default its plain JSON)."""
        t = events.topic_of(ev, "")
        rec = LogRecord(t, 0, self._next(t), events.key_of(ev), to_us(ev.ts) // 1000, value or events.encode(ev), ev)
        self.recs.append(rec)
        return rec

    def garbage(self, topic: str, key: str, value: bytes, at: datetime) -> LogRecord:
        """A record no reader can decode."""
        rec = LogRecord(topic, 0, self._next(topic), key, to_us(at) // 1000, value, None, "not an event")
        self.recs.append(rec)
        return rec

    def read_by(self, service: str, at: datetime) -> list[events.DeadLetter]:
        """What ``service``'s reader edge makes of the log so far: its dead letters, appended to the log."""
        letters: list[events.DeadLetter] = []
        edge = Intake(service, lambda: at, gate=ReportGate(), on_dead=letters.append)
        batch = []
        for r in self.records():
            if r.topic == LETTERS:
                continue
            rec = Rec(r.topic, r.partition, r.offset, (r.key or "").encode(), r.raw, r.timestamp_ms, 1)
            ev = edge.admit(rec)
            if ev is not None:
                batch.append((rec, ev))
        edge.authenticate(batch, lambda x: x)
        for letter in letters:
            self.add(letter)
        return letters

    def records(self) -> list[LogRecord]:
        return sorted(self.recs, key=log_order)


def beat(node: str, at: datetime, tag: str) -> events.NodeHeartbeat:
    return events.NodeHeartbeat(event_id=events.det_id("hb", node, at, tag), node_id=node, ts=at, producer="node-agent")


FORGED_AT = T0 + timedelta(seconds=6)


def forged_report_log() -> tuple[Log, LogRecord]:
    """n0's key registered, an honest heartbeat of n0, and one in n0's name signed with n1's key (the forgery)."""
    log = Log()
    log.add(registered(N0, T0))
    log.add(registered(N1, T0))
    ok = beat("n0", T0 + timedelta(seconds=5), "ok")
    log.add(ok, N0.signed_value(ok))
    forged = beat("n0", FORGED_AT, "forged")
    return log, log.add(forged, N1.signed_value(forged))


def cli_verify(tmp_path: Path, recs: list[LogRecord], *extra: str) -> tuple[int, str]:
    path = tmp_path / "log.jsonl.gz"
    write_export(recs, path, topic_names=verify_topics(), exported_at="test")
    res = CliRunner().invoke(app, ["audit", "verify", "--from-file", str(path), *extra])
    return res.exit_code, res.stdout


# --------------------------------------------------------------------------- classification


def test_a_forgery_both_services_dead_lettered_is_one_refused_attack_and_verify_is_clean() -> None:
    log, forged = forged_report_log()
    # the dispatcher, the accounting, and the dispatcher again after a restart: the same letter id three times
    for service in ("dispatcher", "accounting", "dispatcher"):
        (letter,) = log.read_by(service, FORGED_AT + timedelta(seconds=1))
        assert letter.event_id == events.dead_letter_id(forged.topic, 0, forged.offset)
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    assert rep.records == 7 and rep.signed_reports == 2
    (f,) = rep.refused
    assert f.to_dict() == {
        "offset": "apportion.nodes:0@1",
        "at": FORGED_AT.isoformat(),
        "reason": "unauthenticated_node",
        "kind": "forgery",
        "detail": letter.error,
        "what": "NodeHeartbeat n0",
        "who": "node-agent",
        "by": ["accounting", "dispatcher"],
        "how": ["dead-lettered"],
        "in_log": True,
    }
    assert letter.error.startswith("unauthenticated_node: ")
    summary = rep.to_dict()["refused_attacks"]
    assert {k: summary[k] for k in ("count", "by_reason", "not_in_log")} == {
        "count": 1,
        "by_reason": {"unauthenticated_node": 1},
        "not_in_log": 0,
    }


def test_a_forgery_no_service_dead_lettered_is_a_mismatch() -> None:
    log, forged = forged_report_log()
    rep = verify(log.records())
    assert not rep.ok and rep.refused == []
    assert [(m.check, m.offset, m.subject) for m in rep.mismatches] == [("signature", "apportion.nodes:0@1", "n0")]
    assert "no service dead-lettered it" in rep.mismatches[0].detail


def test_a_dead_letter_of_a_record_not_read_is_told_from_its_copy_of_the_bytes() -> None:
    """Read from a time after the forgery (``--since``): its dead letter is in, the record is not."""
    log, forged = forged_report_log()
    log.read_by("accounting", FORGED_AT + timedelta(seconds=1))
    recs = [r for r in log.records() if r is not forged]
    rep = verify(recs)
    assert rep.ok, rep.to_dict()
    (f,) = rep.refused
    assert (f.offset, f.at, f.what, f.who, f.by, f.in_log) == (
        "apportion.nodes:0@1",
        FORGED_AT.isoformat(),
        "NodeHeartbeat n0",
        "node-agent",
        ["accounting"],
        False,
    )
    assert rep.to_dict()["refused_attacks"]["not_in_log"] == 1


def test_a_dead_letter_that_does_not_hold_the_bytes_of_the_record_it_names_is_a_mismatch() -> None:
    log, forged = forged_report_log()
    (letter,) = log.read_by("dispatcher", FORGED_AT + timedelta(seconds=1))
    i = next(i for i, r in enumerate(log.recs) if r.event == letter)
    other = letter.model_copy(update={"original": base64.b64encode(b'{"type": "NodeHeartbeat"}').decode()})
    log.recs[i] = dataclasses.replace(log.recs[i], raw=events.encode(other), event=other)
    rep = verify(log.records())
    assert [(m.check, m.offset, m.subject) for m in rep.mismatches] == [
        ("deadletter", f"{LETTERS}:0@0", "apportion.nodes:0@1")
    ]
    assert rep.refused == []


def test_an_undecodable_record_dead_lettered_is_refused_as_invalid() -> None:
    log, _ = forged_report_log()
    junk_at = T0 + timedelta(seconds=7)
    log.garbage("apportion.nodes", "n0", b"not json", junk_at)
    letters = log.read_by("dispatcher", junk_at + timedelta(seconds=1))
    assert len(letters) == 2  # the forgery and the junk
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    assert [(f.offset, f.reason, f.what, f.who, f.at) for f in rep.refused] == [
        ("apportion.nodes:0@1", "unauthenticated_node", "NodeHeartbeat n0", "node-agent", FORGED_AT.isoformat()),
        ("apportion.nodes:0@2", "invalid", "undecodable", "-", None),
    ]
    assert rep.to_dict()["refused_attacks"]["by_reason"] == {"invalid": 1, "unauthenticated_node": 1}


def test_a_forged_submission_the_dispatcher_rejected_is_a_refused_attack() -> None:
    """Eve signs a submission in alice's name: the dispatcher's verdict is the refusal (no dead letter)."""
    log = Log()
    gate = RequestGate()
    for key in (registered(ALICE, T0), registered(EVE, T0)):
        gate.refusal(None, log.add(key).event, {}, to_us(T0))  # type: ignore[arg-type]
    sub = EVE.sign(
        events.JobSubmitted(
            event_id=events.det_id("sub", "j1"), job_id="j1", budget="lab/a", user="alice", gpus_per_replica=1,
            min_runtime_s=60, duration_s=60, submitted_at=T0 + timedelta(seconds=1), ts=T0 + timedelta(seconds=1),
        )
    )  # fmt: skip
    rec = log.add(sub)
    verdict = gate.refusal(rec.raw, sub, {}, to_us(T0 + timedelta(seconds=2)))
    assert isinstance(verdict, events.JobRejected) and verdict.reason is events.RejectReason.UNAUTHENTICATED
    log.add(verdict)
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    (f,) = rep.refused
    assert (f.offset, f.reason, f.what, f.who, f.by, f.how, f.detail) == (
        "apportion.submissions:0@0",
        "unauthenticated",
        "JobSubmitted j1",
        "alice",
        ["dispatcher"],
        ["rejected"],
        verdict.message,
    )


@pytest.mark.parametrize("kind", [events.JobCancelRequested, events.JobHoldRequested, events.JobReleaseRequested])
def test_a_forged_request_on_a_job_the_dispatcher_rejected_is_found_in_the_log(
    kind: type[events.JobCancelRequested | events.JobHoldRequested | events.JobReleaseRequested],
) -> None:
    """Eve signs a cancel, hold or release in alice's name: the refusal names the record in the log (its offset),
    whatever kind of request on a job it is."""
    log = Log()
    gate = RequestGate()
    for key in (registered(ALICE, T0), registered(EVE, T0)):
        gate.refusal(None, log.add(key).event, {}, to_us(T0))  # type: ignore[arg-type]
    req = EVE.sign(kind(event_id=events.det_id("req", "j1"), job_id="j1", user="alice", ts=T0 + timedelta(seconds=1)))
    rec = log.add(req)
    verdict = gate.refusal(rec.raw, req, {}, to_us(T0 + timedelta(seconds=2)))
    assert isinstance(verdict, events.JobRejected) and verdict.reason is events.RejectReason.UNAUTHENTICATED
    log.add(verdict)
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    (f,) = rep.refused
    assert (f.offset, f.what, f.who, f.by, f.how) == (
        "apportion.submissions:0@0",
        f"{kind.__name__} j1",
        "alice",
        ["dispatcher"],
        ["rejected"],
    )


def test_a_drain_the_dispatcher_rejected_and_the_accounting_dead_lettered_is_one_refusal() -> None:
    """A node agent's unsigned drain: the dispatcher's verdict and the accounting's dead letter name one record."""
    log = Log()
    gate = RequestGate()
    gate.refusal(None, log.add(registered(N0, T0)).event, {}, to_us(T0))  # type: ignore[arg-type]
    drain = events.NodeDrainRequested(
        event_id=events.det_id("drain", "n0"), node_id="n0", reason="x", ts=FORGED_AT, producer="node-agent"
    )
    rec = log.add(drain)
    verdict = gate.refusal(rec.raw, drain, {}, to_us(FORGED_AT + timedelta(seconds=1)))
    assert isinstance(verdict, events.NodeRequestRefused)
    log.add(verdict)
    (letter,) = log.read_by("accounting", FORGED_AT + timedelta(seconds=1))
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    (f,) = rep.refused
    assert (f.offset, f.reason, f.what, f.who, f.by, sorted(f.how)) == (
        "apportion.nodes:0@0",
        "unauthenticated",
        "NodeDrainRequested n0",
        "node-agent",
        ["accounting", "dispatcher"],
        ["dead-lettered", "rejected"],
    )
    assert letter.error.startswith("unauthenticated: NodeDrainRequested")


@pytest.mark.parametrize(
    "error, kind",
    [
        pytest.param("unauthenticated_node: JobCompleted of j1 ...", "unauthenticated_node", id="a node's report"),
        pytest.param("unauthenticated: NodeLost of n0 ...", "unauthenticated", id="a decision"),
        pytest.param("event_id reused: 1234 was read before ...", "event_id reused", id="a reused id"),
        pytest.param("apply failed: OverflowError: x", "apply failed", id="the fold raised"),
        pytest.param("undecodable: TypeError: x", "undecodable", id="the codec raised"),
        pytest.param("not valid JSON: Expecting value", "invalid", id="not JSON"),
        pytest.param("ts: must be an ISO-8601 time", "invalid", id="a bad field"),
    ],
)
def test_refusal_reason_is_the_prefix_the_services_write(error: str, kind: str) -> None:
    assert refusal_reason(error) == kind


# --------------------------------------------------------------------------- the command


def test_the_command_exits_0_and_prints_the_refused_attacks_when_every_forgery_was_refused(tmp_path: Path) -> None:
    log, _ = forged_report_log()
    log.read_by("dispatcher", FORGED_AT + timedelta(seconds=1))
    code, out = cli_verify(tmp_path, log.records())
    assert code == 0, out
    assert "refused by the services: 1 (1 forgery: unauthenticated_node 1)" in out
    assert "OK" in out
    code, out = cli_verify(tmp_path, log.records(), "--json")
    refused = json.loads(out)["refused_attacks"]
    assert (code, refused["count"], [f["offset"] for f in refused["first"]]) == (0, 1, ["apportion.nodes:0@1"])


def test_the_command_exits_1_on_a_forgery_no_service_refused(tmp_path: Path) -> None:
    log, _ = forged_report_log()
    code, out = cli_verify(tmp_path, log.records(), "--json")
    got = json.loads(out)
    assert (code, got["ok"], got["refused_attacks"]["count"]) == (1, False, 0)
    assert [m["check"] for m in got["mismatches"]] == ["signature"]


def test_the_json_lists_the_first_refusals_and_counts_them_all(tmp_path: Path) -> None:
    log = Log()
    for i in range(REFUSED_LISTED + 2):
        log.garbage("apportion.jobs", f"j{i}", b"{", T0 + timedelta(seconds=i))
    log.read_by("accounting", T0 + timedelta(minutes=1))
    code, out = cli_verify(tmp_path, log.records(), "--json")
    refused = json.loads(out)["refused_attacks"]
    assert code == 0
    assert (refused["count"], refused["by_reason"], len(refused["first"])) == (12, {"invalid": 12}, REFUSED_LISTED)
    assert refused["first"][0]["offset"] == "apportion.jobs:0@0"


def test_the_dispatchers_dead_letters_are_no_input_of_the_re_runs() -> None:
    """A simulated log (three decision ticks, three snapshots) with dead letters the dispatcher wrote between its
    decisions: the re-runs and the snapshot checks fold only what the services folded, and the four letters of one
    record not in the log are one refusal."""
    log = history((at(0, 30), at(1, 30), at(2, 30)))
    log += [
        dead_letter(topic="apportion.jobs", partition=0, offset=99, key="x", value=b"{", reason="not valid JSON",
                    ts=from_us(t), producer="dispatcher")
        for t in (at(0, 30), at(1), at(2), at(2, 45))
    ]  # fmt: skip
    rep = verify(records_from_events(log), config=CFG)
    assert rep.ok, rep.to_dict()
    assert (rep.decisions, rep.snapshots, rep.records) == (3, 3, len(log))
    assert [(f.offset, f.reason, f.in_log, f.by) for f in rep.refused] == [
        ("apportion.jobs:0@99", "invalid", False, ["dispatcher"])
    ]


def not_owner_log() -> Log:
    """alice submits j1 and bob, signing with his own key, asks to cancel it: a refused request, not a forgery."""
    from types import SimpleNamespace

    log = Log()
    gate = RequestGate()
    bob = identity("bob")
    for key in (registered(ALICE, T0), registered(bob, T0)):
        gate.refusal(None, log.add(key).event, {}, to_us(T0))  # type: ignore[arg-type]
    req = bob.sign(
        events.JobCancelRequested(
            event_id=events.det_id("req", "j1"), job_id="j1", user="bob", ts=T0 + timedelta(days=1)
        )
    )
    rec = log.add(req)
    jobs = {"j1": SimpleNamespace(spec=SimpleNamespace(user="alice", budget="lab/a"))}
    verdict = gate.refusal(rec.raw, req, jobs, to_us(T0 + timedelta(days=1, seconds=1)))
    assert isinstance(verdict, events.JobRejected) and verdict.reason is events.RejectReason.NOT_OWNER
    log.add(verdict)
    return log


@pytest.mark.parametrize(
    "reason, kind",
    [
        pytest.param("unauthenticated_node", "forgery", id="a node report no key of its node signed"),
        pytest.param("unauthenticated", "forgery", id="a request no key of its user signed"),
        pytest.param("event_id reused", "forgery", id="a replay"),
        pytest.param("not_owner", "refused request", id="a signed request on another user's job"),
        pytest.param("apply failed", "invalid input", id="the fold raised"),
        pytest.param("undecodable", "invalid input", id="the codec raised"),
        pytest.param("invalid", "invalid input", id="a bad field"),
    ],
)
def test_refusal_kind_tells_a_forgery_from_a_refused_request(reason: str, kind: str) -> None:
    assert refusal_kind(reason) == kind


def test_an_operators_cancel_of_another_users_job_is_a_refused_request_not_an_attack(tmp_path: Path) -> None:
    """bob's own signed cancel of alice's job is refused ``not_owner``: the report calls it a refused request
    and lists no forgery; at 80 columns the table keeps every cell whole and the long reason follows it."""
    log = not_owner_log()
    rep = verify(log.records())
    assert rep.ok, rep.to_dict()
    (f,) = rep.refused
    assert (f.reason, f.kind, f.who, f.how) == ("not_owner", "refused request", "bob", ["rejected"])
    summary = rep.refused_summary()
    assert (summary["by_kind"], summary["first"][0]["kind"]) == ({"refused request": 1}, "refused request")
    assert refused_line(summary) == "refused by the services: 1 (1 refused request: not_owner 1)"
    code, out = cli_verify(tmp_path, log.records())
    assert code == 0, out
    assert "refused by the services: 1 (1 refused request: not_owner 1)" in out
    assert "attack" not in out and "forger" not in out
    console = Console(width=80, record=True)
    console.print(refused_table(summary, 80))
    assert [line.rstrip() for line in console.export_text().splitlines()] == [
        "       refused records (not mismatches): the first 1 of 1",
        "offset                     kind             what",
        "─────────────────────────────────────────────────────────────────",
        "apportion.submissions:0@0  refused request  JobCancelRequested j1",
        "apportion.submissions:0@0: event time 2026-03-03 09:00:00; claims to be bob;",
        "refused by dispatcher; job 'j1' belongs to 'alice'; 'bob' may cancel only their",
        "own jobs",
    ]


def test_the_count_line_of_refused_records_wraps_at_the_terminals_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two kinds with three reasons make the count line 116 characters: at 80 columns it is wrapped between words,
    never left for the terminal to cut mid-word (a replay, a forged report and three cancels of another's job)."""
    from types import SimpleNamespace

    from apportion.cli import audit

    summary = {
        "count": 5,
        "by_kind": {"forgery": 2, "refused request": 3},
        "by_reason": {"event_id reused": 1, "unauthenticated_node": 1, "not_owner": 3},
        "first": [],
    }
    line = refused_line(summary)
    assert line == (
        "refused by the services: 5 (2 forgeries: event_id reused 1, unauthenticated_node 1; "
        "3 refused requests: not_owner 3)"
    )
    console = Console(width=80, record=True)
    monkeypatch.setattr(audit, "_out", lambda: console)
    audit._print_refused(SimpleNamespace(refused_summary=lambda: summary))
    printed = console.export_text().splitlines()
    assert max(len(p) for p in printed) <= 80
    assert " ".join(p.strip() for p in printed) == line
