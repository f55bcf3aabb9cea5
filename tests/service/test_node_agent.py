"""Node agent: pure decisions (table) and the runtime with fakes (no Kafka).

Runtime tests drive :class:`services.node_agent.service.NodeAgent` with a list
sink for events, a :class:`ManualClock` and :class:`FakeGpuProbe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from datetime import UTC, datetime, timedelta

import pytest

from apportion.clock import ManualClock
from apportion.events import (
    JobCompleted,
    JobFailed,
    JobStarted,
    NodeHeartbeat,
    NodeLost,
    NodeRegistered,
    StartWorkload,
    StopWorkload,
    WorkloadRefused,
)
from apportion.gpu import FakeGpuProbe, sim_node_ids
from services.node_agent import logic
from services.node_agent.config import NodeAgentSettings
from services.node_agent.logic import NodeSpec
from services.node_agent.service import NodeAgent, SignedSender, hosted_nodes
from services.node_agent.store import Journal
from tests.kit.narrowing import narrow
from tests.kit.node_agent import Sink

T0 = datetime(2025, 3, 1, tzinfo=UTC)


def spec(node_id: str = "n1", gpus: int = 4, simulated: bool = True) -> NodeSpec:
    return NodeSpec(node_id, FakeGpuProbe.with_gpus(gpus).inventory.gpus, "sim", simulated)


def start(
    job: str = "j1",
    node: str = "n1",
    gpus=(0, 1),
    attempt: int = 1,
    replica: int = 0,
    duration_s: float | None = 60.0,
    command=None,
    token=1,
    ts=T0,
) -> StartWorkload:
    return StartWorkload(
        ts=ts,
        node_id=node,
        job_id=job,
        attempt=attempt,
        replica=replica,
        gpus=gpus,
        duration_s=duration_s,
        command=command,
        fencing_token=token,
    )


def stop(job: str = "j1", node: str = "n1", attempt: int = 1, grace_s: float = 30.0) -> StopWorkload:
    return StopWorkload(ts=T0, node_id=node, job_id=job, attempt=attempt, grace_s=grace_s)


def running(*cmds: StartWorkload, stopping: tuple[str, ...] = ()) -> logic.AgentState:
    st = logic.initial_state([spec()], claim_prefix="n")
    for c in cmds:
        a = logic.decide_start(st, c, T0)
        assert isinstance(a, logic.Launch), a
        w = a.workload
        if w.job_id in stopping:
            w = logic.replace(w, stopping=True)
        st = logic.with_launched(st, w)
    return st


EMPTY = logic.initial_state([spec()], claim_prefix="n")

START_CASES = [
    # id, state, command, expected action type, reason prefix
    ("free GPUs: launch", EMPTY, start(), logic.Launch, None),
    ("another agent's node: ignore", EMPTY, start(node="other-7"), logic.Ignore, None),
    ("claimed prefix but not hosted: refuse", EMPTY, start(node="n9"), logic.Refuse, logic.UNKNOWN_NODE),
    ("GPU index the node lacks", EMPTY, start(gpus=(3, 4)), logic.Refuse, logic.UNKNOWN_GPUS),
    ("repeated GPU index", EMPTY, start(gpus=(1, 1)), logic.Refuse, logic.UNKNOWN_GPUS),
    ("no GPUs at all", EMPTY, start(gpus=()), logic.Refuse, logic.UNKNOWN_GPUS),
    ("neither command nor duration", EMPTY, start(duration_s=None), logic.Refuse, logic.NO_WORKLOAD),
    ("same replica twice", running(start()), start(), logic.Refuse, logic.DUPLICATE_START),
    ("GPU held by running work", running(start()), start(job="j2", gpus=(1, 2)), logic.Refuse, logic.GPUS_BUSY),
    (
        "GPU held by a stopping victim: wait",
        running(start(), stopping=("j1",)),
        start(job="j2", gpus=(1, 2)),
        logic.Defer,
        None,
    ),
    ("other GPUs free while one job runs", running(start()), start(job="j2", gpus=(2, 3)), logic.Launch, None),
    ("next attempt of the same job", running(start()), start(attempt=2, gpus=(2, 3)), logic.Launch, None),
]


@pytest.mark.parametrize("case_id,state,cmd,kind,reason", START_CASES, ids=[c[0] for c in START_CASES])
def test_decide_start(case_id, state, cmd, kind, reason):
    action = logic.decide_start(state, cmd, T0)
    assert isinstance(action, kind)
    if reason is not None:
        refused = narrow(logic.Refuse, action).event
        assert refused.reason.startswith(reason)
        assert refused.job_id == cmd.job_id and refused.node_id == cmd.node_id


def test_refusal_event_id_is_deterministic():
    cmd = start(gpus=(9,))
    a, b = logic.decide_start(EMPTY, cmd, T0), logic.decide_start(EMPTY, cmd, T0)
    assert narrow(logic.Refuse, a).event.event_id == narrow(logic.Refuse, b).event.event_id


def test_stale_fencing_token_refused():
    st = logic.with_token(EMPTY, 5)
    assert isinstance(logic.decide_start(st, start(token=4), T0), logic.Refuse)
    assert isinstance(logic.decide_start(st, start(token=5), T0), logic.Launch)
    assert narrow(logic.Refuse, logic.decide_start(st, start(token=None), T0)).event.reason.startswith(
        logic.MISSING_TOKEN
    )


def test_real_node_runs_command_simulated_node_prefers_duration():
    real = logic.initial_state([spec(simulated=False)])
    sim = EMPTY
    both = start(command=("true",), duration_s=5.0)
    assert not narrow(logic.Launch, logic.decide_start(real, both, T0)).workload.simulated
    assert narrow(logic.Launch, logic.decide_start(sim, both, T0)).workload.simulated
    assert not narrow(
        logic.Launch, logic.decide_start(sim, start(command=("true",), duration_s=None), T0)
    ).workload.simulated


STOP_CASES = [
    ("running replica: stop", running(start()), stop(), logic.Stop, None),
    ("unknown run: refuse", EMPTY, stop(), logic.Refuse, logic.UNKNOWN_RUN),
    ("already stopping: ignore", running(start(), stopping=("j1",)), stop(), logic.Ignore, None),
    ("another agent's node: ignore", EMPTY, stop(node="x"), logic.Ignore, None),
]


@pytest.mark.parametrize("case_id,state,cmd,kind,reason", STOP_CASES, ids=[c[0] for c in STOP_CASES])
def test_decide_stop(case_id, state, cmd, kind, reason):
    action = logic.decide_stop(state, cmd, T0)
    assert isinstance(action, kind)
    if reason:
        assert action.event.reason.startswith(reason)


def test_stop_of_ended_run_is_ignored():
    st = logic.with_exited(running(start()), ("n1", "j1", 1, 0))
    assert isinstance(logic.decide_stop(st, stop(), T0), logic.Ignore)


def test_exit_events():
    w = logic.Workload("n1", "j", 2, 1, (0,), None, 5.0)
    done = logic.exit_event(w, 0, T0)
    assert isinstance(done, JobCompleted) and done.replica == 1 and done.attempt == 2
    failed = logic.exit_event(w, 3, T0)
    assert isinstance(failed, JobFailed) and failed.exit_code == 3 and failed.reason == "exit code 3"
    killed = narrow(JobFailed, logic.exit_event(w, -9, T0))
    assert killed.reason == "killed by signal 9"
    stopped = logic.exit_event(logic.replace(w, stopping=True), -15, T0)
    assert isinstance(stopped, JobFailed) and stopped.reason == logic.STOPPED
    assert stopped.event_id == failed.event_id  # one end per replica: readers de-duplicate


def test_by_node_index_follows_launches_stops_and_exits():
    """held() and heartbeats read the per-node index; it must list exactly the node's running keys, in order."""
    n2 = NodeSpec("n2", FakeGpuProbe.with_gpus(4).inventory.gpus, "sim", True)
    st = logic.initial_state([spec(), n2], claim_prefix="n")
    for cmd in (start("a", gpus=(0,)), start("b", node="n2", gpus=(1,)), start("c", gpus=(2, 3))):
        action = logic.decide_start(st, cmd, T0)
        assert isinstance(action, logic.Launch)
        st = logic.with_launched(st, action.workload)
    assert st.by_node == {"n1": (("n1", "a", 1, 0), ("n1", "c", 1, 0)), "n2": (("n2", "b", 1, 0),)}
    assert {g: w.job_id for g, w in st.held("n1").items()} == {0: "a", 2: "c", 3: "c"}
    stop_a = logic.decide_stop(st, stop("a"), T0)
    assert isinstance(stop_a, logic.Stop)
    st = logic.with_stopping(st, stop_a)
    assert st.by_node["n1"] == (("n1", "a", 1, 0), ("n1", "c", 1, 0))
    assert st.held("n1")[0].stopping is True
    st = logic.with_exited(st, ("n1", "a", 1, 0))
    st = logic.with_exited(st, ("n2", "b", 1, 0))
    assert st.by_node == {"n1": (("n1", "c", 1, 0),)}
    assert {g: w.job_id for g, w in st.held("n1").items()} == {2: "c", 3: "c"}
    assert st.held("n2") == {}
    hb = logic.heartbeat_event(st, "n1", T0)
    assert [(r.job_id, r.gpus) for r in hb.running] == [("c", (2, 3))]
    assert logic.heartbeat_event(st, "n2", T0).running == ()


