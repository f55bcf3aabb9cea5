"""Node agent fencing and restarts (``docs/leadership.md``): each rule with its exact reason, no Kafka.

Pure decisions are a table of named cases; runtime cases drive
:class:`services.node_agent.service.NodeAgent` with a list sink, a
:class:`ManualClock` and a journal in ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from apportion.bus.consumer import Delivery
from apportion.clock import ManualClock
from apportion.events import (
    JobFailed,
    JobLost,
    JobStarted,
    NodeLost,
    NodeRegistered,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
)
from apportion.gpu import FakeGpuProbe
from services.node_agent import logic
from services.node_agent.logic import NodeSpec
from services.node_agent.service import NodeAgent
from services.node_agent.store import Journal
from tests.kit.narrowing import narrow
from tests.kit.node_agent import Sink

T0 = datetime(2025, 3, 1, tzinfo=UTC)
WAIT_S = 10.0


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def spec() -> NodeSpec:
    return NodeSpec("n1", FakeGpuProbe.with_gpus(4).inventory.gpus, "sim", True)


def start(token=5, job="j1", attempt=1, replica=0, gpus=(0,), ts=T0, duration_s=600.0) -> StartWorkload:
    return StartWorkload(
        ts=ts,
        node_id="n1",
        job_id=job,
        attempt=attempt,
        replica=replica,
        gpus=gpus,
        duration_s=duration_s,
        fencing_token=token,
    )


def stop(token=5, job="j1", attempt=1, ts=T0) -> StopWorkload:
    return StopWorkload(ts=ts, node_id="n1", job_id=job, attempt=attempt, grace_s=30.0, fencing_token=token)


def lost(token=5, ts=at(100)) -> NodeLost:
    return NodeLost(ts=ts, producer="dispatcher", node_id="n1", last_heartbeat=at(60), fencing_token=token)


#: An agent that saw token 5 and registered n1 at T0.
SEEN5 = logic.with_registered(
    logic.with_token(logic.initial_state([spec()], claim_prefix="n"), 5),
    [NodeRegistered(ts=T0, node_id="n1", gpu_count=4)],
)

START_CASES = [
    # id, state, command, now, exact reason (None: launched)
    ("no token: refused", SEEN5, start(token=None), T0, "missing_fencing_token: a command without a leader's token"),
    ("token 0: out of range", SEEN5, start(token=0), T0, "fencing_token_out_of_range: token 0 not in [1, 2**53]"),
    ("negative token", SEEN5, start(token=-1), T0, "fencing_token_out_of_range: token -1 not in [1, 2**53]"),
    (
        "token 2**62: out of range",
        SEEN5,
        start(token=2**62),
        T0,
        f"fencing_token_out_of_range: token {2**62} not in [1, 2**53]",
    ),
    (
        "token 2**53 + 1",
        SEEN5,
        start(token=2**53 + 1),
        T0,
        f"fencing_token_out_of_range: token {2**53 + 1} not in [1, 2**53]",
    ),
    ("older token: stale leader", SEEN5, start(token=4), T0, "stale_fencing_token: token 4 < 5"),
    ("same token: the current leader", SEEN5, start(token=5), T0, None),
    ("newer token: a new leader", SEEN5, start(token=6), T0, None),
    ("token 2**53: the top is valid", SEEN5, start(token=2**53), T0, None),
    (
        "run declared lost here",
        logic.with_lost_runs(SEEN5, {("j1", 1)}),
        start(replica=1),
        T0,
        "run_lost: j1 attempt 1 was declared lost on this agent",
    ),
    ("next attempt of a lost run", logic.with_lost_runs(SEEN5, {("j1", 1)}), start(attempt=2), T0, None),
    (
        "sent before the node's latest registration",
        logic.with_registered(SEEN5, [NodeRegistered(ts=at(10), node_id="n1", gpu_count=4)]),
        start(ts=at(9)),
        at(10),
        "before_registration: sent 2025-03-01T00:00:09+00:00, node registered 2025-03-01T00:00:10+00:00",
    ),
    (
        "sent at the registration instant",
        logic.with_registered(SEEN5, [NodeRegistered(ts=at(10), node_id="n1", gpu_count=4)]),
        start(ts=at(10)),
        at(10),
        None,
    ),
    (
        "older than the retention window",
        SEEN5,
        start(ts=T0),
        at(24 * 3600 + 1),
        "expired_command: sent 2025-03-01T00:00:00+00:00, older than 86400 s",
    ),
]


@pytest.mark.parametrize("case_id,state,cmd,now,reason", START_CASES, ids=[c[0] for c in START_CASES])
def test_start_fencing_rules(case_id, state, cmd, now, reason):
    action = logic.decide_start(state, cmd, now)
    if reason is None:
        assert isinstance(action, logic.Launch), action
    else:
        assert isinstance(action, logic.Refuse), action
        assert action.event.reason == reason
        assert (action.event.node_id, action.event.job_id, action.event.attempt) == ("n1", cmd.job_id, cmd.attempt)


def test_token_rules_come_before_the_duplicate_rule_and_a_redelivery_is_a_duplicate():
    st = logic.with_launched(SEEN5, narrow(logic.Launch, logic.decide_start(SEEN5, start(), T0)).workload)
    assert narrow(logic.Refuse, logic.decide_start(st, start(token=4), T0)).event.reason.startswith(logic.STALE_TOKEN)
    # a start redelivered after a restart (sent before the new registration) is a duplicate, not "before_registration"
    later = logic.with_registered(st, [NodeRegistered(ts=at(50), node_id="n1", gpu_count=4)])
    assert narrow(logic.Refuse, logic.decide_start(later, start(), at(50))).event.reason.startswith(
        logic.DUPLICATE_START
    )


def test_out_of_range_tokens_are_never_remembered():
    st = SEEN5
    for t in (2**62, 0, -3, None, 4):
        st = logic.with_token(st, t)
    assert st.fencing_token == 5
    assert logic.with_token(st, 9).fencing_token == 9


RUNNING = logic.with_launched(
    SEEN5, logic.replace(narrow(logic.Launch, logic.decide_start(SEEN5, start(), T0)).workload, started_at=T0)
)

STOP_CASES = [
    # id, command, expected type, ignore reason (for Ignore)
    ("stale token: ignored, nothing published", stop(token=4), logic.Ignore, logic.STALE_TOKEN),
    ("token out of range: ignored", stop(token=2**62), logic.Ignore, logic.TOKEN_OUT_OF_RANGE),
    ("token 0: ignored", stop(token=0), logic.Ignore, logic.TOKEN_OUT_OF_RANGE),
    ("current token: stopped", stop(token=5), logic.Stop, None),
    ("newer token: stopped", stop(token=7), logic.Stop, None),
    ("no token (an operator's tool): stopped", stop(token=None), logic.Stop, None),
]


@pytest.mark.parametrize("case_id,cmd,kind,reason", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_stop_fencing_rules(case_id, cmd, kind, reason):
    action = logic.decide_stop(RUNNING, cmd, T0)
    assert isinstance(action, kind), action
    if kind is logic.Ignore:
        assert action.reason == reason


LOST_CASES = [
    # id, state, loss, expected: "ignore:<why>" or "rejoin" / "stop-only"
    ("older token: a resumed ex-leader's loss", RUNNING, lost(token=4), "ignore:loss of n1: token 4 < 5"),
    ("token 0: out of range", RUNNING, lost(token=0), "ignore:loss of n1: token 0 not in [1, 2**53]"),
    ("current token: fenced, rejoins", RUNNING, lost(token=5), "rejoin"),
    ("newer token: fenced, rejoins", RUNNING, lost(token=6), "rejoin"),
    ("no token: obeyed by default (dispatchers that do not stamp it yet)", RUNNING, lost(token=None), "rejoin"),
    (
        "no token with require_fenced_lost",
        logic.replace(RUNNING, require_fenced_lost=True),
        lost(token=None),
        "ignore:loss of n1 without a fencing token",
    ),
    (
        "declared before the latest registration, nothing it covers",
        logic.with_registered(RUNNING, [NodeRegistered(ts=at(200), node_id="n1", gpu_count=4)]),
        lost(ts=at(100)),
        "stop-only",  # j1 started at T0, before the loss: adopted after a restart, still covered
    ),
]


@pytest.mark.parametrize("case_id,state,ev,expected", LOST_CASES, ids=[c[0] for c in LOST_CASES])
def test_lost_fencing_rules(case_id, state, ev, expected):
    action = logic.decide_lost(state, ev, at(100), grace_s=5.0)
    if expected.startswith("ignore:"):
        assert isinstance(action, logic.Ignore) and action.why == expected[len("ignore:") :]
    else:
        assert isinstance(action, logic.Rejoin)
        assert [w.job_id for w in action.stop.workloads] == ["j1"]
        assert action.register is (expected == "rejoin")


def test_loss_before_registration_spares_replicas_started_after_it():
    """A loss declared while the agent was down covers the replicas it adopted, not those started since."""
    reg = logic.with_registered(RUNNING, [NodeRegistered(ts=at(200), node_id="n1", gpus=(), gpu_count=4)])
    fresh = logic.replace(
        narrow(logic.Launch, logic.decide_start(reg, start(job="j2", gpus=(1,), ts=at(210)), at(210))).workload
    )
    st = logic.with_launched(reg, logic.replace(fresh, started_at=at(210)))
    action = narrow(logic.Rejoin, logic.decide_lost(st, lost(ts=at(100)), at(220), 5.0))
    assert [w.job_id for w in action.stop.workloads] == ["j1"] and not action.register
    after = logic.with_rejoining(st, action)
    assert not after.rejoining and ("j1", 1) in after.lost_runs and ("j2", 1) not in after.lost_runs
    alone = logic.with_exited(st, ("n1", "j1", 1, 0))
    assert narrow(logic.Ignore, logic.decide_lost(alone, lost(ts=at(100)), at(220), 5.0)).why == (
        "loss declared before the node's latest registration"
    )


def test_fenced_node_refuses_a_late_start_for_a_run_it_lost():
    action = narrow(logic.Rejoin, logic.decide_lost(RUNNING, lost(), at(100), 5.0))
    after = logic.with_rejoining(RUNNING, action)
    late = narrow(logic.Refuse, logic.decide_start(after, start(replica=1, gpus=(2,), ts=at(90)), at(101)))
    assert late.event.reason == "run_lost: j1 attempt 1 was declared lost on this agent"


# --------------------------------------------------------------------------- runtime


def agent_at(tmp_path, clock, sink, **kw) -> NodeAgent:
    probe = FakeGpuProbe.with_gpus(4)
    return NodeAgent(
        [(spec(), probe)], sink, clock, journal=Journal(tmp_path / "agent.journal"), claim_prefix="n", **kw
    )


async def until(pred, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.002)


async def test_a_restarted_agent_keeps_refusing_the_stale_leader(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(token=7, ts=T0))
    assert agent.state.fencing_token == 7
    await agent.shutdown(grace_s=0)
    lines = [json.loads(x) for x in (tmp_path / "agent.journal").read_text().splitlines()]
    assert {"op": "token", "token": 7} in lines

    sink2 = Sink()
    again = agent_at(tmp_path, clock, sink2)
    await again.start(heartbeats=False)
    assert again.state.fencing_token == 7
    await again.on_event(start(token=6, job="j2", ts=T0))
    (refused,) = sink2.of(WorkloadRefused)
    assert refused.reason == "stale_fencing_token: token 6 < 7"
    await again.on_event(start(token=2**62, job="j3", ts=T0))
    await again.on_event(start(token=7, job="j4", ts=T0))  # a forged 2**62 did not lock the leader out
    assert [e.job_id for e in sink2.of(JobStarted)] == ["j4"]
    assert sink2.of(WorkloadRefused)[1].reason == f"fencing_token_out_of_range: token {2**62} not in [1, 2**53]"
    await again.shutdown(grace_s=0)


async def test_tokenless_start_is_refused_never_run():
    clock, sink = ManualClock(T0), Sink()
    probe = FakeGpuProbe.with_gpus(4)
    agent = NodeAgent([(NodeSpec("n1", probe.inventory.gpus, "sim", False), probe)], sink, clock, claim_prefix="n")
    cmd = StartWorkload(ts=T0, node_id="n1", job_id="evil", attempt=1, gpus=(0,), command=("touch", "/tmp/pwned"))
    await agent.on_event(cmd)
    (refused,) = sink.events
    assert isinstance(refused, WorkloadRefused)
    assert refused.reason == "missing_fencing_token: a command without a leader's token"
    assert not agent.state.running and not agent._procs


async def test_stale_stop_and_stale_loss_leave_healthy_runs_running(tmp_path, caplog):
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(token=5, ts=T0))
    await agent.on_event(start(token=6, job="j2", gpus=(1,), ts=T0))  # a new leader: 6
    before = list(sink.events)
    await agent.on_event(stop(token=5))  # the ex-leader's stop
    clock.advance(100)
    await agent.on_event(lost(token=5, ts=at(100)))  # and its loss
    assert sink.events == before  # nothing published: no refusal, no stop, no rejoin
    assert sorted(k[1] for k in agent.state.running) == ["j1", "j2"]
    assert not any(w.stopping for w in agent.state.running.values())
    assert "disregarded stop of j1 attempt 1: token 5 < 6" in caplog.text
    assert "disregarded NodeLost: loss of n1: token 5 < 6" in caplog.text
    await agent.on_event(lost(token=6, ts=at(100)))  # the current leader's loss is obeyed
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert [(type(e).__name__, getattr(e, "reason", None)) for e in sink.events[len(before) :]] == [
        ("JobFailed", "stopped"),
        ("JobFailed", "stopped"),
        ("NodeRegistered", None),
    ]


async def test_agent_shutdown_reports_its_runs_lost_not_failed(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.on_event(start())
    await agent.shutdown(grace_s=0)
    assert [type(e).__name__ for e in sink.events] == [
        "JobStarted",
        "NodeRegistered",
        "JobLost",
    ]  # its node withdrawn first
    assert not sink.of(JobFailed)


async def test_ended_replicas_are_forgotten_after_the_retention_window(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink, retention_s=3600.0, ended_cap=1000)
    await agent.on_event(start(duration_s=10.0))
    await until(lambda: clock.sleepers >= 1, "the workload to sleep")
    clock.advance(10)
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert ("n1", "j1", 1, 0) in agent.state.ended
    clock.advance(3600)
    await agent.on_event(start(job="j2", ts=at(3610), duration_s=1.0))  # its exit prunes j1
    await until(lambda: clock.sleepers >= 1, "the workload to sleep")
    clock.advance(1)
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert ("n1", "j1", 1, 0) not in agent.state.ended and ("n1", "j2", 1, 0) in agent.state.ended
    # a start as old as the forgotten one is refused for its age, never run twice
    late = narrow(logic.Refuse, logic.decide_start(agent.state, start(ts=T0), clock.now()))
    assert late.event.reason.startswith(logic.EXPIRED)


def test_journal_cap_prunes_the_oldest_and_compaction_keeps_what_matters(tmp_path, monkeypatch):
    monkeypatch.setattr("services.node_agent.store.os.fsync", lambda fd: None)  # 3,000 lines: skip the disk waits
    j = Journal(tmp_path / "a.journal")
    j.token(3)
    j.token(2)  # older: not recorded
    for i in range(1500):
        key = ("n1", f"j{i}", 1, 0)
        j.started(key, None, ts=T0, gpus=(0,), sim_until=at(10))
        j.ended(key, at(i), lost=i == 1499)
    j.started(("n1", "open", 1, 0), None, ts=T0, gpus=(1, 2), sim_until=at(99))
    gone = j.prune(at(1500), retention_s=10**6, cap=100)
    assert len(gone) == 1400 and gone[0] == ("n1", "j0", 1, 0)
    assert j.needs_compaction()
    j.compact()
    back = Journal(tmp_path / "a.journal")
    assert back.fencing_token == 3
    assert len(back.known()) == 101 and back.lost_runs() == {("j1499", 1)}
    (o,) = back.orphans()
    assert (o.key, o.gpus, o.started_at, o.sim_until) == (("n1", "open", 1, 0), (1, 2), T0, at(99))
    assert len((tmp_path / "a.journal").read_text().splitlines()) == 102


def test_journal_reads_older_lines_and_skips_torn_ones(tmp_path):
    p = tmp_path / "old.journal"
    p.write_text(
        '{"op": "start", "key": ["n1", "a", 1, 0], "pid": null, "pstart": null}\n'
        '{"op": "end", "key": ["n1", "b", 1, 0]}\n'
        '{"op": "token", "token": 18014398509481984}\n'
        '{"op": "token", "token": 4}\n'
        '{"op": "start", "key": ["n1", "c"'
    )
    j = Journal(p)
    assert j.fencing_token == 4  # 2**54 was out of range: never remembered
    assert j.known() == {("n1", "a", 1, 0), ("n1", "b", 1, 0)}
    (o,) = j.orphans()
    assert (o.started_at, o.gpus, o.sim_until) == (None, (), None)


async def test_orphan_from_an_older_journal_without_its_duration_is_reported_lost(tmp_path):
    (tmp_path / "agent.journal").write_text('{"op": "start", "key": ["n1", "a", 2, 0], "pid": null, "pstart": null}\n')
    clock, sink = ManualClock(at(50)), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.start(heartbeats=False)
    assert [type(e).__name__ for e in sink.events] == ["JobLost", "NodeRegistered"]
    lost_ev = sink.of(JobLost)[0]
    assert (lost_ev.job_id, lost_ev.attempt, lost_ev.charged_until) == ("a", 2, at(50))
    await agent.on_event(start(job="a", attempt=2, replica=1, gpus=(1,), ts=at(51)))
    assert sink.of(WorkloadRefused)[0].reason == "run_lost: a attempt 2 was declared lost on this agent"


async def test_simulated_orphan_whose_time_ran_out_completes(tmp_path):
    j = Journal(tmp_path / "agent.journal")
    j.started(("n1", "s", 1, 0), None, ts=T0, gpus=(0,), sim_until=at(30))
    clock, sink = ManualClock(at(45)), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.start(heartbeats=False)
    assert [type(e).__name__ for e in sink.events] == ["JobCompleted", "NodeRegistered"]
    assert not agent.state.running


def test_settings_journal_kept_by_default_and_static_membership(tmp_path, monkeypatch):
    from services.node_agent.config import NodeAgentSettings

    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("APPORTION_TOPIC_PREFIX", "e2e1.")
    sim = NodeAgentSettings(sim_nodes=4, node_prefix="rack1-")
    assert sim.journal_path() == tmp_path / "apportion-node-agent-e2e1.rack1" / "rack1.journal"
    assert sim.instance_id() == "e2e1.node-agent.rack1"
    # the group too: a static member of another namespace's run under the same name would hold it 45 s
    assert sim.consumer_group() == "e2e1.node-agent.rack1"
    assert NodeAgentSettings(sim_nodes=4, node_prefix="rack1-", group_id="g").consumer_group() == "g"
    real = NodeAgentSettings(node_id="gpu-7", state_dir=tmp_path / "state")
    assert real.journal_path() == tmp_path / "state" / "gpu-7.journal"
    assert NodeAgentSettings(node_id="gpu-7", memory_journal=True).journal_path() is None
    assert NodeAgentSettings(node_id="gpu-7", group_instance_id="").instance_id() is None  # dynamic membership
    assert NodeAgentSettings(node_id="gpu-7", group_instance_id="x").instance_id() == "x"
    monkeypatch.delenv("APPORTION_TOPIC_PREFIX")
    assert NodeAgentSettings(node_id="gpu-7").instance_id() == "node-agent.gpu-7"


async def test_a_long_running_agent_keeps_its_journal_bounded(tmp_path, monkeypatch):
    """800 short runs write 1,600 lines; with a cap of 50 the file is compacted while the agent runs."""
    monkeypatch.setattr("services.node_agent.store.os.fsync", lambda fd: None)
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink, ended_cap=50)
    for i in range(800):
        await agent.on_event(start(job=f"j{i}", ts=clock.now(), duration_s=0.0))
        await asyncio.wait_for(agent.idle(), WAIT_S)
    lines = (tmp_path / "agent.journal").read_text().splitlines()
    assert len(lines) < 1200 and len(agent.state.ended) == 50
    assert Journal(tmp_path / "agent.journal").fencing_token == 5
    assert len(sink.of(JobStarted)) == 800


# --------------------------------------------------------------------------- a NodeLost must be the dispatcher's


def _delivered(ev: NodeLost, value: bytes) -> Delivery:
    return Delivery("apportion.nodes", 0, 0, ev.node_id, 0, value)


async def test_a_loss_the_dispatchers_key_did_not_sign_neither_fences_nor_raises_the_token(tmp_path, caplog):
    """Another agent (the node-agent principal may write apportion.nodes) forges a loss of n1 with token 2**53:
    disregarded, n1's run goes on, and the real leader's token 6 still starts work; the signed loss is obeyed."""
    from apportion import events
    from tests.kit.signing import dispatcher_signer, node_identity

    clock, sink = ManualClock(T0), Sink()
    key = dispatcher_signer().identity.public_key
    agent = agent_at(tmp_path, clock, sink, dispatcher_key=key)
    await agent.start(heartbeats=False)
    await agent.on_event(start(token=5, ts=T0))
    clock.advance(100)
    forged = lost(token=2**53, ts=at(100))
    for value in (events.encode(forged), node_identity("n2").signed_value(forged)):  # unsigned; another key
        await agent.on_event(forged, _delivered(forged, value))
    assert agent.state.fencing_token == 5 and not any(w.stopping for w in agent.state.running.values())
    assert caplog.text.count("disregarded NodeLost of n1: not signed by the dispatcher's key") == 2
    await agent.on_event(start(token=6, job="j2", gpus=(1,), ts=at(100)))
    assert sorted(k[1] for k in agent.state.running) == ["j1", "j2"]  # the leader's 6 is not "stale"
    real = lost(token=6, ts=at(101))
    await agent.on_event(real, _delivered(real, dispatcher_signer().values([events.encode(real)])[0]))
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert [type(e).__name__ for e in sink.of(JobFailed)] == ["JobFailed", "JobFailed"]  # both stopped
    assert sink.of(NodeRegistered)  # and the node rejoined


async def test_without_a_dispatcher_key_a_loss_is_judged_on_its_token_only(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = agent_at(tmp_path, clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(token=5, ts=T0))
    clock.advance(100)
    await agent.on_event(lost(token=5, ts=at(100)))  # no delivery at all: nothing to check
    await asyncio.wait_for(agent.idle(), WAIT_S)
    assert sink.of(JobFailed) and sink.of(NodeRegistered)


def test_the_dispatchers_public_key_comes_from_a_key_file_or_is_not_checked(tmp_path):
    from services.node_agent.config import NodeAgentSettings
    from tests.kit.signing import dispatcher_identity

    ident = dispatcher_identity()
    ident.save(tmp_path / "service:dispatcher.json")  # the keyring's file (private key too: only public_key is read)
    assert NodeAgentSettings().dispatcher_public_key() is None
    got = NodeAgentSettings(dispatcher_public_key_file=tmp_path / "service:dispatcher.json").dispatcher_public_key()
    assert got == ident.public_key
    (tmp_path / "bad.json").write_text('{"user": "x"}')
    with pytest.raises(ValueError, match="holds no public_key"):
        NodeAgentSettings(dispatcher_public_key_file=tmp_path / "bad.json").dispatcher_public_key()
