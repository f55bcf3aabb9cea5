"""The threats of docs/security.md that signatures stop, on a live stack with SASL/SCRAM and ACLs on.

Each attacker publishes as the Kafka principal it would hold (``researcher``
for requests, ``node-agent`` for node reports), so the ACLs let the record
in and only the signature check can stop it: the forbidden action is
answered by ``JobRejected`` (``unauthenticated``) or dead-lettered
(``unauthenticated_node``), and the read models (``queue``, ``nodes``) do
not change. The threats the ACLs stop are in ``test_kafka_acls.py``.
"""

from __future__ import annotations

import base64
import json
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from apportion import events
from apportion.identity.keys import Identity
from tests.kit.livestack import Stack
from tests.kit.principals import producer_as

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(kafka_bootstrap: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`stack up` (two simulated nodes of 4 GPUs) with the example budgets; lab/prior/robotics: alice and bob."""
    from tests.kit.livestack import live_stack

    with live_stack(
        kafka_bootstrap, redis_url, tmp_path_factory, name="threats", db=13, sim_nodes=2, gpus_per_node=4
    ) as (info, env, _):
        s = Stack(info, dict(env))
        s.run("budget", "apply", str(ROOT / "infra/budgets/example.yaml"))
        yield s


def _ns(stack: Stack) -> pytest.MonkeyPatch:
    mp = pytest.MonkeyPatch()
    mp.setenv("APPORTION_TOPIC_PREFIX", stack.env["APPORTION_TOPIC_PREFIX"] or "")
    return mp


def _identity(stack: Stack, user: str) -> Identity:
    """The dev keyring's identity of ``user`` (``node:<id>`` for a node), registered by ops in the namespace."""
    from apportion.client import identity_for

    mp = _ns(stack)
    try:
        return identity_for(user, bootstrap=stack.info.bootstrap)
    finally:
        mp.undo()


def _send(stack: Stack, principal: str, ev: events.Event, value: bytes | None = None) -> None:
    """Publish ``ev`` (as ``value``, default its plain JSON) as Kafka principal ``principal``; wait for the ack."""
    topic = (stack.env["APPORTION_TOPIC_PREFIX"] or "") + events.TOPIC_OF[ev.type].base
    p = producer_as(principal, stack.info.bootstrap)
    try:
        p.send(topic, value=value or events.encode(ev), key=events.key_of(ev).encode()).get(timeout=10)
    finally:
        p.close()


def _log(stack: Stack, *bases: str) -> list[Any]:
    from apportion.bus.reader import read_log

    pre = stack.env["APPORTION_TOPIC_PREFIX"] or ""
    return read_log(stack.info.bootstrap, [pre + b for b in bases])


def _verdicts(stack: Stack, job_id: str) -> list[events.Event]:
    return [
        r.event
        for r in _log(stack, "apportion.jobs")
        if isinstance(r.event, (events.JobQueued, events.JobRejected)) and r.event.job_id == job_id
    ]


def _submission(user: str, job_id: str, ts: datetime | None = None, budget: str = "lab/prior/robotics") -> Any:
    ts = ts or datetime.now(UTC)
    return events.JobSubmitted(
        job_id=job_id,
        budget=budget,
        user=user,
        gpus_per_replica=1,
        min_runtime_s=600.0,
        duration_s=3600.0,
        submitted_at=ts,
        ts=ts,
        producer=f"client/{user}",
    )


def _queue_ids(stack: Stack) -> list[str]:
    return sorted(r["job_id"] for r in stack.json("queue"))


def test_eve_cannot_charge_alices_budget_by_signing_in_her_name(stack: Stack) -> None:
    eve = _identity(stack, "eve")
    before = _queue_ids(stack)
    forged = eve.sign(_submission("alice", "th-eve1"))
    _send(stack, "researcher", forged)
    (verdict,) = stack.until(lambda: _verdicts(stack, "th-eve1"), "the dispatcher's verdict on th-eve1")
    assert isinstance(verdict, events.JobRejected) and verdict.reason is events.RejectReason.UNAUTHENTICATED
    assert "signed with a key of 'eve'" in verdict.message
    assert _queue_ids(stack) == before


def test_a_replayed_submission_is_a_duplicate_and_a_copied_signature_is_refused(stack: Stack) -> None:
    alice = _identity(stack, "alice")
    signed = alice.sign(_submission("alice", "th-rep1"))
    raw = events.encode(signed)
    _send(stack, "researcher", signed, raw)
    stack.until(lambda: [r for r in stack.json("queue") if r["job_id"] == "th-rep1"], "th-rep1 in the queue")
    _send(stack, "researcher", signed, raw)  # the same record again: same event id
    copied = json.loads(raw)
    copied["event_id"] = str(uuid.uuid4())  # the signature copied onto a new id
    _send(stack, "researcher", signed, json.dumps(copied).encode())
    rejected = stack.until(
        lambda: [e for e in _verdicts(stack, "th-rep1") if isinstance(e, events.JobRejected)], "the copy's refusal"
    )
    assert [(e.reason.value, str(e.refused_event_id)) for e in rejected] == [("unauthenticated", copied["event_id"])]
    assert [type(e).__name__ for e in _verdicts(stack, "th-rep1")] == ["JobQueued", "JobRejected"]
    assert [r["job_id"] for r in stack.json("queue")].count("th-rep1") == 1


def test_a_revoked_key_signs_nothing_even_backdated_before_the_revocation(stack: Stack) -> None:
    """Backdating: the request's ts is before the revocation, but it reaches the log after it."""
    bob = _identity(stack, "bob")
    registered_at = datetime.now(UTC)
    revoked_at = registered_at + timedelta(seconds=1)
    _send(
        stack,
        "ops",
        events.UserKeyRevoked(user="bob", public_key=bob.public_key, reason="laptop lost", ts=revoked_at, by="ops"),
    )
    before = _queue_ids(stack)
    backdated = bob.sign(_submission("bob", "th-bob1", ts=revoked_at - timedelta(milliseconds=500)))
    _send(stack, "researcher", backdated)
    (verdict,) = stack.until(lambda: _verdicts(stack, "th-bob1"), "the dispatcher's verdict on th-bob1")
    assert isinstance(verdict, events.JobRejected) and verdict.reason is events.RejectReason.UNAUTHENTICATED
    assert _queue_ids(stack) == before


def _metric(stack: Stack, service: str, name: str) -> float:
    port = stack.info.metrics[service]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_node_agent_cannot_report_for_a_node_it_does_not_hold(stack: Stack) -> None:
    """Forged node reports and completions by the node-agent principal: ignored, dead-lettered, counted."""
    alice = _identity(stack, "alice")
    alice_job = alice.sign(_submission("alice", "th-run1"))
    _send(stack, "researcher", alice_job)
    running = stack.until(
        lambda: [r for r in stack.json("queue") if r["job_id"] == "th-run1" and r["state"] == "running"],
        "th-run1 running",
    )
    node = running[0]["nodes"][0]
    nodes_before = sorted(n["node_id"] for n in stack.json("nodes"))
    other = _identity(stack, "node:elsewhere")  # a key ops registered for another node
    now = datetime.now(UTC)
    ghost = events.NodeRegistered(node_id="ghost-0", gpu_count=64, ts=now, producer="node-agent")
    done = events.JobCompleted(job_id="th-run1", attempt=1, replica=0, node_id=node, ts=now, producer="node-agent")
    unsigned = events.NodeRegistered(node_id="ghost-1", gpu_count=64, ts=now, producer="node-agent")
    forged = [(ghost, other.signed_value(ghost)), (done, other.signed_value(done)), (unsigned, None)]
    for ev, value in forged:
        _send(stack, "node-agent", ev, value)

    def letters() -> list[events.DeadLetter]:
        return [
            r.event
            for r in _log(stack, "apportion.deadletter")
            if isinstance(r.event, events.DeadLetter) and r.event.error.startswith("unauthenticated_node")
        ]

    stack.until(
        lambda: {d.producer for d in letters()} == {"dispatcher", "accounting"} and len(letters()) >= 6,
        "both services dead-letter the three forgeries",
    )
    assert {d.error.split(":")[0] for d in letters()} == {"unauthenticated_node"}
    assert sorted(n["node_id"] for n in stack.json("nodes")) == nodes_before  # no ghost node
    (row,) = [r for r in stack.json("queue") if r["job_id"] == "th-run1"]
    assert row["state"] == "running"  # the forged completion changed nothing
    assert _metric(stack, "dispatcher", "apportion_unauthenticated_node_reports_total") >= 3
    assert _metric(stack, "accounting", "apportion_unauthenticated_node_reports_total") >= 3
    # audit verify re-checks every node report from the log: the agent's are signed, the forgeries were ignored
    from apportion.audit.verify import verify

    bases = ("submissions", "jobs", "nodes", "budgets", "deadletter")
    report = verify(_log(stack, *(f"apportion.{b}" for b in bases)))
    assert report.signed_reports > 3
    assert [m for m in report.mismatches if m.check == "signature"] == []


def test_a_node_agent_cannot_forge_the_dispatchers_decisions_nor_report_another_nodes_run(stack: Stack) -> None:
    """As the node-agent principal (which may write apportion.jobs): an unsigned ``JobLost`` and ``JobFailed``
    claiming the dispatcher, a ``JobPreempted`` signed by a node's key, and a completion of the run signed by the
    other node's own key naming itself. Each is ignored, dead-lettered and counted by both readers; the job runs
    on; ``audit verify`` finds every decision and report of the stack signed and no forgery kept."""
    alice = _identity(stack, "alice")
    _send(stack, "researcher", alice.sign(_submission("alice", "th-run2")))
    running = stack.until(
        lambda: [r for r in stack.json("queue") if r["job_id"] == "th-run2" and r["state"] == "running"],
        "th-run2 running",
    )
    node, attempt = running[0]["nodes"][0], 1
    other_node = next(n["node_id"] for n in stack.json("nodes") if n["node_id"] != node)
    other = _identity(stack, f"node:{other_node}")  # the real, registered key of the stack's other node
    now = datetime.now(UTC)
    job: dict[str, Any] = {"job_id": "th-run2", "attempt": attempt}
    lost = events.JobLost(**job, node_id=node, charged_until=now, ts=now, producer="dispatcher")
    failed = events.JobFailed(**job, replica=0, node_id=node, exit_code=1, ts=now, producer="dispatcher")
    preempted = events.JobPreempted(**job, budget="lab/prior/robotics", allocated=True, ts=now, producer="dispatcher")
    cross = events.JobCompleted(**job, replica=0, node_id=other_node, ts=now, producer="node-agent")
    forged = [
        (lost, None),
        (failed, None),
        (preempted, other.signed_value(preempted)),
        (cross, other.signed_value(cross)),
    ]
    for ev, value in forged:
        _send(stack, "node-agent", ev, value)
    ids = {ev.event_id for ev, _ in forged}

    def letters() -> list[events.DeadLetter]:
        out = []
        for r in _log(stack, "apportion.deadletter"):
            d = r.event
            if isinstance(d, events.DeadLetter) and d.error.startswith("unauthenticated"):
                original = json.loads(base64.b64decode(d.original))
                if original.get("event_id") in {str(i) for i in ids}:
                    out.append(d)
        return out

    # the dispatcher folds all four kinds; the accounting folds JobLost, JobFailed, JobPreempted and JobCompleted
    def both_refused_all() -> bool:
        got = {(d.producer, d.source_offset) for d in letters()}
        offsets = {o for _, o in got}
        return len(offsets) == 4 and got == {(p, o) for p in ("dispatcher", "accounting") for o in offsets}

    stack.until(both_refused_all, "both services dead-letter the four forgeries")
    reasons = {d.error.split(":")[0] for d in letters()}
    assert reasons == {"unauthenticated", "unauthenticated_node"}
    assert any("placed on " + node in d.error for d in letters())  # the cross-node completion
    (row,) = [r for r in stack.json("queue") if r["job_id"] == "th-run2"]
    assert row["state"] == "running"  # no forgery stopped, requeued or completed it
    for service in ("dispatcher", "accounting"):
        assert _metric(stack, service, "apportion_unauthenticated_decisions_total") >= 1
        assert _metric(stack, service, "apportion_unauthenticated_node_reports_total") >= 3
    from apportion.audit.verify import verify

    bases = ("submissions", "jobs", "nodes", "budgets", "deadletter")
    report = verify(_log(stack, *(f"apportion.{b}" for b in bases)))
    assert report.signed_reports > 4  # every decision and report of the stack re-checked
    assert [m for m in report.mismatches if m.check == "signature"] == []


def test_a_node_agent_cannot_drain_or_cordon_a_node_and_ops_can(stack: Stack) -> None:
    """As the node-agent principal (which may write apportion.nodes): a drain signed with a node's own key and an
    unsigned cordon. The dispatcher answers each with ``NodeRequestRefused`` (``unauthenticated``), the node stays
    ready, the accounting dead-letters both; an ops-signed cordon works; ``audit verify`` finds no forgery kept."""
    node = sorted(n["node_id"] for n in stack.json("nodes"))[0]
    own_key = _identity(stack, f"node:{node}")  # the key ops registered for that very node
    now = datetime.now(UTC)
    drain = own_key.sign(events.NodeDrainRequested(node_id=node, reason="x", ts=now, producer="node-agent"))
    cordon = events.NodeCordoned(node_id=node, reason="x", ts=now, producer="node-agent")
    for ev in (drain, cordon):
        _send(stack, "node-agent", ev)

    def refusals() -> dict[Any, events.NodeRequestRefused]:
        return {
            r.event.refused_event_id: r.event
            for r in _log(stack, "apportion.nodes")
            if isinstance(r.event, events.NodeRequestRefused)
        }

    got = stack.until(lambda: (v := refusals()) and {drain.event_id, cordon.event_id} <= set(v) and v, "two verdicts")
    assert {(got[e].request, got[e].reason.value) for e in (drain.event_id, cordon.event_id)} == {
        ("NodeDrainRequested", "unauthenticated"),
        ("NodeCordoned", "unauthenticated"),
    }
    assert f"the key of 'node:{node}'" in got[drain.event_id].message
    assert {n["node_id"]: n["state"] for n in stack.json("nodes")}[node] == "ready"
    # ops may: the CLI signs with the operator's identity (the stack's keyring: ops.json)
    assert stack.run("cordon", node, "--reason", "ok").stdout.strip() == f"cordoned {node}"
    stack.run("undrain", node)
    from apportion.audit.verify import verify

    bases = ("submissions", "jobs", "nodes", "budgets", "deadletter")
    report = verify(_log(stack, *(f"apportion.{b}" for b in bases)))
    assert [m for m in report.mismatches if m.check == "signature"] == []
    stack.until(
        lambda: [
            r.event
            for r in _log(stack, "apportion.deadletter")
            if isinstance(r.event, events.DeadLetter) and r.event.producer == "accounting"
            and r.event.error.startswith(f"unauthenticated: NodeDrainRequested of node '{node}'")
        ],
        "the accounting's dead letter of the drain",
    )  # fmt: skip


def test_provisioning_registers_the_compose_keys_once_however_often_it_runs(stack: Stack, tmp_path: Path) -> None:
    """The compose file's keys (infra/compose-secrets.sh) registered by `provision --register-keys`, run at every
    `docker compose up`: the readers' registry proves each key for its principal, and a second run adds nothing."""
    import subprocess

    from apportion.bus.provision import main
    from apportion.identity.keys import Identity
    from apportion.identity.registry import KeyRegistry

    subprocess.run(["bash", str(ROOT / "infra/compose-secrets.sh"), str(tmp_path)], check=True, capture_output=True)
    mp = _ns(stack)
    try:
        for _ in range(2):
            assert main(["--bootstrap", stack.info.bootstrap, "--register-keys", str(tmp_path / "keys/public")]) == 0
    finally:
        mp.undo()
    from apportion.bus.intake import IdLedger

    ledger, reg, kept = IdLedger(), KeyRegistry(), 0
    for r in _log(stack, "apportion.budgets"):
        if isinstance(r.event, events.UserKeyRegistered) and r.event.by == "provision":
            if ledger.check(r.event):
                continue  # the second run's records: duplicates every reader drops
            kept += 1
            reg.apply(r.event)
    disp = Identity.load(tmp_path / "keys/dispatcher.json")
    node = Identity.load(tmp_path / "keys/nodes/node-2/node-2.json")
    far = datetime.now(UTC) + timedelta(days=1)
    from apportion.timeutil import to_us

    assert kept == 5
    assert reg.principal(disp.public_key, to_us(far)) == ("service:dispatcher", "user")
    assert reg.principal(node.public_key, to_us(far)) == ("node:node-2", "user")


def test_a_node_agent_cannot_fence_another_agents_node_with_a_forged_loss(stack: Stack) -> None:
    """As the node-agent principal: a ``NodeLost`` of a node running alice's job, unsigned, with token 2**53. The
    stack's agent (given the dispatcher's public key by `stack up`) disregards it, the job runs on, and the
    dispatcher and the accounting dead-letter it as a decision their key did not sign."""
    alice = _identity(stack, "alice")
    _send(stack, "researcher", alice.sign(_submission("alice", "th-lost1")))
    running = stack.until(
        lambda: [r for r in stack.json("queue") if r["job_id"] == "th-lost1" and r["state"] == "running"],
        "th-lost1 running",
    )
    node = running[0]["nodes"][0]
    now = datetime.now(UTC)
    forged = events.NodeLost(node_id=node, last_heartbeat=now, fencing_token=2**53, ts=now, producer="dispatcher")
    _send(stack, "node-agent", forged)
    agent_log = Path(stack.info.log_dir) / "node_agent.log"
    stack.until(
        lambda: f"disregarded NodeLost of {node}: not signed by the dispatcher's key" in agent_log.read_text(),
        "the agent to disregard the forged loss",
    )
    stack.until(
        lambda: (
            {
                r.event.producer
                for r in _log(stack, "apportion.deadletter")
                if isinstance(r.event, events.DeadLetter) and r.event.error.startswith("unauthenticated: NodeLost")
            }
            == {"dispatcher", "accounting"}
        ),
        "both services to dead-letter the forged loss",
    )
    (row,) = [r for r in stack.json("queue") if r["job_id"] == "th-lost1"]
    assert row["state"] == "running"
    assert {n["node_id"]: n["state"] for n in stack.json("nodes")}[node] != "lost"


def test_audit_verify_is_clean_after_the_threats_and_names_each_refused_forgery(stack: Stack) -> None:
    """Run last: after the threats above, `apportion audit verify` reads the dead letters with the log and reports
    every forgery the services refused as a refused attack, not a mismatch (rule D10.node-boundary). One forgery of its
    own first (an unsigned node registration), so that it has one to find when run alone. The read models are
    left out (``--no-redis``): the stack's jobs still run, and the check here is of what the log holds."""
    ghost = events.NodeRegistered(node_id="ghost-v", gpu_count=8, ts=datetime.now(UTC), producer="node-agent")
    _send(stack, "node-agent", ghost)

    def letters() -> list[events.DeadLetter]:
        return [r.event for r in _log(stack, "apportion.deadletter") if isinstance(r.event, events.DeadLetter)]

    stack.until(
        lambda: {d.producer for d in letters() if d.source_key == "ghost-v"} == {"dispatcher", "accounting"},
        "both services dead-letter the ghost",
    )
    refused_positions = {(d.source_topic, d.source_partition, d.source_offset) for d in letters()}
    rep = json.loads(stack.run("audit", "verify", "--no-redis", "--json").stdout)  # exit 0: Stack.run checks it
    assert rep["ok"] and rep["mismatches"] == []
    refused = rep["refused_attacks"]
    # each record a service dead-lettered is one refused attack, however many services refused it
    assert refused["count"] >= len(refused_positions)
    assert refused["by_reason"].get("unauthenticated_node", 0) >= 1 and refused["not_in_log"] == 0