@pytest.mark.parametrize(
    "job_id, pct",
    [
        # sha256("0:<job>")[:8] / 2**64 = u; idle below 0.05, else 40 + 60 (u - 0.05) / 0.95, to 0.1
        ("j1", 49.9),  # 0x34e0178037bdb3fd: u = 0.2065
        ("j7", 94.5),  # 0xe99dfbbe64a00719: u = 0.9126
        ("j21", 0.0),  # 0x0719c3df35bdd9e1: u = 0.0277, idle
        ("j26", 0.0),  # 0x00a909fb854b2a3f: u = 0.0026, idle
        ("j29", 41.2),  # 0x118b8f82da72cb84: u = 0.0685, just busy
    ],
)
def test_simulated_utilisation_is_seeded_per_job(job_id, pct):
    assert logic.simulated_utilisation(0, job_id) == pct
    assert logic.simulated_utilisation(0, job_id) == logic.simulated_utilisation(0, job_id)


def test_simulated_utilisation_idles_about_one_job_in_twenty():
    idle = sum(logic.simulated_utilisation(3, f"job-{i}") == 0.0 for i in range(2000))
    assert 60 <= idle <= 140  # 5% of 2000 = 100; binomial sd ~ 10
    assert logic.simulated_utilisation(1, "j21") != logic.simulated_utilisation(0, "j21")  # the seed matters


def test_heartbeat_reports_the_seeded_utilisation_of_simulated_runs_and_squatting_finds_the_idle_one():
    from apportion.audit.replay import squatting_report
    from apportion.audit.verify import records_from_events

    st = running(start("j1", gpus=(0, 1)), start("j21", gpus=(2,)))
    probe = FakeGpuProbe.with_gpus(4)  # a simulated inventory: no utilisation of its own
    hb = logic.heartbeat_event(st, "n1", T0, probe.sample(), sim_util_seed=0)
    assert [g.utilization_pct for g in hb.gpus] == [49.9, 49.9, 0.0, None]  # GPU 3 is free: nothing to say
    assert [g.utilization_pct for g in logic.heartbeat_event(st, "n1", T0, probe.sample()).gpus] == [None] * 4
    probe.utilization[0] = 12.0  # a measured value is never overwritten
    assert logic.heartbeat_event(st, "n1", T0, probe.sample(), sim_util_seed=0).gpus[0].utilization_pct == 12.0
    real = logic.replace(st, nodes={"n1": spec(simulated=False)})
    assert (
        logic.heartbeat_event(real, "n1", T0, FakeGpuProbe.with_gpus(4).sample(), sim_util_seed=0)
        .gpus[2]
        .utilization_pct
        is None
    )  # a real node's GPUs are measured, never drawn

    beats = [logic.heartbeat_event(st, "n1", T0 + timedelta(minutes=m), probe.sample(), 0) for m in range(0, 50, 10)]
    rep = squatting_report(records_from_events(beats), threshold_s=1800)
    assert [(r["job_id"], r["node_id"], r["idle_s"]) for r in rep.rows] == [("j21", "n1", 2400.0)]
    assert rep.heartbeats_with_utilisation == 5 and not rep.blind


def test_node_ids_are_zero_padded():
    assert sim_node_ids("sim-", 32)[:2] == ["sim-00", "sim-01"]
    assert sim_node_ids("sim-", 32)[-1] == "sim-31"


def test_hosted_nodes_in_sim_mode_are_the_prefixed_ids_from_the_start_index_each_with_the_declared_gpus():
    settings = NodeAgentSettings(sim_nodes=3, sim_node_start=9, node_prefix="x-", gpus_per_node=2, gpu_model="m")
    nodes, prefix = hosted_nodes(settings)
    assert prefix == "x-"
    assert [(n.node_id, len(n.gpus), n.model, n.simulated) for n, _ in nodes] == [
        ("x-09", 2, "m", True),
        ("x-10", 2, "m", True),
        ("x-11", 2, "m", True),
    ]
    assert len({id(p) for _, p in nodes}) == 1  # one probe shared (app.run closes the first only)


def test_hosted_nodes_forced_simulated_is_one_node_with_no_claim_prefix():
    settings = NodeAgentSettings(node_id="h1", force_simulated=True, gpus_per_node=4, gpu_model="m")
    nodes, prefix = hosted_nodes(settings)
    assert prefix == ""
    assert [(n.node_id, len(n.gpus), n.model, n.simulated) for n, _ in nodes] == [("h1", 4, "m", True)]


class FakeProducer:
    """Records what was sent, returning kafka-python's own futures; raises on the events whose job id is in
    ``refuse`` (a full buffer)."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.sent: list = []
        self.futures: list = []
        self.refuse = refuse
        self.flushed: list = []

    def send(self, ev, value):
        if getattr(ev, "job_id", None) in self.refuse:
            raise TimeoutError("buffer full")
        self.sent.append((ev.event_id, value))
        from kafka.future import Future

        self.futures.append(Future())
        return self.futures[-1]

    def flush(self, timeout_s) -> None:
        self.flushed.append(timeout_s)


class FakeSigner:
    def value(self, ev) -> bytes:
        return f"signed:{ev.event_id}".encode()


def test_signed_sender_queues_each_signed_value_and_counts_a_refused_send_and_a_failed_delivery():
    from prometheus_client import CollectorRegistry

    from apportion.metrics import node_agent_metrics

    metrics = node_agent_metrics(CollectorRegistry())
    producer = FakeProducer(refuse=("j2",))
    sender = SignedSender(producer, FakeSigner(), metrics)
    e1, e2 = start("j1"), start("j2")
    asyncio.run(sender.emit(e1))
    asyncio.run(sender.emit(e2))  # refused at once: counted, never raised
    assert producer.sent == [(e1.event_id, f"signed:{e1.event_id}".encode())]
    assert metrics["send_errors"]._value.get() == 1
    producer.futures[0].failure(ConnectionError("delivery timed out"))  # the producer gave up on e1
    assert metrics["send_errors"]._value.get() == 2
    asyncio.run(sender.flush())
    assert producer.flushed == [30.0]


def test_signed_sender_signs_a_group_together_in_order_and_counts_what_it_cannot_send():
    from prometheus_client import CollectorRegistry

    from apportion.identity.canonical import signer_of
    from apportion.identity.keys import ReportSigner
    from apportion.metrics import node_agent_metrics
    from tests.kit.signing import node_identity

    metrics = node_agent_metrics(CollectorRegistry())
    producer = FakeProducer(refuse=("j2",))
    key = node_identity("n1")
    sender = SignedSender(producer, ReportSigner({"n1": key}), metrics)
    started = [
        logic.started_event(narrow(logic.Launch, logic.decide_start(EMPTY, start(j, gpus=(g,)), T0)).workload, T0)
        for j, g in (("j1", 0), ("j2", 1), ("j3", 2))
    ]
    asyncio.run(sender.emit_many(started))
    assert [eid for eid, _ in producer.sent] == [started[0].event_id, started[2].event_id]  # j2 refused, counted
    assert metrics["send_errors"]._value.get() == 1
    assert {signer_of(v, appended=True) for _, v in producer.sent} == {key.public_key}
    roots = {v.rsplit(b'"signature":"', 1)[1].split(b".")[3] for _, v in producer.sent}
    assert len(roots) == 1  # one signature for the three


# --------------------------------------------------------------------------- runtime


def make_agent(
    clock: ManualClock, sink: Sink, *, simulated: bool = True, journal: Journal | None = None, gpus: int = 4
) -> NodeAgent:
    probe = FakeGpuProbe.with_gpus(gpus)
    probe.utilization[0] = 55.0
    return NodeAgent([(spec(gpus=gpus, simulated=simulated), probe)], sink, clock, journal=journal, claim_prefix="n")


async def settle(clock: ManualClock, sleepers: int, deadline_s: float = 5.0) -> None:
    """Let tasks run until ``sleepers`` are waiting on the manual clock (bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while clock.sleepers < sleepers:
        assert loop.time() < end, "tasks did not reach the clock in time"
        await asyncio.sleep(0.001)


async def test_register_heartbeat_and_simulated_run_to_completion():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    reg = sink.of(NodeRegistered)
    assert [(r.node_id, r.gpu_count, r.simulated) for r in reg] == [("n1", 4, True)]

    await agent.on_event(start(duration_s=60.0))
    await agent.on_event(start(duration_s=60.0))  # a second StartWorkload: refused, not run twice
    (started,) = sink.of(JobStarted)
    assert started.gpus == (0, 1) and started.replica == 0
    assert sink.of(WorkloadRefused)[0].reason.startswith(logic.DUPLICATE_START)

    await agent.heartbeat()
    hb = sink.of(NodeHeartbeat)[-1]
    assert [r.job_id for r in hb.running] == ["j1"]
    assert hb.gpus[0].utilization_pct == 55.0

    await settle(clock, 1)
    clock.advance(59)
    await asyncio.sleep(0.01)
    assert not sink.of(JobCompleted)
    clock.advance(1)
    await asyncio.wait_for(agent.idle(), 5)
    (done,) = sink.of(JobCompleted)
    assert done.ts == datetime(2025, 3, 1, 0, 1, tzinfo=UTC) and done.exit_code == 0


async def test_preemption_stop_then_deferred_start_runs_after_victim_exits():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(job="victim", gpus=(0, 1, 2, 3), duration_s=3600))
    await settle(clock, 1)
    await agent.on_event(stop(job="victim", grace_s=30))
    await agent.on_event(start(job="winner", gpus=(0, 1), duration_s=10))
    await asyncio.wait_for(_until(lambda: len(sink.of(JobStarted)) == 2), 5)
    failed = sink.of(JobFailed)
    assert [(f.job_id, f.reason, f.exit_code) for f in failed] == [("victim", "stopped", -15)]
    assert [s.job_id for s in sink.of(JobStarted)] == ["victim", "winner"]
    assert not sink.of(WorkloadRefused)
    await agent.shutdown()


async def test_unknown_node_and_unknown_gpu_refused_without_crash():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.on_event(start(node="n2"))
    await agent.on_event(start(gpus=(7,)))
    await agent.on_event(stop(job="nope"))
    await agent.on_event(start(node="elsewhere"))  # another agent's: no event
    reasons = [e.reason.split(":")[0] for e in sink.of(WorkloadRefused)]
    assert reasons == [logic.UNKNOWN_NODE, logic.UNKNOWN_GPUS, logic.UNKNOWN_RUN]
    assert not agent.state.running


async def test_real_process_gets_cuda_visible_devices_and_exit_code(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, simulated=False)
    out = tmp_path / "env.txt"
    code = f"import os,sys; open({str(out)!r},'w').write(os.environ['CUDA_VISIBLE_DEVICES']); sys.exit(3)"
    await agent.on_event(start(gpus=(2, 3), duration_s=None, command=(sys.executable, "-c", code)))
    await asyncio.wait_for(agent.idle(), 20)
    assert out.read_text() == "2,3"
    (started,) = sink.of(JobStarted)
    assert started.pid is not None
    (failed,) = sink.of(JobFailed)
    assert failed.exit_code == 3 and failed.reason == "exit code 3"


async def test_real_process_stop_sigterm_then_sigkill_after_grace(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, simulated=False)
    ready = tmp_path / "ready"
    # ignores SIGTERM, then says it is ready
    code = (
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r},'w').close(); time.sleep(60)"
    )
    await agent.on_event(start(duration_s=None, command=(sys.executable, "-c", code)))
    await asyncio.wait_for(_until(ready.exists), 20)
    await agent.on_event(stop(grace_s=30))
    await settle(clock, 1)  # the SIGKILL timer waits on the clock
    assert not sink.of(JobFailed)
    clock.advance(30)
    await asyncio.wait_for(agent.idle(), 20)
    (failed,) = sink.of(JobFailed)
    assert failed.reason == "stopped" and failed.exit_code == -9


async def test_spawn_failure_is_reported_not_raised():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, simulated=False)
    await agent.on_event(start(duration_s=None, command=("/nonexistent/binary",)))
    (failed,) = sink.of(JobFailed)
    assert failed.reason.startswith("spawn failed")
    assert not agent.state.running


async def test_a_command_with_a_nul_byte_fails_its_job_and_the_next_start_runs():
    """A submission's argv may hold a NUL (any producer can write one); ``exec`` cannot take it. The start is a
    spawn failure reported for that job, not an exception that the consumer retries for ever, which held every
    later command of the agent's nodes behind it."""
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, simulated=False)
    await agent.on_event(start(job="nul", gpus=(0,), duration_s=None, command=("/bin/echo", "a\x00b")))
    await agent.on_event(start(job="next", gpus=(1,), duration_s=None, command=("true",)))
    await asyncio.wait_for(agent.idle(), 20)
    assert [(type(e).__name__, e.job_id) for e in sink.events if e.type != "NodeRegistered"] == [
        ("JobFailed", "nul"),
        ("JobStarted", "next"),
        ("JobCompleted", "next"),
    ]
    assert sink.of(JobFailed)[0].reason == "spawn failed: embedded null byte"


async def test_journal_makes_restart_refuse_redelivered_start_and_adopt_orphans(tmp_path):
    """A simulated orphan with time left is adopted for the rest of its duration; a redelivered start is refused."""
    clock, sink = ManualClock(T0), Sink()
    path = tmp_path / "agent.journal"
    agent = make_agent(clock, sink, journal=Journal(path))
    await agent.on_event(start(job="done", gpus=(0,), duration_s=1))
    await agent.on_event(start(job="orphan", gpus=(1,), duration_s=999))
    await settle(clock, 2)
    clock.advance(1)
    await asyncio.wait_for(_until(lambda: len(sink.of(JobCompleted)) == 1), 5)
    # "crash": drop the agent without shutdown; a new one reads the journal
    for t in list(agent._tasks.values()):
        t.cancel()
    sink2 = Sink()
    agent2 = make_agent(clock, sink2, journal=Journal(path))
    await agent2.start(heartbeats=False)
    assert [type(e).__name__ for e in sink2.events] == ["JobStarted", "NodeRegistered"]
    assert sink2.events[0] == sink.of(JobStarted)[1]  # the same event again: readers de-duplicate it
    assert not sink2.of(JobFailed)
    await agent2.on_event(start(job="done", gpus=(0,), duration_s=1))
    assert sink2.of(WorkloadRefused)[0].reason.startswith(logic.DUPLICATE_START)
    assert [e.job_id for e in sink2.of(JobStarted)] == ["orphan"]
    await agent2.heartbeat()
    assert [r.job_id for r in sink2.of(NodeHeartbeat)[0].running] == ["orphan"]
    await settle(clock, 1)
    clock.advance(998)  # the rest of its 999 s
    await asyncio.wait_for(agent2.idle(), 5)
    (done,) = sink2.of(JobCompleted)
    assert (done.job_id, done.ts) == ("orphan", T0 + timedelta(seconds=999))


class CountingJournal(Journal):
    """A journal that counts its writes to the file (each one write and one fsync)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.appends: list[int] = []

    def append(self, lines: list[str]) -> None:
        self.appends.append(len(lines))
        super().append(lines)


def _journal_ops(path) -> list[tuple[str, str]]:
    import json

    if not path.exists():
        return []
    return [
        (r["op"], r["key"][1] if "key" in r else str(r["token"]))
        for r in map(json.loads, path.read_text().splitlines())
    ]


def group_agent(clock: ManualClock, journal: Journal, emit_many=None) -> tuple[NodeAgent, Sink]:
    sink = Sink()
    probe = FakeGpuProbe.with_gpus(4)
    agent = NodeAgent(
        [(spec(), probe)], sink, clock, journal=journal, claim_prefix="n", group_commit=True, emit_many=emit_many
    )
    return agent, sink


async def test_group_commit_journals_a_batch_with_one_write_and_reports_only_after_it(tmp_path):
    """Three starts of one poll: nothing on disk or published until the group closes; then one write, three reports."""
    clock = ManualClock(T0)
    path = tmp_path / "agent.journal"
    journal = CountingJournal(path)
    agent, sink = group_agent(clock, journal)
    for job, gpu in (("a", 0), ("b", 1), ("c", 2)):
        await agent.on_event(start(job=job, gpus=(gpu,), duration_s=600))
    await agent.heartbeat()  # a heartbeat made while the group is open waits for it too
    assert sink.events == [] and _journal_ops(path) == [] and journal.appends == []
    await agent.end_group()
    assert journal.appends == [4]  # one write (and one fsync) for the group: the fencing token and three starts
    assert _journal_ops(path) == [("token", "1"), ("start", "a"), ("start", "b"), ("start", "c")]
    assert [type(e).__name__ for e in sink.events] == ["JobStarted"] * 3 + ["NodeHeartbeat"]
    assert [e.job_id for e in sink.of(JobStarted)] == ["a", "b", "c"]
    await agent.on_event(stop(job="b", grace_s=30))  # a later poll: its own group
    await agent.end_group()
    await asyncio.wait_for(_until(lambda: len(sink.of(JobFailed)) == 1), 5)
    assert _journal_ops(path)[-1] == ("end", "b") and sink.events[-1] == sink.of(JobFailed)[0]
    await agent.shutdown()


async def test_crash_between_group_journal_and_publish_replays_the_same_reports(tmp_path):
    """The group's lines are on disk, the process dies publishing: the restarted agent reports exactly those starts."""
    clock = ManualClock(T0)
    path = tmp_path / "agent.journal"
    lost_in_crash: list = []

    async def crash(evs) -> None:
        lost_in_crash.extend(evs)
        raise ConnectionError("agent died while publishing")

    agent, sink = group_agent(clock, Journal(path), emit_many=crash)
    for job, gpu in (("a", 0), ("b", 1)):
        await agent.on_event(start(job=job, gpus=(gpu,), duration_s=600))
    with pytest.raises(ConnectionError):
        await agent.end_group()
    assert sink.events == [] and [e.job_id for e in lost_in_crash] == ["a", "b"]
    for t in list(agent._tasks.values()):
        t.cancel()
    agent2, sink2 = group_agent(clock, Journal(path))
    await agent2.start(heartbeats=False)
    assert sink2.of(JobStarted) == lost_in_crash  # same ids and times: nothing lost, nothing new
    await agent2.on_event(start(job="a", gpus=(0,), duration_s=600))  # the command redelivered: refused
    await agent2.end_group()
    assert sink2.of(WorkloadRefused)[0].reason.startswith(logic.DUPLICATE_START)
    await agent2.shutdown()


async def test_failed_group_write_publishes_nothing_and_is_written_by_the_next_close(tmp_path):
    """A write that fails keeps the group's lines and reports; nothing is published before a later write succeeds."""
    clock = ManualClock(T0)
    path = tmp_path / "agent.journal"

    class FailingOnce(Journal):
        failed = False

        def append(self, lines: list[str]) -> None:
            if not self.failed:
                self.failed = True
                raise OSError("disk full")
            super().append(lines)

    agent, sink = group_agent(clock, FailingOnce(path))
    await agent.on_event(start(job="a", gpus=(0,), duration_s=600))
    with pytest.raises(OSError):
        await agent.end_group()
    assert sink.events == [] and _journal_ops(path) == []
    await agent.end_group()
    assert _journal_ops(path) == [("token", "1"), ("start", "a")] and [e.job_id for e in sink.of(JobStarted)] == ["a"]
    await agent.shutdown()


def lost(node: str = "n1", at_s: float = 100.0, last_hb_s: float = 10.0) -> NodeLost:
    return NodeLost(
        ts=T0 + timedelta(seconds=at_s),
        producer="dispatcher",
        node_id=node,
        last_heartbeat=T0 + timedelta(seconds=last_hb_s),
    )


def test_decide_lost_fences_the_hosted_node_only():
    st = logic.with_registered(running(start(), start(job="j2", gpus=(2,))), logic.registered_events(EMPTY, T0))
    st = logic.with_deferred(st, logic.replace(st.running[("n1", "j1", 1, 0)], job_id="j3"))
    a = logic.decide_lost(st, lost(), T0 + timedelta(seconds=100), grace_s=5.0)
    assert isinstance(a, logic.Rejoin) and a.node_id == "n1"
    assert [(w.job_id, w.stopping, w.grace_s) for w in a.stop.workloads] == [("j1", True, 5.0), ("j2", True, 5.0)]
    assert [(e.job_id, narrow(JobFailed, e).reason) for e in a.stop.events] == [("j3", "stopped before start")]
    after = logic.with_rejoining(st, a)
    assert after.rejoining == {"n1"} and not after.waiting and logic.ready_to_rejoin(after) == ()
    assert logic.ready_to_rejoin(
        logic.with_exited(logic.with_exited(after, ("n1", "j1", 1, 0)), ("n1", "j2", 1, 0))
    ) == ("n1",)
    # another agent's node, a loss older than the latest registration, a second loss while rejoining
    assert isinstance(logic.decide_lost(st, lost(node="other-1"), T0, 5.0), logic.Ignore)
    assert (
        narrow(logic.Ignore, logic.decide_lost(st, lost(at_s=-1, last_hb_s=-20), T0, 5.0)).why
        == "loss declared before the node's latest registration"
    )
    assert narrow(logic.Ignore, logic.decide_lost(after, lost(at_s=200), T0, 5.0)).why == "already rejoining"


async def test_lost_node_stops_its_replicas_then_registers_again():
    """NodeLost of a hosted node: its replica is stopped (-15), then NodeRegistered follows; a stale loss does nothing."""
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(start(duration_s=3600.0))
    await settle(clock, 1)
    clock.advance(100)
    await agent.on_event(lost())
    await asyncio.wait_for(agent.idle(), 5)
    kinds = [(type(e).__name__, getattr(e, "job_id", None)) for e in sink.events]
    assert kinds == [("NodeRegistered", None), ("JobStarted", "j1"), ("JobFailed", "j1"), ("NodeRegistered", None)]
    failed = sink.of(JobFailed)[0]
    assert (failed.attempt, failed.reason, failed.exit_code) == (1, "stopped", -15)
    again = sink.of(NodeRegistered)[1]
    assert again.ts == T0 + timedelta(seconds=100) and again.gpu_count == 4
    assert agent.state.registered_at["n1"] == again.ts and not agent.state.rejoining
    # a loss declared before the latest registration (T0+100 s) is stale: ignored
    await agent.on_event(lost(at_s=50))
    assert len(sink.events) == 4
    # an idle node rejoins at once
    clock.advance(10)
    await agent.on_event(lost(at_s=110, last_hb_s=100))
    assert [type(e).__name__ for e in sink.events[4:]] == ["NodeRegistered"]


async def _until(pred, step: float = 0.005) -> None:
    while not pred():
        await asyncio.sleep(step)


def _limited(cmd: StartWorkload, limit_s: float) -> StartWorkload:
    return cmd.model_copy(update={"time_limit_s": limit_s})


async def test_simulated_run_past_its_time_limit_is_stopped_and_reported_time_limit():
    # 3,600 s of work, a 100 s limit: SIGTERM at T0 + 100 s; a simulated workload exits on it at once, so the
    # JobFailed is stamped T0 + 100 s with reason time_limit (not "stopped": nobody asked for a stop)
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(_limited(start(duration_s=3600.0), 100.0))
    await settle(clock, 2)  # the workload's sleep and its limit's
    clock.advance(99)
    await asyncio.sleep(0.01)
    assert not sink.of(JobFailed)
    clock.advance(1)
    await asyncio.wait_for(agent.idle(), 5)
    (failed,) = sink.of(JobFailed)
    assert (failed.reason, failed.exit_code, failed.ts) == (logic.TIME_LIMIT, -15, T0 + timedelta(seconds=100))
    assert not sink.of(JobCompleted)


async def test_run_that_ends_before_its_limit_completes_and_a_stop_before_the_limit_stays_a_stop():
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    await agent.on_event(_limited(start(job="short", gpus=(0,), duration_s=50.0), 100.0))
    await agent.on_event(_limited(start(job="stopped", gpus=(1,), duration_s=3600.0), 100.0))
    await settle(clock, 4)
    await agent.on_event(stop(job="stopped", grace_s=30))
    clock.advance(50)
    await asyncio.wait_for(_until(lambda: len(sink.of(JobFailed)) + len(sink.of(JobCompleted)) == 2), 5)
    clock.advance(100)  # past both limits: nothing more happens
    await asyncio.wait_for(agent.idle(), 5)
    assert [c.job_id for c in sink.of(JobCompleted)] == ["short"]
    assert [(f.job_id, f.reason) for f in sink.of(JobFailed)] == [("stopped", "stopped")]


async def test_an_adopted_process_is_stopped_at_the_time_limit_counted_from_its_start(tmp_path):
    """A process with a 100 s limit runs 40 s, then its agent dies (no shutdown) and a new one adopts it from
    the journal: the limit still holds, counted from the start, so the process is stopped at T0 + 100 s and
    reported ``time_limit``. The journal kept no limit before, and an adopted process ran on unlimited."""
    clock, sink = ManualClock(T0), Sink()
    path = tmp_path / "agent.journal"
    agent = make_agent(clock, sink, simulated=False, journal=Journal(path))
    ready = tmp_path / "ready"
    code = f"import time; open({str(ready)!r},'w').close(); time.sleep(60)"
    await agent.on_event(_limited(start(duration_s=None, command=(sys.executable, "-c", code)), 100.0))
    await asyncio.wait_for(_until(ready.exists), 20)
    (started,) = sink.of(JobStarted)
    try:
        await settle(clock, 1)
        clock.advance(40)
        for t in [*agent._tasks.values(), *agent._limits.values()]:  # "crash": no shutdown, the process lives
            t.cancel()
        sink2 = Sink()
        agent2 = make_agent(clock, sink2, simulated=False, journal=Journal(path))
        agent2.progress_poll_wall_s = 0.01
        await agent2.start(heartbeats=False)
        assert sink2.of(JobStarted) == [started]  # adopted: the same event again
        await settle(clock, 1)  # the limit, re-armed for the 60 s left
        clock.advance(59)
        await asyncio.sleep(0.05)
        assert not sink2.of(JobFailed)
        os.kill(started.pid, 0)  # still running (ProcessLookupError otherwise)
        clock.advance(1)
        await asyncio.wait_for(agent2.idle(), 20)
        (failed,) = sink2.of(JobFailed)
        assert (failed.job_id, failed.reason, failed.ts) == (
            started.job_id,
            logic.TIME_LIMIT,
            T0 + timedelta(seconds=100),
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(started.pid, signal.SIGKILL)


async def test_real_process_that_ignores_sigterm_at_its_time_limit_is_killed_after_the_grace(tmp_path):
    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink, simulated=False)
    ready = tmp_path / "ready"
    code = (
        "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r},'w').close(); time.sleep(60)"
    )
    await agent.on_event(_limited(start(duration_s=None, command=(sys.executable, "-c", code)), 10.0))
    await asyncio.wait_for(_until(ready.exists), 20)
    await settle(clock, 1)  # the limit waits on the clock
    clock.advance(10)  # the limit: SIGTERM (ignored), SIGKILL after the default grace
    await settle(clock, 1)
    assert not sink.of(JobFailed)
    clock.advance(logic.DEFAULT_GRACE_S)
    await asyncio.wait_for(agent.idle(), 20)
    (failed,) = sink.of(JobFailed)
    assert (failed.reason, failed.exit_code) == (logic.TIME_LIMIT, -9)


async def test_a_stopping_agent_withdraws_its_nodes_before_reporting_its_replicas_lost():
    """Shutdown with j1 running on n1: first n1 registered again with 0 GPUs, then j1's JobLost. Folded by the
    dispatcher in that order, the requeued j1 is not placed back on n1 (its agent is going away); n1's next
    registration with its 4 GPUs places it there again."""
    from apportion.domain.budgets import BudgetTree
    from apportion.domain.dispatch import DispatchConfig, DispatchState, Tick, step
    from apportion.events import JobLost, JobPlaced, det_id
    from apportion.timeutil import to_us
    from tests.kit.builders import submitted

    clock, sink = ManualClock(T0), Sink()
    agent = make_agent(clock, sink)
    await agent.start(heartbeats=False)
    (reg,) = sink.of(NodeRegistered)
    await agent.on_event(start(job="j1", gpus=(0,), duration_s=3600))
    await settle(clock, 1)
    before = len(sink.events)
    await agent.shutdown()
    after = sink.events[before:]
    assert [(type(e).__name__, e.node_id, getattr(e, "gpu_count", None)) for e in after] == [
        ("NodeRegistered", "n1", 0),
        ("JobLost", "n1", None),
    ]
    assert narrow(NodeRegistered, after[0]).gpus == () and narrow(JobLost, after[1]).job_id == "j1"

    cfg, t0 = DispatchConfig(heartbeat_timeout_s=None), to_us(T0)
    state = DispatchState(BudgetTree.from_mapping({"lab": 1.0, "lab/a": {"share": 1.0, "members": ["alice"]}}))
    step(state, reg, t0, cfg)
    step(state, submitted("j1", at=t0), t0, cfg)
    out = step(state, Tick(t0), t0, cfg)
    assert [(e.job_id, e.placements[0].node_id) for e in out if isinstance(e, JobPlaced)] == [("j1", "n1")]
    lost_ev = narrow(JobLost, after[1]).model_copy(update={"attempt": 1})
    for e in (after[0], lost_ev, Tick(t0)):
        assert not [x for x in step(state, e, t0, cfg) if isinstance(x, JobPlaced)]
    assert state.jobs["j1"].status == "pending"
    again = reg.model_copy(update={"event_id": det_id("NodeRegistered", "n1", "next start")})
    out = step(state, again, t0, cfg)
    out += step(state, Tick(t0), t0, cfg)
    assert [(e.job_id, e.attempt) for e in out if isinstance(e, JobPlaced)] == [("j1", 2)]
